"""A storm of TCPStore connects to a fresh server, as when every client of every rank follows a
new leader's store at once (``--store-mode etcd``, the loss of node 0).

Torch names each connection with ``getnameinfo`` twice: the client names the address it
connects to (torch's socket.cpp, ``SocketImpl``), and the server names each accepted peer on
its only thread (``TCPStoreLibUvBackend.cpp``, ``UvTcpSocket::startRead``; the legacy server in
``SocketImpl::accept``). The server listens on a dual-stack IPv6 socket, so both names are of
``::ffff:127.0.0.1``, which ``/etc/hosts`` (IPv4 entries) cannot answer: each is a reverse DNS
query. A resolver that drops one costs glibc's timeout, 5 s (10 s when both tries drop); on the
server's thread that silences the whole store, its heartbeats and votes included.

For each server, a fresh store, then ``--clients`` connects at once (``--procs`` processes of
threads), while an already connected client adds in a loop (the store's stall is its worst
``add``). Servers: torch's default (libuv), torch's legacy one, and
:func:`megatron_mecefo.recovery.store_forwarding.serve` (an IPv4 listening socket for an IPv4
host: the server's query is answered by ``/etc/hosts``). Before each, ``--settle`` seconds with no
query let a rate-limiting resolver recover. Also measured: ``getnameinfo`` of the two addresses
(``--lookups`` at once). Writes JSON and one summary line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from run_header import run_header  # noqa: E402


def _connects(port: int, threads: int, start_at: float, out: Any) -> None:
    """One process: ``threads`` TCPStore clients built at ``start_at``; their build times."""
    import torch.distributed as dist

    times: List[float] = []
    keep: List[Any] = []
    lock = threading.Lock()

    def one() -> None:
        while time.time() < start_at:
            time.sleep(0.0005)
        t0 = time.monotonic()
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        with lock:
            times.append(time.monotonic() - t0)
            keep.append(client)

    workers = [threading.Thread(target=one) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    out.put(times)


def _lookups(address: str, n: int) -> Dict[str, Any]:
    """``n`` simultaneous ``getnameinfo`` of ``address``: seconds each, and the failures."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sockaddr = (address, 1234, 0, 0) if family == socket.AF_INET6 else (address, 1234)
    times: List[float] = []
    failed = [0]

    def one() -> None:
        t0 = time.monotonic()
        try:
            socket.getnameinfo(sockaddr, socket.NI_NUMERICSERV)
        except OSError:
            failed[0] += 1
        times.append(time.monotonic() - t0)

    ts = [threading.Thread(target=one) for _ in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return {"address": address, "n": n, **_stats(times), "failed": failed[0]}


def _stats(times: List[float]) -> Dict[str, Any]:
    s = sorted(times)
    return {
        "p50_s": round(statistics.median(s), 4),
        "max_s": round(s[-1], 4),
        "over_1s": sum(t > 1.0 for t in s),
    }


def _storm(kind: str, clients: int, procs: int) -> Dict[str, Any]:
    import torch.distributed as dist

    from megatron_mecefo.recovery.store_forwarding import serve

    if kind == "serve":
        server = serve("127.0.0.1", 0)
    else:
        server = dist.TCPStore(
            "127.0.0.1", 0, None, is_master=True, wait_for_workers=False,
            use_libuv=(kind == "torch_libuv"),
        )  # fmt: skip
    pinger = dist.TCPStore("127.0.0.1", server.port, is_master=False)
    stop = threading.Event()
    adds: List[float] = []

    def ping() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            pinger.add("ping", 1)
            adds.append(time.monotonic() - t0)
            time.sleep(0.01)

    pinging = threading.Thread(target=ping)
    pinging.start()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    per = [clients // procs + (i < clients % procs) for i in range(procs)]
    start_at = time.time() + 4.0  # after the spawned interpreters imported torch
    ps = [ctx.Process(target=_connects, args=(server.port, n, start_at, out)) for n in per]
    for p in ps:
        p.start()
    times: List[float] = []
    for _ in ps:
        times += out.get(timeout=120)
    for p in ps:
        p.join()
    time.sleep(0.3)
    stop.set()
    pinging.join()
    return {
        "server": kind,
        "clients": clients,
        "procs": procs,
        "connect": _stats(times),
        "store_stall_s": round(max(adds), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--lookups", type=int, default=64)
    parser.add_argument("--settle", type=float, default=6.0)
    parser.add_argument("--servers", default="torch_libuv,torch_legacy,serve")
    parser.add_argument("--output", default="results/store_connect_storm.json")
    a = parser.parse_args()
    result: Dict[str, Any] = run_header("store_connect_storm")
    result["lookups"] = []
    for address in ("127.0.0.1", "::ffff:127.0.0.1"):
        time.sleep(a.settle)
        result["lookups"].append(_lookups(address, a.lookups))
    result["storms"] = []
    for kind in a.servers.split(","):
        time.sleep(a.settle)
        result["storms"].append(_storm(kind, a.clients, a.procs))
    os.makedirs(os.path.dirname(a.output) or ".", exist_ok=True)
    with open(a.output, "w") as f:
        json.dump(result, f, indent=2)
    parts = [
        f"{s['server']}: connect p50 {s['connect']['p50_s']:.3f} s max {s['connect']['max_s']:.2f}"
        f" s ({s['connect']['over_1s']}/{s['clients']} over 1 s), store stall"
        f" {s['store_stall_s']:.2f} s"
        for s in result["storms"]
    ]
    look = "; ".join(
        f"getnameinfo {x['address']} x{x['n']}: max {x['max_s']:.2f} s" for x in result["lookups"]
    )
    print(f"store_connect_storm, {a.clients} clients from {a.procs} processes: "
          + "; ".join(parts) + f" | {look}")  # fmt: skip


if __name__ == "__main__":
    main()
