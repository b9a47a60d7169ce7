"""The low-rank basis V in checkpoints: a run resumed inside a failure window, between two
refreshes of V, matches the uninterrupted run bitwise (example trainer, DP2 on gloo)."""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import TINY_MODEL, run_trainer, train_records

# Replica 1 is down for iterations 2..7: replica 0 takes its micro-batches over in takeover
# mode, so V is computed at iteration 2 and refreshed at 6 (tau = 4). The checkpoint at 4
# sits between the two: resumed without the saved V, iteration 5 would compute a new one
# from its own weights.
ARGS = TINY_MODEL + [
    "--train-iters", "8", "--eval-iters", "0", "--mecefo", "--mecefo-fail", "1:2:8",
    "--mecefo-rank", "8", "--mecefo-basis-interval", "4", "--save-interval", "4",
]  # fmt: skip
KEYS = ("loss", "grad_norm", "lr", "consumed_samples")


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt.parent / f"{ckpt.parent.name}_{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    state = torch.load(out, weights_only=False)
    # Flat keys: the model's weights and (unless kept per rank) the optimizer's moments.
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def test_resume_mid_window_matches_uninterrupted_bitwise(tmp_path: Path, text_data: str) -> None:
    full_dir, resumed_dir = tmp_path / "full", tmp_path / "resumed"
    args = ARGS + ["--data-path", text_data]
    _, full = run_trainer(2, args + ["--save", str(full_dir)], tmp_path)
    assert sorted(p.name for p in (full_dir / "iter_0000004" / "mecefo_basis").iterdir()) == [
        "tp0of1_pp0of1_dp0of2.pt",
        "tp0of1_pp0of1_dp1of2.pt",
    ]
    saved = torch.load(full_dir / "iter_0000004" / "mecefo_basis" / "tp0of1_pp0of1_dp0of2.pt")
    assert {e["step"] for e in saved.values()} == {2}  # replica 0 refreshed V at iteration 2
    # Resume from iteration 4 of the same run (the tracker names 8 after the full run).
    (full_dir / "latest_checkpointed_iteration.txt").write_text("4")
    proc, resumed = run_trainer(
        2, args + ["--load", str(full_dir), "--save", str(resumed_dir)], tmp_path
    )
    assert "restored 8 low-rank bases" in proc.stdout
    full, resumed = train_records(full), train_records(resumed)
    assert [r["iteration"] for r in resumed] == [5, 6, 7, 8]
    for key in KEYS:
        assert [r[key] for r in resumed] == [r[key] for r in full[4:]], key
    mine, ref = _weights(resumed_dir / "iter_0000008"), _weights(full_dir / "iter_0000008")
    assert mine.keys() == ref.keys() and len(ref) > 10
    for name, tensor in ref.items():
        assert torch.equal(mine[name], tensor), name
