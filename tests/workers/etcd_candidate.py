"""A leader candidate in its own process, for the etcd control plane's tests.

``etcd_candidate.py ENDPOINTS PREFIX TTL_S ID``: campaigns (up to 300 s), then obeys one JSON
command per stdin line. Writes one JSON event per stdout line: ``elected`` (with the term),
``lost`` (the keepalive's reason), ``result`` (of a command: ok, or the error's class and
message).
"""

from __future__ import annotations

import json
import sys
import threading

from megatron_mecefo.recovery.etcd_control import ControlError, EtcdControl

_out = threading.Lock()


def say(**event: object) -> None:
    with _out:
        print(json.dumps(event), flush=True)


def main() -> None:
    endpoints, prefix, ttl, me = sys.argv[1:5]
    ctl = EtcdControl(endpoints, prefix, float(ttl), on_lost=lambda why: say(event="lost", why=why))
    say(event="started")
    term = ctl.campaign(me, timeout_s=300)
    say(event="elected", id=me, term=term.number)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["cmd"] == "publish":
                ctl.publish_generation(int(cmd["n"]), cmd["text"])
            elif cmd["cmd"] == "put":
                ctl.put_fenced(cmd["name"], cmd["value"])
            elif cmd["cmd"] == "exit":
                break
            say(event="result", ok=True, lost=ctl.lost.is_set())
        except ControlError as e:
            say(event="result", ok=False, error=type(e).__name__, message=str(e))
    ctl.close()


if __name__ == "__main__":
    main()
