"""Run unmodified megatron-core 0.16.x on a CPU-only PyTorch build over gloo.

Megatron-Core assumes CUDA in a few dozen places: it asks for ``torch.cuda.current_device()``,
creates tensors with ``device="cuda"``, reads and writes the CUDA RNG state, and checks tensor
type strings such as ``'torch.cuda.FloatTensor'``. None of this is numerics; it is device
plumbing. :class:`CpuRuntime` redirects exactly that plumbing to the CPU, in-process, and can
undo it. Nothing on disk is changed.

The runtime is switched on explicitly (the trainer does it when the CPU device is chosen) and
refuses to start when CUDA is available, so it can never change a GPU run.

Each patch belongs to one *layer*; :data:`PATCHED_CALL_SITES` lists every megatron-core call
site a layer serves, with the reason. ``CpuRuntime(record=True)`` records the sites it actually
intercepts, and ``tests/integration/runtime/test_cpu_runtime_runs.py`` checks that the list is
complete for the features the plugin supports, so the list cannot silently go stale on a
megatron-core upgrade.
"""

from __future__ import annotations

import atexit
import collections
import functools
import json
import logging
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

import torch

_CPU = torch.device("cpu")
_MCORE = "megatron/core/"


@dataclass(frozen=True)
class PatchedCallSite:
    """One megatron-core call site that the CPU runtime serves.

    Attributes:
        layer: Name of the runtime layer whose patch handles the site.
        path: File under ``megatron/core/``.
        function: Enclosing function (line numbers drift between releases; names do not).
        when: The feature that reaches the site.
        why: What the site does with CUDA, and what it gets on the CPU instead.
    """

    layer: str
    path: str
    function: str
    when: str
    why: str


_ALLOC = "allocates on device=torch.cuda.current_device(); gets the CPU device"
_LITERAL = "creates a tensor with a literal device='cuda'; it is made on the CPU"
_RNG = (
    "reads/writes/seeds the per-TP-rank 'CUDA' RNG stream (CudaRNGStatesTracker); served by "
    "the CPU default generator, so tracker forks (dropout, recomputation) stay consistent"
)
_TYPE = (
    "asserts type() == 'torch.cuda.*Tensor'; for callers in megatron/core/optimizer/ only, a "
    "CPU tensor reports the CUDA type name"
)

