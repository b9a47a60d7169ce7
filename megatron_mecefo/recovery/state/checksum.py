"""A cheap, exact checksum of a tensor's bytes, computed on the tensor's own device.

The heal used SHA-256 over ``.numpy().tobytes()`` copies: a second copy of every tensor on the
host, a few hundred MB/s on one core, and an error on a GPU tensor. This sums the bytes as
64-bit words (wrapping), plain and weighted by block position, so that a changed word or two
swapped blocks change it; integer sums do not depend on the reduction order, so the sender's
and the receiver's devices agree. It detects transport faults, not an adversary.
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable, Iterator

import torch

BLOCK_WORDS = 4096
"""Words per block of the position-weighted sum (32 KiB)."""

SLICE_BYTES = 1 << 20
"""Bytes summed per kernel call (bounds the temporaries to a few KiB)."""


def _words_checksum(words: torch.Tensor) -> tuple:
    """(sum, position-weighted sum) of an int64 vector, each modulo 2**64."""
    n = words.numel()
    full = n - n % BLOCK_WORDS
    plain = words.sum()
    weighted = torch.zeros((), dtype=torch.int64, device=words.device)
    if full:
        blocks = words[:full].view(-1, BLOCK_WORDS).sum(dim=1)
        weights = torch.arange(1, blocks.numel() + 1, dtype=torch.int64, device=words.device)
        weighted = (blocks * weights).sum()
    if full < n:  # the tail is one more block
        weighted = weighted + words[full:].sum() * (full // BLOCK_WORDS + 1)
    return plain, weighted


def bytes_checksum(data: torch.Tensor) -> torch.Tensor:
    """The checksum of a 1-D ``uint8`` tensor: an int64 tensor of 2 on ``data``'s device."""
    out = torch.zeros(2, dtype=torch.int64, device=data.device)
    for start in range(0, data.numel(), SLICE_BYTES):
        part = data[start : start + SLICE_BYTES]
        whole = part.numel() - part.numel() % 8
        if whole and part.data_ptr() % 8 == 0:
            plain, weighted = _words_checksum(part[:whole].view(torch.int64))
        else:
            whole = 0
            plain = weighted = torch.zeros((), dtype=torch.int64, device=data.device)
        if whole < part.numel():  # a ragged tail (or an unaligned view): byte by byte
            tail = part[whole:].to(torch.int64)
            plain = plain + tail.sum()
            weighted = weighted + (tail * 7919).sum()
        # Mix the slice's index in, so that swapped slices differ too.
        out[0] += plain
        out[1] += weighted * (start // SLICE_BYTES + 1)
    return out


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a 1-D ``uint8`` view (no copy)."""
    if not tensor.is_contiguous():
        raise ValueError("as_bytes needs a contiguous tensor")
    return tensor.detach().reshape(-1).view(torch.uint8)


def tensor_checksum(tensor: torch.Tensor) -> torch.Tensor:
    """:func:`bytes_checksum` of a tensor (a non-contiguous one is copied first)."""
    t = tensor.detach()
    return bytes_checksum(as_bytes(t if t.is_contiguous() else t.contiguous()))


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nested dict/list/tuple, in a deterministic order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from _tensors(obj[key])
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)


def state_checksum(parameters: Iterable[torch.Tensor], optimizer_state: Any, extra: str) -> str:
    """A hex digest of the parameters, the optimizer state's tensors and ``extra`` (e.g. the
    learning rates): per-tensor checksums on their devices, folded on the host."""
    h = hashlib.sha256(extra.encode())
    for t in [*parameters, *_tensors(optimizer_state)]:
        h.update(repr((tuple(t.shape), str(t.dtype))).encode())
        h.update(tensor_checksum(t).cpu().numpy().tobytes())
    return h.hexdigest()
