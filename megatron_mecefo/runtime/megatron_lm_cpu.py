"""Extra CPU shims that Megatron-LM's ``megatron/training`` needs on top of the CPU runtime.

:mod:`megatron_mecefo.runtime.cpu` makes *megatron-core* run on a CPU-only torch over gloo.
Megatron-LM's own trainer (``pretrain_gpt.py`` -> ``megatron/training``, tag core_v0.16.1)
adds a few CUDA assumptions of its own that megatron-core does not have. This module serves
exactly those, nothing more; each shim says which line of ``megatron/training`` needs it.

Use it through ``patches/run_megatron_lm_cpu.py``, which calls :func:`enable_megatron_lm_cpu`
in every rank and then runs the checkout's ``pretrain_gpt.py`` as ``__main__``. The shims are
process-wide monkeypatches, like the CPU runtime's, and are only ever switched on by that
launcher (never by the plugin itself). They refuse to start when CUDA is available.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Callable

import torch

_TRAINING = "megatron/training/"

CPU_FLAGS: tuple[str, ...] = (
    "--distributed-backend", "gloo", "--transformer-impl", "local", "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
    "--no-masked-softmax-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
)  # fmt: skip
"""The stock Megatron-LM flags a CPU run needs (gloo, the local spec, no fused kernels: the
fusions are CUDA kernels, Transformer Engine or torch.compile)."""

#: The shims, with the megatron/training site (core_v0.16.1) that needs each one.
SHIMS: tuple[tuple[str, str], ...] = (
    (
        "no_triton_batch_invariant",
        "initialize.py:25 imports megatron.core.transformer.custom_layers."
        "batch_invariant_kernels, which does an unguarded `import triton` (a GPU compiler, not "
        "installed on CPU); only when triton is absent, a stand-in module is registered whose "
        "functions raise if --batch-invariant-mode is actually used (initialize.py:121-123)",
    ),
    (
        "allow_no_cuda",
        "initialize.py:62 initialize_megatron asserts torch.cuda.is_available() unless "
        "allow_no_cuda=True; pretrain() (training.py:768) does not pass it",
    ),
    (
        "device_arch",
        "arguments.py:928,958 validate_args calls utils.get_device_arch_version(), which reads "
        "torch.cuda.get_device_properties; it gets 0 (no GPU arch, i.e. pre-Blackwell rules: "
        "TP>1 requires CUDA_DEVICE_MAX_CONNECTIONS=1, which the launcher sets)",
    ),
    (
        "device_count",
        "initialize.py:319,422 gate initialize_model_parallel and "
        "model_parallel_cuda_manual_seed on torch.cuda.device_count() > 0; only callers in "
        "megatron/training/ are told 1 device (set_device is already a no-op)",
    ),
    (
        "dataset_helpers",
        "initialize.py:187-192 _compile_dependencies runs `make` in megatron/core/datasets on "
        "rank 0 and exits on failure; the megatron-core wheel ships helpers_cpp prebuilt and no "
        "Makefile, so compile_helpers is skipped when helpers_cpp already imports",
    ),
    (
        "fused_kernels",
        "initialize.py:221-228 calls megatron.legacy.fused_kernels.load(), which runs "
        "$CUDA_HOME/bin/nvcc -V (and builds nothing else in this tag); a no-op on the CPU",
    ),
    (
        "cuda_streams",
        "training.py:1325-1344 get_model builds DDP inside a side torch.cuda.Stream(); "
        "streams become no-op objects (the CPU executes in program order)",
    ),
    (
        "dist_optimizer_checkpoint",
        "checkpointing.py:1653 (torch_dist) and :1810 (torch) load a DistributedOptimizer's "
        "state through megatron-core's no-Apex/TE path, which fails in 0.16.1 "
        "(distrib_optimizer.py:642 `assert len(steps) == 1`; distrib_optimizer.py:940 "
        "copy_ into a view of a leaf that requires grad); with --use-distributed-optimizer, "
        "training.py's save_checkpoint also writes each rank's optimizer shard, and its "
        "load_checkpoint loads the checkpoint as with --no-load-optim, then restores that "
        "shard and the LR scheduler (see megatron_lm_cpu_checkpoint)",
    ),
)


def _called_from_training(depth: int = 2) -> bool:
    """Whether the function ``depth`` frames up is in Megatron-LM's megatron/training/."""
    frame = sys._getframe(depth)
    return _TRAINING in frame.f_code.co_filename.replace("\\", "/")


