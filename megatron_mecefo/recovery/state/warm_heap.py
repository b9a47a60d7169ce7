"""A joiner's heap, faulted in while it waits for its world: the heal then writes into
resident pages.

A process that joins a running job (a replacement, a rejoining node, a spare) builds its model
and receives the state into memory it has never touched. On the CPU every 4 KiB page of it is
faulted in and zeroed by the kernel on first write: measured here, 0.34 s per GiB, as much CPU
as gloo's loopback transfer of the same bytes. The heal's own prefault
(:class:`.memory.Prefaulter`) overlaps that work with the transfer but cannot remove it from a
machine whose cores all serve the transfer.

Yet a joiner idles before the heal: a rejoin is announced ``--join-margin`` iterations ahead,
and the joiner waits in the rendezvous until the survivors reach that boundary. :class:`WarmHeap`
spends that wait: it switches glibc's allocator to its heap for every size (``M_MMAP_MAX`` 0),
takes one block of the size its slot's state had (:func:`publish`, by the slot's previous
process) with a small fence allocated above it, and has a thread fault the block in
(``madvise(MADV_POPULATE_WRITE)``, 8 MiB a call, without the GIL). When every member has
arrived it frees the block: the fence keeps it from merging into the top of the heap, which
glibc trims, so it stays resident as a free chunk, and the model, the gradient buffers and the
optimizer moments the joiner allocates next are carved from it.
After the heal (:meth:`WarmHeap.close`) the allocator gets back the thresholds that its dynamic
rule reaches in a training process, and ``malloc_trim`` returns what the state did not take.

The resident size does not grow: the block is what the state takes a moment later. CPU ranks
with glibc only; a GPU's destinations are device memory, allocated without page faults.
"""

from __future__ import annotations

import ctypes
from typing import Any, Iterator, List, Optional

import torch

from megatron_mecefo.recovery.state.memory import (
    M_MMAP_MAX,
    PAGE_BYTES,
    Background,
    libc,
    mem_available,
    populate,
    training_thresholds,
)

KEY = "heap/{slot}"
"""Store key: the bytes of the slot's last process's state tensors (:func:`publish`)."""

MAX_SHARE_OF_AVAILABLE = 0.5
"""The block never takes more than this share of the machine's MemAvailable."""


def _torch_optimizers(optimizer: Any) -> Iterator[torch.optim.Optimizer]:
    """The ``torch.optim`` optimizers inside megatron-core's wrappers (chained, mixed
    precision, distributed), or ``optimizer`` itself."""
    if isinstance(optimizer, torch.optim.Optimizer):
        yield optimizer
        return
    for inner in getattr(optimizer, "chained_optimizers", None) or []:
        yield from _torch_optimizers(inner)
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and inner is not optimizer:
        yield from _torch_optimizers(inner)


def state_tensor_bytes(model_chunks: List[torch.nn.Module], optimizer: Any) -> int:
    """Bytes of the tensors a joiner allocates before its heal ends: the parameters, their
    gradient buffers (``main_grad``), the optimizer's parameters (megatron-core's fp32 main
    copies) and its state; each storage counted once."""
    tensors: List[torch.Tensor] = []
    for chunk in model_chunks:
        for p in chunk.parameters():
            tensors.append(p)
            grad = getattr(p, "main_grad", None)
            if grad is not None:
                tensors.append(grad)
    for opt in _torch_optimizers(optimizer):
        tensors += [p for group in opt.param_groups for p in group["params"]]
        for per_param in opt.state.values():
            tensors += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen and t.device.type == "cpu":
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def publish(store: Any, slot: int, trainer: Any) -> int:
    """Set :data:`KEY` of ``slot`` to the bytes of ``trainer``'s state tensors (once per world,
    after its first step: Adam's moments exist from then); returns them."""
    nbytes = state_tensor_bytes(trainer.model_chunks, trainer.optimizer)
    store.set(KEY.format(slot=slot), str(nbytes))
    return nbytes


