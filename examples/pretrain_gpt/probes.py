"""Measurements taken beside training: the planner's (what ``--mecefo-policy auto`` predicted,
measured), the gradient-error probe (``--mecefo-grad-error-interval``), every rank's CPU time
(``--log-rank-cpu-time``), the sample indices each replica processed, and Megatron-LM's
weight-hash check across data-parallel replicas.

Torch and megatron-core are imported inside the functions (see ``building.py``).
"""

from __future__ import annotations

from typing import Any, Callable


def planner_active(controller: Any) -> bool:
    """Whether ``--mecefo-policy auto`` runs (its decisions are logged with measurements)."""
    return controller is not None and hasattr(controller.policy, "decisions")


class PlannerProbe:
    """What the planner predicts, measured: the largest decoder activation bytes one
    micro-batch saved and the critical path's CPU time, next to each decision's prediction;
    and the calibration of the planner's profile on the first failure-free steps."""

    def __init__(self) -> None:
        self.activation_peak = 0  # decoder activation bytes, largest micro-batch of the step
        self.calibration: list[float] = []  # measured / predicted, failure-free steps

    def forward(self, model: Any, batch: dict[str, Any]) -> Any:
        """``model``'s forward on ``batch``, counting the decoder's saved activation bytes."""
        from megatron_mecefo.techniques.activation_bytes import SavedActivationBytes

        inner = model
        while hasattr(inner, "module"):
            inner = inner.module
        with SavedActivationBytes(inner, scope=getattr(inner, "decoder", None)) as saved:
            output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        self.activation_peak = max(self.activation_peak, saved.nbytes)
        return output

    def measure(
        self,
        planner: dict[str, Any],
        cpu: tuple[float, float],
        controller: Any,
        calibrate_steps: int,
        iteration: int,
        device: Any,
        print_line: Callable[[str], None],
    ) -> None:
        """Add the measured values next to the decision's predictions (``mecefo.planner``):
        the slowest rank's CPU ms of forward-backward plus optimizer (the critical path) and
        the largest decoder activation bytes one micro-batch saved, both the max over ranks.

        During the first ``calibrate_steps`` failure-free steps (after the first) it also
        collects the critical path; then the profile is rescaled by the median measured /
        predicted ratio, identically on every rank (the values are all-reduced).
        ``iteration`` is the one being measured.
        """
        import statistics

        import torch
        import torch.distributed as dist

        both = torch.tensor(
            [float(self.activation_peak), 1e3 * (cpu[0] + cpu[1])],
            dtype=torch.float64,
            device=device,
        )
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        self.activation_peak = 0
        planner["measured_peak_activation_bytes"] = int(both[0].item())
        planner["measured_step_ms"] = float(both[1].item())
        policy = controller.policy
        if calibrate_steps and iteration >= 2 and not policy.rescaled:
            if planner["policy"] == "none" and not controller.plan.failed:
                self.calibration.append(planner["measured_step_ms"] / planner["predicted_step_ms"])
            if len(self.calibration) >= calibrate_steps or controller.plan.failed:
                if self.calibration:
                    factor = statistics.median(self.calibration)
                    policy.rescale(factor)
                    print_line(
                        f"> MeCeFO planner: calibrated on {len(self.calibration)} failure-free "
                        f"steps: measured critical path / profile = {factor:.3f}; predictions "
                        "are rescaled by it from the next decision on"
                    )


def grad_buffers(model: list[Any]) -> list[Any]:
    """The DDP gradient buffers of every model chunk."""
    return [b.grad_data for m in model for b in m.buffers]


def failure_free_grads(trainer: Any) -> list[Any]:
    """The synced gradient of ``trainer``'s next iteration's batch with no replica down.

    Every micro-batch is read by index, so the data iterators do not move, and the RNG
    states are restored afterwards, so the real step runs as if this had not happened.
    """
    import torch
    from megatron.core import tensor_parallel

    rng = (torch.get_rng_state(), tensor_parallel.get_cuda_rng_tracker().get_states())
    trainer.controller.begin_iteration(
        trainer.iteration + 1, trainer.consumed_samples, failure_free=True
    )
    trainer.zero_grads()
    vpp = trainer.args.virtual_pipeline_model_parallel_size
    trainer.run_schedule([None] * vpp if vpp else None, forward_only=False)
    grads = [g.clone() for g in grad_buffers(trainer.model)]
    torch.set_rng_state(rng[0])
    tensor_parallel.get_cuda_rng_tracker().set_states(rng[1])
    return grads


def grad_rel_error(model: list[Any], reference: list[Any], device: Any) -> float:
    """||g_hat - g|| / ||g|| over the whole model (reduced over the model-parallel ranks)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for g_hat, g in zip(grad_buffers(model), reference, strict=True):
        sums[0] += (g_hat.double() - g.double()).square().sum()
        sums[1] += g.double().square().sum()
    dist.all_reduce(sums, group=ps.get_model_parallel_group())
    return float(sums[0].sqrt() / sums[1].sqrt())


def gather_dp_ranks(dp_rank: int) -> list[int]:
    """Collective: every global rank's replica index (whose CPU time it is)."""
    import torch.distributed as dist

    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, dp_rank)
    return [int(r) for r in every]


def gather_samples(consumed: dict[int, list[list[int]]]) -> dict[str, list[list[int]]]:
    """Collective over the data-parallel group: the sample indices every replica processed
    this iteration (``MecefoController.samples_consumed``: replica -> runs ``[start, stop)``),
    keyed by replica (a string, for JSON); one small object per rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group()
    every: list[Any] = [consumed]
    if dist.get_world_size(group) > 1:
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, consumed, group=group)
    merged: dict[int, list[list[int]]] = {}
    for part in every:
        merged.update(part)
    return {str(r): merged[r] for r in sorted(merged)}


def gather_rank_cpu(cpu: tuple[float, float], dp_ranks: list[int]) -> dict[str, list[Any]]:
    """Every rank's CPU seconds of (forward-backward, optimizer step), by global rank.

    Process CPU time counts a rank's own work only: a rank blocked in a gloo collective
    does not spin, and ranks sharing a core each count just their share.
    """
    import torch
    import torch.distributed as dist

    mine = torch.tensor(cpu, dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return {
        "fwd_bwd": [float(t[0]) for t in every],
        "optimizer": [float(t[1]) for t in every],
        "dp_rank": dp_ranks,
    }


def check_dp_replicas(
    model_chunks: list[Any], device: Any, iteration: int, emit: Callable[[dict[str, Any]], None]
) -> None:
    """Megatron-LM's weight-hash check: every DP replica must hold the same bits.

    Emits a ``dp_weight_check`` record; raises when any replica differs (one verdict for
    the whole job, so every rank raises together).
    """
    import hashlib

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    digest = hashlib.sha256()
    for chunk in model_chunks:
        for _, param in sorted(chunk.named_parameters()):
            digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy())
    mine = torch.tensor(list(digest.digest()), dtype=torch.uint8, device=device)
    gathered = [torch.empty_like(mine) for _ in range(ps.get_data_parallel_world_size())]
    dist.all_gather(gathered, mine, group=ps.get_data_parallel_group())
    identical = all(torch.equal(g, gathered[0]) for g in gathered)
    flags = torch.tensor([0.0 if identical else 1.0], device=device)
    dist.all_reduce(flags)  # one verdict for the whole job
    record = {
        "type": "dp_weight_check",
        "iteration": iteration,
        "identical": bool(flags.item() == 0),
    }
    emit(record)
    if not record["identical"]:
        raise RuntimeError(f"iteration {iteration}: DP replicas hold different weights")
