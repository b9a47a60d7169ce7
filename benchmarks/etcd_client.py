"""etcd v3 Python clients compared on a 3-member cluster: etcd3gw (JSON gateway) vs etcd-sdk-python.

Issue 43 moves the recovery control state (leader, generations, deaths, step outcomes) onto
etcd v3. This measures the two maintained clients that speak v3, against the same private
3-member etcd (``scripts/etcd_cluster.sh``, Debian's etcd-server) on 127.0.0.1, the client in
this process and every member in its own:

* ``etcd3gw`` (HTTP + JSON through etcd's v3 gRPC gateway; pure Python over ``requests``);
* ``etcd-sdk-python`` (module ``pyetcd``, gRPC; a fork of python-etcd3).

Per client: p50/p90/p99 of ``put``, ``get`` (linearizable), a txn (compare value == x, then
put), lease grant, one lease keepalive, and a watch's wake-up (from just before another
client's put of the watched key until the watcher's callback sees the event). Then failover:
a client given all 3 endpoints, the member it talks to SIGKILLed (once the raft leader, once a
follower, ``--failover-repeats`` times each, each on a fresh cluster), and the time until its
next txn succeeds (the client retries on the next endpoint after an error; per-request timeout
``--timeout``); the same for the control plane's own connection (``recovery/etcd_transport.py``).

Last, the chosen client as the control plane uses it (``recovery/etcd_control.py``): a fenced
generation publish, an outcome claim and a generation read, p50/p90/p99.

Writes JSON (``results/etcd_client.json``) and one summary line. Run it alone on the machine
(under the heavy-run lock here): every number is a round trip through 3 processes.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

from run_header import run_header  # benchmarks/, this script's folder

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "helpers"))
sys.path.insert(0, str(REPO))
from etcd_cluster import EtcdCluster, etcd_missing_reason  # noqa: E402

T0 = time.monotonic()


def _say(msg: str) -> None:
    print(f"[etcd_client {time.monotonic() - T0:.1f}s] {msg}", file=sys.stderr, flush=True)


def _summary(times: List[float]) -> Dict[str, float]:
    times = sorted(times)
    n = len(times)
    return {
        "n": n,
        "p50_ms": round(1e3 * statistics.median(times), 3),
        "p90_ms": round(1e3 * times[int(0.9 * (n - 1))], 3),
        "p99_ms": round(1e3 * times[int(0.99 * (n - 1))], 3),
    }


def _timed(fn: Callable[[int], Any], n: int) -> Dict[str, float]:
    times: List[float] = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    return _summary(times)


class GatewayDriver:
    """etcd3gw: one ``Etcd3Client`` (HTTP session) per endpoint; moves on after an error."""

    name = "etcd3gw"

    def __init__(self, endpoints: List[str], timeout: float) -> None:
        import etcd3gw

        self.clients = [
            etcd3gw.Etcd3Client(e.split(":")[0], int(e.split(":")[1]), timeout=timeout)
            for e in endpoints
        ]
        self.cur = 0

    @property
    def c(self) -> Any:
        return self.clients[self.cur]

    def next_endpoint(self) -> None:
        self.cur = (self.cur + 1) % len(self.clients)

    def put(self, key: str, value: str) -> None:
        self.c.put(key, value)

    def get(self, key: str) -> Any:
        return self.c.get(key)

    def txn(self, key: str, expect: str, value: str) -> bool:
        from etcd3gw.utils import _encode

        k = _encode(key)
        return self.c.transaction(
            {
                "compare": [
                    {"key": k, "result": "EQUAL", "target": "VALUE", "value": _encode(expect)}
                ],
                "success": [{"request_put": {"key": k, "value": _encode(value)}}],
                "failure": [],
            }
        ).get("succeeded", False)

    def lease_grant(self, ttl: int) -> Any:
        return self.c.lease(ttl)

    def keepalive(self, lease: Any) -> int:
        return lease.refresh()

    def watch(self, key: str, on_event: Callable[[], None]) -> Callable[[], None]:
        events, cancel = self.c.watch(key)

        def consume() -> None:
            for _ in events:
                on_event()

        threading.Thread(target=consume, daemon=True).start()
        return cancel

    def close(self) -> None:
        for c in self.clients:
            c.session.close()


class GrpcDriver:
    """etcd-sdk-python (``pyetcd``): its multi-endpoint client with ``failover=True``."""

    name = "etcd-sdk-python"

    def __init__(self, endpoints: List[str], timeout: float) -> None:
        import pyetcd

        # time_retry: how long a failed endpoint is skipped; the library's default (300 s)
        # leaves no endpoint once an election has timed out one request on each member.
        eps = [
            pyetcd.Endpoint(e.split(":")[0], int(e.split(":")[1]), secure=False, time_retry=timeout)
            for e in endpoints
        ]
        self.c = pyetcd.MultiEndpointEtcd3Client(endpoints=eps, timeout=timeout, failover=True)
        # Start on the first endpoint, like the gateway driver (the library picks at random).
        self.c._current_endpoint_label = eps[0].netloc

    def next_endpoint(self) -> None:
        pass  # the library marks the failed endpoint and uses another on the next call

    def put(self, key: str, value: str) -> None:
        self.c.put(key, value)

    def get(self, key: str) -> Any:
        return self.c.get(key)

    def txn(self, key: str, expect: str, value: str) -> bool:
        t = self.c.transactions
        ok, _ = self.c.transaction(
            compare=[t.value(key) == expect], success=[t.put(key, value)], failure=[]
        )
        return ok

    def lease_grant(self, ttl: int) -> Any:
        return self.c.lease(ttl)

    def keepalive(self, lease: Any) -> int:
        return [r.TTL for r in lease.refresh()][-1]

    def watch(self, key: str, on_event: Callable[[], None]) -> Callable[[], None]:
        wid = self.c.add_watch_callback(key, lambda _resp: on_event())
        return lambda: self.c.cancel_watch(wid)

    def close(self) -> None:
        self.c.close()


class ControlDriver:
    """The control plane's own connection (recovery/etcd_transport.py, on etcd-sdk-python's
    stubs): it retries on the next member inside each call, up to the call's bound."""

    name = "etcd_control"

    def __init__(self, endpoints: List[str], timeout: float) -> None:
        from megatron_mecefo.recovery.etcd_transport import EtcdConnection

        self.c = EtcdConnection(endpoints, call_timeout_s=30.0, request_timeout_s=timeout)

    def next_endpoint(self) -> None:
        pass

    def put(self, key: str, value: str) -> None:
        self.c.put(key.encode(), value)

    def txn(self, key: str, expect: str, value: str) -> bool:
        from megatron_mecefo.recovery.etcd_transport import cmp_value, op_put

        k = key.encode()
        return self.c.txn("txn", [cmp_value(k, expect)], [op_put(k, value)], []).succeeded

    def close(self) -> None:
        self.c.close()


