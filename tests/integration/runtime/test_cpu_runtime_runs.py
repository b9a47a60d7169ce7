"""The CPU runtime in real processes: every layer is needed and all together suffice (one DDP +
optimizer step on a gloo rank), and the megatron-core call sites a sweep of trainer runs
records are exactly the documented list."""

from __future__ import annotations

import glob
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, child_env, free_port, run_trainer

from megatron_mecefo.runtime import LAYERS, PATCHED_CALL_SITES


def test_every_layer_is_needed_and_all_together_suffice() -> None:
    """A real DDP + optimizer step fails without any one layer and succeeds with all."""
    env = child_env(MASTER_PORT=str(free_port()))
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "workers" / "runtime_worker.py"), *LAYERS],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, proc.stderr[-3000:]
    results = json.loads(line[0][len("RESULT ") :])
    assert results["<all layers>"] == {"ok": True, "error": None}
    for layer in LAYERS:
        assert not results[layer]["ok"], f"the step works without layer {layer}: drop it"
        assert results[layer]["error"], layer


SWEEP = [
    # (ranks, flags): together they reach every feature the runtime supports.
    (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--overlap-grad-reduce", "--tie-embeddings-and-output-weights", "--save", "{ckpt}"]),
    (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--bf16",
         "--use-distributed-optimizer", "--recompute-granularity", "full",
         "--recompute-method", "uniform"]),
    (2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]),
    (2, ["--fp16", "--position-embedding-type", "learned_absolute", "--no-swiglu",
         "--normalization", "LayerNorm", "--add-bias-linear"]),
    # Resharded load: TP2 x PP2 checkpoint into TP1 x PP2.
    (4, ["--pipeline-model-parallel-size", "2", "--tie-embeddings-and-output-weights",
         "--load", "{ckpt}", "--train-iters", "4", "--use-checkpoint-opt-param-scheduler"]),
]  # fmt: skip


# A sweep of trainer runs (about 60 s): in make test-all, to keep .ci/run within its 35 min.
@pytest.mark.slow
def test_patched_call_sites_are_exactly_the_documented_list(tmp_path: Path) -> None:
    record = tmp_path / "sites"
    base = ["--mock-data", "--train-iters", "2", "--eval-iters", "1", "--eval-interval", "2",
            "--seq-length", "32", "--hidden-size", "64", "--global-batch-size", "8"]  # fmt: skip
    for i, (nproc, flags) in enumerate(SWEEP):
        flags = [f.format(ckpt=tmp_path / "ckpt") for f in flags]
        run_trainer(nproc, base + flags, tmp_path, MECEFO_CPU_RUNTIME_RECORD=str(record / str(i)))
    observed = set()
    for path in glob.glob(str(record / "*" / "cpu_runtime_sites_rank*.json")):
        observed |= {tuple(row[:3]) for row in json.loads(Path(path).read_text())}
    documented = {(s.layer, s.path, s.function) for s in PATCHED_CALL_SITES}
    assert not observed - documented, f"undocumented sites: {sorted(observed - documented)}"
    assert not documented - observed, f"documented but never hit: {sorted(documented - observed)}"
