"""The two-vector checksum code (Huang–Abraham): weights ``1`` and ``1..n`` over a line.

A *line* is the vector one checksum pair covers. Every protected GEMM is checked over its
token dimension first (*token-sum* checksums, ``t(Y) = [1; 1..s] · Y`` per sample or head);
the attention GEMMs also have the *feature-sum* direction (``f(Y) = Y · [1, 1..d]ᵀ``) as a
second check for patterns the first cannot repair. For ``Y = A·B``: ``t(A·B) = t(A)·B`` and
``f(A·B) = A·f(B)`` — the identities that let a checksum be carried from a GEMM's operands
(or from the previous GEMM) to its output without touching the output itself.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

_CACHE: Dict[Tuple[int, int, int, torch.dtype, str], torch.Tensor] = {}


def weights(
    n: int, count: int = 2, offset: int = 0, dtype=torch.float32, device="cpu"
) -> torch.Tensor:
    """``[count, n]``: row 0 all ones, row 1 ``offset+1 .. offset+n`` (positions, 1-based).

    ``offset`` is the global position of the first element, for a sequence-parallel shard.
    """
    key = (n, count, offset, dtype, str(device))
    w = _CACHE.get(key)
    if w is None:
        w = torch.ones(count, n, dtype=dtype, device=device)
        if count > 1:
            w[1] = torch.arange(offset + 1, offset + n + 1, dtype=dtype, device=device)
        if len(_CACHE) > 256:
            _CACHE.clear()
        _CACHE[key] = w
    return w


def position_sums(n: int, offset: int = 0) -> Tuple[float, float]:
    """``(Σ 1, Σ position)`` over ``n`` positions from ``offset``: what a bias adds to t(Y)."""
    return float(n), float(n * offset + n * (n + 1) // 2)


def token_sums(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``t(x)`` of a seq-first tensor ``[s, *rest]`` → ``[count, *rest]`` (one GEMM)."""
    s = x.shape[0]
    return (w @ x.reshape(s, -1).to(w.dtype)).view(w.shape[0], *x.shape[1:])


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """Checksums are kept in at least fp32 (fp64 stays fp64)."""
    if any(t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def is_half(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float16, torch.bfloat16)
