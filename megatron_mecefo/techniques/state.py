"""Per-process MeCeFO state: the mode (exact or takeover) of each micro-batch of the step."""

from __future__ import annotations

import enum
import functools
import zlib
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from megatron_mecefo.techniques.config import MecefoConfig

if TYPE_CHECKING:
    import torch


class MicrobatchMode(str, enum.Enum):
    """How one micro-batch runs on this replica."""

    EXACT = "exact"
    """Stock Megatron-Core forward and backward."""

    TAKEOVER = "takeover"
    """MeCeFO's cheap path, with the techniques that ``MecefoConfig`` switches on."""


ModeLike = Union[MicrobatchMode, str]


class MecefoState:
    """What the MeCeFO modules of this process read: the config and the step's plan.

    One object per process, bound to the model by ``apply_mecefo``. Every rank of a TP/CP
    group must be given the same plan (the same ``start_step`` arguments), because a takeover
    micro-batch runs different collectives than an exact one; ``check_group_consistent``
    verifies that. Before the first ``start_step`` and after ``reset`` every micro-batch is
    exact.
    """

    def __init__(self, config: Optional[MecefoConfig] = None) -> None:
        self.config = config if config is not None else MecefoConfig()
        self.reset()

    def reset(self) -> None:
        """Forget the plan, the micro-batch counters and the basis-refresh log."""
        self.step: int = -1
        self.modes: Tuple[MicrobatchMode, ...] = ()
        self._next_index: Dict[int, int] = {}
        self.current_mode: MicrobatchMode = MicrobatchMode.EXACT
        self.current_index: int = -1
        self.basis_refreshes: List[Tuple[int, str]] = []
        """(step, weight name) of every V refresh in this process, in order."""

    def start_step(self, step: int, modes: Sequence[ModeLike]) -> None:
        """Set the plan of optimizer step ``step``: one mode per micro-batch, in order.

        Args:
            step: Optimizer-step index (the iteration number); V refreshes count these.
            modes: ``MicrobatchMode`` (or its string value) for each micro-batch this replica
                runs in this step; every model chunk sees them in this order.
        """
        if step < self.step:
            raise ValueError(f"start_step({step}) after step {self.step}: steps must not go back")
        self.step = int(step)
        self.modes = tuple(MicrobatchMode(m) for m in modes)
        self._next_index = {}
        self.current_mode = MicrobatchMode.EXACT
        self.current_index = -1

    def begin_microbatch(self, chunk: Any = None) -> MicrobatchMode:
        """Advance ``chunk``'s micro-batch counter and make its mode current.

        Pipeline schedules run each model chunk's micro-batches in order, so one counter per
        chunk maps every forward to its micro-batch.
        """
        key = id(chunk)
        index = self._next_index.get(key, 0)
        if index >= len(self.modes):
            raise RuntimeError(
                f"micro-batch {index} of step {self.step} has no mode: the plan given to "
                f"MecefoState.start_step has {len(self.modes)} micro-batches; pass one mode "
                "per micro-batch the schedule runs"
            )
        self._next_index[key] = index + 1
        self.current_index = index
        self.current_mode = self.modes[index]
        return self.current_mode

    def wrap_forward_step(self, forward_step_func: Callable) -> Callable:
        """Wrap a Megatron ``forward_step_func(data_iterator, model)`` to set each mode."""

        @functools.wraps(forward_step_func)
        def forward_step(data_iterator: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
            self.begin_microbatch(model)
            return forward_step_func(data_iterator, model, *args, **kwargs)

        return forward_step

    @property
    def num_takeover(self) -> int:
        """Number of takeover micro-batches in the current step."""
        return sum(m is MicrobatchMode.TAKEOVER for m in self.modes)

    @property
    def mixes_modes(self) -> bool:
        """Whether the current step has both exact and takeover micro-batches."""
        return len(set(self.modes)) > 1

    def basis_is_stale(self, refreshed_at: Optional[int]) -> bool:
        """Whether a basis last computed at step ``refreshed_at`` must be recomputed now."""
        if refreshed_at is None:
            return True
        return self.step - refreshed_at >= self.config.basis_interval

    def plan_digest(self) -> int:
        """A 31-bit digest of (step, modes), equal on ranks that hold the same plan."""
        text = f"{self.step}:" + ",".join(m.value for m in self.modes)
        return zlib.crc32(text.encode()) & 0x7FFFFFFF

    def check_group_consistent(self, group: Optional["torch.distributed.ProcessGroup"]) -> None:
        """Raise on every rank of ``group`` if their plans differ (a would-be deadlock).

        It is a collective over ``group``: call it on all of its ranks.
        """
        import torch  # here, so that the torch-free flag checks can import this module

        digest = torch.tensor([self.plan_digest(), -self.plan_digest()], dtype=torch.int64)
        torch.distributed.all_reduce(digest, op=torch.distributed.ReduceOp.MAX, group=group)
        if int(digest[0]) != -int(digest[1]):
            raise RuntimeError(
                f"MeCeFO plans differ across the ranks of a TP/CP group at step {self.step}: "
                "every rank of the group must call MecefoState.start_step with the same modes"
            )
