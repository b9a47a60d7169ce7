"""Issue 45, item 7: four mistakes on Megatron-LM's path that used to end badly are said at
start-up in one line (the example trainer's checks, on Megatron-LM's flags): ``--mecefo`` on
a script without the patch, an ABFT injection aimed at a layer (rank, iteration, micro-batch)
that does not exist, ``--iterations-to-skip`` under ``--mecefo``, and token ids beyond the
tokenizer's vocabulary. Megatron-LM itself runs these in ``tests/helpers/user_error_rows.py``
(the ``mlm-*`` rows)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, List

import numpy as np
import pytest
import torch
from conftest import REPO
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from megatron_mecefo.megatron_lm import flags, patch_check
from megatron_mecefo.megatron_lm.flags import check_token_ids, extra_args_provider
from megatron_mecefo.takeover.config import MecefoConfigError


def _megatron_args(argv: List[str], **megatron: Any) -> argparse.Namespace:
    """Megatron-LM's parsed flags as far as the checks read them (a 2-layer model, 2 ranks)."""
    parser = extra_args_provider()(argparse.ArgumentParser())
    args = parser.parse_args(argv)
    defaults = dict(
        num_layers=2, hidden_size=64, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, context_parallel_size=1, micro_batch_size=2,
        global_batch_size=8, train_iters=10, train_samples=None, seed=1234,
        calculate_per_token_loss=False, transformer_impl="local", iterations_to_skip=[],
    )  # fmt: skip
    defaults.update(megatron)
    for key, value in defaults.items():
        setattr(args, key, value)
    return args


@pytest.fixture
def two_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MECEFO_RECOVERY", raising=False)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"])


def _error_line(capsys: pytest.CaptureFixture, code: int, call: Any) -> str:
    with pytest.raises(SystemExit) as stop:
        call()
    assert stop.value.code == code
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: "), lines
    return lines[0]


# ---------------------------------------------------------------- --mecefo-abft-inject targets
@pytest.mark.parametrize(
    "rule,words",
    [
        ("kind=inf,op=scores,layer=9,iter=2", ["layer 9 does not exist", "--num-layers=2",
                                               "never fire"]),
        ("kind=inf,op=scores,layer=0,iter=2", ["layer=0 must be >= 1"]),  # the parser's
        ("kind=inf,op=scores,layer=1,iter=2,rank=2", ["rank 2 does not exist",
                                                      "world size 2"]),
        ("kind=inf,op=scores,layer=1,iter=11", ["iteration 11 is after the last one (10)"]),
        ("kind=inf,op=scores,layer=1,iter=2,mb=2", ["micro-batch 2 does not exist",
                                                    "2 per replica"]),
    ],
)  # fmt: skip
def test_abft_injection_that_never_fires_is_refused(
    two_ranks: None, capsys: pytest.CaptureFixture, rule: str, words: List[str]
) -> None:
    """With or without --mecefo; before it, a 2-layer model ran to the end "0 injected"."""
    args = _megatron_args(["--mecefo-abft-inject", rule])
    line = _error_line(capsys, 2, lambda: flags.check_parsed_args(args))
    assert f"--mecefo-abft-inject {rule!r}" in line
    for word in words:
        assert word in line, line


def test_abft_injection_inside_the_model_passes(two_ranks: None) -> None:
    rule = "kind=inf,op=scores,layer=2,iter=10,mb=1,rank=1"
    args = _megatron_args(["--mecefo-abft-inject", rule])
    flags.check_parsed_args(args)  # no exit


# ---------------------------------------------------------------- --iterations-to-skip
def test_iterations_to_skip_is_refused_under_mecefo(two_ranks: None) -> None:
    args = _megatron_args(
        ["--mecefo", "--mecefo-policy", "drop", "--mecefo-rank", "16"], iterations_to_skip=[3, 5]
    )
    args.data_parallel_size = 2
    with pytest.raises(MecefoConfigError, match="--iterations-to-skip 3 5: Megatron-LM skips"):
        flags.validated_config(args)
    args.iterations_to_skip = []
    assert flags.validated_config(args).enabled
    # Without --mecefo it is Megatron-LM's business.
    plain = _megatron_args([], iterations_to_skip=[3])
    plain.data_parallel_size = 2
    assert not flags.validated_config(plain).enabled


