"""A joiner's warm heap (``recovery/state/warm_heap.py``): the state size it publishes counts
a real megatron-core model's weights, gradient buffer and Adam moments once each; memory
allocated after the block is freed takes no page faults; closed, the allocator maps large
tensors again and the memory goes back; the size comes from the slot's store key, capped by
the machine. Run in a child process: the allocator's settings are per process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, child_env, free_port

from megatron_mecefo.recovery.state.memory import PAGE_BYTES, Prefaulter

MiB = 1 << 20
FILL_PAGES = 128 * MiB // PAGE_BYTES


@pytest.fixture(scope="module")
def result() -> dict:
    out = subprocess.run(
        [sys.executable, str(REPO / "tests" / "workers" / "warm_heap_worker.py")],
        env=child_env(MASTER_PORT=str(free_port())), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


def test_the_published_size_counts_weights_gradients_and_both_moments_once(result: dict) -> None:
    # fp32 weights, their gradient buffer (every main_grad a view of one storage) and Adam's
    # two moments: four times the weights; padding and Adam's step counters add a little.
    p = result["param_bytes"]
    assert 4 * p <= result["counted"] <= 4.05 * p, result


def _populate_supported() -> bool:
    import torch

    probe = torch.empty(64 * MiB, dtype=torch.uint8)  # above any mmap threshold: fresh
    with Prefaulter([(probe.data_ptr(), probe.numel())]) as p:
        p._thread.join()
    return p.populated > 0


def test_allocations_after_the_block_take_no_page_faults(result: dict) -> None:
    assert result["started"], result
    assert result["faults_cold"] >= 0.9 * FILL_PAGES, result  # fresh pages: one fault each
    if not _populate_supported():  # a kernel before 5.14: the block is not faulted in
        return
    assert result["populated"] >= 128 * MiB, result
    assert result["faults_warm"] <= 0.05 * FILL_PAGES, result
    # The tensors took the block's pages: no new memory beyond it.
    assert result["rss_grown_by_fill"] <= 16 * MiB, result


def test_closed_the_allocator_maps_again_and_the_memory_goes_back(result: dict) -> None:
    assert result["faults_after_close"] >= 0.9 * 64 * MiB // PAGE_BYTES, result
    assert result["rss_back"] <= 16 * MiB, result


def test_the_size_is_the_slots_and_never_over_half_the_free_memory(result: dict) -> None:
    assert result["no_size"], result  # no key: no block
    assert result["slot_bytes"] == 8 * MiB, result
    assert result["capped_bytes"] is not None, result
    assert result["capped_bytes"] <= 0.5 * result["mem_available"] * 1.1, result
