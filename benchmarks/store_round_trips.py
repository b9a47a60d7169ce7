"""Store round trips: the embedded TCPStore against a 3-member etcd, for the loss of node 0.

Issue 28 asks whether a consensus store (etcd, the way torchelastic's etcd rendezvous uses it)
fits the commit vote's round trips per iteration and the recovery latency goal (the answer
kept the vote on a TCPStore; ``--store-mode etcd`` puts only what must outlive node 0 on
etcd). This measures, on this machine, with the client in another process than every server
(as a training rank and node 0's supervisor are):

* ``TCPStore`` (the embedded default, hosted by a child process): ``set``, ``get``, ``add``;
* torch's ``EtcdStore`` (``torch.distributed.elastic.rendezvous.etcd_store``, the c10d store
  over etcd's v2 API with ``python-etcd``) on a 3-member etcd cluster on localhost: the same
  operations, then the first write after SIGKILL of the member the client talks to (node 0's),
  then writes with 2 of 3 members.

Prerequisites for the etcd part (skipped with a note when missing): the ``etcd`` binary
(Debian: ``apt-get install etcd-server``, 3.4.23 here) and ``python-etcd`` on ``sys.path``
(``pip install --target DIR python-etcd`` and ``--python-etcd-path DIR``). Writes JSON and one
summary line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

from run_header import run_header  # benchmarks/, this script's folder

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stats(fn: Callable[[int], Any], n: int) -> Dict[str, float]:
    times: List[float] = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t0)
    times.sort()
    return _summary(times)


def _summary(times: List[float]) -> Dict[str, float]:
    times = sorted(times)
    n = len(times)
    return {
        "n": n,
        "p50_ms": round(1e3 * statistics.median(times), 3),
        "p90_ms": round(1e3 * times[int(0.9 * (n - 1))], 3),
    }


def _open(kind: str, address: Any, read_timeout: float = 1.0) -> Any:
    """A client of the store under test: ``("tcp", port)`` or ``("etcd", hosts)``."""
    import torch.distributed as dist

    if kind == "tcp":
        return dist.TCPStore("127.0.0.1", address, 1, False, timeout=datetime.timedelta(seconds=30))
    import etcd
    from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

    client = etcd.Client(
        host=address, protocol="http", allow_reconnect=True, read_timeout=read_timeout
    )
    return EtcdStore(client, "/bench", timeout=datetime.timedelta(seconds=30))


def _contender(kind: str, address: Any, ops: int, start: Any, out: Any, path: str) -> None:
    if path:
        sys.path.insert(0, path)
    store = _open(kind, address)
    times = []
    start.wait()
    for _ in range(ops):
        t0 = time.perf_counter()
        store.add("contended", 1)
        times.append(time.perf_counter() - t0)
    out.put(times)


def contended_adds(kind: str, address: Any, clients: int, ops: int, path: str) -> Dict[str, Any]:
    """``clients`` processes add to one key at once, as the members of a commit vote do."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_contender, args=(kind, address, ops, start, out, path), daemon=True)
        for _ in range(clients)
    ]
    for p in procs:
        p.start()
    time.sleep(3.0)  # every client connected (spawn + import)
    start.set()
    times: List[float] = []
    try:
        for _ in procs:
            times += out.get(timeout=300)
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return {"clients": clients, "ops_each": ops, "per_add": _summary(times)}


def _host_tcpstore(port: int, stop: Any) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, 1, True, wait_for_workers=False)
    stop.wait()
    del store


def tcpstore_part(n: int, clients: int) -> Dict[str, Any]:
    port = _free_port()
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    server = ctx.Process(target=_host_tcpstore, args=(port, stop), daemon=True)
    server.start()
    try:
        store = _open("tcp", port)
        return {
            "set": _stats(lambda i: store.set(f"k{i}", "v"), n),
            "get": _stats(lambda i: store.get(f"k{i}"), n),
            "add": _stats(lambda i: store.add("counter", 1), n),
            "contended_add": contended_adds("tcp", port, clients, 50, ""),
        }
    finally:
        stop.set()
        server.join(5)
        if server.is_alive():
            server.kill()


