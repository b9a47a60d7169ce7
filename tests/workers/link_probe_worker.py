"""One of two gloo ranks: a real megatron-core GPT under DDP trains a step, then
``probe_link`` sends rank 0's gradient buffer to rank 1 (``plan`` {0: [1]}).

Prints one JSON line: the GB/s it returned, the bytes this rank wrote to its sockets meanwhile
(``/proc/self/io``), and whether its gradient buffer is zero afterwards or unchanged.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grad_buffer_worker import build, step  # noqa: E402  (a real GPT + DDP + optimizer)


class Trainer:
    """What ``probe_link`` reads of a trainer: its DDP-wrapped model chunks."""

    def __init__(self, model: object) -> None:
        self.model = [model]


def main() -> None:
    from megatron_mecefo.recovery.state.link_probe import probe_link
    from megatron_mecefo.recovery.state.memory import written_bytes
    from megatron_mecefo.runtime import CpuRuntime

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    runtime = CpuRuntime().enable()
    _, model, opt = build()
    step(model, opt, rank)  # the two ranks' gradients differ
    buf = model.buffers[0].grad_data
    before = buf.clone()
    reps = int(os.environ.get("REPS", "2"))
    written = written_bytes()
    gbps = probe_link(Trainer(model), {0: [1]}, rank, dist.group.WORLD, reps)
    result = {
        "rank": rank,
        "gbps": gbps,
        "buffer_bytes": buf.numel() * buf.element_size(),
        "written": written_bytes() - written,
        "zero": int(torch.count_nonzero(buf)) == 0,
        "unchanged": torch.equal(buf, before),
        "nonzero_before": int(torch.count_nonzero(before)) > 0,
    }
    runtime.disable()
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    main()
