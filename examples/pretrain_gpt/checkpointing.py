"""Save and resume through Megatron-Core's ``dist_checkpointing`` (torch_dist format).

The layout follows Megatron-LM: ``<dir>/iter_0000100/`` holds one sharded checkpoint and
``<dir>/latest_checkpointed_iteration.txt`` names the newest. Model and optimizer state are
sharded tensors, so a checkpoint loads into another TP/PP layout; the iteration, consumed
samples and LR-scheduler state are common state. Per-rank RNG states go to ``rng/`` and are
restored only when the layout is unchanged (they only matter with dropout). With ``--mecefo``
and low-rank FFN gradients, each rank's low-rank basis V and its refresh step go to
``mecefo_basis/`` (same layout only), so a run resumed inside a failure window keeps the V of
the uninterrupted run instead of recomputing it from the resumed weights.

Fallback: with ``--use-distributed-optimizer`` on megatron-core without Apex/TE (the CPU
case), the optimizer state is saved per rank beside the sharded checkpoint (see
``_per_rank_optimizer_state``); model weights still go through dist_checkpointing.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps

TRACKER = "latest_checkpointed_iteration.txt"  # also arguments.TRACKER (checked pre-torch)


def _sharded_state(
    model_chunks: list[torch.nn.Module],
    optimizer: Any,
    with_optimizer: bool,
    is_loading: bool,
    dist_optimizer: bool,
) -> dict[str, Any]:
    state: dict[str, Any] = {}
    if len(model_chunks) == 1:
        state["model"] = model_chunks[0].sharded_state_dict(prefix="")
    else:  # virtual pipeline: one entry per chunk, as Megatron-LM
        for i, chunk in enumerate(model_chunks):
            state[f"model{i}"] = chunk.sharded_state_dict(prefix="")
    if with_optimizer and not _per_rank_optimizer_state(dist_optimizer):
        model_state = {k: v for k, v in state.items() if k.startswith("model")}
        # fully_reshardable: the default "fully_sharded_model_space" raises on flattened
        # ranges in 0.16.1.
        metadata = {"distrib_optim_sharding_type": "fully_reshardable"} if dist_optimizer else None
        state["optimizer"] = optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=metadata
        )
    return state


def _per_rank_optimizer_state(dist_optimizer: bool) -> bool:
    """Whether the optimizer state must take the per-rank fallback instead of dist_checkpointing.

    megatron-core 0.16.1 cannot load a DistributedOptimizer's state without Apex/TE: building
    the load template asserts on the (empty) torch-Adam 'step', and once that is filled,
    ``_set_main_param_and_optimizer_states`` looks for a 'step' tensor that the checkpoint
    never holds. The fallback stores each rank's shard (main params and Adam state) next to
    the sharded checkpoint; it resumes exactly, on the same layout only.
    """
    if not dist_optimizer:
        return False
    from megatron.core.optimizer import distrib_optimizer

    return not getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)


def _optimizer_path(ckpt_dir: str) -> str:
    return os.path.join(ckpt_dir, "optim", os.path.basename(_rng_path(ckpt_dir)))


def _inner_optimizers(optimizer: Any) -> list[Any]:
    return [sub.optimizer for sub in getattr(optimizer, "chained_optimizers", [optimizer])]


def _save_optimizer_per_rank(
    ckpt_dir: str, optimizer: Any, model_chunks: list[torch.nn.Module]
) -> None:
    from megatron_mecefo.snapshot.contents import TrainingState, dist_opt_map

    inner = _inner_optimizers(optimizer)
    payload = {
        "state": [opt.state_dict() for opt in inner],
        "main_params": [
            [p.detach().clone() for g in opt.param_groups for p in g["params"]] for opt in inner
        ],
        # Which slice of which parameter each shard tensor holds: lets another data-parallel
        # size put the shards back together (_reshard_optimizer_per_rank).
        "dist_opt_map": dist_opt_map(TrainingState(model_chunks, optimizer)),
    }
    os.makedirs(os.path.dirname(_optimizer_path(ckpt_dir)), exist_ok=True)
    torch.save(payload, _optimizer_path(ckpt_dir))


def _load_optimizer_per_rank(
    ckpt_dir: str, optimizer: Any, model_chunks: list[torch.nn.Module]
) -> None:
    path = _optimizer_path(ckpt_dir)
    if not os.path.isfile(path):
        if _reshard_optimizer_per_rank(ckpt_dir, optimizer, model_chunks):
            return
        raise RuntimeError(
            f"--load {ckpt_dir}: no distributed-optimizer state for this rank's layout "
            f"({os.path.basename(path)}); on megatron-core without Apex/TE that state resumes "
            "only on the layout that saved it or, when the checkpoint holds its shard maps, on "
            "another data-parallel size. Resume with the same TP/PP/DP sizes, or pass "
            "--no-load-optim to load the weights alone"
        )
    payload = torch.load(path, weights_only=False)
    for opt, state, params in zip(
        _inner_optimizers(optimizer), payload["state"], payload["main_params"], strict=True
    ):
        opt.load_state_dict(state)
        live = [p for g in opt.param_groups for p in g["params"]]
        for dst, src in zip(live, params, strict=True):
            dst.data.copy_(src)


def _payload_tensors(payload: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A per-rank optimizer file's tensors, named as :mod:`megatron_mecefo.snapshot.contents`
    names them (``optim{j}.main.{g}.{k}``, ``optim{j}.state.{g}.{k}.{key}``)."""
    out: dict[str, torch.Tensor] = {}
    for j, (sd, mains) in enumerate(zip(payload["state"], payload["main_params"], strict=True)):
        flat = 0  # torch numbers the parameters in param_groups order
        for g, group in enumerate(sd["param_groups"]):
            for k, pid in enumerate(group["params"]):
                out[f"optim{j}.main.{g}.{k}"] = mains[flat]
                for key, value in sd["state"].get(pid, {}).items():
                    if isinstance(value, torch.Tensor):
                        out[f"optim{j}.state.{g}.{k}.{key}"] = value
                flat += 1
    return out


