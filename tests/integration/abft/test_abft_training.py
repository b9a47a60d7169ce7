"""The example trainer with ``--mecefo-abft``: 100 iterations, a fault every 10 iterations."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TRAINER, child_env, run_trainer, train_records

MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--lr", "3e-3", "--lr-decay-style", "constant", "--split", "90,10,0", "--eval-iters", "0",
    "--make-vocab-size-divisible-by", "256", "--add-bias-linear", "--log-interval", "50",
]  # fmt: skip
# Ten faults, one every 10 iterations: each kind, each op, a seeded layer and element.
FAULTS = [
    "kind=inf,op=scores,every=40,start=10",
    "kind=nan,op=context,every=40,start=20",
    "kind=near_inf,op=proj,every=40,start=30,mb=1",
    "kind=bitflip,op=qkv,every=40,start=40",
]
# Corrected runs differ from the clean one by the rounding of the corrected elements
# (~1e-7 relative), which Adam carries on: measured max |loss - clean| over 100 steps 3.2e-5
# (printed by the test). 1e-3 is far below the effect of one uncorrected fault (NaN, or a
# jump of order 1).
LOSS_ATOL = 1e-3


@pytest.fixture(scope="module")
def runs(tmp_path_factory, text_data):
    base = MODEL + ["--data-path", text_data, "--train-iters", "100"]
    inject = [a for f in FAULTS for a in ("--mecefo-abft-inject", f)]
    out = {}
    for name, extra in (
        ("clean", []),
        ("abft_clean", ["--mecefo-abft"]),
        ("abft_faults", ["--mecefo-abft", *inject]),
        ("faults", inject),
    ):
        proc, records = run_trainer(1, base + extra, tmp_path_factory.mktemp(name))
        out[name] = (proc, train_records(records))
    return out


def _losses(records):
    return [r["loss"] for r in records]


def test_abft_without_faults_is_bit_identical(runs):
    assert _losses(runs["abft_clean"][1]) == _losses(runs["clean"][1])
    assert all(r["abft"]["corrected"] == 0 for r in runs["abft_clean"][1])


def test_abft_corrects_every_fault_and_matches_the_clean_run(runs):
    clean, fixed = _losses(runs["clean"][1]), _losses(runs["abft_faults"][1])
    diff = max(abs(a - b) for a, b in zip(clean, fixed, strict=True))
    print(f"max |loss(abft+faults) - loss(clean)| over 100 steps: {diff:.2e}")
    assert all(math.isfinite(x) for x in fixed)
    assert diff <= LOSS_ATOL
    recs = runs["abft_faults"][1]
    hit = [r["iteration"] for r in recs if r["abft"]["injected"]]
    assert hit == list(range(10, 101, 10))
    assert sum(r["abft"]["corrected"] for r in recs) == 10
    assert not any(r["skipped"] for r in recs)
    summary = runs["abft_faults"][0].stdout
    assert "10 injected; detected: 10 corrected, 0 recomputed, 0 uncorrectable" in summary


def test_same_faults_without_abft_break_training(runs):
    clean, broken = _losses(runs["clean"][1]), _losses(runs["faults"][1])
    assert broken[:9] == clean[:9]  # identical until the first fault
    nan = any(math.isnan(x) for x in broken)
    spike = max(b - a for a, b in zip(clean, broken, strict=True)) > 1.0
    assert nan or spike, broken


BAD = [
    (["--mecefo-abft-inject", "kind=fire,op=scores,iter=3"], "kind=fire"),
    (["--mecefo-abft-inject", "op=scores"], "give exactly one of iter=I or every=N"),
    (["--mecefo-abft-inject", "kind=inf,op=softmax,iter=1"], "op=softmax"),
    (["--mecefo-abft", "--mecefo-abft-policy", "sometimes"], "--mecefo-abft-policy"),
    (["--mecefo-abft-mode", "detect"], "without --mecefo-abft"),
    (["--mecefo-abft", "--transformer-impl", "transformer_engine"], "fused attention"),
]  # fmt: skip


@pytest.mark.parametrize("flags,expected", BAD, ids=[b[1] for b in BAD])
def test_bad_abft_flags_fail_at_start_up(tmp_path: Path, flags, expected):
    proc = subprocess.run(
        [sys.executable, str(TRAINER), "--mock-data", *flags],
        cwd=tmp_path, env=child_env(WORLD_SIZE="1", RANK="0"), capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("pretrain_gpt.py: error:")]
    assert len(lines) == 1 and expected in lines[0], proc.stderr[-2000:]
