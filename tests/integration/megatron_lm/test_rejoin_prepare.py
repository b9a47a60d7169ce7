"""What a joiner does before it says ready, so that the survivors do not wait for it (issue 44,
item 2): Megatron-LM's fused kernels compiled once, and its flags parsed once per process.

One process (no world): the flags of the recovery tests are parsed through the cached
``parse_args``, the kernels compiled by :func:`~megatron_mecefo.megatron_lm.recovery.
warm_jit_fusions`, and then Megatron-LM's own ``set_jit_fusion_options`` (``pretrain()``'s
call, with ``validate_args``'s flags) must compile nothing more.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import child_env
from mlm_runs import CPU_GPT, MECEFO

SCRIPT = """
import os, sys
sys.path.append(os.environ["MEGATRON_LM_DIR"])
os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
from megatron_mecefo.runtime.megatron_lm_cpu import enable_megatron_lm_cpu
enable_megatron_lm_cpu()
from torch._dynamo.utils import counters
from megatron.training import arguments, global_vars, initialize
from megatron_mecefo.megatron_lm import recovery
from megatron_mecefo.megatron_lm.flags import extra_args_provider
sys.argv = ["pretrain_gpt.py", *sys.argv[1:]]
provider = extra_args_provider()
recovery._cache_parse_args()
os.environ.update(RANK="0", WORLD_SIZE="4")
args = arguments.parse_args(provider)  # run_pretrain's parse
recovery.warm_jit_fusions(args, "cpu")
warm = counters["stats"]["unique_graphs"]
os.environ["RANK"] = "3"  # a later generation's rank
again = initialize.parse_args(provider)  # initialize_megatron's parse
assert again is not args and again.rank == 3, again.rank
assert vars(again) == {**vars(args), "rank": 3}, "the cached flags differ"
arguments.validate_args(again, {})
global_vars._GLOBAL_ARGS = again
initialize.set_jit_fusion_options()  # pretrain()'s own call
print(f"GRAPHS {warm} {counters['stats']['unique_graphs'] - warm}")
"""


def test_kernels_compiled_before_ready_are_reused_by_pretrain(megatron_lm: Path) -> None:
    argv = [*CPU_GPT, *MECEFO, "--train-iters", "4"]
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, *argv],
        env=child_env(MEGATRON_LM_DIR=str(megatron_lm)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("GRAPHS"))
    before_ready, by_pretrain = map(int, line.split()[1:])
    # Compiled early (bias-GeLU and bias-dropout-add), and nothing left for pretrain().
    assert before_ready >= 2 and by_pretrain == 0, line
