"""The coordinator's steady cost at 2,048 emulated nodes, before and after issue 54's M1.

One ``TCPStore`` (a child process) is the hot store of a started job of ``--nodes`` x
``--ranks-per-node`` ranks (default 2,048 x 8 = 16,384): its layout, every rank ``ready``
under its node's supervisor. The real coordinator thread runs in this process; its store
clients (its own and its event waiter) are wrapped to count every request. A second process
writes the heartbeats a real job writes, once per ``--interval`` second, with a pool of
threads (a client each):

* ``before``: the coordinator of commit 8438184 (``git show 8438184:megatron_mecefo/recovery/
  coordinator.py``, loaded from a temporary file beside today's membership module, whose
  per-rank heartbeat reads are unchanged); every rank ``add``s its counter ``hb/<slot>/<inc>``
  and every supervisor its ``hb/supervisor/<id>``;
* ``after``: this commit's coordinator; every node's supervisor ``set``s one key ``hb/node/<id>``
  (its count and its ranks'), and holds one connection to the coordinator's liveness
  listener (``--nodes`` idle sockets in its ``select``).

Both run in one invocation, one after the other, each on a fresh store. After the start-up
(the first full rescan of every slot, and the first heartbeat pass; not measured), a window of
``--seconds`` is measured: hot-store requests per second (the coordinator's, counted; the
heartbeat writers', counted by the writer process), the coordinator's CPU per second (its
threads' CPU clocks: the loop, and the liveness listener), and the store server's CPU per
second (``/proc``); and how many heartbeat checks the coordinator made per second (one is due
each ``--interval``: a check that takes longer than that is throughput-bound, and its requests
per second are then what the store answers, not what the check asks). Then one event (a
replacement rank ``ready``) and the requests of the coordinator's pass that reads it.

Adds the ``coordinator`` section to ``--output`` (``results/commit_at_scale.json`` by
default; what is there is kept) and prints one summary line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Tuple

from run_header import run_header  # benchmarks/, this script's folder

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

OLD_COMMIT = "8438184"
WRITER_THREADS = 8


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _host(port_out: Any, stop: Any) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=300),
                           wait_for_workers=False, use_libuv=True)  # fmt: skip
    port_out.put(server.port)
    stop.wait()


def _supervisor(node: int) -> str:
    return f"{node}@emulated{node}:{100000 + node}"


def _writer(address: str, mode: str, nodes: int, per_node: int, interval: float,
            counts: Any, stop: Any) -> None:  # fmt: skip
    """The heartbeats of every rank and supervisor (``before``) or of every node (``after``),
    once per ``interval``, from a pool of threads; ``counts`` gets the requests done. After:
    also every node's connection to the liveness listener, once its address is published."""
    from megatron_mecefo.recovery.membership import MembershipStore

    socks = []

    def hold() -> None:
        import socket

        ms = MembershipStore.connect(address, 300.0)
        while not stop.is_set() and (liveness := ms.get_str("liveness")) is None:
            time.sleep(0.05)
        host, port = liveness.rsplit(":", 1)
        for node in range(nodes):
            conn = socket.create_connection((host, int(port)))
            conn.sendall(f"{_supervisor(node)}\n".encode())
            socks.append(conn)

    if mode == "after":
        threading.Thread(target=hold, daemon=True).start()
    done = [0] * WRITER_THREADS

    def beat(i: int) -> None:
        ms = MembershipStore.connect(address, 300.0)
        mine = range(i, nodes, WRITER_THREADS)
        beat_no = 0
        while not stop.is_set():
            t0 = time.monotonic()
            beat_no += 1
            for node in mine:
                slots = range(node * per_node, (node + 1) * per_node)
                if mode == "before":
                    for slot in slots:
                        ms.store.add(f"hb/{slot}/0", 1)
                    ms.store.add(f"hb/supervisor/{_supervisor(node)}", 1)
                    done[i] += per_node + 1
                else:
                    ms.node_heartbeat(
                        _supervisor(node), beat_no, {f"{s}/0": beat_no for s in slots}
                    )
                    done[i] += 1
            counts[i] = done[i]
            stop.wait(max(0.0, interval - (time.monotonic() - t0)))

    threads = [threading.Thread(target=beat, args=(i,), daemon=True) for i in range(WRITER_THREADS)]
    for t in threads:
        t.start()
    stop.wait()
    for t in threads:
        t.join(10)


class CountingStore:
    """A store client that counts its requests (and forwards them)."""

    def __init__(self, inner: Any, counter: List[int], calls: List[Tuple[str, str]]) -> None:
        self.inner, self.counter, self.calls = inner, counter, calls

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.counter[0] += 1
            first = args[0] if args else ""
            key = str(first[0] if isinstance(first, list) else first)
            if key == "done":  # each heartbeat check looks at it first
                self.counter[2] += 1
            if self.counter[1]:  # recording: (request, its first key)
                self.calls.append((name, key))
            return attr(*args, **kwargs)

        return call


