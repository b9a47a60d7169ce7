"""Item 11 of issue 12: ``make demo-simulated NPROC=N`` builds a valid run for every even N >= 4.

``make -n`` prints the recipe's torchrun command without running it; its flags must pass the
trainer's start-up checks at that world size (the failure schedule used to name replica 3
at every NPROC, so NPROC=4 failed).
"""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "examples" / "pretrain_gpt"))
from arguments import build_parser, validate_args  # noqa: E402


def _demo_argv(nproc: int) -> list[str]:
    out = subprocess.run(
        ["make", "-n", "demo-simulated", f"NPROC={nproc}"], cwd=REPO, capture_output=True, text=True
    ).stdout
    line = " ".join(out.replace("\\\n", " ").split("\n"))
    words = shlex.split(line[line.index("--nproc_per_node") :])
    assert words[0] == f"--nproc_per_node={nproc}"
    argv = words[words.index("examples/pretrain_gpt/pretrain_gpt.py") + 1 :]
    argv = argv[: argv.index("--metrics-file")]
    i = argv.index("--data-path")  # CI has no dataset: the checks need none
    return argv[:i] + ["--mock-data"] + argv[i + 2 :]


@pytest.mark.parametrize("nproc,replicas", [(4, {1}), (6, {1, 2}), (8, {1, 2, 3}), (16, {1, 2, 3})])
def test_demo_recipe_follows_nproc(nproc: int, replicas: set) -> None:
    args = validate_args(build_parser().parse_args(_demo_argv(nproc)), nproc)
    assert args.data_parallel_size == nproc // 2 and args.num_microbatches == 2
    assert {int(f.split(":")[0]) for f in args.mecefo_fail} == replicas
