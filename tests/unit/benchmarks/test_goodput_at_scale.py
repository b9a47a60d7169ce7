"""``benchmarks/goodput_at_scale.py``: the closed-form ETTR model with published inputs, the
measured regroup points and the labelled assumptions."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

import goodput_at_scale as gas  # noqa: E402


def test_rates_are_the_published_figures() -> None:
    """Llama 3: 419 interruptions in 54 days at 16,384 GPUs; Meta: MTTF 1.8 h at 16,384, labelled
    a fitted projection."""
    assert 1 / gas.rate_per_s("llama3_rate", 16384) / 3600 == pytest.approx(54 * 24 / 419)
    assert 1 / gas.rate_per_s("meta_rsc_16k_rate", 16384) / 3600 == pytest.approx(1.8)
    assert gas.SOURCES["meta_rsc_16k_rate"]["kind"] == "fitted projection"


def test_llama3_split_sums_to_419_with_the_restart_causes() -> None:
    """Table 5's counts add up to the 419; software bugs, host maintenance, NCCL watchdog
    timeouts and dependencies (95, 22.7%) need a restart, the rest a neighbour absorbs."""
    s = gas.SPLIT
    assert s["total"] == 419 == s["absorb_count"] + s["restart_count"]
    assert {c["cause"]: c["count"] for c in s["restart"]} == {
        "Software bug": 54, "Host maintenance": 32, "NCCL watchdog timeouts": 7, "Dependency": 2,
    }  # fmt: skip
    lam_a, lam_r = gas.rates("llama3_rate", 16384)
    assert lam_r / (lam_a + lam_r) == pytest.approx(95 / 419)


def test_checkpoint_restart_is_calibrated_to_llama3s_90_percent() -> None:
    """The derived restart puts checkpoint-restart at Llama 3's 0.90 at 16k GPUs (about 5 min
    with the assumed 30 s save), and it is labelled derived."""
    lam = gas.rate_per_s("llama3_rate", 16384)
    assert gas.checkpoint_restart(lam, 30.0, gas.RESTART_S) == pytest.approx(0.90)
    assert 250 < gas.RESTART_S < 350 and gas.INPUTS["restart_s"]["kind"] == "derived"


def test_spread_pays_a_whole_micro_batch_at_any_n() -> None:
    """One replica down (M <= n - 1): a survivor runs M + c whatever n, so spread is
    M / (M + c), not the perfect split 1 / (1 + c/(n-1)); neighbor is 1 / (1 + c)."""
    for n in (5, 32, 2048):
        t = gas.degraded_throughput(1, n, 4, 0.96)
        assert t["spread"] == pytest.approx(4 / 4.96) and t["neighbor"] == pytest.approx(1 / 1.96)
    # k M beyond n - k survivors: ceil(k M / (n - k)) micro-batches on the critical path.
    assert gas.degraded_throughput(1, 4, 4, 1.0)["spread"] == pytest.approx(4 / (4 + 2))
    assert gas.degraded_throughput(3, 8, 4, 1.0)["spread"] == pytest.approx(4 / (4 + 3))


def test_world_rebuild_is_extrapolated_from_the_measured_points() -> None:
    """The rebuild's fixed part is the largest regroup measured in recovery_scale.json (a
    configuration's median over its runs), its store part every rank's requests at
    commit_at_scale.json's CPU per request, and it costs more than shrink_group at every
    scale; shrink and grow start from 3.79 / 4.19 s at 1,024."""
    scale = json.loads((REPO / "results" / "recovery_scale.json").read_text())
    configs = scale["cross_size"]["configs"]
    fixed = max(c["regroup_s"] for c in configs if c.get("regroup_s") is not None)
    assert fixed < max(r["regroup_s"] for r in scale["runs"] if r.get("regroup_s"))
    assert gas.MEASURED["fixed_s"] == fixed
    sg = gas.shrink_grow_s(1024)
    assert (sg["shrink"], sg["grow"]) == (3.79, 4.19)
    assert gas.shrink_grow_s(16384)["shrink"] == pytest.approx(3.79 + 0.3 * 4)
    for gpus in gas.GPUS:
        rb = gas.rebuild_s(gpus)
        assert rb["store"] == pytest.approx(gpus * 4 * gas.MEASURED["store_ms_per_request"] / 1e3)
        assert gas.regroup_pair(gpus, "rebuild") > gas.regroup_pair(gpus, "shrink_group")


def test_auto_grows_with_m_and_the_restart_class_costs_it(tmp_path: Path) -> None:
    """At 16k GPUs (Llama 3): auto rises with M; the restart-class failures (as
    checkpoint-restart) cost it more than they would as a 120 s restart; every input that is
    not cited is labelled, and the smallest-M answer agrees with the M table."""
    res = gas.main(["--output", str(tmp_path / "g.json")])
    at16 = [r for r in res["m_table"] if r["gpus"] == 16384 and r["rate"] == "llama3_rate"]
    assert [r["M"] for r in at16] == [4, 8, 16, 32]
    vals = [r["auto_rebuild"] for r in at16]
    assert vals == sorted(vals) and len(set(vals)) == 4
    for r in at16:
        assert r["auto_rebuild"] < r["auto_rebuild_fast_restart_class"]
        assert r["auto_rebuild"] <= r["auto_shrink_group"]
    assert {v["kind"] for v in res["inputs"].values()} <= {"assumed", "measured", "derived"}
    assert "mttr_s" in res["assumed"] and "failure_split" in res["assumed"]
    sm = res["smallest_m_beating"]
    fr = sm["targets"]["flashrecovery"]
    m = sm["rebuild_fast_restart_class"]["flashrecovery"]
    lam_a, lam_r = gas.rates("llama3_rate", 16384)
    got = gas.mecefo(lam_a, lam_r, 16384, res["inputs"], "auto", "rebuild", m, None, "fast")
    below = gas.mecefo(lam_a, lam_r, 16384, res["inputs"], "auto", "rebuild", m - 1, None, "fast")
    assert got > fr >= below
    assert json.loads((tmp_path / "g.json").read_text())["smallest_m_beating"] == json.loads(
        json.dumps(sm)
    )


def test_longest_regroup_for_the_goal_is_where_auto_crosses_it() -> None:
    """With every failure absorbed (no restart class) auto crosses 0.99 at a finite regroup."""
    inp = gas.INPUTS
    lam = gas.rate_per_s("llama3_rate", 16384)
    r = gas.max_regroup_for(0.99, lam, 0.0, 16384, {**inp, "microbatches": {"value": 32}})
    inp32 = {**inp, "microbatches": {"value": 32}}
    assert gas.mecefo(lam, 0.0, 16384, inp32, regroup=r) >= 0.99
    assert gas.mecefo(lam, 0.0, 16384, inp32, regroup=r + 0.1) < 0.99
    assert not math.isinf(r)