#: Every megatron-core 0.16.1 call site the runtime serves, as recorded (``record=True``) by a
#: sweep over what the plugin supports: GPTModel with the local spec (RoPE, SwiGLU, RMSNorm,
#: learned positions, tied embeddings), DDP with and without overlap_grad_reduce, the plain
#: and distributed optimizer, fp32/bf16/fp16, 1F1B and interleaved schedules, TP with and
#: without sequence parallelism, full recomputation, and dist_checkpointing save/load.
#: ``tests/integration/runtime/test_cpu_runtime_runs.py`` re-runs that sweep and requires this
#: list to equal what it records, so it can go stale neither way.
PATCHED_CALL_SITES: tuple[PatchedCallSite, ...] = tuple(
    PatchedCallSite(*row)
    for row in [
        ("cuda_api", "utils.py", "get_tensor", "always (GlobalMemoryBuffer)", _ALLOC),
        ("cuda_api", "distributed/param_and_grad_buffer.py", "__init__", "DDP", _ALLOC),
        ("cuda_api", "models/common/embeddings/rotary_pos_embedding.py", "get_emb", "RoPE", _ALLOC),
        ("cuda_api", "pipeline_parallel/p2p_communication.py", "_communicate", "PP > 1", _ALLOC),
        (
            "cuda_api",
            "pipeline_parallel/p2p_communication.py",
            "create_tensor_recv_next",
            "PP > 1",
            _ALLOC,
        ),
        (
            "cuda_api",
            "pipeline_parallel/p2p_communication.py",
            "create_tensor_recv_prev",
            "PP > 1",
            _ALLOC,
        ),
        ("cuda_api", "tensor_parallel/layers.py", "backward", "sequence parallel", _ALLOC),
        (
            "cuda_api",
            "tensor_parallel/mappings.py",
            "_gather_along_first_dim",
            "sequence parallel",
            _ALLOC,
        ),
        (
            "cuda_api",
            "tensor_parallel/mappings.py",
            "_reduce_scatter_along_first_dim",
            "sequence parallel",
            _ALLOC,
        ),
        (
            "cuda_api",
            "dist_checkpointing/strategies/filesystem_async.py",
            "preload_tensors",
            "checkpoint save",
            "calls torch.cuda.synchronize(); nothing to wait for on the CPU",
        ),
        (
            "cuda_api",
            "dist_checkpointing/strategies/state_dict_saver.py",
            "save_state_dict_async_finalize",
            "checkpoint save",
            "calls torch.cuda.synchronize(); nothing to wait for on the CPU",
        ),
        (
            "cuda_rng",
            "tensor_parallel/random.py",
            "model_parallel_cuda_manual_seed",
            "always",
            _RNG,
        ),
        ("cuda_rng", "tensor_parallel/random.py", "add", "always", _RNG),
        ("cuda_rng", "tensor_parallel/random.py", "fork", "always (attention forward)", _RNG),
        ("cuda_rng", "tensor_parallel/random.py", "_get_all_rng_states", "recomputation", _RNG),
        ("cuda_rng", "tensor_parallel/random.py", "_set_all_rng_states", "recomputation", _RNG),
        ("factory", "transformer/utils.py", "get_default_causal_mask", "always", _LITERAL),
        (
            "factory",
            "pipeline_parallel/schedules.py",
            "forward_backward_no_pipelining",
            "PP = 1",
            _LITERAL,
        ),
        (
            "factory",
            "pipeline_parallel/schedules.py",
            "forward_backward_pipelining_without_interleaving",
            "PP > 1",
            _LITERAL,
        ),
        (
            "factory",
            "pipeline_parallel/schedules.py",
            "forward_backward_pipelining_with_interleaving",
            "virtual pipeline",
            _LITERAL,
        ),
        ("factory", "optimizer/optimizer.py", "__init__", "always", _LITERAL),
        ("factory", "optimizer/clip_grads.py", "get_grad_norm_fp32", "every step", _LITERAL),
        (
            "factory",
            "optimizer/clip_grads.py",
            "clip_grad_by_total_norm_fp32",
            "clip_grad > 0",
            _LITERAL,
        ),
        ("factory", "utils.py", "local_multi_tensor_l2_norm", "every step (no apex)", _LITERAL),
        ("factory", "optimizer/grad_scaler.py", "__init__", "fp16", _LITERAL),
        (
            "factory",
            "models/common/language_module/language_module.py",
            "setup_embeddings_and_output_layer",
            "tied embeddings with PP > 1",
            "calls weight.data.cuda() to all-reduce the tied embedding; stays on the CPU",
        ),
        (
            "grad_type",
            "optimizer/clip_grads.py",
            "clip_grad_by_total_norm_fp32",
            "clip_grad > 0",
            _TYPE,
        ),
        ("grad_type", "optimizer/optimizer.py", "__init__", "bf16/fp16", _TYPE),
        ("grad_type", "optimizer/distrib_optimizer.py", "__init__", "distributed optimizer", _TYPE),
        (
            "grad_type",
            "optimizer/distrib_optimizer.py",
            "_build_model_and_main_param_groups",
            "distributed optimizer",
            _TYPE,
        ),
    ]
)

#: Runtime layers, in the order they are applied.
LAYERS: tuple[str, ...] = ("cuda_api", "cuda_rng", "factory", "grad_type")

_FACTORIES = (
    "zeros",
    "ones",
    "empty",
    "full",
    "tensor",
    "arange",
    "rand",
    "randn",
    "randint",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
    "as_tensor",
    "eye",
    "linspace",
)