def test_iterations_to_skip_stops_the_parse(two_ranks: None, capsys: pytest.CaptureFixture):
    args = _megatron_args(["--mecefo", "--mecefo-policy", "drop"], iterations_to_skip=[4])
    line = _error_line(capsys, 2, lambda: flags.check_parsed_args(args))
    assert "--mecefo with --iterations-to-skip 4" in line and "drop --iterations-to-skip" in line


# ---------------------------------------------------------------- token ids beyond the vocabulary
def _dataset(prefix: Path, documents: List[List[int]]) -> str:
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for doc in documents:
        builder.add_document(torch.tensor(np.array(doc, dtype=np.uint16)), [len(doc)])
    builder.finalize(f"{prefix}.idx")
    return str(prefix)


def test_token_ids_beyond_the_vocabulary_are_refused(
    tmp_path: Path, two_ranks: None, capsys: pytest.CaptureFixture
) -> None:
    good = _dataset(tmp_path / "good", [[1, 2, 128], [5, 6]])
    foreign = _dataset(tmp_path / "foreign", [[1, 2, 3], [50000, 4]])
    args = argparse.Namespace(
        data_path=["0.5", good, "0.5", foreign], tokenizer_type="NullTokenizer", mock_data=False
    )
    line = _error_line(capsys, 1, lambda: check_token_ids(args, 129))
    assert f"--data-path {foreign}: token id 50000 (read all of 5 tokens)" in line
    assert "NullTokenizer vocabulary (129 ids)" in line and "another tokenizer" in line
    # The good one alone passes, and rank 0 says what it read.
    check_token_ids(argparse.Namespace(data_path=[good], tokenizer_type="NullTokenizer"), 129)
    assert "token ids <= 128 < vocabulary 129, read all of 5 tokens" in capsys.readouterr().out
    # --train-data-path and a --data-args-path file are read too.
    listing = tmp_path / "data_args.txt"
    listing.write_text(f"1.0 {foreign}\n")
    for extra in ({"train_data_path": [foreign]}, {"data_args_path": str(listing)}):
        with pytest.raises(SystemExit):
            check_token_ids(argparse.Namespace(tokenizer_type="GPT2BPETokenizer", **extra), 129)
    assert flags.data_prefixes(argparse.Namespace(mock_data=True, data_path=[foreign])) == []


# ---------------------------------------------------------------- --mecefo without the patch
def test_unpatched_script_is_named_with_the_fix(tmp_path: Path, capsys: Any) -> None:
    stock = tmp_path / "pretrain_gpt.py"
    stock.write_text("from megatron.training import pretrain\n")
    message = patch_check.missing_patch_message(str(stock), "--mecefo")
    assert message is not None and f"{stock} does not have the MeCeFO patch" in message
    assert f"cd {tmp_path} && git apply {REPO / 'patches'}/megatron-lm-<tag>.patch" in message
    assert "core_v0.16.1 or core_v0.19.0" in message
    assert patch_check.main([str(tmp_path)]) == 2
    assert "patch_check: error: --mecefo:" in capsys.readouterr().err
    # With megatron/core/package_info.py the patch of the checkout's tag is named.
    info = tmp_path / "megatron" / "core" / "package_info.py"
    info.parent.mkdir(parents=True)
    info.write_text("MAJOR = 0\nMINOR = 16\nPATCH = 1\n")
    assert patch_check.patch_for(str(tmp_path)) == str(
        REPO / "patches" / "megatron-lm-core_v0.16.1.patch"
    )
    patched = tmp_path / "patched.py"
    patched.write_text("    import megatron_mecefo.megatron_lm as mecefo\n")
    assert patch_check.missing_patch_message(str(patched)) is None
    assert patch_check.main([str(patched)]) == 0
    assert patch_check.mecefo_flag(["--lr", "1", "--mecefo-rank=4"]) == "--mecefo-rank"
    assert patch_check.mecefo_flag(["--lr", "1"]) is None
