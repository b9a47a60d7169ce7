"""Per-rank distributed-optimizer checkpoints for Megatron-LM's loop on the CPU.

megatron-core 0.16.1 without Apex or Transformer Engine (always the case on a CPU) cannot load
a ``DistributedOptimizer``'s state, in either checkpoint format Megatron-LM offers:

* ``--ckpt-format torch_dist``: building the load template calls ``state_dict()`` on an
  optimizer that has not stepped, whose torch Adam holds no ``step`` yet
  (distrib_optimizer.py:642 ``assert len(steps) == 1``);
* ``--ckpt-format torch``: ``load_parameter_state`` copies the saved shard into the fp32 main
  params, which are views of the model's leaf parameters, outside ``no_grad``
  (distrib_optimizer.py:940, "a view of a leaf Variable that requires grad is being used in
  an in-place operation").

This is the example trainer's fallback (``examples/pretrain_gpt/checkpointing.py``) applied to
Megatron-LM's ``save_checkpoint``/``load_checkpoint``: Megatron-LM still writes its usual
checkpoint, and each rank also writes its shard (the torch optimizer's state, the fp32 main
params, the LR scheduler, the grad scaler) to ``iter_N/cpu_dist_optimizer/<layout>.pt``. A
resume loads the checkpoint as with ``--no-load-optim`` and restores that shard, so it resumes
exactly, on the same TP/PP/DP layout only. Only the CPU launcher installs it
(:mod:`megatron_mecefo.runtime.megatron_lm_cpu`, shim ``dist_optimizer_checkpoint``).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import torch

FOLDER = "cpu_dist_optimizer"


def _needs_fallback(args: Any, optimizer: Any) -> bool:
    if optimizer is None or not getattr(args, "use_distributed_optimizer", False):
        return False
    from megatron.core.optimizer import distrib_optimizer

    return not getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)


def shard_path(checkpoint_dir: str, iteration: int, folder: str = FOLDER) -> str:
    """This rank's file in ``checkpoint_dir/iter_N/folder`` (named after its TP/PP/DP layout)."""
    from megatron.core import parallel_state as ps

    layout = (
        f"tp{ps.get_tensor_model_parallel_rank()}of{ps.get_tensor_model_parallel_world_size()}"
        f"_pp{ps.get_pipeline_model_parallel_rank()}of{ps.get_pipeline_model_parallel_world_size()}"
        f"_dp{ps.get_data_parallel_rank(with_context_parallel=True)}"
        f"of{ps.get_data_parallel_world_size(with_context_parallel=True)}"
    )
    return os.path.join(checkpoint_dir, f"iter_{iteration:07d}", folder, f"{layout}.pt")


def _parts(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _main_params(part: Any) -> list[torch.Tensor]:
    return [p for group in part.optimizer.param_groups for p in group["params"]]


def save_shard(path: str, optimizer: Any, scheduler: Any) -> None:
    """Write this rank's optimizer shard, main params and scheduler state to ``path``."""
    payload = {
        "state": [part.optimizer.state_dict() for part in _parts(optimizer)],
        "main_params": [
            [p.detach().clone() for p in _main_params(part)] for part in _parts(optimizer)
        ],
        "grad_scaler": [
            part.grad_scaler.state_dict() if getattr(part, "grad_scaler", None) else None
            for part in _parts(optimizer)
        ],
        "opt_param_scheduler": scheduler.state_dict() if scheduler is not None else None,
    }
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(payload, path + ".tmp")
    os.replace(path + ".tmp", path)  # a crash mid-write leaves no half file under the name


def load_shard(path: str, optimizer: Any, scheduler: Any) -> None:
    """Restore what :func:`save_shard` wrote; a clear error when this layout has no file."""
    if not os.path.isfile(path):
        raise RuntimeError(
            f"--use-distributed-optimizer on CPU: no optimizer shard {path}. megatron-core "
            "0.16.1 without Apex/TE cannot load a distributed optimizer's state, so "
            "run_megatron_lm_cpu.py saves each rank's shard beside the checkpoint, and resumes "
            "only a checkpoint it saved, on the same TP/PP/DP sizes. Pass --no-load-optim to "
            "load the weights alone"
        )
    payload = torch.load(path, weights_only=False)
    parts = _parts(optimizer)
    for part, state, params, scaler in zip(
        parts, payload["state"], payload["main_params"], payload["grad_scaler"], strict=True
    ):
        part.optimizer.load_state_dict(state)
        with torch.no_grad():  # fp32 main params are views of the model's leaf parameters
            for dst, src in zip(_main_params(part), params, strict=True):
                dst.copy_(src)
        if scaler is not None and getattr(part, "grad_scaler", None):
            part.grad_scaler.load_state_dict(scaler)
    if scheduler is not None and payload["opt_param_scheduler"] is not None:
        scheduler.load_state_dict(payload["opt_param_scheduler"])


def wrap_save(original: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron-LM's ``save_checkpoint``, plus this rank's shard with the distributed optimizer."""

    @functools.wraps(original)
    def save_checkpoint(
        iteration: int, model: Any, optimizer: Any, opt_param_scheduler: Any, *a: Any, **kw: Any
    ) -> Any:
        result = original(iteration, model, optimizer, opt_param_scheduler, *a, **kw)
        from megatron.training.global_vars import get_args

        args = get_args()
        if (
            _needs_fallback(args, optimizer)
            and not args.no_save_optim
            and not kw.get("non_persistent_ckpt", False)
            and not kw.get("release", False)
        ):
            save_shard(shard_path(args.save, iteration), optimizer, opt_param_scheduler)
        return result

    return save_checkpoint


def wrap_load(original: Callable[..., Any]) -> Callable[..., Any]:
    """Megatron-LM's ``load_checkpoint`` without the optimizer, then this rank's shard."""

    @functools.wraps(original)
    def load_checkpoint(
        ddp_model: Any, optimizer: Any, opt_param_scheduler: Any, *a: Any, **kw: Any
    ) -> Any:
        from megatron.training.global_vars import get_args

        args = get_args()
        if not _needs_fallback(args, optimizer) or args.no_load_optim or args.finetune:
            return original(ddp_model, optimizer, opt_param_scheduler, *a, **kw)
        args.no_load_optim = True  # Megatron-LM then loads neither optimizer nor scheduler
        try:
            result = original(ddp_model, optimizer, opt_param_scheduler, *a, **kw)
        finally:
            args.no_load_optim = False
        iteration = result[0]
        load_arg = a[0] if a else kw.get("load_arg", "load")
        # finetune: Megatron-LM switched to --pretrained-checkpoint, which loads no optimizer.
        if iteration > 0 and not args.finetune:
            load_shard(
                shard_path(getattr(args, load_arg), iteration), optimizer, opt_param_scheduler
            )
        return result

    return load_checkpoint
