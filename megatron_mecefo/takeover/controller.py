"""``MecefoController``: runs each training iteration of one process through failures.

Per iteration it asks the failure schedule which replicas are down, asks the takeover policy
for the work plan, and then wraps the three Megatron entry points a training loop already has:

* the ``forward_backward_func`` (from ``get_forward_backward_func``): this replica runs its
  planned micro-batches, own and absorbed, with the changed count; a failed replica computes
  nothing (or one zero-weight micro-batch when ``overlap_grad_reduce`` needs its hooks) but
  still joins the gradient collectives with zeros;
* the ``forward_step_func``: each micro-batch's mode is set, and its loss re-weighted;
* ``finalize_model_grads``: after the data-parallel sync the MHA-group gradients are
  re-weighted, before clipping and the optimizer see them.

Every rank computes the same plan from the same seeded schedule, so every rank of a replica
runs the same collectives.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from megatron_mecefo.takeover.data_remap import (
    GlobalBatchLayout,
    ReplicaMicrobatches,
    draw_own,
    index_ranges,
)
from megatron_mecefo.takeover.failure_schedule import FailureSchedule
from megatron_mecefo.takeover.plan import MicrobatchWork, StepPlan
from megatron_mecefo.takeover.policies import TakeoverPolicy
from megatron_mecefo.techniques.state import MecefoState, MicrobatchMode

FINALIZE_KEYWORDS = ("pg_collection", "force_all_reduce")
"""Keywords of a ``forward_backward_func`` call that its schedule hands on to
``config.finalize_model_grads_func``; the no-compute path passes them on the same way."""


class MecefoController:
    """Per-process MeCeFO training state: schedule, policy, the current plan and counters.

    Args:
        schedule: Which replicas are down at each iteration.
        policy: Turns failures into work plans.
        state: The ``MecefoState`` bound to the model (``apply_mecefo``).
        replica: This process's data-parallel index.
        layout: The global batch's split into replicas and micro-batches.
        mha_parameters: The MHA-group parameters of this rank's model chunks.
        calculate_per_token_loss: Megatron's flag; loss weights then stay 1.
        overlap_grad_reduce: DDP's flag; a failed replica then runs one zero-weight
            micro-batch so that its gradient hooks launch the bucket reductions in order.
    """

    def __init__(
        self,
        schedule: FailureSchedule,
        policy: TakeoverPolicy,
        state: MecefoState,
        replica: int,
        layout: GlobalBatchLayout,
        mha_parameters: Sequence[torch.nn.Parameter],
        calculate_per_token_loss: bool = False,
        overlap_grad_reduce: bool = False,
    ) -> None:
        if schedule.num_replicas != layout.num_replicas:
            raise ValueError(
                f"schedule has {schedule.num_replicas} replicas, the batch layout "
                f"{layout.num_replicas}"
            )
        self.schedule = schedule
        self.policy = policy
        self.state = state
        self.replica = replica
        self.layout = layout
        self.mha_parameters = list(mha_parameters)
        self.calculate_per_token_loss = calculate_per_token_loss
        self.overlap_grad_reduce = overlap_grad_reduce
        self.reset()

    def reset(self) -> None:
        """Forget the current plan and the run's counters (e.g. for an in-process restart)."""
        self.plan: Optional[StepPlan] = None
        self.consumed_samples = 0
        self._handed: Dict[int, ReplicaMicrobatches] = {}  # replica -> this iteration's
        self._counts: Dict[str, int] = {}
        self._announced: tuple = ((), ())  # (failed, notes) of the last plan announced
        self._decisions_announced = 0  # planner decisions (auto) announced so far
        reset_policy = getattr(self.policy, "reset", None)
        if reset_policy is not None:
            reset_policy()
        self._sampler_checked: Optional[frozenset] = None  # failed set of the last check
        self.degraded_iterations = 0
        self.fallback_iterations = 0
        self.samples_processed = 0
        self.samples_skipped = 0

    # ------------------------------------------------------------------ per iteration
    def plan_for(self, iteration: int, failure_free: bool = False) -> StepPlan:
        """The plan of (1-based) ``iteration``; ``failure_free`` ignores the schedule."""
        n, m = self.layout.num_replicas, self.layout.microbatches
        if failure_free:
            # Every policy's plan with no failure is all-exact; the base class builds it
            # without telling a stateful policy (auto) of a failure event that is not one.
            return TakeoverPolicy.plan(self.policy, iteration, frozenset(), n, m)
        return self.policy.plan(iteration, self.schedule.failed_at(iteration), n, m)

    def begin_iteration(
        self, iteration: int, consumed_samples: int, failure_free: bool = False
    ) -> StepPlan:
        """Make ``iteration``'s plan current and hand its modes to the ``MecefoState``."""
        plan = self.plan_for(iteration, failure_free)
        counts = self._counts = self.layout.account(plan, consumed_samples)
        self.plan = plan
        self._handed = {}
        self.consumed_samples = consumed_samples
        modes = plan.modes(self.replica) or [MicrobatchMode.EXACT]
        self.state.start_step(iteration, modes)
        if not failure_free:
            self.degraded_iterations += plan.degraded
            self.fallback_iterations += bool(plan.notes)
            self.samples_processed += counts["samples_processed"]
            self.samples_skipped += counts["samples_skipped"]
        return plan

    def act_as(self, replica: int) -> None:
        """Run the rest of the current iteration as ``replica``: its micro-batches, their modes
        and its loss weight (one process simulating every replica, :mod:`.virtual_replicas`)."""
        plan = self._require_plan()
        self.replica = replica
        self.state.start_step(plan.iteration, plan.modes(replica) or [MicrobatchMode.EXACT])

    @property
    def is_failed(self) -> bool:
        """Whether this replica is down in the current plan."""
        return self.plan is not None and not self.plan.work[self.replica]

    def record(self) -> Dict[str, Any]:
        """The metrics fields of the current iteration."""
        plan = self._require_plan()
        fields = plan.summary()
        fields.update(self._counts)
        fields["degraded"] = plan.degraded
        fields["no_update"] = plan.no_update
        planner = getattr(self.policy, "record", None)  # --mecefo-policy auto: its decision
        if planner is not None:
            fields["planner"] = planner()
        return fields

    def samples_consumed(self) -> Dict[int, List[List[int]]]:
        """Per replica run in this process this iteration, the sample indices of the planned
        micro-batches its schedule took (the first data iterator's, in order), as
        :func:`.data_remap.index_ranges`. A failed replica took none (its zero-weight
        micro-batch, if any, is not counted)."""
        return {r: index_ranges([i for mb in it.processed for i in mb]) for r, it in
                self._handed.items()}  # fmt: skip

    def announcements(self) -> List[str]:
        """Run-log lines for the current plan when its failed set or its fallbacks differ
        from the last plan announced (nothing while they stay the same)."""
        plan = self._require_plan()
        key = (plan.failed, plan.notes)
        lines: List[str] = []
        decisions = getattr(self.policy, "decisions", None)
        if decisions is not None and len(decisions) != self._decisions_announced:
            self._decisions_announced = len(decisions)
            lines.append(self.policy.log_line(plan.iteration))
        if key == self._announced:
            return lines
        self._announced = key
        return plan_log_lines(plan.iteration, self.record()) + lines

    def _require_plan(self) -> StepPlan:
        if self.plan is None:
            raise RuntimeError("MecefoController.begin_iteration was not called this iteration")
        return self.plan

    # ------------------------------------------------------------------ data
    def microbatches(
        self,
        data_iterator: Any,
        fetch: Optional[Callable[[List[int]], Any]],
    ) -> Any:
        """This replica's data iterator(s) for the current iteration.

        Args:
            data_iterator: The replica's usual iterator, or a list of them (one per virtual
                pipeline chunk), or ``None``; each is advanced by exactly ``M`` micro-batches.
            fetch: Reads and collates the samples of another replica's micro-batch.
        """
        plan = self._require_plan()
        work = plan.work[self.replica]
        samples = functools.partial(self.layout.samples, self.consumed_samples)

        def one(it: Any, first: bool) -> ReplicaMicrobatches:
            own = draw_own(it, self.layout.microbatches)
            self.check_sampler(own, fetch)
            # A failed replica that must still fire its hooks runs its first own micro-batch.
            planned = list(work) or [MicrobatchWork(self.replica, 0, MicrobatchMode.EXACT)]
            handed = ReplicaMicrobatches(planned, own, fetch, samples, self.replica)
            if first and work:  # the samples consumed (samples_consumed): one chunk's view
                self._handed[self.replica] = handed
            return handed

        if isinstance(data_iterator, list):
            return [one(it, i == 0) for i, it in enumerate(data_iterator)]
        return one(data_iterator, True)

    def check_sampler(
        self, own: Sequence[Any], fetch: Optional[Callable[[List[int]], Any]]
    ) -> None:
        """Check, once per change of the failed set, that the sample indices the plan reads
        by index are the ones this replica's own data loader produced (on a plan that reads
        any: a replica down, or micro-batches moved by fail-slow rebalancing).

        Absorbed micro-batches are read as ``layout.samples(consumed_samples, failed, i)``;
        that is right only if ``consumed_samples`` is the offset the loaders were built at.
        Every replica, the failed ones included, reads its own first micro-batch by index
        and compares it with the one its sampler gave. Every replica computes the same
        offset, so a wrong one stops every data-reading rank here, before any gradient.

        Raises:
            SampleOffsetError: If the two differ.
        """
        plan = self._require_plan()
        if not (plan.degraded or plan.remapped) or fetch is None or not own or own[0] is None:
            return
        if self._sampler_checked == plan.failed:
            return
        indices = self.layout.samples(self.consumed_samples, self.replica, 0)
        if not _same_batch(own[0], fetch(indices)):
            raise SampleOffsetError(
                f"MeCeFO: iteration {plan.iteration}: replica {self.replica}'s first "
                f"micro-batch from its own data loader is not samples {indices}, which the "
                f"takeover plan computes from consumed samples {self.consumed_samples}; "
                "absorbed micro-batches would be read from the wrong samples, so the run "
                "stops here. The data loader was built at a different sample offset than the "
                "one passed to begin_iteration (e.g. Megatron-LM's "
                "consumed_train_samples_in_current_phase with --phase-transition-iterations); "
                "pass the loader's offset"
            )
        self._sampler_checked = plan.failed

    # ------------------------------------------------------------------ wrappers
    def loss_weight(self) -> float:
        """Factor on this replica's micro-batch losses in the current iteration."""
        plan = self._require_plan()
        if not plan.work[self.replica]:
            return 0.0
        if self.calculate_per_token_loss:
            return plan.loss_weight_per_token
        return plan.loss_weight(self.replica)

    def wrap_forward_step(self, forward_step_func: Callable) -> Callable:
        """Wrap Megatron's ``forward_step_func``: set each micro-batch's mode, weight its loss."""

        @functools.wraps(forward_step_func)
        def forward_step(data_iterator: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
            self.state.begin_microbatch(model)
            output, loss_func = forward_step_func(data_iterator, model, *args, **kwargs)
            weight = self.loss_weight()
            if weight == 1.0:  # failure-free: the very same autograd graph as without MeCeFO
                return output, loss_func
            return output, functools.partial(_weighted_loss, loss_func, weight)

        return forward_step

    def wrap_finalize(self, finalize_model_grads: Callable) -> Callable:
        """Wrap ``finalize_model_grads``: after the sync, re-weight the MHA-group gradients."""

        @functools.wraps(finalize_model_grads)
        def finalize(*args: Any, **kwargs: Any) -> Any:
            result = finalize_model_grads(*args, **kwargs)
            if self.plan is not None:
                scale = self.plan.mha_scale
                if scale != 1.0:
                    for p in self.mha_parameters:
                        grad = getattr(p, "main_grad", None)
                        grad = p.grad if grad is None else grad
                        if grad is not None:
                            grad.mul_(scale)
            return result

        return finalize

    def wrap_forward_backward(
        self,
        forward_backward_func: Callable,
        fetch: Optional[Callable[[List[int]], Any]] = None,
        finalize: Optional[Callable] = None,
        zero_report: Optional[Callable[[], Dict[str, torch.Tensor]]] = None,
        is_last_stage: Optional[Callable[[], bool]] = None,
    ) -> Callable:
        """Wrap a Megatron ``forward_backward_func`` to run the current plan.

        Forward-only calls (evaluation) pass through with every micro-batch exact. A training
        call runs this replica's planned micro-batches (``num_microbatches`` becomes their
        count) from :meth:`microbatches`, with ``forward_step_func`` wrapped by
        :meth:`wrap_forward_step`. On a failed replica, without ``overlap_grad_reduce`` and
        with ``zero_report`` and ``finalize`` given, nothing is computed: ``finalize`` runs
        on zero gradients and the last stage returns one zero loss report. Otherwise the
        failed replica runs its first own micro-batch with zero weight.

        Args:
            forward_backward_func: Megatron's schedule function.
            fetch: Reads another replica's samples (see :meth:`microbatches`).
            finalize: ``config.finalize_model_grads_func`` (already wrapped), for the
                no-compute path.
            zero_report: Builds the loss report of a replica that computed nothing.
            is_last_stage: Whether this rank is a last pipeline stage (reports losses).
        """

        @functools.wraps(forward_backward_func)
        def run(*, forward_step_func: Callable, data_iterator: Any, model: Any, **kw: Any) -> Any:
            if kw.get("forward_only", False):
                self.state.start_step(max(self.state.step, 0), [])  # everything exact
                return forward_backward_func(
                    forward_step_func=forward_step_func,
                    data_iterator=data_iterator,
                    model=model,
                    **kw,
                )
            plan = self._require_plan()
            chunks = model if isinstance(model, list) else [model]
            if plan.no_update or (
                self.is_failed
                and not self.overlap_grad_reduce
                and finalize is not None
                and zero_report is not None
            ):
                draw = data_iterator if isinstance(data_iterator, list) else [data_iterator]
                for i, it in enumerate(draw):  # keep the data position aligned
                    own = draw_own(it, self.layout.microbatches)
                    if i == 0 and not plan.no_update:
                        self.check_sampler(own, fetch)
                if plan.no_update:
                    return []
                num_tokens = None
                if self.calculate_per_token_loss:
                    num_tokens = torch.zeros([], dtype=torch.int, device=_device_of(chunks))
                # The same keywords the schedule would pass (megatron-core >= 0.16:
                # pg_collection, force_all_reduce): a failed replica must run the same
                # reduction (all-reduce vs reduce-scatter) over the same groups as the others.
                passed = {k: kw[k] for k in FINALIZE_KEYWORDS if k in kw}
                finalize(chunks, num_tokens, **passed)
                last = is_last_stage() if is_last_stage is not None else True
                return [zero_report()] if last else []
            iterator = self.microbatches(data_iterator, fetch)
            count = len(plan.work[self.replica]) or 1
            kw["num_microbatches"] = count
            return forward_backward_func(
                forward_step_func=self.wrap_forward_step(forward_step_func),
                data_iterator=iterator,
                model=model,
                **kw,
            )

        return run


class SampleOffsetError(RuntimeError):
    """The plan's sample indices do not match what the replica's own data loader reads."""


def _same_batch(a: Any, b: Any) -> bool:
    """Whether two collated micro-batches (dicts / sequences of tensors) are equal."""
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(_same_batch(a[k], b[k]) for k in a)
        )
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and torch.equal(a.cpu(), b.to(a.dtype).cpu())
        )
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(_same_batch(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b


def _device_of(chunks: Sequence[torch.nn.Module]) -> torch.device:
    for p in chunks[0].parameters():
        return p.device
    return torch.device("cpu")


def _weighted_loss(loss_func: Callable, weight: float, output_tensor: Any) -> Any:
    """``loss_func`` with its loss (and, at weight 0, its token count and report) scaled."""
    out = loss_func(output_tensor)
    if len(out) == 3:
        loss, num_tokens, report = out
        if weight == 0.0:
            num_tokens = num_tokens * 0
            report = {k: v * 0 for k, v in report.items()}
        return loss * weight, num_tokens, report
    loss, report = out
    if weight == 0.0:
        report = {k: v * 0 for k, v in report.items()}
    return loss * weight, report


def plan_log_lines(iteration: int, record: Dict[str, Any]) -> List[str]:
    """The run-log lines announcing a plan (``MecefoController.record()``) of ``iteration``."""
    if not record["failed_replicas"]:
        return [f"> MeCeFO: iteration {iteration}: every replica up again; training exact"]
    nbrs = ", ".join(f"{f}->{n}" for f, n in record["neighbours"].items()) or "none"
    lines = [
        f"> MeCeFO: iteration {iteration}: replicas {record['failed_replicas']} down; policy "
        f"{record['policy']}: neighbours {nbrs}, micro-batches per replica "
        f"{record['microbatches_per_replica']}, {record['takeover_microbatches']} in takeover "
        f"mode, MHA exact fraction {record['mha_exact_fraction']:.2f}, samples processed "
        f"{record['samples_processed']} / skipped {record['samples_skipped']}"
    ]
    return lines + [f"> MeCeFO: fallback: {note}" for note in record["fallback"]]