DRIVERS = {"etcd3gw": GatewayDriver, "etcd-sdk-python": GrpcDriver, "etcd_control": ControlDriver}


def round_trips(cls: Any, endpoints: List[str], n: int, timeout: float) -> Dict[str, Any]:
    d = cls(endpoints, timeout)
    w = cls(endpoints, timeout)  # the watcher: another client, as a member would be
    try:
        pre = f"/bench/{cls.name}/"
        d.put(pre + "cas", "0")
        out: Dict[str, Any] = {
            "put": _timed(lambda i: d.put(f"{pre}k{i}", "v" * 64), n),
            "get": _timed(lambda i: d.get(f"{pre}k{i}"), n),
        }
        ok = []
        out["txn_compare_put"] = _timed(
            lambda i: ok.append(d.txn(pre + "cas", str(i), str(i + 1))), n
        )
        assert all(ok), "a compare-and-put failed: the measurement is wrong"
        leases: List[Any] = []
        out["lease_grant"] = _timed(lambda i: leases.append(d.lease_grant(10)), max(20, n // 5))
        ttls: List[int] = []
        out["lease_keepalive"] = _timed(lambda i: ttls.append(d.keepalive(leases[0])), n)
        assert min(ttls) > 0, "a keepalive found the lease expired"
        arrivals: "queue.Queue[float]" = queue.Queue()
        cancel = w.watch(pre + "watched", lambda: arrivals.put(time.perf_counter()))
        time.sleep(0.5)  # the watch stream is established
        wakes = []
        for i in range(n):
            t0 = time.perf_counter()
            d.put(pre + "watched", str(i))
            wakes.append(arrivals.get(timeout=10) - t0)
        cancel()
        out["watch_wakeup"] = _summary(wakes)
        return out
    finally:
        d.close()
        w.close()


def control_plane(endpoints: List[str], n: int) -> Dict[str, Any]:
    """The chosen client as the recovery uses it (megatron_mecefo/recovery/etcd_control.py):
    a campaign, a fenced generation publish (one txn), an outcome claim (one txn)."""
    from megatron_mecefo.recovery.etcd_control import EtcdControl

    ctl = EtcdControl(endpoints, "/bench/control", ttl_s=5)
    try:
        t0 = time.perf_counter()
        ctl.campaign("bench", timeout_s=10)
        out: Dict[str, Any] = {"campaign_ms": round(1e3 * (time.perf_counter() - t0), 3)}
        out["publish_generation"] = _timed(lambda i: ctl.publish_generation(i, "{}" * 200), n)
        out["claim_outcome"] = _timed(lambda i: ctl.claim_outcome(0, i, "commit"), n)
        out["generation"] = _timed(lambda i: ctl.generation(), n)
        return out
    finally:
        ctl.close()


def failover(cls: Any, workdir: Path, victim: str, timeout: float) -> Dict[str, Any]:
    """SIGKILL the member the client talks to (``victim``: the raft leader or a follower)."""
    cluster = EtcdCluster(workdir).start()
    try:
        leader = cluster.leader()
        target = leader if victim == "leader" else (leader + 1) % 3
        order = [target] + [i for i in range(3) if i != target]
        d = cls([cluster.endpoints[i] for i in order], timeout)
        d.put("/fo/k", "0")
        assert d.txn("/fo/k", "0", "1")  # the connection to the victim is up
        cluster.signal(target)
        t0 = time.perf_counter()
        errors = 0
        while True:
            try:
                if d.txn("/fo/k", "1", "2"):
                    break
                raise AssertionError("the txn after the kill failed its compare")
            except AssertionError:
                raise
            except Exception:  # noqa: BLE001 (each client's own connection errors)
                errors += 1
                d.next_endpoint()
                if time.perf_counter() - t0 > 60:
                    raise
        took = time.perf_counter() - t0
        d.close()
        return {"victim": victim, "first_txn_after_kill_s": round(took, 4), "errors": errors}
    finally:
        cluster.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", type=int, default=500, help="operations per measurement")
    p.add_argument("--timeout", type=float, default=1.0, help="per-request timeout (s)")
    p.add_argument("--clients", default="etcd3gw,etcd-sdk-python")
    p.add_argument("--failover-repeats", type=int, default=3, help="kills per victim kind")
    p.add_argument("--output", default=str(REPO / "results" / "etcd_client.json"))
    a = p.parse_args()
    missing = etcd_missing_reason()
    if missing:
        sys.exit(f"etcd_client: {missing}")
    names = a.clients.split(",")
    version = subprocess.run(["etcd", "--version"], capture_output=True, text=True).stdout
    result: Dict[str, Any] = {
        **run_header("etcd_client"),
        "config": {
            "etcd": version.split("\n")[0],
            "cluster": "3 members on 127.0.0.1 (scripts/etcd_cluster.sh; heartbeat 100 ms, "
            "election timeout 1000 ms), each its own process; the client in this process",
            "ops": a.ops,
            "request_timeout_s": a.timeout,
            "clients": {
                n: importlib.metadata.version("etcd3gw" if n == "etcd3gw" else "etcd-sdk-python")
                for n in names
            },
            "value_bytes": 64,
        },
        "clients": {},
    }
    with tempfile.TemporaryDirectory(prefix="etcd-bench-") as tmp:
        cluster = EtcdCluster(Path(tmp) / "rt").start()
        try:
            for n in names:
                _say(f"{n}: round trips")
                result["clients"][n] = round_trips(DRIVERS[n], cluster.endpoints, a.ops, a.timeout)
            _say("etcd_control (etcd-sdk-python's gRPC stubs)")
            result["clients"]["etcd_control"] = control_plane(cluster.endpoints, a.ops)
        finally:
            cluster.stop()
        for n in names + ["etcd_control"]:
            _say(f"{n}: failover")
            result["clients"].setdefault(n, {})["failover"] = [
                failover(DRIVERS[n], Path(tmp) / f"fo-{n}-{v}-{k}", v, a.timeout)
                for v in ("leader", "follower")
                for k in range(a.failover_repeats)
            ]
    _say("done")
    result["machine"]["loadavg_end"] = os.getloadavg()
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(result, indent=1) + "\n")
    parts = []
    for n, r in result["clients"].items():
        fo = ", ".join(
            f"{v} "
            + "/".join(
                f"{f['first_txn_after_kill_s']:.2f}" for f in r["failover"] if f["victim"] == v
            )
            + " s"
            for v in ("leader", "follower")
        )
        if n == "etcd_control":
            ops = (
                f"fenced publish {r['publish_generation']['p50_ms']} claim "
                f"{r['claim_outcome']['p50_ms']} generation {r['generation']['p50_ms']}"
            )
        else:
            ops = (
                f"put {r['put']['p50_ms']} get {r['get']['p50_ms']} txn "
                f"{r['txn_compare_put']['p50_ms']} lease grant {r['lease_grant']['p50_ms']} "
                f"keepalive {r['lease_keepalive']['p50_ms']} watch wake-up "
                f"{r['watch_wakeup']['p50_ms']}"
            )
        parts.append(f"{n} {ops}; first txn after killing its member: {fo}")
    print(
        f"etcd clients, 3 members on localhost (p50 ms, load {os.getloadavg()[0]:.1f}): "
        + " | ".join(parts)
    )
    print(f"etcd_client: wrote {a.output}")


if __name__ == "__main__":
    main()
