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


def test_a_carried_tensor_the_old_parameter_still_refers_to_is_taken_without_a_copy() -> None:
    # After a failure the old world's parameters often outlive the world (an interrupted
    # step's autograd graph): the carry, their state_dict(), is then not alone on its storage.
    torch.manual_seed(0)
    old = torch.nn.Linear(100, 50)
    carried = old.state_dict()  # shares storage with old.weight, as export_state's does
    expected = {k: v.clone() for k, v in carried.items()}
    storage = carried["weight"].data_ptr()
    new = torch.nn.Linear(100, 50)
    assert load_consuming(new, carried) == 0
    assert new.weight.data_ptr() == storage  # adopted: no second copy of the weights
    assert torch.equal(new.weight, expected["weight"]) and torch.equal(new.bias, expected["bias"])


def test_a_storage_tied_in_the_carry_is_adopted_once_and_copied_for_the_other_tensor() -> None:
    shared = torch.randn(50, 100)
    carried = {"a.weight": shared, "b.weight": shared}  # tied in the carry
    new = torch.nn.ModuleDict({"a": torch.nn.Linear(100, 50, bias=False),
                               "b": torch.nn.Linear(100, 50, bias=False)})  # fmt: skip
    expected = shared.clone()
    load_consuming(new, carried)
    a, b = new["a"].weight, new["b"].weight
    assert a.data_ptr() != b.data_ptr()  # not aliased: the new model does not tie them
    assert torch.equal(a, expected) and torch.equal(b, expected)
    assert shared.untyped_storage().nbytes() > 0  # the adopted storage is not freed
