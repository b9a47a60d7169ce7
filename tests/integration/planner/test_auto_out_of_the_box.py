"""``--mecefo-policy auto`` without ``--mecefo-planner-profile``, started from a folder with no
``results/``: it reads the profile shipped in the package, says so at its first decision, and
plans a failure with it."""

from __future__ import annotations

from pathlib import Path

from conftest import run_trainer, train_records

from megatron_mecefo.planner.calibration import PACKAGED_PROFILE, load_profile


def test_auto_starts_from_any_folder_with_the_packaged_profile(tmp_path: Path) -> None:
    assert Path(PACKAGED_PROFILE).is_file() and load_profile(PACKAGED_PROFILE).exact_ms > 0
    assert not (tmp_path / "results").exists()
    proc, records = run_trainer(
        2,
        ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
         "4", "--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4",
         "--train-iters", "4", "--eval-iters", "0", "--mecefo", "--mecefo-rank", "16",
         "--mecefo-policy", "auto", "--mecefo-fail", "1:3", "--mecefo-grad-error-budget", "1"],
        tmp_path,
    )  # fmt: skip
    out = proc.stdout
    said = f"> MeCeFO planner: cost profile {PACKAGED_PROFILE} (the packaged default"
    assert out.count(said) == 1, out[-3000:]
    first = out.index("> MeCeFO planner: iteration 1")
    assert out.index(said) < first  # named before the first decision
    assert "> MeCeFO planner: iteration 3, replicas down [1]:" in out, out[-3000:]
    plans = [r["mecefo"]["planner"] for r in train_records(records)]
    assert len(plans) == 4 and plans[2]["policy"] != "none", plans
