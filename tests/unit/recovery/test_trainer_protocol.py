"""The recovery session's trainer interface (``recovery/trainer.py``): both trainers implement
it, and the session reaches into nothing else."""

from __future__ import annotations

import inspect
import re
import sys
import types

from conftest import REPO

from megatron_mecefo.recovery.trainer import OPTIONAL_METHODS, RecoverableTrainer

PROTOCOL_METHODS = sorted(
    name
    for name, value in vars(RecoverableTrainer).items()
    if inspect.isfunction(value) and not name.startswith("_")
)


def test_protocol_names_its_methods() -> None:
    assert PROTOCOL_METHODS == sorted(
        ["train", "rewind_data", "extra_state", "load_extra_state", "hook_phases", "emit",
         "snapshot_state", "recovery_checkpoint", "load_recovery_checkpoint", "release"]
    )  # fmt: skip


def test_megatron_lm_adapter_is_a_recoverable_trainer() -> None:
    from megatron_mecefo.megatron_lm.recovery import MegatronLMTrainer

    session = types.SimpleNamespace(rank=0)
    integration = types.SimpleNamespace(controller=None)
    trainer = MegatronLMTrainer(session, integration, lambda: None, (), {})
    assert isinstance(trainer, RecoverableTrainer)
    assert all(callable(getattr(trainer, name)) for name in OPTIONAL_METHODS)
    assert not trainer.built  # nothing to export before setup_model_and_optimizer ran


def test_example_trainer_has_every_protocol_method(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.syspath_prepend(str(REPO / "examples" / "pretrain_gpt"))
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py"])
    import pretrain_gpt

    for name in PROTOCOL_METHODS + list(OPTIONAL_METHODS):
        assert callable(getattr(pretrain_gpt.Trainer, name)), name


def test_session_uses_only_the_protocol() -> None:
    """No private trainer attribute is read or written by the recovery package."""
    used = set()
    for path in (REPO / "megatron_mecefo" / "recovery").glob("*.py"):
        used |= set(re.findall(r"(?<![.\w`])trainer\.(\w+)", path.read_text()))
    allowed = set(PROTOCOL_METHODS) | set(RecoverableTrainer.__annotations__) | {"saved_layouts"}
    allowed |= set(OPTIONAL_METHODS)
    assert not {u for u in used if u.startswith("_")}, used
    assert used <= allowed, sorted(used - allowed)
