"""The commit vote at 2,048 nodes: per-rank votes against node-level votes (issue 43, item 9).

One ``TCPStore`` (a child process) serves every vote. Voters are threads, each with a store
client of its own, in a few processes (``--procs``); each runs :func:`.commit.vote` (the real
protocol: ``add``, then a wait for the commit key; the last voter ``set``s it) once per
iteration, all released together by a barrier. Runs:

* ``per_rank``: today's protocol, one voter per rank, at ``--rank-counts`` voters (16,384 ranks
  do not fit one 2-core machine as threads; the server's CPU per vote gives the extrapolation);
* ``node``: one voter per node (``--nodes``): the store sees what the node-level vote
  (:mod:`.node_vote`) casts; one of the nodes is a real :class:`.node_vote.NodeVoteServer`
  with ``--ranks-per-node`` real :class:`.node_vote.NodeVoteClient` ranks (Unix socket), so
  the local gather is in the measured path;
* ``node_etcd``: the same in ``--store-mode etcd``: a real 3-member etcd
  (``tests/helpers/etcd_cluster.py``) names the hot store (``hot_store``), and every voter's
  client is the real :class:`.store_etcd.EtcdStore` (found through etcd, with the per-process
  watch of ``hot_store``); the vote claims nothing on etcd (the hot path's rule,
  :mod:`.commit`), so etcd's share is the watches' reads. The etcd members' CPU per
  iteration is reported;
* ``two_level``: the real two-level vote (:mod:`.group_vote`) at ``--nodes`` nodes in groups
  of ``--group-size``: every emulated node is a :class:`.group_vote.GroupVote` (a thread of a
  voter process); each group's head (its first node) serves its
  :class:`.group_vote.GroupStore` in the same voter process, gathers its group's votes there
  and casts one vote on the hot store; every node learns the outcome from its head. Node 1 is
  a real :class:`.node_vote.NodeVoteServer` (``group_size`` set) with ``--ranks-per-node``
  real rank clients. Besides the hot store's CPU, the heads' servers' CPU (their threads'
  CPU, read from ``/proc``) per iteration is reported, in all and per head;
* ``top_level``: ``--nodes / --group-size`` voters only: the hot store's share of the
  two-level vote alone (one ``commit.vote`` per group);
* ``one_group``: ``--group-size`` voters: one group's size on one TCPStore.

Per iteration: the time from the first voter's start to the last voter knowing the outcome
(every voter, including the real node's ranks), p50 and p99; and the store server's CPU
seconds per iteration (its cost on a real cluster, where the voters are elsewhere). On this
machine voters and server share 2 cores, so the wall times include the emulation's own load:
each run also reports the CPU that the whole emulation (every voter process, the heads' servers
and the hot store) burns per iteration, and that divided by the cores, the least wall time an
iteration can take here however fast the protocol is (``emulation_wall_floor_ms``).
Writes JSON and one summary line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from run_header import run_header  # benchmarks/, this script's folder

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "helpers"))
sys.path.insert(0, str(REPO))

CORES = len(os.sched_getaffinity(0))
"""The cores the emulation shares (the floor under its wall times)."""
POLL_S = float(os.environ.get("COMMIT_AT_SCALE_POLL_S", 0.01))  # RecoveryConfig's default

# The store server looks up each accepted client's name (getnameinfo of ::ffff:127.0.0.1 goes to
# DNS here); with the resolver's 5 s timeout, a dropped query stalled every ~10th of the 2,048
# connections by 5 s. Set before the spawned processes start: they inherit it.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _host(port_out: Any, stop: Any) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    port_out.put(store.port)
    stop.wait()


class _Counted:
    """A store client that counts its requests (what the server serves, polls included)."""

    def __init__(self, store: Any) -> None:
        self.store, self.ops = store, 0

    def __getattr__(self, name: str) -> Any:
        call = getattr(self.store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.ops += 1
            return call(*args, **kwargs)

        return counted


def _membership(address: str, etcd: Optional[str]) -> Any:
    """A voter's client: of the TCPStore at ``address``, or (``etcd``: an ``etcd://``
    address) the real etcd-mode client, which finds the hot store through etcd."""
    from megatron_mecefo.recovery.membership import MembershipStore
    from megatron_mecefo.recovery.store_forwarding import tcp_client

    if etcd is None:
        return MembershipStore(_Counted(tcp_client(address, 60.0)), address)
    from megatron_mecefo.recovery.store_etcd import EtcdStore

    return MembershipStore(_Counted(EtcdStore(etcd, 60.0, raise_on_failover=True)))


def _voters(
    address: str,
    clients: int,
    voters: int,
    generation: int,
    iterations: int,
    etcd: Optional[str],
    barrier: Any,
    out: Any,
) -> None:
    """A process of ``clients`` voter threads; puts, per iteration, (first start, last end,
    every outcome commit)."""
    from megatron_mecefo.recovery.commit import forget, vote

    stores = [_membership(address, etcd) for _ in range(clients)]
    go = threading.Barrier(clients + 1)
    done = threading.Barrier(clients + 1)
    rows: List[List[Any]] = [[0.0, 0.0, True] for _ in range(clients)]

    def voter(k: int) -> None:
        ms = stores[k]
        for it in range(1, iterations + 1):
            go.wait()
            outcome: Dict[str, bool] = {"last": False}
            t0 = time.monotonic()
            ok = vote(ms, generation, it, k, range(voters), POLL_S, outcome)
            rows[k] = [t0, time.monotonic(), ok]
            if outcome["last"]:  # as AsyncVoter does, after the result
                forget(ms, generation, it - 1)
            done.wait()

    threads = [threading.Thread(target=voter, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    result, cpu0 = [], None
    for _ in range(iterations):
        barrier.wait()
        if cpu0 is None:
            cpu0 = time.process_time()
        go.wait()
        done.wait()
        result.append((min(r[0] for r in rows), max(r[1] for r in rows), all(r[2] for r in rows)))
    cpu = time.process_time() - (cpu0 or 0.0)  # every thread of this voter process
    out.put((result, sum(ms.store.ops for ms in stores), None, cpu))


def _thread_cpu_s(tids: Sequence[str]) -> float:
    """User + system CPU seconds of this process's threads ``tids``."""
    total = 0.0
    for tid in tids:
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def _group_voters(
    address: str,
    mine: Sequence[int],
    nodes: Sequence[int],
    group_size: int,
    generation: int,
    iterations: int,
    barrier: Any,
    out: Any,
) -> None:
    """A process of emulated nodes ``mine`` of the two-level vote, one thread each; the heads
    among them serve their group stores here. Puts the rows as :func:`_voters` does, the hot
    store requests, and the heads' servers' CPU seconds over the iterations."""
    from megatron_mecefo.recovery.group_vote import GroupStore, GroupVote, groups_of

    heads = {g[0] for g in groups_of(nodes, group_size).values()}
    before = set(os.listdir("/proc/self/task"))
    stores = {n: GroupStore("127.0.0.1") for n in mine if n in heads}
    server_tids = [  # the group stores' server threads (a libuv loop each)
        t
        for t in sorted(set(os.listdir("/proc/self/task")) - before)
        if Path(f"/proc/self/task/{t}/comm").read_text().strip() == "pt_tcpstore_uv"
    ]
    hot = [_membership(address, None) for _ in mine]
    voters = [
        GroupVote(n, stores.get(n), hot[k], lambda: _membership(address, None),
                  group_size=group_size, poll_interval_s=POLL_S)
        for k, n in enumerate(mine)
    ]  # fmt: skip
    for v in voters:
        v.prepare(generation, nodes)
    clients = len(voters)
    go = threading.Barrier(clients + 1)
    done = threading.Barrier(clients + 1)
    rows: List[List[Any]] = [[0.0, 0.0, True] for _ in range(clients)]

    def voter(k: int) -> None:
        for it in range(1, iterations + 1):
            go.wait()
            t0 = time.monotonic()
            ok, _ = voters[k].vote(generation, it, nodes)
            rows[k] = [t0, time.monotonic(), ok]
            done.wait()

    threads = [threading.Thread(target=voter, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    result, cpu0, proc0 = [], None, 0.0
    for _ in range(iterations):
        barrier.wait()
        if cpu0 is None:
            cpu0, proc0 = _thread_cpu_s(server_tids), time.process_time()
        go.wait()
        done.wait()
        result.append((min(r[0] for r in rows), max(r[1] for r in rows), all(r[2] for r in rows)))
    head_cpu = _thread_cpu_s(server_tids) - (cpu0 or 0.0)
    proc_cpu = time.process_time() - proc0
    ops = sum(ms.store.ops for ms in hot) + sum(
        v._hot_voter.store.ops for v in voters if v.own is not None
    )
    out.put((result, ops, head_cpu, proc_cpu))


def run(
    address: str,
    server_pid: int,
    name: str,
    voters: int,
    procs: int,
    iterations: int,
    generation: int,
    real_node_ranks: int,
    etcd: Optional[str],
    etcd_pids: Sequence[int] = (),
    group_size: int = 0,
) -> Dict[str, Any]:
    """One configuration: ``voters`` store voters, of which one is a real node (a
    :class:`NodeVoteServer` with ``real_node_ranks`` ranks) when ``real_node_ranks``. With
    ``group_size``: ``voters`` nodes of the two-level vote (node 1 the real one)."""
    from megatron_mecefo.recovery.membership import Generation, MembershipStore
    from megatron_mecefo.recovery.node_vote import NodeVoteClient, NodeVoteServer

    ms = MembershipStore.connect(address)
    ms.publish(Generation(number=generation, replicas=(), members={0: 0}))
    emulated = voters - (1 if real_node_ranks else 0)
    per = [emulated // procs + (1 if p < emulated % procs else 0) for p in range(procs)]
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(procs + 1), ctx.Queue()
    real = 1 if group_size else 0  # the real node's index (two-level: a member of group 0)
    if group_size:
        nodes = list(range(voters))
        emulated_nodes = [n for n in nodes if not (real_node_ranks and n == real)]
        workers = [
            ctx.Process(
                target=_group_voters,
                args=(address, emulated_nodes[p::procs], nodes, group_size, generation,
                      iterations, barrier, out),
                daemon=True,
            )  # fmt: skip
            for p in range(procs)
        ]
    else:
        workers = [
            ctx.Process(
                target=_voters,
                args=(address, n, voters, generation, iterations, etcd, barrier, out),
                daemon=True,
            )
            for n in per
        ]
    server = clients = tmp = None
    try:
        for w in workers:
            w.start()
        if real_node_ranks:
            tmp = tempfile.TemporaryDirectory(prefix="nvb")
            server = NodeVoteServer(
                f"{tmp.name}/node", address, node=real, poll_interval_s=POLL_S,
                membership=lambda: _membership(address, etcd), group_size=group_size,
            )  # fmt: skip
            ranks = range(real_node_ranks)
            if group_size:  # slot s >= R is node s - R; the real node's ranks are node 1
                members = list(ranks) + [real_node_ranks + n for n in emulated_nodes]
                node_of = lambda s: real if s < real_node_ranks else s - real_node_ranks  # noqa
            else:  # every emulated voter is a node of its own: slots past the real node's
                members = list(ranks) + [real_node_ranks + k for k in range(voters - 1)]
                node_of = lambda s: 0 if s < real_node_ranks else s  # noqa: E731
            clients = [NodeVoteClient(f"{tmp.name}/node", node_of) for _ in ranks]
        spans: List[tuple] = []
        cpu0 = None
        for it in range(1, iterations + 1):
            barrier.wait(timeout=600)  # every voter connected and done with it - 1
            if cpu0 is None:
                cpu0, t_run = _cpu_s(server_pid), time.monotonic()
                etcd_cpu0 = sum(_cpu_s(p) for p in etcd_pids)
            if clients:
                t0 = time.monotonic()
                futures = [
                    c.start(generation, it, s, members) for s, c in zip(ranks, clients, strict=True)
                ]
                results = [f.result(timeout=600) for f in futures]
                spans.append((t0, time.monotonic(), all(r[0] for r in results)))
        got = [out.get(timeout=600) for _ in workers]
        per_proc = [g[0] for g in got]
        ops = sum(g[1] for g in got)
        head_cpu = sum(g[2] for g in got) if group_size else None
        voter_cpu = sum(g[3] for g in got)
        cpu = _cpu_s(server_pid) - cpu0
        etcd_cpu = sum(_cpu_s(p) for p in etcd_pids) - etcd_cpu0
        wall = time.monotonic() - t_run
    finally:
        for w in workers:
            w.join(10)
            if w.is_alive():
                w.kill()
        if server is not None:
            server.close()
        if tmp is not None:
            tmp.cleanup()
    times, commits = [], 0
    for it in range(iterations):
        rows = [p[it] for p in per_proc] + ([spans[it]] if spans else [])
        times.append(max(r[1] for r in rows) - min(r[0] for r in rows))
        commits += all(r[2] for r in rows)
    times.sort()
    return {
        "name": name,
        "store_voters": voters,
        "real_node_ranks": real_node_ranks,
        "processes": procs,
        "iterations": iterations,
        "committed": commits,
        "p50_ms": round(1e3 * times[len(times) // 2], 2),
        "p99_ms": round(1e3 * times[min(len(times) - 1, int(0.99 * len(times)))], 2),
        "max_ms": round(1e3 * times[-1], 2),
        "server_cpu_ms_per_iteration": round(1e3 * cpu / iterations, 2),
        # The emulated voters' requests (the real node's few are not counted): 2 per voter
        # and 1 set when no wait slice expires; more when waits time out and poll.
        "store_requests_per_iteration": round(ops / iterations, 1),
        "server_requests_per_cpu_s": round(ops / cpu) if cpu > 0 else None,
        "run_wall_s": round(wall, 1),
        "etcd_cpu_ms_per_iteration": round(1e3 * etcd_cpu / iterations, 2) if etcd else None,
        **(
            {
                "group_size": group_size,
                "heads": -(-voters // group_size),
                "heads_server_cpu_ms_per_iteration": round(1e3 * head_cpu / iterations, 2),
                "per_head_server_cpu_ms_per_iteration": round(
                    1e3 * head_cpu / iterations / -(-voters // group_size), 3
                ),
            }
            if group_size
            else {}
        ),
        # What the emulation itself burns per iteration (every voter process, the heads'
        # servers included, and the hot store), and so the least wall time an iteration can
        # take when all of it shares this machine's cores: on a cluster it is spread over the
        # nodes' own CPUs.
        "emulation_cpu_ms_per_iteration": round(1e3 * (voter_cpu + cpu) / iterations, 1),
        "emulation_wall_floor_ms": round(1e3 * (voter_cpu + cpu) / iterations / CORES, 1),
        "load_after": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    global POLL_S
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=2048)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--iterations", type=int, default=50)
    p.add_argument("--rank-counts", default="512,1024,2048", help="per-rank runs (voters)")
    p.add_argument("--skip-etcd", action="store_true")
    p.add_argument("--skip-node", action="store_true", help="no node run without etcd")
    p.add_argument(
        "--group-size", type=int, default=32, help="two_level and top_level runs: nodes per group"
    )
    p.add_argument("--only", default="", help="comma-separated run names to run (default: all)")
    p.add_argument(
        "--poll-interval", type=float, default=POLL_S, help="commit.vote's (waits: 10x it)"
    )
    p.add_argument("--output", default=str(REPO / "results" / "commit_at_scale.json"))
    a = p.parse_args()
    POLL_S = a.poll_interval
    os.environ["COMMIT_AT_SCALE_POLL_S"] = str(a.poll_interval)  # the spawned voters read it
    # SIGTERM (a timeout) unwinds through the finally blocks, which end the children by PID.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ctx = mp.get_context("spawn")
    port_q, stop = ctx.Queue(), ctx.Event()
    host = ctx.Process(target=_host, args=(port_q, stop), daemon=True)
    host.start()
    address = f"127.0.0.1:{port_q.get(timeout=120)}"
    result: Dict[str, Any] = {
        **run_header("commit_at_scale"),
        "config": {
            "nodes": a.nodes,
            "ranks_per_node": a.ranks_per_node,
            "ranks": a.nodes * a.ranks_per_node,
            "voter_processes": a.procs,
            "iterations": a.iterations,
            "poll_interval_s": a.poll_interval,
            "store": "one TCPStore in its own process; voters: threads, a client each",
            "group_size": a.group_size,
        },
        "runs": [],
    }
    cluster = None
    gen = 0
    only = {x for x in a.only.split(",") if x}

    def measure(name: str, voters: int, ranks: int = 0, **kw: Any) -> None:
        nonlocal gen
        if only and name not in only:
            return
        gen += 1
        r = run(address, host.pid, name, voters, a.procs, a.iterations, gen, ranks, **kw)
        result["runs"].append(r)
        print(json.dumps(r), flush=True)

    try:
        for n in [int(x) for x in a.rank_counts.split(",") if x]:
            measure("per_rank", n, etcd=None)
        if not a.skip_node:
            measure("node", a.nodes, a.ranks_per_node, etcd=None)
        if a.group_size > 1:
            measure("two_level", a.nodes, a.ranks_per_node, etcd=None, group_size=a.group_size)
            measure("top_level", -(-a.nodes // a.group_size), etcd=None)
            measure("one_group", a.group_size, etcd=None)
        if not a.skip_etcd and (not only or "node_etcd" in only):
            from etcd_cluster import EtcdCluster, etcd_missing_reason

            if etcd_missing_reason() is None:
                from megatron_mecefo.recovery.etcd_control import EtcdControl
                from megatron_mecefo.recovery.store_etcd import HOT_STORE, etcd_address

                cluster = EtcdCluster(Path(tempfile.mkdtemp(prefix="etcd-commit-"))).start()
                prefix = f"/bench/commit{os.getpid()}"
                ctl = EtcdControl(cluster.endpoints, prefix, 10)
                ctl.conn.put(ctl.key(HOT_STORE), address)  # as a leader publishes its store
                etcd = etcd_address(cluster.endpoints, prefix, 10)
                pids = [cluster.pid(i) for i in range(len(cluster.endpoints))]
                gen += 1
                r = run(
                    address, host.pid, "node_etcd", a.nodes, a.procs, a.iterations, gen,
                    a.ranks_per_node, etcd, [p for p in pids if p is not None],
                )  # fmt: skip
                result["runs"].append(r)
                print(json.dumps(r), flush=True)
            else:
                result["etcd_skipped"] = etcd_missing_reason()
    finally:
        if cluster is not None:
            cluster.stop()
        stop.set()
        host.join(10)
        if host.is_alive():
            host.kill()
    per_rank = [r for r in result["runs"] if r["name"] == "per_rank"]
    if per_rank:  # the server's CPU per vote, at the largest per-rank run
        big = per_rank[-1]
        per_vote_ms = big["server_cpu_ms_per_iteration"] / big["store_voters"]
        ranks = a.nodes * a.ranks_per_node
        result["per_rank_extrapolated"] = {
            "ranks": ranks,
            "server_cpu_ms_per_vote": round(per_vote_ms, 4),
            "server_cpu_ms_per_iteration": round(per_vote_ms * ranks, 1),
            "note": "linear in the voters: every vote is an add and a wait on one server",
        }
    result["machine"]["loadavg_end"] = os.getloadavg()
    parts = [
        f"{r['name']}({r['store_voters']} voters) p50 {r['p50_ms']} p99 {r['p99_ms']} ms, "
        f"server {r['server_cpu_ms_per_iteration']} ms CPU/it, "
        f"emulation floor {r['emulation_wall_floor_ms']} ms"
        for r in result["runs"]
    ]
    if "per_rank_extrapolated" in result:
        x = result["per_rank_extrapolated"]
        parts.append(
            f"per-rank at {x['ranks']} ranks: ~{x['server_cpu_ms_per_iteration']} ms CPU/it"
        )
    cpus = os.cpu_count()
    result["summary"] = (
        f"commit at scale (load {os.getloadavg()[0]:.1f}, {cpus} cores): " + "; ".join(parts)
    )
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(result, indent=1))
    print(result["summary"])
    print(f"commit_at_scale: wrote {a.output}")


if __name__ == "__main__":
    main()
