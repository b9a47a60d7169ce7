"""The ``torch_dist`` write-results Manager is started before a process is ready (issue 44)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from megatron.core.dist_checkpointing.strategies import filesystem_async

from megatron_mecefo.megatron_lm.checkpoint_writer import start_checkpoint_writer


@pytest.fixture()
def no_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron-Core's cached Manager queue unset for the test (and put back after it)."""
    monkeypatch.setattr(filesystem_async, "_results_queue", None)


@pytest.mark.parametrize(
    "args",
    [
        SimpleNamespace(save=None, ckpt_format="torch_dist"),
        SimpleNamespace(save="/ckpt", ckpt_format="torch"),
    ],
)
def test_nothing_started_without_a_torch_dist_save(args: SimpleNamespace, no_writer: None) -> None:
    assert start_checkpoint_writer(args) is False
    assert filesystem_async._results_queue is None


def test_started_once_and_reused_by_the_first_save(no_writer: None) -> None:
    args = SimpleNamespace(save="/ckpt", ckpt_format="torch_dist")
    assert start_checkpoint_writer(args) is True
    queue = filesystem_async._results_queue
    assert queue is not None
    queue.put("probe")  # the Manager process answers
    assert queue.get(timeout=30) == "probe"
    # What a save calls gets the same queue: no second Manager in the save.
    assert filesystem_async._get_write_results_queue() is queue
