"""A trainer's state as local tensors: carried across a regroup, or sent to a joiner.

``export_state`` takes the state at the last committed iteration boundary: the model chunks'
tensors, the optimizer state, the LR scheduler, the RNG states and the MeCeFO controller
counters of that boundary, the MeCeFO bases, the data position and the logged history. The
tensors are the trainer's own (shared, not copied). A survivor keeps it in memory and loads it
into the model it rebuilds in the new world (nothing is read from disk); a joiner receives it
from a data-parallel peer with the same TP/PP coordinates (:mod:`.heal`).

The model's tensors are loaded *consuming* the carry: a rebuilt parameter takes the carried
tensor's storage where the parameter is the sole tensor on its storage and the carried one the
whole of its own (no copy), else the carried tensor is copied and its memory freed at once. So
a survivor whose new model was built without initialisation
(``RecoverySession.initializes_model`` False: its fresh pages are untouched) never holds two
copies of the weights; at most one tensor is ever duplicated.
"""

from __future__ import annotations

from typing import Any, Dict

import torch


def boundary_snapshot(trainer: Any) -> Dict[str, Any]:
    """RNG states and controller counters at an iteration boundary (cheap: a few KB)."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
    snap: Dict[str, Any] = {
        "rng": {
            "torch": torch.get_rng_state(),
            "tracker": {k: v.clone() for k, v in tracker.items()},
        }
    }
    ctrl = getattr(trainer, "controller", None)
    if ctrl is not None:
        snap["controller"] = {
            k: getattr(ctrl, k)
            for k in ("degraded_iterations", "fallback_iterations", "samples_processed",
                      "samples_skipped", "_announced")  # fmt: skip
        }
    return snap


TP_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride")
"""Set on a parameter by megatron-core's weight initialisation only
(``set_tensor_model_parallel_attributes`` inside ``_initialize_affine_weight_cpu``/``_gpu``):
a model built with ``perform_initialization=False`` lacks them, and the gradient norm then
counts tensor-parallel shards as duplicates (measured: TP2 x PP2 x DP2 drifted 1e-2 from the
simulated run). They travel with the state and are put back on the rebuilt parameters."""


def parallel_attributes(module: torch.nn.Module) -> Dict[str, Dict[str, Any]]:
    """Per parameter name, its tensor-parallel attributes (:data:`TP_ATTRIBUTES`)."""
    out: Dict[str, Dict[str, Any]] = {}
    for name, p in module.named_parameters():
        attrs = {a: getattr(p, a) for a in TP_ATTRIBUTES if hasattr(p, a)}
        if attrs:
            out[name] = attrs
    return out


def set_parallel_attributes(module: torch.nn.Module, attrs: Dict[str, Dict[str, Any]]) -> None:
    """Put :func:`parallel_attributes` of the same model back on ``module``'s parameters."""
    params = dict(module.named_parameters())
    for name, values in attrs.items():
        for attr, value in values.items():
            setattr(params[name], attr, value)


def export_state(trainer: Any, boundary: Dict[str, Any]) -> Dict[str, Any]:
    """The trainer's state at its last committed boundary (tensors shared, not copied)."""
    basis = {}
    for i, chunk in enumerate(trainer.model_chunks):
        for name, module in chunk.named_modules():
            if getattr(module, "mecefo_basis", None) is not None:
                basis[f"{i}.{name}"] = (module.mecefo_basis, module.mecefo_basis_step)
    return {
        "iteration": trainer.iteration,
        "consumed_samples": trainer.consumed_samples,
        "model": [chunk.state_dict() for chunk in trainer.model_chunks],
        "param_attrs": [parallel_attributes(chunk) for chunk in trainer.model_chunks],
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": trainer.scheduler.state_dict(),
        "boundary": boundary,
        "mecefo_basis": basis,
        "history": list(trainer.history),
        "evals": list(trainer.evals),
        "saved": list(trainer.saved),
        "extra": trainer.extra_state(),
    }


