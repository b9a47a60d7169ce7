"""What the commit's claim on etcd adds to a vote, side by side in one run.

In ``--store-mode etcd`` the voter that completes a count claims the commit on etcd
(``commit.claim``: a create-if-absent transaction fenced on the leader's term) before it sets
the commit key that every other member waits for; the claim is on every member's path to the
optimizer's update, once per iteration. This measures that path alone: a completer's
``commit.vote`` (its ``add``, the claim, the commit key's ``set`` and ``check``) on a hot
TCPStore whose address a leader published on a private 3-member etcd
(``tests/helpers/etcd_cluster.py``, one host), alternated vote by vote with the same vote on
a client that claims nothing (the design before the claims, ``claims_outcomes = False`` on
that client: a measurement switch of this script only). The completer's ``forget`` of the
previous iteration (its keys and, with claims, its claim) runs after each vote, off the timed
path, as the vote worker does.

Configuration: 1 voter (it completes every count), ``--votes`` iterations per side, one
process, ``OMP_NUM_THREADS=1``. Writes ``results/outcome_claim_cost.json`` (``--output``) and
one summary line: p50/p90/p99 per side and the p50 added.

Usage (repo root)::

    PYTHONPATH=. .venv/bin/python benchmarks/outcome_claim_cost.py [--votes 500]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "helpers"))
from etcd_cluster import EtcdCluster, etcd_missing_reason  # noqa: E402

from megatron_mecefo.recovery import commit  # noqa: E402
from megatron_mecefo.recovery.etcd_control import EtcdControl  # noqa: E402
from megatron_mecefo.recovery.membership import MembershipStore  # noqa: E402
from megatron_mecefo.recovery.store_etcd import EtcdStore, etcd_address  # noqa: E402

TTL = 10


def _percentiles(xs: List[float]) -> Dict[str, float]:
    q = statistics.quantiles(xs, n=100)
    ms = {"p50_ms": q[49], "p90_ms": q[89], "p99_ms": q[98], "mean_ms": statistics.fmean(xs)}
    return {k: round(v * 1e3, 3) for k, v in ms.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--votes", type=int, default=500, help="iterations per side")
    p.add_argument("--output", default=str(REPO / "results" / "outcome_claim_cost.json"))
    a = p.parse_args()
    missing = etcd_missing_reason()
    if missing:
        sys.exit(f"outcome_claim_cost: {missing}")
    import torch.distributed as dist

    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        cluster = EtcdCluster(Path(tmp))
        cluster.start()
        control = None
        try:
            server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30),
                                   wait_for_workers=False)  # fmt: skip
            prefix = f"/mecefo/claimcost{os.getpid()}"
            control = EtcdControl(cluster.endpoints, prefix, TTL)
            control.campaign("node0", 10.0)
            control.put_fenced("hot_store", f"127.0.0.1:{server.port}")
            url = etcd_address(cluster.endpoints, prefix, TTL)
            claimed = MembershipStore(EtcdStore(url, 30.0, raise_on_failover=True))
            unclaimed = MembershipStore(EtcdStore(url, 30.0, raise_on_failover=True))
            unclaimed.store.claims_outcomes = False  # the design before the claims
            sides = {"claimed": claimed, "unclaimed": unclaimed}
            times: Dict[str, List[float]] = {name: [] for name in sides}
            for i in range(1, a.votes + 1):
                for gen, (name, ms) in enumerate(sides.items()):
                    t0 = time.perf_counter()
                    assert commit.vote(ms, gen, i, 0, [0], 0.01)
                    times[name].append(time.perf_counter() - t0)
                    commit.forget(ms, gen, i - 1)  # off the timed path, as the vote worker
            left = control.conn.range(control.key("kv/outcome/"), prefix=True).kvs
        finally:
            if control is not None:
                control.close()
            cluster.stop()
    result = {
        "benchmark": "outcome_claim_cost",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            "loadavg_start": round(load0, 2),
            "loadavg_end": round(os.getloadavg()[0], 2),
        },
        "config": {
            "etcd": "3 members on 127.0.0.1 (tests/helpers/etcd_cluster.py), one host",
            "voters": 1,
            "votes_per_side": a.votes,
            "timed": "commit.vote of the completer: add, (claim), set + check of the commit key",
            "alternated": "vote by vote, claimed then unclaimed",
        },
        "claimed": _percentiles(times["claimed"]),
        "unclaimed": _percentiles(times["unclaimed"]),
        "claims_left_on_etcd": len(left),
    }
    result["added_p50_ms"] = round(result["claimed"]["p50_ms"] - result["unclaimed"]["p50_ms"], 3)
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    c, u = result["claimed"], result["unclaimed"]
    print(
        f"outcome_claim_cost ({a.votes} votes a side, load {load0:.1f}): claimed p50/p99 "
        f"{c['p50_ms']}/{c['p99_ms']} ms, unclaimed {u['p50_ms']}/{u['p99_ms']} ms: "
        f"+{result['added_p50_ms']} ms p50; {len(left)} claim(s) left on etcd; wrote {out}"
    )


if __name__ == "__main__":
    main()
