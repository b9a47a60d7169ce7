"""MeCeFO's low-rank basis V in Megatron-LM's checkpoints (``--mecefo``, low-rank FFN on).

Megatron-LM's ``save_checkpoint`` does not know V, so a run resumed between two refreshes
would recompute V from the resumed weights. These wrappers of the names in
``megatron.training.training`` add, per rank, ``iter_N/mecefo_basis/<layout>.pt`` after a save
and restore it after a load (same TP/PP/DP layout only; on another layout, or from a
checkpoint without the file, V is recomputed at the first takeover and rank 0 says so).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, List


def basis_path(checkpoint_dir: str, iteration: int) -> str:
    """This rank's basis file: ``iter_N/mecefo_basis/<layout>.pt``, beside the CPU shards."""
    from megatron_mecefo.runtime.megatron_lm_cpu_checkpoint import shard_path

    return shard_path(checkpoint_dir, iteration, folder="mecefo_basis")


def _chunks(model: Any) -> List[Any]:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def wrap_save(original: Callable[..., Any]) -> Callable[..., Any]:
    """``save_checkpoint``, then this rank's bases (a persistent, non-release save only)."""

    @functools.wraps(original)
    def save_checkpoint(iteration: int, model: Any, *a: Any, **kw: Any) -> Any:
        result = original(iteration, model, *a, **kw)
        import torch
        from megatron.training.global_vars import get_args

        from megatron_mecefo.techniques.basis_checkpoint import basis_state_dict

        args = get_args()
        if kw.get("non_persistent_ckpt", False) or kw.get("release", False) or not args.save:
            return result
        bases = basis_state_dict(_chunks(model))
        if bases:
            path = basis_path(args.save, iteration)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(bases, path + ".tmp")
            os.replace(path + ".tmp", path)
        return result

    return save_checkpoint


def wrap_load(original: Callable[..., Any]) -> Callable[..., Any]:
    """``load_checkpoint``, then this rank's bases when the checkpoint has them."""

    @functools.wraps(original)
    def load_checkpoint(ddp_model: Any, *a: Any, **kw: Any) -> Any:
        result = original(ddp_model, *a, **kw)
        import torch
        from megatron.training.global_vars import get_args

        from megatron_mecefo.techniques.basis_checkpoint import load_basis_state_dict

        args = get_args()
        iteration = result[0] if isinstance(result, tuple) else result
        load_arg = a[2] if len(a) > 2 else kw.get("load_arg", "load")
        directory = getattr(args, load_arg, None)
        if not iteration or not directory or args.finetune:
            return result
        path = basis_path(directory, iteration)
        rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        if os.path.isfile(path):
            n = load_basis_state_dict(_chunks(ddp_model), torch.load(path, weights_only=True))
            if rank0:
                print(f"> MeCeFO: restored {n} low-rank bases from {directory}", flush=True)
        elif rank0:
            print(
                f"> MeCeFO: {directory} iteration {iteration} holds no low-rank basis for "
                "this layout; V is recomputed at the first takeover",
                flush=True,
            )
        return result

    return load_checkpoint