def _reshard_optimizer_per_rank(
    ckpt_dir: str, optimizer: Any, model_chunks: list[torch.nn.Module]
) -> bool:
    """Load the per-rank distributed-optimizer files of another data-parallel size (same TP/PP
    position) into this layout's shard: every old shard is read, the full fp32 main params and
    Adam state are put back together from their shard maps, and this rank takes its slice.
    Returns False when the checkpoint has no complete set of files with shard maps."""
    import glob

    from megatron_mecefo.snapshot.contents import (
        TrainingState,
        dist_opt_map,
        reshard,
        restore_optimizer,
    )

    own = os.path.basename(_optimizer_path(ckpt_dir))
    position = own[: own.index("_dp")]
    files = sorted(glob.glob(os.path.join(ckpt_dir, "optim", f"{position}_dp*of*.pt")))
    sizes = {os.path.basename(f).rsplit("of", 1)[1][: -len(".pt")] for f in files}
    if len(sizes) != 1 or len(files) != int(next(iter(sizes))):
        return False
    payloads = [torch.load(f, weights_only=False) for f in files]
    if any(p.get("dist_opt_map") is None for p in payloads):
        return False
    state = TrainingState(model_chunks, optimizer)
    numels = {
        f"model{i}.{name}": p.numel()
        for i, chunk in enumerate(model_chunks)
        for name, p in chunk.named_parameters()
    }
    shards = [({"dist_opt_map": p["dist_opt_map"]}, _payload_tensors(p)) for p in payloads]
    restore_optimizer(optimizer, reshard(shards, dist_opt_map(state), numels))
    return True


def _rng_path(ckpt_dir: str) -> str:
    layout = (
        f"tp{ps.get_tensor_model_parallel_rank()}of{ps.get_tensor_model_parallel_world_size()}"
        f"_pp{ps.get_pipeline_model_parallel_rank()}of{ps.get_pipeline_model_parallel_world_size()}"
        f"_dp{ps.get_data_parallel_rank()}of{ps.get_data_parallel_world_size()}"
    )
    return os.path.join(ckpt_dir, "rng", f"{layout}.pt")


def layout_name() -> str:
    """This rank's position (``tp{i}of{n}_pp{i}of{n}_dp{i}of{n}``): names its per-rank files."""
    return os.path.basename(_rng_path(""))[: -len(".pt")]


def _basis_path(ckpt_dir: str, layout: Optional[str] = None) -> str:
    name = f"{layout}.pt" if layout else os.path.basename(_rng_path(ckpt_dir))
    return os.path.join(ckpt_dir, "mecefo_basis", name)


