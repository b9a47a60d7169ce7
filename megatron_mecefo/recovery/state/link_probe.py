"""gloo's own one-tensor bandwidth between a heal's sender and its joiner, measured in the job's
processes right before the heal: a benchmark's diagnostic, off unless :data:`ENV` is set.

A heal's bandwidth is judged against gloo's bandwidth for one large tensor, which
``benchmarks/recovery_scale.py`` measures between two fresh processes. The job's own
processes are not fresh: each holds gigabytes, dozens of threads (gloo's loops, the
watchdog, the heartbeat) and a supervisor beside it, and on a machine of two cores gloo itself
may not reach there what it reaches between two idle processes. This probe sends one large
tensor from the sender to the joiner over the heal's own group, so that the heal can also be
compared with the link as the job's processes see it.

It costs no memory: the tensor is each side's largest gradient buffer (megatron-core's
``grad_data``, the same length on every data-parallel replica), which holds nothing the next
step needs; the joiner's is zeroed again after the probe. It runs before the heal's clock
starts (``heal_start``), so ``heal_s`` does not include it; the rejoin's switch does.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any, Dict, List, Optional

import torch

from megatron_mecefo.recovery.state.grad_buffers import ddp_buffers

ENV = "MECEFO_HEAL_LINK_PROBE"
"""Set to the number of repetitions (e.g. 3) to measure; unset or 0: no probe."""


def repetitions() -> int:
    """The repetitions :data:`ENV` asks for (0: no probe)."""
    try:
        return max(0, int(os.environ.get(ENV, "0") or 0))
    except ValueError:
        return 0


def probe_buffer(trainer: Any) -> Optional[torch.Tensor]:
    """The largest CPU gradient buffer of ``trainer``'s model (megatron-core DDP's
    ``grad_data``), or None without one."""
    grads = (getattr(b, "grad_data", None) for b in ddp_buffers(getattr(trainer, "model", [])))
    found = [g for g in grads if isinstance(g, torch.Tensor) and g.device.type == "cpu"]
    return max(found, key=lambda t: t.numel() * t.element_size(), default=None)


def probe_link(
    trainer: Any, plan: Dict[int, List[int]], me: int, group: Any, reps: int
) -> Optional[float]:
    """With the first source of ``plan`` (source -> receivers, global ranks) and its first
    receiver, send the probe buffer ``reps`` times; the receiver returns the median GB/s, the
    sender and the others None. Only those two ranks take part (point to point): the other
    members do nothing."""
    import torch.distributed as dist

    if reps <= 0 or not plan:
        return None
    src = min(plan)
    dst = plan[src][0]
    if me not in (src, dst):
        return None
    buf = probe_buffer(trainer)
    size = torch.tensor([-1 if buf is None else buf.numel() * buf.element_size()])
    # Both sides agree on the size first: a model without a gradient buffer skips alike.
    if me == src:
        dist.send(size, dst, group=group)
        dist.recv(size, dst, group=group)
    else:
        theirs = torch.zeros_like(size)
        dist.recv(theirs, src, group=group)
        dist.send(size, src, group=group)
        size = size if int(theirs) == int(size) else torch.tensor([-1])
    if int(size) <= 0 or buf is None:
        return None
    data = buf.detach().view(-1).view(torch.uint8)
    rates = []
    for _ in range(reps):
        t0 = time.perf_counter()
        if me == src:
            dist.send(data, dst, group=group)
        else:
            dist.recv(data, src, group=group)
        rates.append(data.numel() / (time.perf_counter() - t0) / 1e9)
    if me == src:
        return None
    buf.zero_()  # the joiner's gradients start from zero, as they were built
    return round(statistics.median(rates), 3)