_CPU_TO_CUDA_TYPE = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):  # torch reads a bare int device as cuda:<int>
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CpuRuntime:
    """Process-local CPU runtime for megatron-core; enable before building models.

    Args:
        record: Record every intercepted megatron-core call site (costs a stack walk per call).
        skip_layers: Layer names to leave unpatched (to reproduce the failure a layer fixes).

    Use :func:`enable_cpu_runtime` in a training script; use the object directly (or as a
    context manager) where the patches must be undone again, as tests do.
    """

    _active: Optional["CpuRuntime"] = None  # monkeypatches are process-wide: allow one owner

    def __init__(self, record: bool = False, skip_layers: Iterable[str] = ()) -> None:
        unknown = set(skip_layers) - set(LAYERS)
        if unknown:
            raise ValueError(f"unknown CPU runtime layer(s) {sorted(unknown)}; known: {LAYERS}")
        self.record = record
        self.skip_layers = frozenset(skip_layers)
        self.observed: collections.Counter[tuple[str, str, str]] = collections.Counter()
        self._saved: list[tuple[Any, str, Any]] = []

    # ------------------------------------------------------------------ lifecycle
    @property
    def enabled(self) -> bool:
        """Whether this runtime's patches are in place."""
        return CpuRuntime._active is self

    def enable(self) -> "CpuRuntime":
        """Apply the patches. Raises if CUDA is available or another runtime is active."""
        if self.enabled:
            return self
        if CpuRuntime._active is not None:
            raise RuntimeError("another CpuRuntime is already enabled in this process")
        if torch.cuda.is_available():
            raise RuntimeError(
                "the megatron_mecefo CPU runtime is for CPU-only runs, but CUDA is available; "
                "run on the GPU without it (--device cuda)"
            )
        # Import megatron-core (and with it torch._dynamo, via jit_fuser) unpatched first: the
        # imports build tables keyed on torch.cuda functions that must see the originals.
        import megatron.core  # noqa: F401

        for name in LAYERS:
            if name not in self.skip_layers:
                getattr(self, f"_patch_{name}")()
        CpuRuntime._active = self
        return self

    def disable(self) -> None:
        """Undo every patch, restoring the original functions in reverse order."""
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)
        self._saved.clear()
        if CpuRuntime._active is self:
            CpuRuntime._active = None

    def __enter__(self) -> "CpuRuntime":
        return self.enable()

    def __exit__(self, *exc: Any) -> None:
        self.disable()

    def dump_sites(self, path: str) -> None:
        """Write the observed call sites and their counts as JSON."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        rows = [[*site, n] for site, n in sorted(self.observed.items())]
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)

    # ------------------------------------------------------------------ helpers
    def _set(self, owner: Any, attr: str, value: Any) -> None:
        self._saved.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, value)

    def _note(self, layer: str) -> None:
        """Record the innermost megatron-core frame calling into a patched function."""
        if not self.record:
            return
        frame = sys._getframe(2)
        while frame is not None:
            filename = frame.f_code.co_filename.replace("\\", "/")
            if _MCORE in filename:
                path = filename[filename.index(_MCORE) + len(_MCORE) :]
                self.observed[(layer, path, frame.f_code.co_name)] += 1
                return
            frame = frame.f_back

    # ------------------------------------------------------------------ layers
    def _patch_cuda_api(self) -> None:
        def current_device() -> torch.device:
            self._note("cuda_api")
            return _CPU

        def make_noop(name: str) -> Callable[..., None]:
            # One function object per name: torch._dynamo rejects one object under two names.
            def noop(*args: Any, **kwargs: Any) -> None:
                self._note("cuda_api")

            noop.__name__ = name
            return noop

        self._set(torch.cuda, "current_device", current_device)
        for name in ("synchronize", "empty_cache", "set_device"):
            self._set(torch.cuda, name, make_noop(name))

    def _patch_cuda_rng(self) -> None:
        from megatron.core.tensor_parallel import random as mrandom

        def get_rng_state(device: Any = "cuda") -> torch.Tensor:
            self._note("cuda_rng")
            return torch.get_rng_state()

        def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
            self._note("cuda_rng")
            torch.set_rng_state(new_state)

        def manual_seed(seed: int) -> None:
            self._note("cuda_rng")
            # Not torch.manual_seed(): that calls torch.cuda.manual_seed_all -> recursion.
            torch.default_generator.manual_seed(int(seed))

        for owner in (torch.cuda, torch.cuda.random):
            self._set(owner, "get_rng_state", get_rng_state)
            self._set(owner, "set_rng_state", set_rng_state)
            self._set(owner, "manual_seed", manual_seed)
            self._set(owner, "manual_seed_all", manual_seed)

        def _get(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
            self._note("cuda_rng")
            state = torch.get_rng_state()
            return state.clone() if clone else state

        def _set(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
            self._note("cuda_rng")
            torch.set_rng_state(new_state)

        self._set(mrandom, "_get_cuda_rng_state", _get)
        self._set(mrandom, "_set_cuda_rng_state", _set)
        # fork() warns "CPU RNG state changed within GPU RNG context" whenever dropout runs in
        # it: expected here, because the "GPU" generator is the CPU generator.
        log = logging.getLogger(mrandom.__name__)
        self._set(log, "level", log.level)
        log.setLevel(logging.ERROR)

    def _patch_factory(self) -> None:
        def wrap(name: str, original: Callable) -> Callable:
            @functools.wraps(original)
            def factory(*args: Any, **kwargs: Any) -> torch.Tensor:
                device = kwargs.get("device")
                if device is not None and _is_cuda_device(device):
                    self._note("factory")
                    kwargs["device"] = _CPU
                return original(*args, **kwargs)

            return factory

        for name in _FACTORIES:
            self._set(torch, name, wrap(name, getattr(torch, name)))

        original_to = torch.Tensor.to

        def cuda(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            self._note("factory")
            return tensor

        def to(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if args and _is_cuda_device(args[0]):
                self._note("factory")
                args = (_CPU,) + tuple(args[1:])
            if "device" in kwargs and _is_cuda_device(kwargs["device"]):
                self._note("factory")
                kwargs["device"] = _CPU
            return original_to(tensor, *args, **kwargs)

        self._set(torch.Tensor, "cuda", cuda)
        self._set(torch.Tensor, "to", to)

    def _patch_grad_type(self) -> None:
        original_type = torch.Tensor.type

        def type_(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            result = original_type(tensor, *args, **kwargs)
            if not args and not kwargs and result in _CPU_TO_CUDA_TYPE:
                caller = sys._getframe(1).f_code.co_filename.replace("\\", "/")
                # Only the optimizer's assertions are lied to; everyone else sees the truth.
                if _MCORE + "optimizer/" in caller:
                    self._note("grad_type")
                    return _CPU_TO_CUDA_TYPE[result]
            return result

        self._set(torch.Tensor, "type", type_)


#: Warnings megatron-core prints (once per rank) that say nothing on a CPU run: the fallbacks
#: for absent Apex/TE, and CUDA-stream tuning advice.
CPU_NOISE = (
    r".*(Apex|Transformer Engine).*installed",
    r".*CUDA_DEVICE_MAX_CONNECTIONS",
    r"full scope is deprecated",
)


def quiet_cpu_warnings() -> None:
    """Silence :data:`CPU_NOISE`, keeping every other warning."""
    for pattern in CPU_NOISE:
        warnings.filterwarnings("ignore", message=pattern)


#: Set to a directory to record the intercepted call sites of every rank into
#: ``<dir>/cpu_runtime_sites_rank<RANK>.json`` at exit (used by the runtime's own tests).
RECORD_ENV = "MECEFO_CPU_RUNTIME_RECORD"


def enable_cpu_runtime(record: bool = False) -> CpuRuntime:
    """Enable the CPU runtime for this process (idempotent) and return it.

    Call it in every rank after choosing the CPU device and before building models.

    Args:
        record: Record intercepted call sites; also switched on by ``$MECEFO_CPU_RUNTIME_RECORD``.
    """
    active = CpuRuntime._active
    if active is not None:
        return active
    record_dir = os.environ.get(RECORD_ENV)
    runtime = CpuRuntime(record=record or bool(record_dir)).enable()
    if record_dir:
        path = os.path.join(record_dir, f"cpu_runtime_sites_rank{os.environ.get('RANK', '0')}.json")
        atexit.register(runtime.dump_sites, path)
    return runtime
