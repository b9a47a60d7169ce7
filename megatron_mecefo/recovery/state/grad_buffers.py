"""A survivor's gradient buffers, reused by the model it rebuilds in the next world.

Megatron-Core's DDP allocates each gradient buffer with ``torch.zeros`` (``_ParamAndGradBuffer``,
one flat tensor as large as the weights). On the CPU every page of a fresh allocation is
faulted in and zeroed by the kernel: measured 0.14 s for 0.43 GB (1.6 GiB of state per rank)
in a DP2 survivor's rebuild, about 1.3 µs per 4 KiB page on this VM, against 0.015 s to zero
the same bytes already resident; and the old world's buffer, freed just before, cost 0.03 s
more to unmap. Both grow with the model, so the regroup did. A data-parallel regroup rebuilds
the same model (a lost replica changes no layer), so its buffers have the same sizes: the
survivor keeps the old buffers (:func:`take_grad_buffers`, in ``leave``), and the new DDP's
``torch.zeros`` of the same size and dtype is answered with one of them, zeroed in place
(:class:`GradBufferReuse`, a ``TorchFunctionMode`` around the model's construction).
Megatron's own code is not changed.

The memory bound holds: the old buffer is dropped by the old world anyway, and it is never
kept next to a new one. A request that no kept buffer fits (another layout) frees every kept
buffer before it allocates; what is left unused when the construction ends is freed then. The
distributed optimizer's buffers are not kept (their padding follows the data-parallel size).

CPU only: on a GPU the caching allocator already reuses the freed block without new page
faults, and an aborted NCCL kernel may still be writing into the old buffer.
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, List, Optional

import torch
from torch.overrides import TorchFunctionMode

_ZEROS = torch._C._VariableFunctions.zeros
"""torch's own ``torch.zeros``: what the mode sees, also under the CPU runtime, whose wrapper
(``runtime/cpu.py``'s factory layer) replaces the ``torch.zeros`` attribute and calls this."""


def _whole(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is contiguous and spans the whole of its (resizable) storage."""
    storage = tensor.untyped_storage()
    return (
        tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and storage.nbytes() == tensor.numel() * tensor.element_size()
        and storage.resizable()
    )


def ddp_buffers(ddp_models: Iterable[Any]) -> Iterator[Any]:
    """The gradient buffers of Megatron DDP wrappers (dense, then expert-parallel)."""
    for ddp in ddp_models:
        yield from getattr(ddp, "buffers", None) or []
        yield from getattr(ddp, "expert_parallel_buffers", None) or []


def take_grad_buffers(ddp_models: Iterable[Any]) -> List[torch.Tensor]:
    """The CPU gradient buffers of ``ddp_models`` (Megatron DDP wrappers), for the next world's
    model (:class:`GradBufferReuse`). Each buffer's ``grad_data`` is detached from its buffer
    object, so that ``release_megatron`` (which frees the buffers still attached) leaves it.
    The old buckets' and parameters' views still refer to the memory; nothing writes through
    them once the world is aborted (its backward never resumes)."""
    kept: List[torch.Tensor] = []
    for buffer in ddp_buffers(ddp_models):
        grad = getattr(buffer, "grad_data", None)
        if getattr(buffer, "param_data", None) is not None:
            continue  # the distributed optimizer: the layout depends on the world's size
        if isinstance(grad, torch.Tensor) and grad.device.type == "cpu" and _whole(grad):
            kept.append(grad.detach())
            buffer.grad_data = None
    return kept


def free(tensors: Iterable[torch.Tensor]) -> None:
    """Give the memory of ``tensors`` back now, whoever else still refers to it."""
    for t in tensors:
        storage = t.untyped_storage()
        if storage.resizable():
            storage.resize_(0)


class GradBufferReuse(TorchFunctionMode):
    """``with GradBufferReuse(kept):`` around a model's construction: a 1-D ``torch.zeros`` of
    exactly a kept buffer's length, dtype and device returns that buffer, zeroed in place
    (module doc). Anything else runs as usual; a request at least as large as a kept buffer
    that none fits frees them all first (never two buffers' worth at once). ``reused`` counts
    the buffers handed out; the unused ones are freed on exit."""

    def __init__(self, kept: List[torch.Tensor]) -> None:
        super().__init__()
        self.kept = list(kept)
        self.reused = 0

    def _take(self, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
        size = args[0] if len(args) == 1 else args
        if isinstance(size, (tuple, list, torch.Size)) and len(size) == 1:
            size = size[0]
        if not isinstance(size, int) or set(kwargs) - {"dtype", "device", "requires_grad"}:
            return None
        if kwargs.get("requires_grad", False):
            return None
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        device = torch.device(kwargs.get("device") if kwargs.get("device") is not None else "cpu")
        for i, t in enumerate(self.kept):
            if t.numel() == size and t.dtype == dtype and t.device == device:
                del self.kept[i]
                self.reused += 1
                return t.zero_()
        if self.kept and size >= min(t.numel() for t in self.kept):
            free(self.kept)  # another layout: never hold the old buffers next to new ones
            self.kept.clear()
        return None

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None
    ) -> Any:
        kwargs = kwargs or {}
        # (The mode is off while its handler runs: zero_() and func do not come back here.)
        if func is _ZEROS and self.kept:
            taken = self._take(args, kwargs)
            if taken is not None:
                return taken
        return func(*args, **kwargs)

    def __exit__(self, *exc: Any) -> None:
        free(self.kept)
        self.kept.clear()
        super().__exit__(*exc)