class _NoopStream:
    """Stands in for torch.cuda.Stream on the CPU, where everything runs in program order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> "_NoopStream":
        return self

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_saved: list[tuple[Any, str, Any]] = []
_BIK = "megatron.core.transformer.custom_layers.batch_invariant_kernels"


def _install_batch_invariant_stub() -> None:
    """Register a stand-in for batch_invariant_kernels when triton cannot be imported."""
    import importlib.util
    import types

    if _BIK in sys.modules or importlib.util.find_spec("triton") is not None:
        return

    def unavailable(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("--batch-invariant-mode needs triton (GPU only); not on the CPU")

    stub = types.ModuleType(_BIK, "CPU stand-in: batch-invariant kernels need triton.")
    stub.enable_batch_invariant_mode = unavailable
    stub.disable_batch_invariant_mode = unavailable
    stub.set_batch_invariant_mode = unavailable
    stub.is_batch_invariant_mode_enabled = lambda: False
    stub.__all__ = [
        "set_batch_invariant_mode",
        "is_batch_invariant_mode_enabled",
        "disable_batch_invariant_mode",
        "enable_batch_invariant_mode",
    ]
    sys.modules[_BIK] = stub


def _set(owner: Any, attr: str, value: Any) -> None:
    _saved.append((owner, attr, getattr(owner, attr)))
    setattr(owner, attr, value)


def enable_megatron_lm_cpu() -> None:
    """Enable the CPU runtime plus the megatron/training shims (idempotent).

    Call it before ``pretrain()`` runs; Megatron-LM's checkout must be importable.
    """
    from megatron_mecefo.runtime.cpu import enable_cpu_runtime

    enable_cpu_runtime()  # refuses to run when CUDA is available
    if _saved:
        return

    _install_batch_invariant_stub()  # before megatron.training is imported

    # allow_no_cuda: pretrain() looks initialize_megatron up in its own module namespace.
    from megatron.training import training as mlm_training

    original_init = mlm_training.initialize_megatron

    @functools.wraps(original_init)
    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return original_init(*args, **kwargs)

    _set(mlm_training, "initialize_megatron", initialize_megatron)

    # device_arch: arguments.py imported the name, so patch it there (and at its source).
    from megatron.training import arguments as mlm_arguments
    from megatron.training import utils as mlm_utils

    def get_device_arch_version() -> int:
        return 0

    _set(mlm_arguments, "get_device_arch_version", get_device_arch_version)
    _set(mlm_utils, "get_device_arch_version", get_device_arch_version)

    # dataset_helpers
    from megatron.core.datasets import utils as dataset_utils

    original_compile = dataset_utils.compile_helpers

    @functools.wraps(original_compile)
    def compile_helpers() -> None:
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401
        except ImportError:
            original_compile()  # the checkout's megatron/core: build it as Megatron-LM does

    _set(dataset_utils, "compile_helpers", compile_helpers)

    # fused_kernels
    from megatron.legacy import fused_kernels

    _set(fused_kernels, "load", lambda args: None)

    # device_count: scoped to megatron/training/ callers, so torch and megatron-core still see 0.
    original_count: Callable[[], int] = torch.cuda.device_count

    @functools.wraps(original_count)
    def device_count() -> int:
        if _called_from_training():
            return 1
        return original_count()

    _set(torch.cuda, "device_count", device_count)

    # cuda_streams
    _set(torch.cuda, "Stream", _NoopStream)
    _set(torch.cuda, "current_stream", lambda *a, **k: _NoopStream())
    _set(torch.cuda, "stream", lambda *a, **k: contextlib.nullcontext())

    # dist_optimizer_checkpoint: training.py imported both names, so patch them there.
    from megatron_mecefo.runtime.megatron_lm_cpu_checkpoint import wrap_load, wrap_save

    _set(mlm_training, "save_checkpoint", wrap_save(mlm_training.save_checkpoint))
    _set(mlm_training, "load_checkpoint", wrap_load(mlm_training.load_checkpoint))


def disable_megatron_lm_cpu() -> None:
    """Undo the megatron/training shims (the CPU runtime stays on)."""
    for owner, attr, original in reversed(_saved):
        setattr(owner, attr, original)
    _saved.clear()
