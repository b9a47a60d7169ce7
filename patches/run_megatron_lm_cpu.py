"""Run Megatron-LM's own, unmodified ``pretrain_gpt.py`` on CPU ranks over gloo.

    export MEGATRON_LM_DIR=/path/to/Megatron-LM   # a checkout of tag core_v0.16.1
    OMP_NUM_THREADS=1 torchrun --nproc_per_node=4 patches/run_megatron_lm_cpu.py \\
        [--megatron-lm-dir DIR] [--pretrain-script FILE] <pretrain_gpt.py arguments>

The launcher switches on the plugin's CPU runtime (``megatron_mecefo.runtime.cpu``) and the
few extra shims that ``megatron/training`` needs (``megatron_mecefo.runtime.megatron_lm_cpu``),
then executes the checkout's ``pretrain_gpt.py`` as ``__main__`` (in this module's namespace,
see the comment in :func:`main`) with the remaining arguments.

Given ``--mecefo`` or a ``--mecefo-*`` flag, it first checks that the script carries the
patch (:mod:`megatron_mecefo.megatron_lm.patch_check`) and, if not, says how to apply it in
one line (exit 2).

``megatron.core`` is imported from the installed megatron-core wheel, not from the checkout:
the checkout is *appended* to ``sys.path``, so the wheel's ``megatron/core`` (the same 0.16.1
sources, plus the prebuilt dataset helpers ``helpers_cpp``) wins, and only
``megatron.training`` / ``megatron.legacy`` (absent from the wheel) come from the checkout.
Rank 0 prints both locations. ``MEGATRON_LM_CORE=checkout`` imports the checkout's
``megatron/core`` instead; Megatron-LM then builds ``helpers_cpp`` with ``make`` on rank 0,
which needs ``pybind11`` and a C++ compiler for the ``python3`` on PATH.

``megatron/training`` imports four pure-Python packages that megatron-core does not need:
``six``, ``regex``, ``pyyaml`` and ``pydantic``; install them (into the venv, or a folder on
PYTHONPATH) first. transformer_engine, apex, triton and nvidia-modelopt are *not* needed and
must not be installed on CPU machines: their imports are guarded, except triton's, which
``megatron_lm_cpu`` covers.

Stock Megatron-LM flags a CPU run needs:
``--distributed-backend gloo --transformer-impl local --use-cpu-initialization
--no-gradient-accumulation-fusion --no-persist-layer-norm --no-bias-gelu-fusion
--no-bias-dropout-fusion --no-masked-softmax-fusion --no-rope-fusion``, plus for data without
files ``--mock-data --tokenizer-type NullTokenizer --vocab-size N``. (The tested runs switch
every fusion off; the fusions are CUDA kernels, Transformer Engine, or torch.compile.)
"""

from __future__ import annotations

import os
import sys


def _pop_option(rest: list[str], name: str) -> str | None:
    for i, arg in enumerate(rest):
        if arg == name:
            value = rest[i + 1]
            del rest[i : i + 2]
            return value
        if arg.startswith(name + "="):
            del rest[i]
            return arg.split("=", 1)[1]
    return None


def _split_argv(argv: list[str]) -> tuple[str, str, list[str]]:
    rest = list(argv)
    mlm_dir = _pop_option(rest, "--megatron-lm-dir") or os.environ.get("MEGATRON_LM_DIR")
    if not mlm_dir:
        sys.exit("run_megatron_lm_cpu.py: give --megatron-lm-dir DIR or set MEGATRON_LM_DIR")
    mlm_dir = os.path.abspath(mlm_dir)
    # --pretrain-script: a (patched) copy of pretrain_gpt.py kept outside the checkout.
    script = os.path.abspath(
        _pop_option(rest, "--pretrain-script") or os.path.join(mlm_dir, "pretrain_gpt.py")
    )
    if not os.path.isfile(script):
        sys.exit(f"run_megatron_lm_cpu.py: no pretrain script {script}")
    return mlm_dir, script, rest


_TRAINING_DEPS = {"six": "six", "regex": "regex", "yaml": "pyyaml", "pydantic": "pydantic"}


def main() -> None:
    mlm_dir, script, rest = _split_argv(sys.argv[1:])
    from megatron_mecefo.megatron_lm.patch_check import mecefo_flag, missing_patch_message

    flag = mecefo_flag(rest)
    message = missing_patch_message(script, flag) if flag else None
    if message is not None:  # else Megatron-LM says only "unrecognized arguments: --mecefo"
        from megatron_mecefo.errors import fail

        fail(message, "pretrain_gpt.py")
    import importlib.util

    missing = [pkg for mod, pkg in _TRAINING_DEPS.items() if importlib.util.find_spec(mod) is None]
    if missing:
        need = " ".join(missing)
        sys.exit(f"run_megatron_lm_cpu.py: megatron/training needs: pip install {need}")
    # The launcher's own folder must not shadow anything the checkout imports.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.path.append(os.path.dirname(script))  # as `python pretrain_gpt.py` would see it
    if os.environ.get("MEGATRON_LM_CORE") == "checkout":
        sys.path.insert(0, mlm_dir)
    else:
        sys.path.append(mlm_dir)

    # validate_args (arguments.py:951) demands it for TP>1 on pre-Blackwell GPUs; the CPU
    # reports no GPU arch, so it applies. It has no effect on the CPU.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    from megatron_mecefo.runtime import quiet_cpu_warnings

    quiet_cpu_warnings()
    import megatron.core

    from megatron_mecefo.runtime.megatron_lm_cpu import enable_megatron_lm_cpu

    enable_megatron_lm_cpu()
    if int(os.environ.get("RANK", "0")) == 0:
        import megatron.training

        print(
            f"> run_megatron_lm_cpu: megatron.core from {os.path.dirname(megatron.core.__file__)}"
            f" (version {megatron.core.__version__}); megatron.training from "
            f"{os.path.dirname(megatron.training.__file__)}",
            flush=True,
        )

    sys.argv = [script] + rest
    # Run pretrain_gpt.py as __main__ *in this module's namespace* rather than with
    # runpy.run_path: run_path swaps in a temporary __main__ whose __file__ is pretrain_gpt.py,
    # so every multiprocessing "spawn" child (the torch_dist checkpoint writer starts a spawn
    # Manager, filesystem_async.py:54) re-imports pretrain_gpt.py without these shims and dies
    # at `import triton`. Here a spawn child re-imports only this launcher, whose work is
    # behind the __main__ guard; pretrain_gpt's functions still pickle as __main__.<name>.
    with open(script) as f:
        code = compile(f.read(), script, "exec")
    exec(code, sys.modules["__main__"].__dict__)


if __name__ == "__main__":
    main()
