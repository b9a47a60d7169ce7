"""Attention ABFT on real megatron-core modules: TP1, TP2 and TP2 with sequence parallelism.

Each layout runs ``abft_worker.py`` once (all its scenarios); the tests assert on what it
measured. The reference is always the same model's fault-free forward and backward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import pytest
from conftest import REPO, run_worker

WORKER = REPO / "tests" / "workers" / "abft_worker.py"
LAYOUTS = {  # layout: (ranks, scenarios)
    "tp1": (1, ["identity", "kinds", "patterns", "modes", "takeover", "spec_errors"]),
    "tp2": (2, ["identity", "kinds_rank1"]),
    "tp2sp": (2, ["identity", "kinds_rank1", "patterns"]),
}
OPS = ("qkv", "scores", "context", "proj")
KINDS = ("inf", "nan", "near_inf", "bitflip")
# A corrected element is `checksum - sum of the others`: it carries the fp32 rounding of the
# checksum GEMM and of the other elements (measured: loss <= 4.8e-7, grads <= 6e-8 on this
# model, whose losses are ~4.2 and gradients ~1e-2). 1e-5 / 1e-6 leave an order of margin; an
# uncorrected INF/NaN/1e20 gives NaN or differences of order 1.
LOSS_ATOL, GRAD_ATOL = 1e-5, 1e-6


def _run(layout: str, out: Path) -> Dict[str, Any]:
    ranks, scenarios = LAYOUTS[layout]
    return run_worker(WORKER, out, layout, ranks, scenarios)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cache: Dict[str, Dict[str, Any]] = {}
    out = tmp_path_factory.mktemp("abft")

    def get(layout: str) -> Dict[str, Any]:
        if layout not in cache:
            cache[layout] = _run(layout, out)
        return cache[layout]

    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_no_fault_is_bit_identical_to_the_stock_spec(results, layout):
    r = results(layout)["identity"]
    assert r["full"]["loss"] == 0.0 and r["full"]["grad"] == 0.0
    assert r["detect"]["loss"] == 0.0 and r["detect"]["grad"] == 0.0
    assert r["full"]["checks"] == 8 * (2 if layout != "tp1" else 1)  # 4 GEMMs x 2 layers
    assert not r["full"]["detections"]  # no false positive


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("kind", KINDS)
def test_one_fault_is_located_and_corrected(results, op, kind):
    r = results("tp1")["kinds"][f"{op}/{kind}"]
    assert r["loss"] <= LOSS_ATOL and r["grad"] <= GRAD_ATOL, r
    rec = r["record"]
    assert (rec["injected"], rec["corrected"], rec["recomputed"], rec["uncorrectable"]) == (
        1, 1, 0, 0
    ), rec  # fmt: skip
    injected, corrected = r["events"]
    assert injected["action"] == "injected" and corrected["action"] == "corrected"
    # Reported where and what it was: the same element, the kind the value really had
    # (a bit flip of a value below 2 in magnitude gives ~1e38: near-INF).
    assert corrected["index"] == injected["index"]
    assert corrected["kind"] == injected["kind"]
    assert corrected["kind"] == (kind if kind != "bitflip" else corrected["kind"])
    assert corrected["kind"] in ("inf", "nan", "near_inf")
    assert corrected["layer"] == 2 and corrected["op"] == op


@pytest.mark.parametrize("layout", ["tp2", "tp2sp"])
def test_tp_rank_corrects_its_own_heads(results, layout):
    for key, r in results(layout)["kinds_rank1"].items():
        assert r["loss"] <= LOSS_ATOL and r["grad"] <= GRAD_ATOL, (key, r)
        assert r["record"]["injected"] == 1 and r["record"]["corrected"] == 1, (key, r)


@pytest.mark.parametrize("layout", ["tp1", "tp2sp"])
@pytest.mark.parametrize("op", OPS)
def test_two_faults_in_one_line_fall_back_to_recompute(results, layout, op):
    pats = results(layout)["patterns"]
    line, row, block = (pats[f"{op}/{p}"] for p in ("line", "row", "block"))
    for r in (line, row, block):
        assert r["loss"] <= LOSS_ATOL and r["grad"] <= GRAD_ATOL, r
        assert r["record"]["uncorrectable"] == 0 and not r["record"]["skip"]
    # Two faults under one token-sum checksum: the projections (one direction) recompute;
    # scores/context fix both from the second (feature-sum) direction.
    if op in ("qkv", "proj"):
        assert (line["record"]["recomputed"], line["record"]["corrected"]) == (1, 0)
    else:
        assert (line["record"]["recomputed"], line["record"]["corrected"]) == (0, 2)
    assert (row["record"]["recomputed"], row["record"]["corrected"]) == (0, 2)
    # A 2x2 block defeats both directions: the GEMM is recomputed; bit-equal afterwards.
    assert block["record"]["recomputed"] == 2 and block["record"]["corrected"] == 0
    assert block["loss"] == 0.0 and block["grad"] == 0.0


def test_detection_only_mode_recomputes(results):
    r = results("tp1")["modes"]["detect"]
    assert r["record"]["recomputed"] == 1 and r["record"]["corrected"] == 0
    assert r["loss"] == 0.0 and r["grad"] == 0.0


def test_uncorrectable_skips_the_step_or_raises(results):
    m = results("tp1")["modes"]
    skip = m["skip"]["record"]
    assert skip["skip"] and skip["uncorrectable"] == 1  # counted once, at the source
    assert not m["skip"]["loss_finite"]  # the NaN is real; the trainer skips the update
    assert "layer 1 proj output still bad" in m["raise"]


def test_every_k_policy_leaves_odd_steps_unchecked(results):
    odd, even = results("tp1")["modes"]["every2"]
    assert not odd["protected"] and odd["corrected"] == 0 and not odd["finite"]
    assert even["protected"] and even["corrected"] == 1 and even["finite"]


def test_takeover_forward_is_still_protected(results):
    r = results("tp1")["takeover"]
    assert r["record"]["corrected"] == 1
    assert r["loss"] <= LOSS_ATOL and r["grad"] <= GRAD_ATOL


def test_spec_rewrite_refuses_what_it_cannot_protect(results):
    e = results("tp1")["spec_errors"]
    assert "TEDotProductAttention" in e["core_attention"] and "fused" in e["core_attention"]
    assert "TELayerNormColumnParallelLinear" in e["linear_qkv"]
    assert "RowParallelLinearOfSomeoneElse" in e["linear_proj"]
    assert all("--transformer-impl local" in v for v in e.values())
