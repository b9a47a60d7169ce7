"""The training thread's waits can be cut short (``recovery/abortable_waits.py``): two real
gloo ranks, a send nobody receives and an all-reduce a peer never joins.

Without the abort, each wait would last the collective timeout (60 s here). The survivor must
raise :class:`WorldAborted` soon after ``abort()``, leave the world without blocking on gloo's
stuck threads, and then work in a new world. "Soon" is well before the timeout (under half of
it): a bound a loaded machine keeps, yet one that waiting for the backstop breaks.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import time
from pathlib import Path

import pytest
from conftest import free_port
from spawned import run_ranks

TIMEOUT_S = 60.0


def _rank(rank: int, port: int, mode: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from megatron_mecefo.recovery.abort import GlooRelease
    from megatron_mecefo.recovery.abortable_waits import STATE, WorldAborted

    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timeout)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("w0/", store), rank=rank, world_size=2, timeout=timeout
    )
    aborter = GlooRelease(store_addresses=[f"127.0.0.1:{port}"], hold_s=TIMEOUT_S + 30.0)
    aborter.arm()
    result: dict = {}
    # Through the patched wait, before any abort: the values are exact.
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    peer = torch.zeros(3)
    if rank == 0:
        dist.send(t * 2, 1)
    else:
        dist.recv(peer, 0)
    result["sum"], result["peer"] = t.tolist(), peer.tolist()
    store.set(f"ready{rank}", "1")
    store.wait(["ready0", "ready1"])
    if rank == 1:
        # The waits alone (no socket shutdown, which may wake some gloo operations itself).
        t0 = time.monotonic()  # before the timer starts: released_s >= 0.5 under any load
        threading.Timer(0.5, STATE.abort).start()
        try:
            if mode == "send":
                dist.send(torch.ones(1000), 0)  # rank 0 never receives
            else:
                dist.all_reduce(torch.ones(3))  # rank 0 never joins
            result["error"] = None
        except WorldAborted as err:
            result["error"] = str(err)
        result["released_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        aborter.destroy()
        result["destroy_s"] = time.monotonic() - t0
        result["retained"] = sum(len(g) for _, g in STATE.retained)
        result["abandoned"] = STATE.abandoned
        store.set("left1", "1")
    else:
        store.wait(["left1"])
        aborter.destroy()
    # A new world on the same store: it works, through the patched wait.
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("w1/", store), rank=rank, world_size=2, timeout=timeout
    )
    aborter.arm()
    t = torch.full((2,), float(10 * (rank + 1)))
    dist.all_reduce(t)
    result["new_world_sum"] = t.tolist()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)  # the abandoned gloo thread is still stuck until the backstop


@pytest.mark.parametrize("mode", ["send", "all_reduce"])
def test_a_blocked_wait_is_released_by_abort(tmp_path: Path, mode: str) -> None:
    port = free_port()
    r0, r1 = run_ranks(_rank, [(r, port, mode, str(tmp_path)) for r in (0, 1)],
                       TIMEOUT_S + 40, tmp_path)  # fmt: skip
    assert r0["sum"] == r1["sum"] == [3.0, 3.0, 3.0]
    assert r1["peer"] == [6.0, 6.0, 6.0]
    assert r1["error"] is not None and "failure ended this world" in r1["error"]
    # Released by the abort at 0.5 s, not by the backstop; the destroy does not join the stuck
    # gloo thread (it would return at the backstop) because the groups are retained.
    assert 0.4 < r1["released_s"] < TIMEOUT_S / 2, r1
    assert r1["destroy_s"] < TIMEOUT_S / 2, r1
    assert r1["abandoned"] == 1 and r1["retained"] >= 1, r1
    assert r0["new_world_sum"] == r1["new_world_sum"] == [30.0, 30.0]
