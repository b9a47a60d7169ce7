"""The per-rank distributed-optimizer files of ``examples/pretrain_gpt/checkpointing.py`` read
back under the snapshot's tensor names (what the disk fallback re-shards), and
``restore_optimizer`` puts them into a fresh optimizer."""

from __future__ import annotations

import sys
from typing import Any

import torch
from conftest import REPO

sys.path.insert(0, str(REPO / "examples" / "pretrain_gpt"))

from checkpointing import _payload_tensors  # noqa: E402

from megatron_mecefo.snapshot.contents import (
    TrainingState,
    collect,
    restore_optimizer,
)  # noqa: E402


class _Part:
    """The shape ``contents`` expects of a (Megatron) optimizer: ``.optimizer`` is the inner."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.optimizer = inner


def _trained() -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 3))
    groups = [  # two groups, the second listing parameters out of module order
        {"params": [model[1].bias, model[0].weight], "weight_decay": 0.1},
        {"params": [model[0].bias, model[1].weight], "weight_decay": 0.0},
    ]
    adam = torch.optim.Adam(groups, lr=1e-2)
    for _ in range(2):
        model(torch.randn(5, 8)).square().sum().backward()
        adam.step()
    return model, adam


def test_per_rank_payload_names_match_the_snapshot() -> None:
    model, adam = _trained()
    payload = {
        "state": [adam.state_dict()],
        "main_params": [[p.detach().clone() for g in adam.param_groups for p in g["params"]]],
    }
    named = _payload_tensors(payload)
    live, _ = collect(TrainingState([model], _Part(adam)))
    expected = {n: t for n, t in live.items() if n.startswith("optim")}
    assert sorted(named) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(named[name], tensor), name
    # Into a fresh optimizer over a fresh model of the same shapes: state and main params equal.
    fresh_model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 3))
    fresh = torch.optim.Adam(
        [
            {"params": [fresh_model[1].bias, fresh_model[0].weight]},
            {"params": [fresh_model[0].bias, fresh_model[1].weight]},
        ]
    )
    restore_optimizer(_Part(fresh), named)
    again, _ = collect(TrainingState([fresh_model], _Part(fresh)))
    for name, tensor in expected.items():
        assert torch.equal(again[name], tensor), name