def etcd_part(
    n: int, workdir: Path, read_timeout: float, clients: int, path: str
) -> Dict[str, Any]:
    import etcd  # python-etcd

    names = ["node0", "node1", "node2"]
    peer = {m: _free_port() for m in names}
    client = {m: _free_port() for m in names}
    cluster = ",".join(f"{m}=http://127.0.0.1:{peer[m]}" for m in names)
    procs: Dict[str, subprocess.Popen] = {}
    try:
        for m in names:
            procs[m] = subprocess.Popen(
                ["etcd", "--name", m, "--data-dir", str(workdir / m), "--enable-v2=true",
                 "--listen-peer-urls", f"http://127.0.0.1:{peer[m]}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer[m]}",
                 "--listen-client-urls", f"http://127.0.0.1:{client[m]}",
                 "--advertise-client-urls", f"http://127.0.0.1:{client[m]}",
                 "--initial-cluster", cluster, "--initial-cluster-state", "new",
                 "--heartbeat-interval", "50", "--election-timeout", "500"],
                stdout=open(workdir / f"{m}.log", "w"), stderr=subprocess.STDOUT,
            )  # fmt: skip
        hosts = tuple(("127.0.0.1", client[m]) for m in names)
        deadline = time.time() + 30
        while True:  # the members start and elect a leader
            try:
                store = _open("etcd", hosts, read_timeout)
                store.set("ready", "1")
                break
            except Exception:  # noqa: BLE001 (etcd's errors while it starts)
                if time.time() > deadline:
                    raise
                time.sleep(0.2)
        out: Dict[str, Any] = {
            "members": 3,
            "version": subprocess.run(
                ["etcd", "--version"], capture_output=True, text=True
            ).stdout.split("\n")[0],
            "client": "python-etcd " + getattr(etcd, "__version__", "0.4.5"),
            "read_timeout_s": read_timeout,
            "set": _stats(lambda i: store.set(f"k{i}", "v"), n),
            "get": _stats(lambda i: store.get(f"k{i}"), n),
            "add": _stats(lambda i: store.add("counter", 1), n),
            "contended_add": contended_adds("etcd", hosts, clients, 50, path),
        }
        procs["node0"].send_signal(signal.SIGKILL)  # node 0's member, the client's first host
        procs["node0"].wait()
        t0 = time.perf_counter()
        errors = 0
        while True:
            try:
                store.set("after-kill", "1")
                break
            except Exception:  # noqa: BLE001 (the dead member's connection error)
                errors += 1
                if time.perf_counter() - t0 > 60:
                    raise
        out["first_write_after_member_kill_s"] = round(time.perf_counter() - t0, 3)
        out["errors_before_it"] = errors
        out["set_2_of_3"] = _stats(lambda i: store.set(f"j{i}", "v"), max(20, n // 3))
        return out
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", type=int, default=300, help="operations per measurement")
    p.add_argument("--python-etcd-path", default=None, help="a directory holding python-etcd")
    p.add_argument(
        "--read-timeout",
        type=float,
        default=1.0,
        help="python-etcd's read timeout (s): bounds the wait on a dead member",
    )
    p.add_argument("--clients", type=int, default=8, help="processes adding to one key at once")
    p.add_argument("--output", default=str(REPO / "results" / "store_round_trips.json"))
    a = p.parse_args()
    if a.python_etcd_path:
        sys.path.insert(0, a.python_etcd_path)
    result: Dict[str, Any] = {
        **run_header("store_round_trips"),
        "config": {
            "ops": a.ops,
            "contending_clients": a.clients,
            "client": "another process than every server, localhost",
        },
        "tcpstore": tcpstore_part(a.ops, a.clients),
    }
    try:
        import etcd  # noqa: F401

        have_etcd = shutil.which("etcd") is not None
    except ImportError:
        have_etcd = False
    if have_etcd:
        with tempfile.TemporaryDirectory() as tmp:
            result["etcd"] = etcd_part(
                a.ops, Path(tmp), a.read_timeout, a.clients, a.python_etcd_path or ""
            )
    else:
        result["etcd"] = {"skipped": "needs the etcd binary and python-etcd (module doc)"}
    result["machine"]["loadavg_end"] = os.getloadavg()
    Path(a.output).write_text(json.dumps(result, indent=1))
    t, e = result["tcpstore"], result["etcd"]
    tc = t["contended_add"]["per_add"]["p50_ms"]
    line = (
        f"store round trips (p50 ms, load {os.getloadavg()[0]:.1f}): TCPStore set "
        f"{t['set']['p50_ms']} get {t['get']['p50_ms']} add {t['add']['p50_ms']}, add with "
        f"{a.clients} clients at once {tc}"
    )
    if "set" in e:
        line += (
            f"; etcd x3 set {e['set']['p50_ms']} get {e['get']['p50_ms']} add "
            f"{e['add']['p50_ms']}, add with {a.clients} clients at once "
            f"{e['contended_add']['per_add']['p50_ms']}, first write after killing node 0's "
            f"member {e['first_write_after_member_kill_s']} s"
        )
    print(line)
    print(f"store_round_trips: wrote {a.output}")


if __name__ == "__main__":
    main()
