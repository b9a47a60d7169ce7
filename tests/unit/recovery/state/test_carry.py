"""Importing a carried state into a rebuilt model (``recovery/state/carry.load_consuming``):
equal to ``load_state_dict``, with no second copy of the weights left behind."""

from __future__ import annotations

import pytest
import torch

from megatron_mecefo.recovery.state.carry import load_consuming


def _carry(module: torch.nn.Module) -> dict:
    return {k: v.clone() for k, v in module.state_dict().items()}


def test_a_sole_parameter_takes_the_carried_storage_without_a_copy() -> None:
    torch.manual_seed(0)
    carried = _carry(torch.nn.Linear(100, 50))
    expected = {k: v.clone() for k, v in carried.items()}
    storage = carried["weight"].data_ptr()
    new = torch.nn.Linear(100, 50)
    assert load_consuming(new, carried) == 0
    assert carried == {}  # consumed
    assert new.weight.data_ptr() == storage  # adopted, not copied
    assert torch.equal(new.weight, expected["weight"]) and torch.equal(new.bias, expected["bias"])


def test_a_parameter_seen_through_a_view_is_copied_into_and_the_carry_freed() -> None:
    carried = _carry(torch.nn.Linear(100, 50))
    expected = carried["weight"].clone()
    old = carried["weight"]
    new = torch.nn.Linear(100, 50)
    view = new.weight.view(-1)  # e.g. a bucket's view: it must keep seeing the parameter
    load_consuming(new, carried)
    assert torch.equal(view.view(50, 100), expected)
    assert old.untyped_storage().nbytes() == 0  # the carried copy's memory is freed


def test_a_carry_that_does_not_fit_the_model_is_refused() -> None:
    carried = _carry(torch.nn.Linear(100, 50))
    carried.pop("bias")
    with pytest.raises(RuntimeError, match="missing \\['bias'\\]"):
        load_consuming(torch.nn.Linear(100, 50), carried)
    carried = _carry(torch.nn.Linear(100, 50))
    carried["weight"] = torch.zeros(50, 99)
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_consuming(torch.nn.Linear(100, 50), carried)