def load_mecefo_basis(
    ckpt_dir: str, model_chunks: list[torch.nn.Module], layout: Optional[str] = None
) -> Optional[int]:
    """Restore this rank's low-rank bases from ``ckpt_dir``; returns how many, or None when
    the checkpoint has none for this layout (V is then recomputed at the first takeover).
    ``layout``: read the file of that position instead of this rank's (:func:`layout_name`
    of the rank when it saved: a survivor of a regroup reads the bases it saved itself)."""
    from megatron_mecefo.techniques.basis_checkpoint import load_basis_state_dict

    path = _basis_path(ckpt_dir, layout)
    if not os.path.isfile(path):
        return None
    return load_basis_state_dict(model_chunks, torch.load(path, weights_only=True))


def save_checkpoint(
    save_dir: str,
    iteration: int,
    model_chunks: list[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    consumed_samples: int,
    save_optimizer: bool,
    dist_optimizer: bool,
    run_record: Optional[dict] = None,
    phase: Optional[Callable[[str], None]] = None,
) -> str:
    """Collective: every rank calls it. Returns the checkpoint directory. ``run_record``: the
    flags a resume is checked against (``arguments.RUN_RECORD``), written by rank 0.
    ``phase(name)`` marks ``save-write`` (the shards are about to be written) and
    ``save-finalize`` (every rank wrote; the tracker file is not written yet), for kill
    injection under the recovery supervisor."""
    ckpt_dir = os.path.join(save_dir, f"iter_{iteration:07d}")
    state = _sharded_state(model_chunks, optimizer, save_optimizer, False, dist_optimizer)
    state.update(
        iteration=iteration,
        consumed_samples=consumed_samples,
        opt_param_scheduler=scheduler.state_dict(),
        checkpoint_version=1,
    )
    if dist.get_rank() == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
    dist.barrier()
    if phase is not None:
        phase("save-write")
    dist_checkpointing.save(state, ckpt_dir)
    if save_optimizer and _per_rank_optimizer_state(dist_optimizer):
        _save_optimizer_per_rank(ckpt_dir, optimizer, model_chunks)
    os.makedirs(os.path.dirname(_rng_path(ckpt_dir)), exist_ok=True)
    torch.save({"torch": torch.get_rng_state()}, _rng_path(ckpt_dir))
    from megatron_mecefo.techniques.basis_checkpoint import basis_state_dict

    bases = basis_state_dict(model_chunks)
    if bases:  # only models built from a low-rank MeCeFO spec have them
        os.makedirs(os.path.dirname(_basis_path(ckpt_dir)), exist_ok=True)
        torch.save(bases, _basis_path(ckpt_dir))
    if run_record is not None and dist.get_rank() == 0:
        import json

        from arguments import RUN_RECORD

        with open(os.path.join(ckpt_dir, RUN_RECORD), "w") as f:
            json.dump(run_record, f, indent=1)
    dist.barrier()
    if phase is not None:
        phase("save-finalize")
    if dist.get_rank() == 0:  # written last: a crash mid-save never names a partial checkpoint
        with open(os.path.join(save_dir, TRACKER), "w") as f:
            f.write(str(iteration))
    dist.barrier()
    return ckpt_dir


def latest_iteration(load_dir: str) -> Optional[int]:
    """The iteration named by the tracker file, or None when there is no checkpoint.

    Raises:
        ConfigError: On a garbage tracker or one naming a missing folder.
    """
    from arguments import checkpoint_to_load

    ckpt_dir = checkpoint_to_load(load_dir)
    return None if ckpt_dir is None else int(os.path.basename(ckpt_dir)[len("iter_") :])


def check_checkpoint_files(ckpt_dir: str) -> None:
    """Metadata checks of a torch_dist checkpoint before loading it: the ``.metadata`` file
    reads, and every shard file is as long as the metadata says (a truncated shard otherwise
    fails deep in the load with a bare ``EOFError`` or unpickling error).

    Raises:
        ConfigError: Naming the damaged file and the fix.
    """
    from arguments import ConfigError
    from torch.distributed.checkpoint import FileSystemReader

    fix = "; the checkpoint is damaged: load an earlier iter_ folder or train from scratch"
    meta = os.path.join(ckpt_dir, ".metadata")
    if not os.path.isfile(meta):
        raise ConfigError(f"{ckpt_dir}: no .metadata file, so not a torch_dist checkpoint{fix}")
    try:
        metadata = FileSystemReader(ckpt_dir).read_metadata()
    except Exception as err:  # noqa: BLE001 (any unpickling error means a damaged file)
        raise ConfigError(f"{meta}: cannot be read ({type(err).__name__}: {err}){fix}") from None
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    for name, end in sorted(need.items()):
        path = os.path.join(ckpt_dir, name)
        have = os.path.getsize(path) if os.path.isfile(path) else -1
        if have < end:
            state = "missing" if have < 0 else f"{have} bytes"
            raise ConfigError(
                f"checkpoint shard {path} is {state}, but {meta} needs {end} bytes: it is "
                f"truncated{fix}"
            )


def check_checkpoint_shapes(ckpt_dir: str, template: dict[str, Any]) -> None:
    """Every model tensor the load asks for must be in the checkpoint with the same global
    shape; a checkpoint of another model used to fail inside dist_checkpointing, with a good
    message inside a traceback from every rank.

    Raises:
        ConfigError: Naming the first differing keys with both shapes (exit 1).
    """
    from arguments import ConfigError
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(ckpt_dir).read_metadata().state_dict_metadata
    problems = []
    for name, part in template.items():
        if not name.startswith("model"):
            continue  # the optimizer's state follows the model's tensors
        for sh in nested_values(part):
            if not isinstance(sh, ShardedTensor):
                continue
            meta = stored.get(sh.key)
            want = list(sh.global_shape)
            if meta is None:
                problems.append(f"{sh.key}: checkpoint none, model {want}")
                continue
            have = list(meta.size) if hasattr(meta, "size") else want
            # The vocabulary rows are padded to a multiple of TP, so another TP size pads
            # differently; dist_checkpointing loads the rows the model has (padding beyond the
            # tokenizer's ids either way).
            vocab = sh.key.endswith(("word_embeddings.weight", "output_layer.weight"))
            if have != want and not (vocab and have[1:] == want[1:]):
                problems.append(f"{sh.key}: checkpoint {have}, model {want}")
    if problems:
        more = f" (and {len(problems) - 2} more)" if len(problems) > 2 else ""
        raise ConfigError(
            f"{ckpt_dir} is a checkpoint of another model: {'; '.join(problems[:2])}{more}; "
            "pass the model flags it was trained with, or another --load",
            usage=False,
        )


def load_checkpoint(
    load_dir: str,
    model_chunks: list[torch.nn.Module],
    optimizer: Any,
    scheduler: Any,
    load_optimizer: bool,
    dist_optimizer: bool,
) -> tuple[int, int]:
    """Collective. Returns ``(iteration, consumed_samples)``; ``(0, 0)`` without a checkpoint."""
    iteration = latest_iteration(load_dir)
    if iteration is None:
        if dist.get_rank() == 0:
            print(f"WARNING: no checkpoint in --load {load_dir}; training from scratch", flush=True)
        return 0, 0
    ckpt_dir = os.path.join(load_dir, f"iter_{iteration:07d}")
    check_checkpoint_files(ckpt_dir)
    template = _sharded_state(model_chunks, optimizer, load_optimizer, True, dist_optimizer)
    check_checkpoint_shapes(ckpt_dir, template)
    state = dist_checkpointing.load(template, ckpt_dir)
    if len(model_chunks) == 1:
        model_chunks[0].load_state_dict(state["model"])
    else:
        for i, chunk in enumerate(model_chunks):
            chunk.load_state_dict(state[f"model{i}"])
    if load_optimizer:
        if _per_rank_optimizer_state(dist_optimizer):
            _load_optimizer_per_rank(ckpt_dir, optimizer, model_chunks)  # main params too
        else:
            optimizer.load_state_dict(state["optimizer"])
        try:
            scheduler.load_state_dict(state["opt_param_scheduler"])
        except AssertionError as err:  # megatron-core's check of the LR schedule's values
            from arguments import ConfigError

            raise ConfigError(
                f"--load {load_dir}: the LR schedule differs from the checkpoint's ({err}); pass "
                "--override-opt-param-scheduler to follow the new flags, or "
                "--use-checkpoint-opt-param-scheduler to keep the checkpoint's (as Megatron-LM)"
            ) from None
    else:
        # The optimizer's fp32/sharded main params must pick up the loaded weights.
        optimizer.reload_model_params()
    rng_file = _rng_path(ckpt_dir)
    if os.path.isfile(rng_file):
        torch.set_rng_state(torch.load(rng_file, weights_only=True)["torch"])
    return int(state["iteration"]), int(state["consumed_samples"])