class WarmHeap(Background):
    """A block of the heap faulted in by a thread (module docstring).

    Args:
        nbytes: The block's size (the slot's state, :func:`publish`).
        chunk_bytes: Bytes per ``madvise`` call: how soon it sees :meth:`release`.
    """

    def __init__(self, nbytes: int, chunk_bytes: int = 8 << 20) -> None:
        super().__init__("mecefo-warm-heap")
        self.nbytes = nbytes
        self.chunk_bytes = chunk_bytes
        self.populated = 0
        """Bytes of the block faulted in so far (by :meth:`release`: in all)."""
        self._libc = libc()
        self._ptr: Optional[int] = None
        self._fence: Optional[int] = None
        self._closed = False

    @classmethod
    def for_slot(cls, store: Any, slot: int) -> Optional[WarmHeap]:
        """Started for ``slot`` from its published size (capped by
        :data:`MAX_SHARE_OF_AVAILABLE`); None without a size, without glibc's ``mallopt``,
        or when the block cannot be had."""
        try:
            raw = store.get(KEY.format(slot=slot)) if store.check([KEY.format(slot=slot)]) else b""
        except RuntimeError:  # the store is being taken over (etcd mode): go without
            return None
        if not raw:
            return None
        nbytes = min(int(raw), int(MAX_SHARE_OF_AVAILABLE * mem_available()))
        heap = cls(nbytes)
        return heap if nbytes >= PAGE_BYTES and heap.start() else None

    def start(self) -> bool:
        """Route every allocation to the heap, take the block, start faulting it in; False
        (nothing changed) where glibc's ``mallopt`` is missing or the block cannot be had."""
        c = self._libc
        if c is None or not all(hasattr(c, f) for f in ("mallopt", "malloc", "free")):
            return False
        c.malloc.restype = ctypes.c_void_p
        c.malloc.argtypes = [ctypes.c_size_t]
        c.free.argtypes = [ctypes.c_void_p]
        c.mallopt(M_MMAP_MAX, 0)
        self._ptr = c.malloc(self.nbytes)
        self._fence = self._fence_above(self._ptr) if self._ptr else None
        if not self._fence:
            c.free(self._ptr)
            self._ptr = None
            training_thresholds(c)
            return False
        self._thread.start()
        return True

    def _fence_above(self, block: int) -> Optional[int]:
        """A small allocation above ``block``: freed, the block is then a chunk of its own,
        not part of the top of the heap, which glibc trims past ``M_TRIM_THRESHOLD`` (an int:
        at most 2 GiB could be kept there). A small request is first served from the free
        chunks below (glibc's caches): sizes grow until one comes from above."""
        c, below, size = self._libc, [], 64
        try:
            while size <= 64 << 20:
                fence = c.malloc(size)
                if not fence or fence > block:
                    return fence or None
                below.append(fence)
                size *= 4
            return None
        finally:
            for p in below:
                c.free(p)

    def _run(self) -> None:
        if self._ptr is not None:
            for n, _ in populate([(self._ptr, self.nbytes)], self.chunk_bytes, self._stop):
                self.populated += n

    def release(self) -> int:
        """Stop faulting in and free the block into the heap, where it stays resident for
        the next allocations; returns the bytes populated. Idempotent."""
        if self._ptr is not None:
            self._stop.set()
            self._thread.join()
            self._libc.free(self._ptr)
            self._ptr = None
        return self.populated

    def close(self) -> None:
        """:meth:`release`, then the allocator's thresholds back (mapped chunks above
        :data:`.memory.DYNAMIC_MMAP_THRESHOLD`) and the unused rest of the heap to the OS."""
        if self._closed:
            return
        self.release()
        self._libc.free(self._fence)
        self._fence = None
        training_thresholds(self._libc)
        self._libc.malloc_trim(0)
        self._closed = True
