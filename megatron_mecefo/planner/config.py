"""``AutoPolicyConfig``: the settings of ``--mecefo-policy auto`` (the recovery planner), their
checks, and the :class:`~.auto_policy.AutoPolicy` they build.

Held by the takeover config (:class:`megatron_mecefo.takeover.config.FaultToleranceConfig`,
field ``planner``); the flags are :mod:`.arguments`'. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from megatron_mecefo.takeover.config_error import MecefoConfigError

DEFAULT_GRAD_ERROR_BUDGET = 0.3
"""``--mecefo-grad-error-budget``'s default: half the relative error (0.6) that MeCeFO's paper
measured as its bound through LLaMA pretraining. At 32 simulated replicas (one micro-batch
each, ``results/convergence_n32/``) it keeps ``neighbor`` while at most 2 replicas are down
and moves to ``spread`` from 3 on (predicted errors 0.25 and 0.33 for ``neighbor``)."""


@dataclass
class AutoPolicyConfig:
    """The planner's ``--mecefo-*`` flags (read only with ``--mecefo-policy auto``)."""

    sample_loss_budget: float = 0.0
    """Share of a step's samples that may be skipped."""

    approx_budget: float = 1.0
    """Most takeover micro-batches per step, as a share of the global batch."""

    rank_min: Optional[int] = None
    """Smallest r the planner may pick (None: ``techniques.rank``)."""

    rank_max: Optional[int] = None
    """Largest r the planner may pick (None: ``techniques.rank``)."""

    memory_headroom_mb: float = 0.0
    """Activation MiB allowed above the failure-free peak before FFN recompute."""

    profile: Optional[str] = None
    """The cost profile file (None: the packaged one,
    :data:`~megatron_mecefo.planner.calibration.PACKAGED_PROFILE`)."""

    allow_shrink: bool = False
    """Whether shrinking data parallelism is a choice."""

    calibrate_steps: int = 3
    """(Example trainer) failure-free steps that rescale the profile to this machine."""

    grad_error_budget: float = DEFAULT_GRAD_ERROR_BUDGET
    """Largest predicted gradient relative error ``||g_hat - g|| / ||g||`` of a choice
    (``--mecefo-grad-error-budget``). ``auto`` takes the fastest candidate within it; when no
    candidate is within it, the one of least predicted error (``exact`` has none, so this
    happens only when ``exact`` is not allowed, e.g. over the memory headroom)."""

    @classmethod
    def from_args(cls, args: Any) -> AutoPolicyConfig:
        """The config of parsed flags."""
        return cls(
            sample_loss_budget=args.mecefo_sample_loss_budget,
            approx_budget=args.mecefo_approx_budget,
            rank_min=args.mecefo_rank_min,
            rank_max=args.mecefo_rank_max,
            memory_headroom_mb=args.mecefo_memory_headroom_mb,
            profile=args.mecefo_planner_profile,
            allow_shrink=args.mecefo_allow_shrink,
            calibrate_steps=args.mecefo_planner_calibrate_steps,
            grad_error_budget=args.mecefo_grad_error_budget,
        )

    def validate(self, policy: str, techniques: Any, dp: int, hidden_size: int) -> None:
        """Budgets in [0, 1], rank bounds, a readable profile; with another ``policy`` than
        ``auto``, none of these flags may be given. Raises :class:`MecefoConfigError`."""
        given = []
        if self.sample_loss_budget != 0.0:
            given.append(f"--mecefo-sample-loss-budget={self.sample_loss_budget}")
        if self.approx_budget != 1.0:
            given.append(f"--mecefo-approx-budget={self.approx_budget}")
        for flag, value in (("--mecefo-rank-min", self.rank_min),
                            ("--mecefo-rank-max", self.rank_max)):  # fmt: skip
            if value is not None:
                given.append(f"{flag}={value}")
        if self.memory_headroom_mb:
            given.append(f"--mecefo-memory-headroom-mb={self.memory_headroom_mb}")
        if self.allow_shrink:
            given.append("--mecefo-allow-shrink")
        if self.calibrate_steps != 3:
            given.append(f"--mecefo-planner-calibrate-steps={self.calibrate_steps}")
        if self.grad_error_budget != DEFAULT_GRAD_ERROR_BUDGET:
            given.append(f"--mecefo-grad-error-budget={self.grad_error_budget}")
        if policy != "auto":
            if given:
                raise MecefoConfigError(
                    f"{given[0]} is read only by --mecefo-policy auto (the recovery planner), "
                    f"not {policy}; add --mecefo-policy auto or drop it"
                )
            return
        for flag, value in (
            ("--mecefo-sample-loss-budget", self.sample_loss_budget),
            ("--mecefo-approx-budget", self.approx_budget),
        ):
            if not 0.0 <= value <= 1.0:
                raise MecefoConfigError(
                    f"{flag}={value}: a share of the global batch, between 0 and 1"
                )
        if not self.grad_error_budget >= 0:  # NaN too
            raise MecefoConfigError(
                f"--mecefo-grad-error-budget={self.grad_error_budget}: a gradient relative "
                f"error, >= 0; use e.g. {DEFAULT_GRAD_ERROR_BUDGET} (the default), or inf for "
                "no bound"
            )
        lo = self.rank_min or techniques.rank
        hi = self.rank_max or techniques.rank
        if not 1 <= lo <= hi:
            raise MecefoConfigError(
                f"--mecefo-rank-min={lo} / --mecefo-rank-max={hi}: need 1 <= min <= max "
                "(each defaults to --mecefo-rank)"
            )
        if techniques.lowrank_ffn and hi > hidden_size:
            raise MecefoConfigError(
                f"--mecefo-rank-max={hi} exceeds --hidden-size={hidden_size}; use at most "
                f"{hidden_size}"
            )
        if self.calibrate_steps < 0:
            raise MecefoConfigError(
                f"--mecefo-planner-calibrate-steps={self.calibrate_steps}: must be >= 0"
            )
        if self.memory_headroom_mb < 0:
            raise MecefoConfigError(
                f"--mecefo-memory-headroom-mb={self.memory_headroom_mb}: must be >= 0"
            )
        if dp < 2:
            raise MecefoConfigError(
                "--mecefo-policy=auto needs at least 2 data-parallel replicas to hand a failed "
                f"replica's work to, but the data-parallel size is {dp}; launch more ranks or "
                "lower the TP/PP sizes"
            )
        from megatron_mecefo.planner.calibration import load_profile, resolve_profile

        try:
            load_profile(resolve_profile(self.profile))
        except (FileNotFoundError, ValueError) as err:
            raise MecefoConfigError(f"--mecefo-planner-profile: {err}") from None

    def planner_config(
        self,
        techniques: Any,
        failure_schedule: str = "none",
        mtbf_hours: Optional[float] = None,
        mttr_hours: Optional[float] = None,
        data_parallel_size: int = 1,
    ) -> Any:
        """The :class:`~megatron_mecefo.planner.recovery_planner.PlannerConfig` of the flags.

        The failure-rate prior is the schedule's when it has one (Poisson's MTBF and MTTR; a
        paper scenario's cluster interval times the replica count), else the planner's.
        """
        from megatron_mecefo.planner.recovery_planner import CHOICES, PlannerConfig
        from megatron_mecefo.takeover.failure_schedule import PAPER_SCENARIOS

        mtbf, mttr = mtbf_hours, mttr_hours
        if failure_schedule in PAPER_SCENARIOS:
            every, recover = PAPER_SCENARIOS[failure_schedule]
            mtbf, mttr = every * data_parallel_size, recover
        t = techniques
        policies = CHOICES if t.any_technique else ("exact", "shrink", "drop")
        return PlannerConfig(
            sample_loss_budget=self.sample_loss_budget,
            approx_budget=self.approx_budget,
            rank_min=self.rank_min or t.rank,
            rank_max=self.rank_max or t.rank,
            memory_headroom_bytes=self.memory_headroom_mb * 2**20,
            recompute_ffn=t.recompute_ffn,
            allow_shrink=self.allow_shrink,
            policies=policies,
            basis_interval=t.basis_interval,
            skip_attention=t.skip_attention,
            mtbf_hours=mtbf or PlannerConfig.mtbf_hours,
            mttr_hours=mttr or PlannerConfig.mttr_hours,
            grad_error_budget=self.grad_error_budget,
        )

    def build_policy(
        self, planner_config: Any, skip_attention: bool, state: Any = None, modules: Any = None
    ) -> Any:
        """The :class:`~megatron_mecefo.planner.auto_policy.AutoPolicy` of the flags, whose
        decisions set the FFN recompute and the rank of ``state`` (and drop the bases of
        ``modules`` on a new r)."""
        from megatron_mecefo.planner.auto_policy import AutoPolicy, technique_hook
        from megatron_mecefo.planner.calibration import (
            describe_profile,
            load_profile,
            resolve_profile,
        )

        hook = technique_hook(state, modules) if state is not None else None
        profile = load_profile(resolve_profile(self.profile))
        policy = AutoPolicy(profile, planner_config, skip_attention, hook)
        policy.profile_origin = describe_profile(self.profile)
        return policy
