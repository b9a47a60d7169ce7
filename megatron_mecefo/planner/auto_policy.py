"""``--mecefo-policy auto``: the recovery planner inside the takeover controller.

:class:`AutoPolicy` has the :class:`~megatron_mecefo.takeover.policies.TakeoverPolicy`
interface, so the controller, the example trainer and the Megatron-LM integration run it like
any fixed policy. When the failed set changes it calls
:func:`~megatron_mecefo.planner.recovery_planner.plan_recovery` and then plans with the chosen
policy until the next change. Every input is deterministic (the failed sets seen so far, the
profile, the budgets; time is counted in predicted failure-free steps, never measured), so
every rank takes the same decision without communicating.

The observed rates: each failure and repair seen so far updates the MTBF and MTTR estimates
from the prior (``PlannerConfig.mtbf_hours`` / ``mttr_hours``) as one pseudo-observation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Optional

from megatron_mecefo.planner.recovery_planner import (
    CostProfile,
    Decision,
    FailureState,
    PlannerConfig,
    build_choice,
    plan_recovery,
)
from megatron_mecefo.takeover.plan import StepPlan
from megatron_mecefo.takeover.policies.base import TakeoverPolicy


def technique_hook(state: Any, modules: Iterable[Any] = ()) -> Callable[[Decision], None]:
    """A decision callback that sets the ``MecefoState``'s FFN recompute and low-rank r.

    ``state.config`` is replaced (not mutated), so the flags' config stays as given. A new r
    drops the cached bases of ``modules`` (their ``mecefo_basis``): the next takeover
    micro-batch computes them at the new rank, as on first use, on every rank of its group.
    """
    modules = list(modules or ())

    def apply(decision: Decision) -> None:
        cfg = state.config
        rank = decision.rank if decision.rank is not None else cfg.rank
        new = dataclasses.replace(cfg, recompute_ffn=decision.recompute_ffn, rank=rank)
        if new == cfg:
            return
        if rank != cfg.rank:
            for m in modules:
                for sub in m.modules():
                    if getattr(sub, "mecefo_basis", None) is not None:
                        sub.mecefo_basis = None
                        sub.mecefo_basis_step = None
        state.config = new

    return apply


class AutoPolicy(TakeoverPolicy):
    """Re-plans per failure event with the recovery planner.

    Args:
        profile: The calibrated costs (:mod:`megatron_mecefo.planner.calibration`).
        config: Budgets and knobs.
        skip_attention: ``MecefoConfig.skip_attention``.
        on_decision: Called with each new :class:`Decision` (e.g. to set the FFN recompute
            and the rank of the ``MecefoState``), on every rank alike.
    """

    name = "auto"
    min_replicas = 1

    def __init__(
        self,
        profile: CostProfile,
        config: PlannerConfig,
        skip_attention: bool = True,
        on_decision: Optional[Callable[[Decision], None]] = None,
    ) -> None:
        super().__init__(skip_attention)
        config.validate()
        self.profile = profile
        self.config = config
        self.on_decision = on_decision
        self.profile_origin: Optional[str] = None
        """Which profile file this is (said once, before the first decision's line)."""
        self._origin_said = False
        self.reset()

    def rescale(self, factor: float) -> None:
        """Scale the profile's compute terms (micro-batches, optimizer, sync, basis refresh)
        by ``factor``, the measured / predicted ratio of failure-free steps on this machine;
        the regroup and rejoin were measured on real deaths and stay. The next call re-decides.
        """
        p = self.profile
        self.profile = dataclasses.replace(
            p,
            exact_ms=p.exact_ms * factor,
            takeover_ms=p.takeover_ms * factor,
            takeover_recompute_ms=p.takeover_recompute_ms * factor,
            takeover_ms_per_rank=p.takeover_ms_per_rank * factor,
            optimizer_ms=p.optimizer_ms * factor,
            sync_ms=p.sync_ms * factor,
            basis_refresh_ms=p.basis_refresh_ms * factor,
            source=f"{p.source} x {factor:.3f} (start-up calibration)",
        )
        self.rescaled = factor
        self.decision = None

    def use_costs(self, profile: CostProfile) -> None:
        """Rank the choices by ``profile`` from the next decision on: under the device clock,
        the clock's costs (:meth:`~megatron_mecefo.planner.device_clock.DeviceClock.cost_profile`).
        They are not rescaled by the start-up calibration (``rescaled`` is set to 1): that
        measures the CPU's critical path, which the clock does not charge."""
        self.profile = profile
        self.rescaled = 1.0
        self.decision = None

    def reset(self) -> None:
        """Forget the decisions and the observed rates."""
        self.rescaled: Optional[float] = None
        self.decision: Optional[Decision] = None
        self.decisions: List[Dict[str, Any]] = []
        self._current: FrozenSet[int] = frozenset()
        self._pending: Optional[tuple] = None  # (iteration, failed) not yet committed
        self._down_since: Dict[int, int] = {}
        self._up_iterations = 0
        self._failures = 0
        self._repair_iterations = 0
        self._repairs = 0
        self._iters_seen = 0

    # --------------------------------------------------------------- observed rates
    def _commit(self, iteration: int, failed: FrozenSet[int], n: int) -> None:
        """Count iteration ``iteration`` (its failed set is final) in the rates."""
        self._iters_seen += 1
        self._up_iterations += n - len(failed)
        for r in failed - set(self._down_since):
            self._down_since[r] = iteration
            self._failures += 1
        for r in set(self._down_since) - failed:
            self._repair_iterations += iteration - self._down_since.pop(r)
            self._repairs += 1

    def observed_rates(self, n: int, microbatches: int) -> tuple:
        """(MTBF, MTTR) in hours: the prior as one observation plus what was seen."""
        step_h = self.profile.failure_free_step(n, microbatches) / 3.6e6
        mtbf = (self.config.mtbf_hours + self._up_iterations * step_h) / (1 + self._failures)
        mttr = (self.config.mttr_hours + self._repair_iterations * step_h) / (1 + self._repairs)
        return mtbf, mttr

    # --------------------------------------------------------------- planning
    def plan(
        self, iteration: int, failed: FrozenSet[int], num_replicas: int, microbatches: int
    ) -> StepPlan:
        """The chosen policy's plan; a new decision when ``failed`` changed."""
        failed = frozenset(failed)
        # The last call of an iteration is its real plan; commit an iteration once a later
        # one is asked for.
        if self._pending is not None and iteration > self._pending[0]:
            self._commit(*self._pending, num_replicas)
        self._pending = (iteration, failed)
        if failed != self._current or self.decision is None:
            mtbf, mttr = self.observed_rates(num_replicas, microbatches)
            state = FailureState(num_replicas, failed, microbatches, mtbf, mttr)
            self.decision = plan_recovery(state, self.profile, self.config)
            self._current = failed
            self.decisions.append(
                {"iteration": iteration, "failed": sorted(failed), **self.decision.summary()}
            )
            if self.on_decision is not None:
                self.on_decision(self.decision)
        choice = self.decision.policy
        if choice == "none":  # every replica up (all exact) or every one down (no update)
            return super().plan(iteration, failed, num_replicas, microbatches)
        return build_choice(choice, self.skip_attention).plan(
            iteration, failed, num_replicas, microbatches
        )

    def record(self) -> Dict[str, Any]:
        """The metrics fields of the current decision (``mecefo.planner``)."""
        d = self.decision
        if d is None:
            return {}
        return {
            "policy": d.policy,
            "recompute_ffn": d.recompute_ffn,
            "rank": d.rank,
            "predicted_step_ms": d.step_time_ms,
            "predicted_transition_ms": d.transition_ms,
            "predicted_peak_activation_bytes": d.peak_memory_bytes,
            "failure_free_peak_activation_bytes": d.failure_free_peak_bytes,
            "predicted_throughput_rel": d.throughput_rel,
            "horizon_s": d.horizon_s,
            "takeover_share": d.takeover_share,
            "approx_budget": self.config.approx_budget,
            "samples_lost_share": d.samples_lost_share,
            "sample_loss_budget": self.config.sample_loss_budget,
            "predicted_grad_error": d.grad_error,
            "grad_error_budget": self.config.grad_error_budget,
            "calibration_factor": self.rescaled,
            "notes": list(d.notes),
        }

    def log_line(self, iteration: int) -> str:
        """One run-log line for the decision just taken (the first one is preceded by a
        line naming the cost profile)."""
        d = self.decision
        assert d is not None
        rank = f", r={d.rank}" if d.rank is not None else ""
        first = ""
        if self.profile_origin and not self._origin_said:
            self._origin_said = True
            first = f"> MeCeFO planner: cost profile {self.profile_origin}\n"
        return first + (
            f"> MeCeFO planner: iteration {iteration}, replicas down {sorted(self._current)}: "
            f"{d.policy} (FFN recompute {'on' if d.recompute_ffn else 'off'}{rank}); predicted "
            f"step {d.step_time_ms:.1f} ms, transition {d.transition_ms:.1f} ms, peak "
            f"activations {d.peak_memory_bytes / 2**20:.2f} MiB (failure-free "
            f"{d.failure_free_peak_bytes / 2**20:.2f}), amortised throughput "
            f"{d.throughput_rel:.3f} of failure-free over a {d.horizon_s / 3600:.2f} h horizon, "
            f"gradient error {d.grad_error:.3f} (budget {self.config.grad_error_budget:g})"
            + (f"; {'; '.join(d.notes)}" if d.notes else "")
        )

    def assign(self, failed, alive, microbatches, work):  # pragma: no cover - plan() delegates
        raise NotImplementedError("AutoPolicy.plan delegates to the chosen policy")
