"""What the recovery session needs of a trainer: the :class:`RecoverableTrainer` protocol.

The session (:mod:`.session`) runs a trainer through membership generations. It never reaches
into a trainer's internals: it reads and writes the state below, calls the methods below, and
nothing else. Two trainers implement it: the example trainer
(``examples/pretrain_gpt/pretrain_gpt.py``) and the Megatron-LM adapter
(:class:`megatron_mecefo.megatron_lm.recovery.MegatronLMTrainer`), which re-enters Megatron-LM's
own ``pretrain()`` in every generation.

As in torchft's ``Manager(state_dict=..., load_state_dict=...)``, the state is what a trainer
hands over; unlike it, the session also drives the data position (a redone iteration reads the
same samples) and the hook points (kill injection, the commit vote).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple, runtime_checkable

OPTIONAL_METHODS = ("apply_prepared_step",)
"""Methods a trainer may have, outside :class:`RecoverableTrainer`; the session checks for them.

``apply_prepared_step(step)``: finish the iteration whose commit vote ended in doubt and was
resolved committed (:mod:`.prepared`): ``step.apply(main params, optimizer's
step_with_ready_grads)``, then what the trainer advances after an update (the iteration, the
data position, the LR schedule, ``step.extra["boundary"]``'s RNG states). A trainer without it
drops a step in doubt (its stage is then healed from a peer, if one holds the iteration).
``step.extra["record"]`` is a copy of the trainer's ``pending_record`` attribute (a dict, if it
has one) when the step was kept: what the trainer measured of the iteration before its update
(its loss, the samples it read), for the iteration's record."""

PhaseHook = Callable[[str, int], None]
"""``phase(name, iteration)``: called at ``forward``, ``backward`` and ``grad-sync``."""


@runtime_checkable
class RecoverableTrainer(Protocol):
    """A trainer the recovery session can carry across worlds, heal and hook.

    State (read at export, written at import; see :mod:`.state.carry`):
        built: Whether the model and optimizer exist in this world (a generation can fail
            before they do; then the carried state is kept as it was).
        iteration: The last committed iteration.
        consumed_samples: Samples of the training set consumed up to ``iteration``.
        model: The DDP-wrapped model chunks (their buckets carry the 1/n scale).
        model_chunks: The unwrapped model chunks (their state dicts).
        optimizer: Megatron-Core's optimizer (its ``step`` is wrapped by the commit vote).
        scheduler: Megatron-Core's ``OptimizerParamScheduler``.
        config: The model's ``TransformerConfig``.
        controller: The MeCeFO controller, or None (its counters are part of the state).
        history: Per-iteration records kept by the trainer (may stay empty).
        evals: Evaluation records (may stay empty).
        saved: Iterations saved to disk (may stay empty).
        snapshots: The in-memory ``SnapshotManager``, or None.
    """

    built: bool
    iteration: int
    consumed_samples: int
    model: List[Any]
    model_chunks: List[Any]
    optimizer: Any
    scheduler: Any
    config: Any
    controller: Any
    history: List[Dict[str, Any]]
    evals: List[Dict[str, Any]]
    saved: List[int]
    snapshots: Any

    def train(self) -> None:
        """Train in this world until the run's last iteration (raises on a failure)."""

    def rewind_data(self, consumed_samples: int) -> None:
        """Read the training data from ``consumed_samples`` on (a redo reads the same
        samples)."""

    def extra_state(self) -> Dict[str, Any]:
        """Trainer-specific state carried across worlds (e.g. Megatron-LM's FLOP count)."""

    def load_extra_state(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`extra_state`."""

    def hook_phases(self, phase: PhaseHook) -> None:
        """Call ``phase(name, iteration)`` at forward, backward and grad-sync (kill
        injection)."""

    def emit(self, record: Dict[str, Any]) -> None:
        """Write a recovery record to the trainer's metrics (may do nothing)."""

    def snapshot_state(self) -> Any:
        """The state an in-memory snapshot holds (``SnapshotState``), for the snapshot path."""

    def recovery_checkpoint(self, before: int) -> Optional[Tuple[str, int]]:
        """(directory, iteration) of the newest disk checkpoint at or before ``before``."""

    def load_recovery_checkpoint(self, directory: str, basis_layout: Optional[str]) -> float:
        """Load that checkpoint into this world; returns seconds spent."""

    def release(self) -> None:
        """Drop every reference to the model, the optimizer and the world's groups."""
