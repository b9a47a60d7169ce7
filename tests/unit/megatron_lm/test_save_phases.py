"""The kill phases inside a save (``save-write``, ``save-finalize``): where they fire, once
each, and that ``torch.save`` and ``torch.distributed.barrier`` are put back afterwards."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import List

import pytest
import torch
import torch.distributed as dist
from conftest import free_port

from megatron_mecefo.megatron_lm.training_hooks import save_phases
from megatron_mecefo.recovery.fault_injection import PHASES, RANDOM_PHASES, parse_kills


@pytest.fixture()
def world() -> None:
    """A one-rank gloo world (the save's barriers are real collectives)."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_writer_fires_write_at_its_first_file_and_finalize_after_the_first_barrier(
    world: None, tmp_path: Path
) -> None:
    seen: List[str] = []
    save, barrier = torch.save, dist.barrier
    with save_phases(seen.append):
        torch.save({"a": 1}, tmp_path / "a.pt")
        assert seen == ["save-write"]
        torch.save({"b": 2}, tmp_path / "b.pt")
        dist.barrier()
        assert seen == ["save-write", "save-finalize"]
        dist.barrier()
    assert seen == ["save-write", "save-finalize"]  # once each per save
    assert torch.save is save and dist.barrier is barrier
    assert torch.load(tmp_path / "b.pt") == {"b": 2}


def test_a_rank_that_writes_nothing_fires_write_at_its_barrier(world: None) -> None:
    seen: List[str] = []
    with save_phases(seen.append):
        dist.barrier()
    assert seen == ["save-write", "save-finalize"]


def test_other_threads_and_errors(world: None, tmp_path: Path) -> None:
    """Another thread's ``torch.save`` fires nothing; an error in the save restores both."""
    seen: List[str] = []
    save = torch.save
    with pytest.raises(RuntimeError, match="disk full"):
        with save_phases(seen.append):
            t = threading.Thread(target=torch.save, args=({"x": 0}, tmp_path / "x.pt"))
            t.start()
            t.join()
            assert seen == []
            raise RuntimeError("disk full")
    assert torch.save is save


def test_the_new_phases_parse_and_random_draws_are_unchanged() -> None:
    kills = parse_kills(["1:3:save-write", "0:6:save-finalize"], 4, 9, seed=1)
    assert [k.phase for k in kills] == ["save-write", "save-finalize"]
    # A seeded "?" draws from the first seven phases, as before these were added.
    assert RANDOM_PHASES == PHASES[:7] and "save-write" not in RANDOM_PHASES


def test_a_forked_writer_fires_nothing(tmp_path: Path) -> None:
    """A torch_dist save forks writer processes that call ``torch.save`` on their main
    thread: the phase must not fire there (a kill would end the writer, and the rank would
    wait for it forever), only in the rank's own process."""
    import multiprocessing as mp
    import os

    fired = tmp_path / "fired.txt"

    def phase(name: str) -> None:  # visible across processes: a line per firing, with its pid
        with open(fired, "a") as f:
            f.write(f"{os.getpid()} {name}\n")

    with save_phases(phase):
        child = mp.get_context("fork").Process(
            target=torch.save, args=({"w": 1}, tmp_path / "w.pt")
        )
        child.start()
        child.join(60)
        assert child.exitcode == 0
        assert not fired.exists(), fired.read_text()
        torch.save({"r": 2}, tmp_path / "r.pt")  # the rank's own write still fires
    assert fired.read_text() == f"{os.getpid()} save-write\n"
    assert torch.load(tmp_path / "w.pt") == {"w": 1}
