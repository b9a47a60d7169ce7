"""Single-process simulation of n data-parallel replicas under the same takeover plan.

A real DP-n run (one :class:`~.controller.MecefoController` per process) does, per iteration:
each replica runs its planned micro-batches (own and absorbed, exact or takeover, each loss
multiplied by the plan's weight) through Megatron's schedule; DDP scales every replica's
gradient by ``1/n`` and sums them in the all-reduce; ``finalize_model_grads`` then multiplies
the MHA group by ``P / E``. :class:`VirtualReplicas` runs the same plan in one process with one
copy of the model, so a study at n = 32 needs no 32 processes:

1. for each replica ``r`` in turn, the controller acts as ``r``
   (:meth:`~.controller.MecefoController.act_as`: its work, modes and loss weight), the
   gradient buffers are zeroed, and ``r``'s micro-batches run through the real schedule, with
   ``r``'s own data iterator and ``r``'s low-rank bases; the buffers are added into an fp64
   accumulator;
2. the accumulator divided by ``n`` (the all-reduce's mean) goes back into the buffers, and the
   real ``finalize_model_grads`` (wrapped by the controller: the MHA re-weighting) runs once.

A replica keeps its own low-rank bases V: it computes V when it first runs a takeover
micro-batch and refreshes it every tau steps, so replicas hold V of different steps. The bases
are swapped in and out per replica. The only difference from the real run is the order of the
sum over replicas: gloo sums fp32 in its own ring order, here the sum is in fp64 and rounded
once (tests/integration/takeover/test_virtual_replicas.py measures the difference).

Not simulated, so refused at start-up (:func:`check_virtual_replicas`): more than one process,
dropout (each real rank draws its own random stream), overlapped grad reduce and the
distributed optimizer (their reductions run inside the backward), the per-token loss (its token
count is summed over replicas in the finalize), and what keeps per-rank files or counters.
"""

from __future__ import annotations

import time
from typing import Any, Callable, List, Optional, Sequence, Tuple, TypeVar

T = TypeVar("T")


def check_virtual_replicas(
    replicas: int, world_size: int, incompatible: Sequence[str] = ()
) -> Optional[str]:
    """The start-up error of ``--mecefo-virtual-replicas`` (None when fine).

    Args:
        replicas: The flag's value, the simulated data-parallel size.
        world_size: Processes launched.
        incompatible: Flags given (with their values) that the simulation does not support.
    """
    flag = f"--mecefo-virtual-replicas={replicas}"
    if replicas < 2:
        return f"{flag}: simulates that many data-parallel replicas; use at least 2"
    if world_size != 1:
        return (
            f"{flag} simulates {replicas} replicas in one process, but {world_size} processes "
            "were launched; launch one (torchrun --nproc_per_node=1), or drop the flag to train "
            "with real data parallelism"
        )
    if incompatible:
        return (
            f"{flag} does not simulate {incompatible[0]} (one process stands for every replica, "
            "see megatron_mecefo/takeover/virtual_replicas.py); drop one of the two"
        )
    return None


class VirtualReplicas:
    """Runs every replica of the controller's plan in this process, one after another.

    Args:
        controller: The controller of the simulated DP-n job (its layout has ``n`` replicas).
        models: The DDP-wrapped model chunks (their gradient buffers are accumulated).
        model_chunks: The unwrapped chunks (holding the low-rank linears' bases).
        config: The ``TransformerConfig``; its ``finalize_model_grads_func`` runs once per
            iteration, after the sum over replicas.
    """

    def __init__(
        self, controller: Any, models: Sequence[Any], model_chunks: Sequence[Any], config: Any
    ) -> None:
        self.controller = controller
        self.models = list(models)
        self.config = config
        self.num_replicas = controller.layout.num_replicas
        self._lowrank = [
            m
            for chunk in model_chunks
            for m in chunk.modules()
            if hasattr(m, "mecefo_basis") and hasattr(m, "mecefo_basis_step")
        ]
        self.reset()

    def reset(self) -> None:
        """Forget every replica's bases and timings."""
        self._bases: List[List[Tuple[Any, Optional[int]]]] = [
            [(None, None)] * len(self._lowrank) for _ in range(self.num_replicas)
        ]
        self._rank = self.controller.state.config.rank
        self.replica_cpu_s: List[float] = [0.0] * self.num_replicas
        """CPU seconds each replica's micro-batches took in the last training step."""

    # ------------------------------------------------------------------ bases
    def _swap_in(self, replica: int) -> None:
        for module, (basis, step) in zip(self._lowrank, self._bases[replica], strict=True):
            module.mecefo_basis, module.mecefo_basis_step = basis, step

    def _swap_out(self, replica: int) -> None:
        self._bases[replica] = [(m.mecefo_basis, m.mecefo_basis_step) for m in self._lowrank]
        for module in self._lowrank:
            module.mecefo_basis, module.mecefo_basis_step = None, None

    def _grad_buffers(self) -> List[Any]:
        return [
            b.grad_data
            for m in self.models
            for b in list(getattr(m, "buffers", []))
            + list(getattr(m, "expert_parallel_buffers", []))
        ]

    # ------------------------------------------------------------------ one step
    def run(self, run_replica: Callable[[int], T], forward_only: bool = False) -> List[T]:
        """Run ``run_replica(r)`` for every replica ``r`` of the current plan; returns the
        results in replica order.

        ``run_replica`` calls the controller-wrapped ``forward_backward_func`` with ``r``'s data
        iterator. For a training step the gradient buffers then hold the synced, re-weighted
        gradient, as after a real DP-n step's ``finalize_model_grads``. Forward-only calls
        (evaluation) just run every replica's share.
        """
        import torch  # here, so that the start-up check imports no torch

        ctrl = self.controller
        plan = ctrl._require_plan()  # noqa: SLF001 (same package)
        home = ctrl.replica
        if forward_only:
            return [run_replica(r) for r in range(self.num_replicas)]
        if ctrl.state.config.rank != self._rank:  # auto picked a new r: every V is stale
            self._bases = [[(None, None)] * len(self._lowrank) for _ in range(self.num_replicas)]
            self._rank = ctrl.state.config.rank
        finalize = self.config.finalize_model_grads_func
        buffers = self._grad_buffers()
        total = [torch.zeros_like(b, dtype=torch.float64) for b in buffers]
        results: List[T] = []
        self.config.finalize_model_grads_func = None  # once, after the sum over replicas
        try:
            for r in range(self.num_replicas):
                ctrl.act_as(r)
                for m in self.models:
                    m.zero_grad_buffer()
                self._swap_in(r)
                started = time.process_time()
                try:
                    results.append(run_replica(r))
                finally:
                    self._swap_out(r)
                self.replica_cpu_s[r] = time.process_time() - started
                if plan.work[r]:  # a failed replica adds zeros to the all-reduce
                    for acc, buf in zip(total, buffers, strict=True):
                        acc += buf
        finally:
            self.config.finalize_model_grads_func = finalize
            ctrl.act_as(home)
        if plan.no_update:  # every replica down: nothing computed, no optimizer step
            return results
        for acc, buf in zip(total, buffers, strict=True):
            buf.copy_(acc / self.num_replicas)  # DDP: each replica x 1/n, summed
        if finalize is not None:
            finalize(self.models, None)
        return results
