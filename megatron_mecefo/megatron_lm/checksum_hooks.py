"""The attention checksums' (``--mecefo-abft``) hooks in Megatron-LM's training loop.

:class:`ChecksumHooks` is the part of
:class:`~megatron_mecefo.megatron_lm.integration.MegatronLMIntegration` that wraps
``megatron.training.training.get_forward_backward_func`` (with or without ``--mecefo``) to
count steps and micro-batches (for the protection policy and the fault injector) and to sum
the counts over ranks: rank 0 prints a line for each iteration with a fault or a detection, and
a summary at exit. An output that stays bad after its recompute goes to Megatron's
``rerun_state_machine`` (``on_uncorrectable="raise"``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

__all__ = ["ChecksumHooks"]

_TRAINING = "megatron.training.training"


class ChecksumHooks:
    """The ABFT step hooks; the state is the integration's (``abft``, the
    :class:`~megatron_mecefo.abft.state.AbftState` bound at model build)."""

    abft: Any
    _abft_hooks_installed: bool
    _abft_open_step: Optional[int]

    def _install_abft_hooks(self) -> None:
        """Wrap ``get_forward_backward_func``: steps, micro-batches and all-rank counts."""
        import atexit
        import importlib

        if self._abft_hooks_installed:
            return
        self._abft_hooks_installed = True
        training = importlib.import_module(_TRAINING)
        get_fbf = training.get_forward_backward_func

        @functools.wraps(get_fbf)
        def get_forward_backward_func(*a: Any, **kw: Any) -> Callable:
            inner = get_fbf(*a, **kw)

            def run(**kwargs: Any) -> Any:
                state = self.abft
                if state is None or kwargs.get("forward_only", False):
                    return inner(**kwargs)
                from megatron.training import get_args

                state.start_step(get_args().curr_iteration + 1)
                self._abft_open_step = state.iteration  # until end_step has summed it
                kwargs["forward_step_func"] = state.wrap_forward_step(kwargs["forward_step_func"])
                result = inner(**kwargs)
                self._abft_log(state.end_step())  # every rank: sums the counts
                self._abft_open_step = None
                return result

            return run

        training.get_forward_backward_func = get_forward_backward_func
        atexit.register(self._abft_summary)

    def _abft_log(self, record: dict) -> None:
        """Rank 0 prints a step's injections and detections (all ranks), if it had any."""
        import torch

        if torch.distributed.is_initialized() and torch.distributed.get_rank():
            return
        if not record["detections"]:
            return
        where = ", ".join(
            f"layer {d['layer']} {d['op']} {d['kind']} {d['action']}"
            + (f" x{d['count']}" if d["count"] > 1 else "")
            for d in record["detections"]
        )
        print(
            f"> MeCeFO ABFT: iteration {self.abft.iteration}: {record['injected']} injected, "
            f"{record['corrected']} corrected, {record['recomputed']} recomputed, "
            f"{record['uncorrectable']} uncorrectable ({where})",
            flush=True,
        )

    def _abft_summary(self) -> None:
        import torch

        if self.abft is None or (
            torch.distributed.is_initialized() and torch.distributed.get_rank()
        ):
            return
        rows = "; ".join(f"{k}: {v}" for k, v in self.abft.counters.rows())
        if self._abft_open_step is not None:  # e.g. a NaN loss raised inside the step
            rows += f"; iteration {self._abft_open_step} did not finish and is not counted"
        print(f"> MeCeFO ABFT summary: {rows}", flush=True)
