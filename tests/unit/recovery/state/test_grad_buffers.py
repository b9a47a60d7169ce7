"""A survivor's gradient buffers reused by its rebuilt model (``recovery/state/grad_buffers``):
the same memory, zeroed, for a ``torch.zeros`` of the same size; never two buffers' worth at
once; and a real megatron-core DDP rebuilt on them trains exactly as a fresh one."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from conftest import REPO, child_env, free_port

from megatron_mecefo.recovery.state.grad_buffers import GradBufferReuse


def test_a_zeros_of_a_kept_buffers_size_gets_that_buffer_zeroed() -> None:
    old = torch.full((1000,), 3.0)
    ptr = old.data_ptr()
    with GradBufferReuse([old]) as reuse:
        small = torch.zeros(10)  # another size: allocated as usual
        new = torch.zeros(1000, dtype=torch.float32, device="cpu", requires_grad=False)
    assert new.data_ptr() == ptr and reuse.reused == 1
    assert torch.count_nonzero(new) == 0 and small.data_ptr() != ptr


def test_a_request_no_kept_buffer_fits_frees_them_before_it_allocates() -> None:
    old = torch.ones(1000)
    with GradBufferReuse([old]) as reuse:
        other = torch.zeros(1200)  # another layout (e.g. padded buckets)
        assert old.untyped_storage().nbytes() == 0  # freed before the new allocation
    assert reuse.reused == 0 and other.numel() == 1200 and torch.count_nonzero(other) == 0


def test_other_dtypes_are_not_served_and_unused_buffers_are_freed_on_exit() -> None:
    old = torch.ones(1000)
    with GradBufferReuse([old]) as reuse:
        half = torch.zeros(1000, dtype=torch.bfloat16)  # a size match of another dtype: freed
        assert half.dtype == torch.bfloat16 and half.data_ptr() != old.data_ptr()
    assert reuse.reused == 0 and old.untyped_storage().nbytes() == 0
    kept = torch.ones(1000)
    with GradBufferReuse([kept]):
        torch.zeros(5)
    assert kept.untyped_storage().nbytes() == 0  # not handed out: given back on exit


def test_a_rebuilt_megatron_ddp_on_the_old_buffer_trains_as_a_fresh_one() -> None:
    env = child_env(MASTER_PORT=str(free_port()))
    out = subprocess.run(
        [sys.executable, str(REPO / "tests" / "workers" / "grad_buffer_worker.py")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, out.stdout[-2000:] + out.stderr[-4000:]
    r = json.loads(lines[-1][len("RESULT ") :])
    assert r["reused"] == 1 and r["same_memory"], r
    assert r["zeroed"] and r["main_grads_inside"], r
    assert r["grads_equal"] and r["params_equal"], r