def _old_coordinator_class() -> Any:
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{OLD_COMMIT}:megatron_mecefo/recovery/coordinator.py"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    folder = tempfile.mkdtemp(prefix="coordinator_old_")
    path = os.path.join(folder, f"coordinator_{OLD_COMMIT}.py")
    Path(path).write_text(source)
    spec = importlib.util.spec_from_file_location(f"coordinator_{OLD_COMMIT}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Coordinator


def _thread_cpu_s(threads: List[threading.Thread]) -> float:
    total = 0.0
    for t in threads:
        if t.ident is not None and t.is_alive():
            total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
    return total


def _run(mode: str, a: argparse.Namespace) -> Dict[str, Any]:
    from megatron_mecefo.recovery import membership
    from megatron_mecefo.recovery.config import RecoveryConfig
    from megatron_mecefo.recovery.coordinator import Coordinator
    from megatron_mecefo.recovery.membership import MembershipStore

    ctx = mp.get_context("spawn")
    port_q, stop_host = ctx.Queue(), ctx.Event()
    host = ctx.Process(target=_host, args=(port_q, stop_host), daemon=True)
    host.start()
    writer = None
    stop_writer = ctx.Event()
    counter = [0, 0, 0]  # requests; whether to record them in calls; heartbeat checks
    calls: List[Tuple[str, str]] = []
    real_connect = MembershipStore.connect
    coord = None
    try:
        address = f"127.0.0.1:{port_q.get(timeout=120)}"
        world = a.nodes * a.ranks_per_node
        ms = MembershipStore.connect(address, 300.0)
        ms.set_json("layout", {"tp": 1, "pp": 1, "dp": world})
        batch = 1024
        for start in range(0, world, batch):
            slots = range(start, min(world, start + batch))
            ms.store.multi_set(
                [f"ready/{s}/0" for s in slots],
                [json.dumps({"supervisor": _supervisor(s // a.ranks_per_node)}) for s in slots],
            )
        cfg = RecoveryConfig(store=address, heartbeat_interval_s=a.interval,
                             heartbeat_timeout_s=a.heartbeat_timeout)  # fmt: skip

        def counted_connect(*args: Any, **kwargs: Any) -> MembershipStore:
            client = real_connect(*args, **kwargs)
            return MembershipStore(CountingStore(client.store, counter, calls), client.address())

        # The coordinator's event waiter (and the listener's notifier) connect inside it.
        membership.MembershipStore.connect = staticmethod(counted_connect)  # type: ignore
        cls = _old_coordinator_class() if mode == "before" else Coordinator
        own = real_connect(address, 300.0)
        coord = cls(MembershipStore(CountingStore(own.store, counter, calls), address), world, cfg,
                    log=lambda line: None)  # fmt: skip
        # The beats first: a job's ranks beat before the coordinator looks at them.
        counts = ctx.Array("q", [0] * WRITER_THREADS)
        writer = ctx.Process(target=_writer, daemon=True, args=(
            address, mode, a.nodes, a.ranks_per_node, a.interval, counts, stop_writer))  # fmt: skip
        writer.start()
        one_round = a.nodes * ((a.ranks_per_node + 1) if mode == "before" else 1)
        while sum(counts[:]) < one_round:
            time.sleep(0.05)
        t_start = time.monotonic()
        coord.start()
        # Start-up: the first rescan of every slot and heartbeat pass (every rank seen).
        while len(coord._hb) < world:
            assert time.monotonic() - t_start < 600, "the coordinator never saw every rank"
            time.sleep(0.1)
        startup_s = time.monotonic() - t_start
        time.sleep(2 * a.interval)
        threads = [coord.thread] + ([coord.listener.thread] if mode == "after" else [])
        r0, w0, p0 = counter[0], sum(counts[:]), counter[2]
        c0, s0, t0 = _thread_cpu_s(threads), _cpu_s(host.pid), time.monotonic()
        time.sleep(a.seconds)
        r1, w1, p1 = counter[0], sum(counts[:]), counter[2]
        c1, s1, t1 = _thread_cpu_s(threads), _cpu_s(host.pid), time.monotonic()
        window = t1 - t0
        # One event: a replacement of rank 5 is ready. Its pass: the requests from the
        # coordinator's read of the event count before it sees the rank to the next such
        # read, less a heartbeat check's if one fell due in it.
        ms.store.set("inc/5", "1")
        counter[1] = 1
        te = time.monotonic()
        ms.mark_ready(5, 1, {"supervisor": _supervisor(5 // a.ranks_per_node)})
        while (5, 1) not in coord.ready:
            time.sleep(0.001)
        event_s = time.monotonic() - te
        passes: List[List[Tuple[str, str]]] = []
        while len(passes) < 3 or not any(("get", "ready/5/1") in one for one in passes[:-1]):
            time.sleep(0.05)
            passes = []
            for call in list(calls):
                if call == ("add", "events"):
                    passes.append([])
                if passes:
                    passes[-1].append(call)
        counter[1] = 0
        (event_pass,) = [one for one in passes[:-1] if ("get", "ready/5/1") in one]
        event_requests = sum(
            1 for _, key in event_pass if not key.startswith("hb/") and key != "done"
        )
        dead = len(coord.dead)
        return {
            "coordinator": f"commit {OLD_COMMIT}" if mode == "before" else "this commit",
            "heartbeat_writes": (
                "one add per rank and per supervisor per interval"
                if mode == "before" else "one set per node per interval (its ranks beat locally)"
            ),  # fmt: skip
            "startup_s": round(startup_s, 2),
            "window_s": round(window, 2),
            "coordinator_requests_per_s": round((r1 - r0) / window, 1),
            "heartbeat_checks_per_s": round((p1 - p0) / window, 2),
            "coordinator_requests_per_check": round((r1 - r0) / max(1, p1 - p0), 1),
            "heartbeat_requests_per_s": round((w1 - w0) / window, 1),
            "hot_store_requests_per_s": round((r1 - r0 + w1 - w0) / window, 1),
            "coordinator_cpu_s_per_s": round((c1 - c0) / window, 4),
            "store_server_cpu_s_per_s": round((s1 - s0) / window, 4),
            "event_requests": event_requests,
            "event_seen_after_s": round(event_s, 3),
            "ranks_declared_dead": dead,
        }
    finally:
        membership.MembershipStore.connect = staticmethod(real_connect)  # type: ignore
        if coord is not None:
            coord.stop()
        stop_writer.set()
        if writer is not None:
            writer.join(30)
            if writer.is_alive():
                writer.kill()
        stop_host.set()
        host.join(10)
        if host.is_alive():
            host.kill()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=2048)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--interval", type=float, default=1.0, help="heartbeat interval (s)")
    p.add_argument("--heartbeat-timeout", type=float, default=120.0,
                   help="long: no emulated rank is killed during the run")  # fmt: skip
    p.add_argument("--seconds", type=float, default=20.0, help="the measured window")
    p.add_argument("--output", default=str(REPO / "results" / "commit_at_scale.json"))
    a = p.parse_args()
    header = run_header("coordinator_at_scale")
    runs = {mode: _run(mode, a) for mode in ("before", "after")}
    b, f = runs["before"], runs["after"]
    summary = (
        f"coordinator at {a.nodes} nodes x {a.ranks_per_node} ranks (load "
        f"{os.getloadavg()[0]:.1f}, {os.cpu_count()} cores): hot-store requests/s "
        f"{b['hot_store_requests_per_s']:.0f} -> {f['hot_store_requests_per_s']:.0f} (the "
        f"coordinator's {b['coordinator_requests_per_s']:.0f} -> "
        f"{f['coordinator_requests_per_s']:.0f}; heartbeat checks/s, one due: "
        f"{b['heartbeat_checks_per_s']:.2f} -> {f['heartbeat_checks_per_s']:.2f}; requests per "
        f"check {b['coordinator_requests_per_check']:.0f} -> "
        f"{f['coordinator_requests_per_check']:.0f}), coordinator CPU s/s "
        f"{b['coordinator_cpu_s_per_s']:.3f} -> {f['coordinator_cpu_s_per_s']:.3f}, store "
        f"server CPU s/s {b['store_server_cpu_s_per_s']:.3f} -> "
        f"{f['store_server_cpu_s_per_s']:.3f}, requests per event {b['event_requests']} -> "
        f"{f['event_requests']}"
    )
    section = {
        **header,
        "config": {
            "nodes": a.nodes, "ranks_per_node": a.ranks_per_node,
            "ranks": a.nodes * a.ranks_per_node, "heartbeat_interval_s": a.interval,
            "heartbeat_timeout_s": a.heartbeat_timeout, "window_s": a.seconds,
            "writer_threads": WRITER_THREADS,
            "store": "one TCPStore (libuv) in its own process; the coordinator thread in the "
                     "benchmark's process, its store clients counted; the heartbeat writers in "
                     "a second process",
            "before": f"the coordinator of commit {OLD_COMMIT} (git show), loaded beside "
                      "today's membership module",
        },  # fmt: skip
        "runs": runs,
        "summary": summary,
    }
    section["machine"]["loadavg_end"] = os.getloadavg()
    out = Path(a.output)
    data = json.loads(out.read_text()) if out.exists() else {}
    data["coordinator"] = section
    out.write_text(json.dumps(data, indent=1))  # as commit_at_scale.py writes it
    print(summary)


if __name__ == "__main__":
    main()
