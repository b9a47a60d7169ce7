"""Deaths near a checkpoint save in Megatron-LM's own ``pretrain_gpt.py`` (issue 44, item 1).

DP4 under the recovery supervisor, ``--save-interval 3``, ``--ckpt-format torch`` (rank 0
writes, the others wait in the save's barriers). A rank is SIGKILLed at one phase of the save
of iteration 3 (``--mecefo-kill``): as it starts (``save``), in its write (``save-write``), in
its finalize (``save-finalize``: every rank wrote, the tracker file not yet), or once it ended
(``saved``); a second rank dies in the write of the recovered world's save of iteration 6.
Each death must cost one regroup of seconds with that rank lost (no generation without a lost
rank: the survivors left in the save's collectives are released by the abort, not by the
30 s collective timeout), every sample is processed once, and the checkpoint the tracker
names afterwards loads. ``make test`` runs the writer's death in the write; the rest are
``slow``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import List

import pytest
import torch
from mlm_runs import MECEFO, SAMPLES, supervised

ITERS, INTERVAL, GBS = 9, 3, 16


def _records(work: Path) -> List[dict]:
    path = work / "records.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if r.get("type") == "recovery"]


def _check_checkpoint(save: Path) -> int:
    """The tracker names a whole checkpoint of the last iteration, which loads; every
    ``iter_*`` folder it could name holds a loadable model file. Returns its iteration."""
    iteration = int((save / "latest_checkpointed_iteration.txt").read_text().strip())
    files = sorted((save / f"iter_{iteration:07d}").glob("mp_rank_*/model_optim_rng.pt"))
    assert files, sorted(p.name for p in save.iterdir())
    for path in files:
        state = torch.load(path, map_location="cpu", weights_only=False)
        assert state["iteration"] == iteration, (path, state["iteration"])
        params = [v for v in state["model"].values() if isinstance(v, torch.Tensor)]
        assert params and all(torch.isfinite(p).all() for p in params), path
        assert "optimizer" in state and "opt_param_scheduler" in state, sorted(state)
    return iteration


def _check_torch_dist_checkpoint(save: Path) -> int:
    """The tracker names a whole ``torch_dist`` checkpoint: its metadata reads and lists the
    model's tensors. Returns its iteration."""
    from torch.distributed.checkpoint import FileSystemReader

    iteration = int((save / "latest_checkpointed_iteration.txt").read_text().strip())
    meta = FileSystemReader(str(save / f"iter_{iteration:07d}")).read_metadata()
    keys = list(meta.state_dict_metadata)
    assert any(k.startswith("decoder.") for k in keys), keys[:20]
    return iteration


def _run(tree: Path, work: Path, kills: List[str], fmt: List[str] = ()) -> tuple[str, List[dict]]:
    save = work / "ckpt"
    argv = ["--train-iters", str(ITERS), "--save-interval", str(INTERVAL), *MECEFO,
            "--save", str(save), *fmt]  # fmt: skip
    flags = [a for k in kills for a in ("--mecefo-kill", k)]
    rc, log = supervised(tree, [*argv, *flags], work)
    assert rc == 0, log[-6000:]
    return log, _records(work)


def _check(
    log: str, records: List[dict], lost: List[int], work: Path, torch_dist: bool = False
) -> None:
    # Released by the abort, not by the collective timeout; no regroup without a lost rank.
    assert not re.search(r"[Tt]imed out|ranks \[\] lost", log), log[-6000:]
    assert "loading checkpoint" not in log
    gens = re.findall(r"\[coordinator\] generation (\d+) \((\w+)", log)
    assert gens == [(str(g), "death") for g in range(1, len(lost) + 1)], gens
    assert [(r["ranks_lost"], r["iteration"]) for r in records] == [
        ([v], i) for v, i in lost
    ], records
    totals = [r["total_s"] for r in records]
    assert all(t is not None and 0 <= t < 10 for t in totals), records
    processed, skipped = SAMPLES.findall(log)[-1]
    assert (int(processed), int(skipped)) == (GBS * ITERS, 0)
    if torch_dist:
        assert _check_torch_dist_checkpoint(work / "ckpt") == ITERS
    else:
        assert _check_checkpoint(work / "ckpt") == ITERS
    print(f"kill -> redone {totals} s")


def test_writer_killed_in_the_write(megatron_lm: Path, tmp_path: Path) -> None:
    """Rank 0 (the writer) dies as it writes iteration 3; slot 2 dies in the write of the
    recovered world's save of 6 (a waiter: slot 1, world rank 0 there, writes)."""
    log, records = _run(megatron_lm, tmp_path, ["0:3:save-write", "2:6:save-write"])
    _check(log, records, [(0, 4), (2, 7)], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "victim,phase",
    [(1, "save"), (1, "save-write"), (0, "save-finalize"), (1, "save-finalize"), (1, "saved")],
)
def test_death_at_each_phase_of_a_save(
    megatron_lm: Path, tmp_path: Path, victim: int, phase: str
) -> None:
    """``victim`` dies at ``phase`` of the save of iteration 3; slot 2 dies in the finalize
    of the recovered world's save of 6."""
    log, records = _run(megatron_lm, tmp_path, [f"{victim}:3:{phase}", "2:6:save-finalize"])
    _check(log, records, [(victim, 4), (2, 7)], tmp_path)


@pytest.mark.slow
def test_death_in_a_torch_dist_save(megatron_lm: Path, tmp_path: Path) -> None:
    """``--ckpt-format torch_dist`` (Megatron-LM's default): slot 1 dies as the first save
    (iteration 3) starts, slot 2 in the write of the recovered world's save of 6. The
    survivors' first save must not start Megatron-Core's write-results Manager (a spawned
    interpreter, seconds, not abortable) inside the recovery: every rank started it before it
    said ready."""
    log, records = _run(
        megatron_lm, tmp_path, ["1:3:save", "2:6:save-write"], ["--ckpt-format", "torch_dist"]
    )
    _check(log, records, [(1, 4), (2, 7)], tmp_path, torch_dist=True)
    # Rank 0 at start-up and each replacement incarnation say so.
    assert "rank 0: torch_dist checkpoint writer started before ready" in log, log[-4000:]
