"""The low-rank basis V: top-r right singular vectors of a full, TP-sharded FFN weight.

Only Gram-sized blocks cross the TP group, so every TP layout gets the V of the unsharded
weight (mecefo-algorithm.md §5.2):

- column-parallel (fc1, ``W_k: [m/tp, n]``): V are the top eigenvectors of
  ``WᵀW = Σ_k W_kᵀ W_k``, replicated on every TP rank;
- row-parallel (fc2, ``W_k: [m, n/tp]``): with ``U, λ`` the top eigenpairs of
  ``W Wᵀ = Σ_k W_k W_kᵀ``, ``V = Wᵀ U λ^-1/2``; each rank keeps its row block
  ``V_k = W_kᵀ U λ^-1/2`` and the blocks are re-orthonormalised through an r×r Gram.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_mecefo.techniques.config import MecefoConfig

COLUMN = "column"
ROW = "row"


def _all_reduce(tensor: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, group=group)
    return tensor


def _top_eigenpairs_exact(gram: torch.Tensor, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    evals, evecs = torch.linalg.eigh(gram)  # ascending
    return evals.flip(0)[:rank], evecs.flip(1)[:, :rank]


def _top_eigenpairs_randomized(
    apply: Callable[[torch.Tensor], torch.Tensor],
    dim: int,
    rank: int,
    config: MecefoConfig,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Randomized subspace iteration (Halko et al. 2011, alg. 4.4) on a PSD operator."""
    width = min(dim, rank + config.randomized_oversample)
    generator = torch.Generator().manual_seed(seed)
    omega = torch.randn(dim, width, generator=generator, dtype=dtype).to(device)
    basis = torch.linalg.qr(apply(omega)).Q
    for _ in range(config.randomized_power_iters):
        basis = torch.linalg.qr(apply(basis)).Q
    small = basis.T @ apply(basis)
    evals, evecs = torch.linalg.eigh((small + small.T) / 2)
    evals, evecs = evals.flip(0)[:rank], evecs.flip(1)[:, :rank]
    return evals, basis @ evecs


def compute_basis(
    weight: torch.Tensor,
    parallel_mode: str,
    config: MecefoConfig,
    tp_group: Optional[dist.ProcessGroup],
    seed_offset: int = 0,
) -> torch.Tensor:
    """This TP rank's part of V for one FFN weight, in the weight's dtype.

    Args:
        weight: The local shard, ``[out_per_rank, in]`` (column) or ``[out, in_per_rank]`` (row).
        parallel_mode: ``"column"`` or ``"row"``: which dimension TP shards.
        config: Rank, method and dtype of the basis.
        tp_group: The tensor-parallel group the weight is sharded over.
        seed_offset: Added to ``config.seed`` for the randomized method (e.g. the step), so
            refreshes draw fresh test matrices; identical on all ranks of the group.

    Returns:
        ``[in, r]`` (column: the whole V) or ``[in_per_rank, r]`` (row: this rank's rows of V),
        with ``r = min(config.rank, out, in)`` of the full weight, or fewer columns if the
        weight is rank-deficient. When ``r`` equals ``in``, V is the identity.
    """
    if parallel_mode not in (COLUMN, ROW):
        raise ValueError(f"parallel_mode={parallel_mode!r}; expected {COLUMN!r} or {ROW!r}")
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    out_full = weight.shape[0] * (tp_size if parallel_mode == COLUMN else 1)
    in_full = weight.shape[1] * (tp_size if parallel_mode == ROW else 1)
    rank = min(config.rank, out_full, in_full)
    if rank == in_full:
        # r covers the whole input space: any orthonormal basis of it gives the same, exact
        # projection, and the identity is the one free of eigendecomposition rounding.
        eye = torch.eye(in_full, dtype=weight.dtype, device=weight.device)
        if parallel_mode == COLUMN:
            return eye
        tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        return eye[tp_rank * weight.shape[1] : (tp_rank + 1) * weight.shape[1]].contiguous()

    dtype = getattr(torch, config.basis_dtype)
    w = weight.detach().to(dtype)
    if parallel_mode == COLUMN:
        dim = w.shape[1]

        def apply(y: torch.Tensor) -> torch.Tensor:
            return _all_reduce(w.T @ (w @ y), tp_group)

        def explicit() -> torch.Tensor:
            return _all_reduce(w.T @ w, tp_group)

    else:
        dim = w.shape[0]

        def apply(y: torch.Tensor) -> torch.Tensor:
            return _all_reduce(w @ (w.T @ y), tp_group)

        def explicit() -> torch.Tensor:
            return _all_reduce(w @ w.T, tp_group)

    if config.basis_method == "eigh":
        evals, evecs = _top_eigenpairs_exact(explicit(), rank)
    else:
        evals, evecs = _top_eigenpairs_randomized(
            apply, dim, rank, config, dtype, w.device, config.seed + seed_offset
        )
    if parallel_mode == COLUMN:
        return evecs.to(weight.dtype).contiguous()

    # Row-parallel: V_k = W_kᵀ U λ^-1/2. Directions with (numerically) zero singular value
    # have no defined right singular vector and are dropped.
    keep = evals > evals.max().clamp(min=0) * torch.finfo(dtype).eps * max(dim, 1)
    evals, evecs = evals[keep], evecs[:, keep]
    v_local = (w.T @ evecs) / evals.sqrt()
    # Rounding makes the blocks slightly non-orthonormal; V ← V (VᵀV)^-1/2 fixes it with an
    # r×r all-reduce and keeps span(V).
    gram = _all_reduce(v_local.T @ v_local, tp_group)
    mu, q = torch.linalg.eigh(gram)
    v_local = v_local @ (q * mu.clamp(min=torch.finfo(dtype).tiny).rsqrt()) @ q.T
    return v_local.to(weight.dtype).contiguous()
