"""One process (the allocator's settings are per process): a real megatron-core GPT + DDP +
optimizer after one step, its state's bytes as :func:`state_tensor_bytes` counts them; then
a :class:`WarmHeap` against fresh allocations, and the slot's size read from a real TCPStore.

Prints one JSON line with the numbers; ``tests/unit/recovery/state/test_warm_heap.py``
asserts on them.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

MiB = 1 << 20
FILL = 128 * MiB
"""Bytes allocated and written in 8 MiB tensors, as a heal's destinations are."""


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def fill() -> tuple:
    """Allocate and write :data:`FILL` bytes; (tensors, page faults taken)."""
    before = faults()
    out = [torch.empty(8 * MiB, dtype=torch.uint8) for _ in range(FILL // (8 * MiB))]
    for t in out:
        t.fill_(1)
    return out, faults() - before


def state_bytes() -> dict:
    from grad_buffer_worker import build, step
    from megatron.core import parallel_state as ps

    from megatron_mecefo.recovery.state.warm_heap import state_tensor_bytes
    from megatron_mecefo.runtime import CpuRuntime

    dist.init_process_group("gloo", rank=0, world_size=1)
    runtime = CpuRuntime().enable()
    gpt, model, opt = build()
    step(model, opt, 0)
    numel = sum(p.numel() for p in gpt.parameters())
    counted = state_tensor_bytes([model], opt)
    ps.destroy_model_parallel()
    runtime.disable()
    dist.destroy_process_group()
    return {"param_bytes": 4 * numel, "counted": counted}


def heap() -> dict:
    from megatron_mecefo.recovery.state.memory import mem_available, release_unused, rss_bytes
    from megatron_mecefo.recovery.state.warm_heap import KEY, WarmHeap

    out: dict = {}
    tensors, out["faults_cold"] = fill()
    del tensors
    release_unused()
    rss0 = rss_bytes()
    warm = WarmHeap(FILL + 16 * MiB)
    out["started"] = warm.start()
    warm._thread.join()  # let it fault the whole block in
    out["populated"] = warm.release()
    tensors, out["faults_warm"] = fill()
    out["rss_grown_by_fill"] = rss_bytes() - rss0 - out["populated"]
    warm.close()
    del tensors
    release_unused()
    out["rss_back"] = rss_bytes() - rss0
    # Closed: a large tensor is a fresh mapping again (mmap back on).
    big = torch.empty(64 * MiB, dtype=torch.uint8)
    before = faults()
    big.fill_(1)
    out["faults_after_close"] = faults() - before
    del big

    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    out["no_size"] = WarmHeap.for_slot(store, 3) is None
    store.set(KEY.format(slot=3), str(8 * MiB))
    small = WarmHeap.for_slot(store, 3)
    out["slot_bytes"] = small.nbytes if small is not None else None
    if small is not None:
        small.close()
    store.set(KEY.format(slot=4), str(1 << 50))  # more than the machine has
    capped = WarmHeap.for_slot(store, 4)
    out["capped_bytes"] = capped.nbytes if capped is not None else None
    if capped is not None:
        capped._stop.set()  # do not fault in half the machine
        capped.close()
    out["mem_available"] = mem_available()
    return out


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    torch.set_num_threads(1)
    result = {**state_bytes(), **heap()}
    print("RESULT " + json.dumps(result), flush=True)