def restore_boundary(trainer: Any, b: Dict[str, Any]) -> None:
    """Put back the RNG states and controller counters of a :func:`boundary_snapshot`."""
    from megatron.core import tensor_parallel

    torch.set_rng_state(b["rng"]["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(
        {k: v.clone() for k, v in b["rng"]["tracker"].items()}
    )
    ctrl = getattr(trainer, "controller", None)
    if ctrl is not None and "controller" in b:
        for k, v in b["controller"].items():
            setattr(ctrl, k, v)


def import_state(trainer: Any, state: Dict[str, Any]) -> int:
    """Load ``state`` into a trainer built in the new world and rewind its data iterator;
    returns the bytes of the carried weights that stayed allocated (:func:`load_consuming`)."""
    kept = 0
    for chunk, sd in zip(trainer.model_chunks, state["model"], strict=True):
        kept += load_consuming(chunk, sd)
    for chunk, attrs in zip(trainer.model_chunks, state.get("param_attrs", []), strict=False):
        set_parallel_attributes(chunk, attrs)
    trainer.optimizer.load_state_dict(state["optimizer"])
    # Megatron's OptimizerParamScheduler.load_state_dict *adds* the saved step count to its
    # own (made for a fresh scheduler): start from zero, or a second import doubles the steps.
    trainer.scheduler.num_steps = 0
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.iteration = state["iteration"]
    trainer.consumed_samples = state["consumed_samples"]
    trainer.history = list(state["history"])
    trainer.evals = list(state["evals"])
    trainer.saved = list(state["saved"])
    restore_boundary(trainer, state["boundary"])
    modules = {
        f"{i}.{name}": m
        for i, chunk in enumerate(trainer.model_chunks)
        for name, m in chunk.named_modules()
    }
    for name, (basis, step) in state["mecefo_basis"].items():
        modules[name].mecefo_basis = basis
        modules[name].mecefo_basis_step = step
    trainer.load_extra_state(state.get("extra", {}))
    trainer.rewind_data(trainer.consumed_samples)
    return kept


def _free_if_sole_owner(tensor: torch.Tensor) -> int:
    """Free a copied carry tensor's memory now. Dropping the reference is not enough: after
    a failure in the backward, the old world's DDP hooks (held by the interrupted autograd
    graph) still refer to the old parameters, measured to keep every old weight resident
    until the next generation. Only a storage that is exactly this tensor is freed (under the
    distributed optimizer the parameters are views of one buffer: left alone). Returns the
    bytes left allocated."""
    storage = tensor.untyped_storage()
    whole = storage.nbytes() == tensor.numel() * tensor.element_size()
    # Not resizable: memory torch does not own (e.g. from numpy, or an external allocator).
    if tensor.storage_offset() == 0 and whole and storage.resizable():
        storage.resize_(0)
        return 0
    return tensor.numel() * tensor.element_size()


def _sole_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is the whole of its storage, and the only tensor on it."""
    storage = tensor.untyped_storage()
    whole = (
        tensor.storage_offset() == 0 and storage.nbytes() == tensor.numel() * tensor.element_size()
    )
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    # 2: the tensor and ``storage`` above; a view elsewhere (a bucket, a cache) adds one.
    return whole and use_count is not None and use_count(storage._cdata) == 2


def _whole_own_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is the whole of a storage torch owns (resizable): the condition on
    which :func:`_free_if_sole_owner` frees a copied carry tensor."""
    storage = tensor.untyped_storage()
    return (
        tensor.storage_offset() == 0
        and storage.nbytes() == tensor.numel() * tensor.element_size()
        and storage.resizable()
    )


def _adoptable(target: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the rebuilt model's ``target`` can take the carried ``value``'s storage instead
    of a copy: same layout, ``target`` the sole tensor on its whole storage (not under the
    distributed optimizer, whose parameters are views of DDP's buffer, nor where a view or a
    cache still refers to the new storage and would go on reading it), and ``value`` the whole
    of a storage torch owns.

    ``value`` need not be the sole tensor on its storage: after a failure the old world's
    parameters often still refer to it (an interrupted step's autograd graph keeps DDP's
    accumulator nodes, and through them the parameters, alive; measured: every weight of the
    survivors of a DP2 kill, so the whole model was copied into fresh pages, 0.16 s at 0.43 GB
    of weights). Those holders are dead: the copy path frees this very storage under them
    (:func:`_free_if_sole_owner`), so taking it instead is as safe, and costs no copy."""
    return (
        target.shape == value.shape
        and target.dtype == value.dtype
        and target.device == value.device
        and target.is_contiguous()
        and value.is_contiguous()
        and _sole_storage(target)
        and _whole_own_storage(value)
    )


def load_consuming(module: torch.nn.Module, sd: Dict[str, Any]) -> int:
    """``module.load_state_dict(sd, strict=True)``, but each tensor is removed from ``sd`` as
    soon as it is copied, and its memory freed (:func:`_free_if_sole_owner`). Returns the
    bytes of copied tensors that could not be freed."""
    own = module.state_dict(keep_vars=True)
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    if missing or unexpected:
        raise RuntimeError(
            f"the carried state does not fit the rebuilt model: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    kept = 0
    adopted: set = set()  # storages taken: a second tensor on one (tied weights) is copied
    with torch.no_grad():
        for name in [k for k in list(sd) if isinstance(own[k], torch.Tensor)]:
            value = sd[name]
            if not isinstance(value, torch.Tensor) or value.shape != own[name].shape:
                continue  # load_state_dict below names the mismatch
            target = own[name]
            if value.data_ptr() == target.data_ptr():  # a heal received it in place
                pass
            elif value.data_ptr() in adopted:  # tied in the carry, not here: copied, kept
                target.copy_(value)
            elif _adoptable(target, value):
                target.data = value  # no copy: the new (untouched) storage is dropped
                adopted.add(value.data_ptr())
            else:
                target.copy_(value)
                kept += _free_if_sole_owner(value)
            del sd[name], value
    # What is left (extra states, mismatches) goes through Megatron's own path; the copied
    # tensors count as present.
    module.load_state_dict(sd, strict=False)
    return kept
