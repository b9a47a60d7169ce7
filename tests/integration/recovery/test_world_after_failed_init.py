"""A world whose ``init_process_group`` failed half-way does not poison the next one
(``recovery/abort.py: WorldAborter.destroy``), on two real gloo ranks.

torch names every group, the default one included, after a per-process counter, and resets it
only when ``destroy_process_group`` runs to its end. A rank whose world failed inside
``init_process_group`` (its rendezvous timed out: a member died, or never came) has no world
to destroy, so the counter kept that attempt. If another rank's world failed after its
``init_process_group`` (and was destroyed, counter reset), the two named the next world's
default group differently and each waited for keys the other never wrote, in that world and
in every later one. That was seen under Slurm: 18 generations in a row with no rank lost.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

from conftest import free_port
from spawned import run_ranks


def _rank(rank: int, port: int, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from megatron_mecefo.recovery.abort import build_aborter

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0,
                          timeout=datetime.timedelta(seconds=60))  # fmt: skip
    aborter = build_aborter("gloo", [f"127.0.0.1:{port}"], hold_s=30.0)
    result: dict = {}
    if rank == 1:
        # World 0: rank 0 never comes, so this rank's rendezvous times out inside
        # init_process_group; rank 0 stands for a peer whose own world failed later on.
        short = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=2))
        try:
            dist.init_process_group(
                "gloo", store=dist.PrefixStore("w0/", short), rank=1, world_size=2,
                timeout=datetime.timedelta(seconds=2),
            )  # fmt: skip
            result["w0"] = "formed"
        except Exception as err:  # noqa: BLE001 - any failure of the rendezvous
            result["w0"] = f"failed: {type(err).__name__}"
        result["initialized_after_w0"] = dist.is_initialized()
        aborter.destroy()
        store.set("left0", "1")
    else:
        store.wait(["left0"])
        aborter.destroy()  # a rank with no world at all: nothing to undo
    # World 1, with a timeout that a mismatch would meet (each side waiting for the other's
    # keys under another group name).
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore("w1/", store), rank=rank,
                                world_size=2, timeout=datetime.timedelta(seconds=20))  # fmt: skip
        t = torch.full((2,), float(rank + 1))
        dist.all_reduce(t)
        result["w1_sum"] = t.tolist()
    except Exception as err:  # noqa: BLE001 - recorded, asserted by the test
        result["w1_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)


def test_a_failed_init_leaves_the_next_world_formable(tmp_path: Path) -> None:
    port = free_port()
    r0, r1 = run_ranks(_rank, [(r, port, str(tmp_path)) for r in (0, 1)], 120, tmp_path)
    assert r1["w0"].startswith("failed") and r1["initialized_after_w0"] is False, r1
    assert r0.get("w1_sum") == r1.get("w1_sum") == [3.0, 3.0], (r0, r1)
