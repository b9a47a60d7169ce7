"""The CPU runtime in one process: it undoes itself, unknown layers are refused, and the docs'
table lists exactly the patched call sites. The runs are
``tests/integration/runtime/test_cpu_runtime_runs.py``."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import REPO

from megatron_mecefo.runtime import PATCHED_CALL_SITES, CpuRuntime, enable_cpu_runtime


def test_enable_disable_restores_every_patched_function() -> None:
    originals = {
        "zeros": torch.zeros, "to": torch.Tensor.to, "type": torch.Tensor.type,
        "current_device": torch.cuda.current_device, "get_rng_state": torch.cuda.get_rng_state,
    }  # fmt: skip
    runtime = CpuRuntime(record=True).enable()
    try:
        assert torch.zeros(2, device="cuda").device.type == "cpu"
        assert torch.ones(1).to("cuda").device.type == "cpu"
        assert torch.cuda.current_device() == torch.device("cpu")
        assert torch.zeros(1).type() == "torch.FloatTensor"  # only optimizer callers are lied to
        with pytest.raises(RuntimeError, match="already enabled"):
            CpuRuntime().enable()
        assert enable_cpu_runtime() is runtime  # idempotent: the active one is returned
    finally:
        runtime.disable()
    assert not runtime.enabled
    current = {
        "zeros": torch.zeros, "to": torch.Tensor.to, "type": torch.Tensor.type,
        "current_device": torch.cuda.current_device, "get_rng_state": torch.cuda.get_rng_state,
    }  # fmt: skip
    assert current == originals
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):  # the real one is back
        torch.zeros(1, device="cuda")


def test_unknown_layer_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown CPU runtime layer"):
        CpuRuntime(skip_layers=["cuda_streamz"])


def test_readme_table_lists_exactly_the_patched_call_sites() -> None:
    readme = (REPO / "docs" / "cpu-runtime.md").read_text()
    listed = set(re.findall(r"^\| (\w+) \| `([^`]+)::(\w+)` \|", readme, flags=re.M))
    assert listed == {(s.layer, s.path, s.function) for s in PATCHED_CALL_SITES}
