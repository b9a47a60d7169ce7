"""``AbftState``: the per-process ABFT state the checked modules read.

One object per process, bound to the model by :func:`~megatron_mecefo.abft.apply.apply_abft`.
The trainer calls ``start_step(iteration)`` before a step's forward-backward,
``begin_microbatch(chunk)`` at each forward step (or wraps its ``forward_step_func`` with
``wrap_forward_step``), and ``end_step()`` before the optimizer step; ``end_step`` all-reduces
the step's detections and the poisoned mark, so every rank agrees on skipping the update and
on the policy's next decision. ``reset()`` forgets everything.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional

import torch

from megatron_mecefo.abft.config import AbftConfig
from megatron_mecefo.abft.inject import build_injector
from megatron_mecefo.abft.metrics import AbftCounters
from megatron_mecefo.abft.policy import build_policy


class AbftUncorrectableError(RuntimeError):
    """A GEMM output stayed bad after correction and recompute (``on_uncorrectable=raise``)."""


class AbftState:
    """Config, policy, injector and counters of one process; see the module docstring."""

    def __init__(
        self, config: Optional[AbftConfig] = None, rank: int = 0, num_layers: int = 0
    ) -> None:
        self.config = (config if config is not None else AbftConfig()).validate()
        self.rank = rank
        self.num_layers = num_layers
        """Layers of the whole model (all pipeline stages); ``apply_abft`` fills it in."""
        self.policy = build_policy(self.config.policy)
        self.injector = build_injector(
            self.config.inject, self.config.seed, rank, self.config.near_inf_threshold
        )
        self.counters = AbftCounters(self.config.max_events)
        self.reset()

    def reset(self) -> None:
        """Forget the step, the counters, the injector's memory and any hand-off."""
        self.iteration = 0
        self.protecting = True
        self.poisoned = False
        self.current_microbatch = 0
        self._next_index: Dict[int, int] = {}
        self.handoff: Dict[int, Any] = {}
        self.counters.reset()
        if self.injector is not None:
            self.injector.reset()
        self.policy = build_policy(self.config.policy)

    # ------------------------------------------------------------------ per step
    def start_step(self, iteration: int) -> None:
        """Begin optimizer step ``iteration`` (1-based, as logged)."""
        self.iteration = int(iteration)
        self.protecting = self.policy.protect(self.iteration)
        self.poisoned = False
        self._next_index = {}
        self.current_microbatch = 0
        self.handoff.clear()
        self.counters.start_step()

    def begin_microbatch(self, chunk: Any = None) -> int:
        """Advance ``chunk``'s micro-batch counter (one per model chunk, as in 1F1B)."""
        key = id(chunk)
        index = self._next_index.get(key, 0)
        self._next_index[key] = index + 1
        self.current_microbatch = index
        return index

    def wrap_forward_step(self, forward_step_func: Callable) -> Callable:
        """Wrap a Megatron ``forward_step_func(data_iterator, model)`` to count micro-batches."""

        @functools.wraps(forward_step_func)
        def forward_step(data_iterator: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
            self.begin_microbatch(model)
            return forward_step_func(data_iterator, model, *args, **kwargs)

        return forward_step

    def end_step(self, group: Any = None) -> Dict[str, Any]:
        """Close the step: sum the counts over ``group`` (default: all ranks), agree on
        skipping, and update the policy.

        Returns the step record of all ranks (see ``AbftCounters.step_record``) plus
        ``protected`` and ``skip`` (some rank's GEMM stayed bad: skip the optimizer update
        on every rank). It is a collective when torch.distributed is initialised: call it on
        every rank.
        """
        dense = torch.tensor(
            self.counters.dense(max(self.num_layers, 1)) + [float(self.poisoned)],
            dtype=torch.float64,
        )
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(dense, group=group)
        values = dense.tolist()
        poisoned = values.pop()
        self.counters.close_step(values)
        record = self.counters.step_record()
        detections = record["corrected"] + record["recomputed"] + record["uncorrectable"]
        self.policy.observe(self.iteration, self.protecting, detections)
        record.update(protected=self.protecting, skip=poisoned > 0)
        return record

    # ------------------------------------------------------------------ for the modules
    def checks(self, op: str) -> bool:
        """Whether GEMM ``op`` is checked in the current step."""
        return self.config.check and self.protecting and op in self.config.ops

    def escalate(self, layer: int, op: str, message: str) -> None:
        """A GEMM output stayed bad after the recompute: skip the step, or raise."""
        self.poisoned = True
        if self.config.on_uncorrectable == "skip":
            return
        text = (
            f"ABFT: layer {layer} {op} output still bad after correction and recompute "
            f"(iteration {self.iteration}, micro-batch {self.current_microbatch}): {message}"
        )
        from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

        machine = get_rerun_state_machine()
        if machine.get_mode() == RerunMode.DISABLED or getattr(machine, "state", None) is None:
            raise AbftUncorrectableError(text)
        try:
            machine.validate_result(
                result=torch.tensor(float("nan")),
                rejection_func=lambda _: True,
                message=text,
                fatal=True,
            )
        except AssertionError:  # not inside Megatron's train_step: nothing to rerun
            raise AbftUncorrectableError(text) from None
