"""``FaultToleranceConfig``: the takeover's ``--mecefo-*`` settings (policy, failure schedule,
techniques; the planner's in :mod:`megatron_mecefo.planner.config`), their start-up checks and
the objects they build: the failure schedule, the policy and the controller.

``--mecefo-policy auto`` is the planner's, a subsystem above this one: the planner plugs its
settings class and flags in with :func:`register_auto_policy` when it is imported (the package's
``__init__`` imports it), so the takeover never imports the planner.

:meth:`FaultToleranceConfig.from_args` reads the flags of :mod:`.arguments`;
:meth:`FaultToleranceConfig.validate` checks them against the job, raising
:class:`MecefoConfigError` with a message that names the flag, the value and the fix, before any
collective runs. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from megatron_mecefo.takeover.config_error import MecefoConfigError
from megatron_mecefo.techniques.config import MecefoConfig

__all__ = [
    "MAX_NOMINAL_STEP_TIME_S",
    "POLICY_NAMES",
    "SCHEDULES",
    "FaultToleranceConfig",
    "MecefoConfigError",
    "auto_policy",
    "register_auto_policy",
]

POLICY_NAMES = ("neighbor", "spread", "exact", "drop", "auto")
SCHEDULES = ("none", "scripted", "low", "mid", "high", "poisson", "replay")
MAX_NOMINAL_STEP_TIME_S = 3600.0
"""Largest ``--mecefo-nominal-step-time``: an iteration longer than an hour is a unit mistake
(the paper's scenarios fail a replica every 0.5-2 h)."""

_AUTO_POLICY: Dict[str, Any] = {}
"""What :func:`register_auto_policy` plugged in: ``settings`` (a class) and ``add_arguments``."""


def register_auto_policy(settings: type, add_arguments: Callable[[Any], None]) -> None:
    """Plug ``--mecefo-policy auto`` into the takeover (the planner does, on import).

    Args:
        settings: The class of :attr:`FaultToleranceConfig.planner`
            (:class:`~megatron_mecefo.planner.config.AutoPolicyConfig`): built with no
            arguments or by ``settings.from_args(args)``; it provides ``validate``,
            ``planner_config`` and ``build_policy``.
        add_arguments: Adds its flags to the MeCeFO argument group
            (:func:`~megatron_mecefo.planner.arguments.add_planner_arguments`).
    """
    _AUTO_POLICY.update(settings=settings, add_arguments=add_arguments)


def auto_policy(what: str) -> Any:
    """The registered ``settings`` class or ``add_arguments`` function of ``auto``."""
    if what not in _AUTO_POLICY:
        raise RuntimeError(
            "--mecefo-policy auto is not plugged in: import megatron_mecefo.planner (importing "
            "megatron_mecefo does), which registers it with register_auto_policy"
        )
    return _AUTO_POLICY[what]


def _default_planner_settings() -> Any:
    return auto_policy("settings")()


@dataclass
class FaultToleranceConfig:
    """The ``--mecefo-*`` flags: policy, failure schedule and takeover techniques."""

    enabled: bool = False
    """``--mecefo``: run training through the MeCeFO controller."""

    policy: str = "neighbor"
    """Takeover policy name (``megatron_mecefo.takeover.policies.POLICIES``)."""

    techniques: MecefoConfig = field(default_factory=MecefoConfig)
    """What a takeover micro-batch does (skip-attention, FFN recompute, low-rank wgrad)."""

    failure_schedule: str = "none"
    """Where failures come from: none, scripted, low, mid, high, poisson or replay."""

    fail: List[str] = field(default_factory=list)
    """Scripted events, ``REPLICA:FAIL[:RECOVER]`` in logged (1-based) iterations."""

    nominal_step_time_s: Optional[float] = None
    """Failure-free seconds per iteration; maps time-based schedules to iterations."""

    mtbf_hours: Optional[float] = None
    """Poisson schedule: mean time between failures of one replica."""

    mttr_hours: Optional[float] = None
    """Poisson schedule: mean time to repair a failed replica."""

    failure_trace: Optional[str] = None
    """Replay schedule: path of a JSON trace."""

    seed: int = 1234
    """Seed of every random choice (failure times, victims, randomized basis)."""

    grad_error_interval: int = 0
    """Every K-th degraded iteration, log the gradient's error against the failure-free one."""

    planner: Any = field(default_factory=_default_planner_settings)
    """``--mecefo-policy auto``: the recovery planner's budgets, rank bounds and profile."""

    def build_policy(
        self, data_parallel_size: int = 1, state: Any = None, modules: Any = None
    ) -> Any:
        """The takeover policy object; for ``auto`` an
        :class:`~megatron_mecefo.planner.auto_policy.AutoPolicy` whose decisions set the FFN
        recompute and the rank of ``state`` (and drop the bases of ``modules`` on a new r)."""
        from megatron_mecefo.takeover.policies import build_policy

        if self.policy != "auto":
            return build_policy(self.policy, self.techniques.skip_attention)
        return self.planner.build_policy(
            self.planner_config(data_parallel_size),
            self.techniques.skip_attention,
            state,
            modules,
        )

    def planner_config(self, data_parallel_size: int = 1) -> Any:
        """The recovery planner's ``PlannerConfig`` of the flags, with this schedule's
        failure-rate prior (:meth:`.AutoPolicyConfig.planner_config`)."""
        return self.planner.planner_config(
            self.techniques,
            self.failure_schedule,
            self.mtbf_hours,
            self.mttr_hours,
            data_parallel_size,
        )

    def build_controller(
        self, args: Any, state: Any, chunks: Any, replica: int, dp: int, schedule: Any
    ) -> Any:
        """The :class:`~megatron_mecefo.takeover.controller.MecefoController` of replica
        ``replica`` of ``dp`` (both trainers build it here).

        Args:
            args: The job's flags (``global_batch_size``, ``micro_batch_size``,
                ``calculate_per_token_loss``, ``overlap_grad_reduce``), Megatron-LM's or the
                example trainer's.
            state: The :class:`~megatron_mecefo.techniques.state.MecefoState` the MeCeFO
                modules of ``chunks`` are bound to.
            chunks: The model chunks (the MHA groups to re-weight; ``auto``'s bases).
            schedule: The failure schedule (:meth:`build_schedule`, plus real failures under
                the recovery supervisor).
        """
        from megatron_mecefo.takeover.controller import MecefoController
        from megatron_mecefo.takeover.data_remap import GlobalBatchLayout
        from megatron_mecefo.techniques.apply import mha_group_parameters

        return MecefoController(
            schedule=schedule,
            policy=self.build_policy(dp, state, chunks),
            state=state,
            replica=replica,
            layout=GlobalBatchLayout(args.global_batch_size, args.micro_batch_size, dp),
            mha_parameters=mha_group_parameters(chunks),
            calculate_per_token_loss=args.calculate_per_token_loss,
            overlap_grad_reduce=args.overlap_grad_reduce,
        )

    @classmethod
    def from_args(cls, args: Any) -> FaultToleranceConfig:
        """The config of parsed flags (``args.seed`` is the default seed)."""
        seed = args.mecefo_seed if args.mecefo_seed is not None else getattr(args, "seed", 1234)
        schedule = args.mecefo_failure_schedule
        if schedule is None:
            schedule = "scripted" if args.mecefo_fail else "none"
        for flag, value in (
            ("--mecefo-rank", args.mecefo_rank),
            ("--mecefo-basis-interval", args.mecefo_basis_interval),
        ):
            if value < 1:
                raise MecefoConfigError(f"{flag}={value}: must be a positive integer")
        return cls(
            enabled=bool(args.mecefo),
            policy=args.mecefo_policy,
            techniques=MecefoConfig(
                skip_attention=args.mecefo_skip_attention,
                recompute_ffn=args.mecefo_recompute_ffn,
                lowrank_ffn=args.mecefo_lowrank_ffn,
                rank=args.mecefo_rank,
                basis_interval=args.mecefo_basis_interval,
                basis_method=args.mecefo_basis_method,
                seed=seed,
            ),
            failure_schedule=schedule,
            fail=list(args.mecefo_fail),
            nominal_step_time_s=args.mecefo_nominal_step_time,
            mtbf_hours=args.mecefo_mtbf_hours,
            mttr_hours=args.mecefo_mttr_hours,
            failure_trace=args.mecefo_failure_trace,
            seed=seed,
            grad_error_interval=args.mecefo_grad_error_interval,
            planner=auto_policy("settings").from_args(args),
        )

    def validate(
        self,
        *,
        data_parallel_size: int,
        hidden_size: int,
        train_iters: int,
        virtual_pipeline: bool = False,
        calculate_per_token_loss: bool = False,
        full_recompute: bool = False,
        distributed_optimizer: bool = False,
        mecefo_flags_given: Optional[str] = None,
        ffn_hidden_size: Optional[int] = None,
        gated_linear_unit: bool = False,
    ) -> List[str]:
        """Check the flags against the job; raise :class:`MecefoConfigError` on the first
        problem. ``mecefo_flags_given``: a ``--mecefo-*`` flag set explicitly, if any.

        Returns:
            Warnings (one line each) for flags that are valid but partly without effect;
            the caller prints them once, on rank 0.
        """
        warnings: List[str] = []
        if not self.enabled:
            if mecefo_flags_given:
                raise MecefoConfigError(
                    f"{mecefo_flags_given} was given without --mecefo, so it would be ignored; "
                    "add --mecefo or drop it"
                )
            return warnings
        from megatron_mecefo.takeover.policies import POLICIES

        self.planner.validate(self.policy, self.techniques, data_parallel_size, hidden_size)
        policy = POLICIES.get(self.policy) or (
            POLICIES["neighbor"] if self.policy == "auto" else None
        )
        if policy is None:
            raise MecefoConfigError(
                f"--mecefo-policy={self.policy}: unknown; use one of {sorted(POLICIES)}"
            )
        if data_parallel_size < policy.min_replicas:
            raise MecefoConfigError(
                f"--mecefo-policy={self.policy} needs at least {policy.min_replicas} data-"
                f"parallel replicas to hand a failed replica's work to, but the data-parallel "
                f"size is {data_parallel_size}; launch more ranks or lower the TP/PP sizes"
            )
        t = self.techniques
        if t.lowrank_ffn and t.rank > hidden_size:
            raise MecefoConfigError(
                f"--mecefo-rank={t.rank} exceeds --hidden-size={hidden_size}; use a rank of at "
                f"most {hidden_size} (r = hidden size already makes fc1's gradient exact), or "
                "--no-mecefo-lowrank-ffn"
            )
        if t.lowrank_ffn and ffn_hidden_size:
            # V has min(r, out, in) columns per weight; once r reaches min(out, in) of every
            # FFN weight, no weight gets a rank-limited gradient.
            fc1 = (ffn_hidden_size * (2 if gated_linear_unit else 1), hidden_size)
            fc2 = (hidden_size, ffn_hidden_size)
            full = max(min(fc1), min(fc2))
            if t.rank >= full:
                warnings.append(
                    f"--mecefo-rank={t.rank} >= min(in, out) of every FFN weight (fc1 "
                    f"{fc1[0]}x{fc1[1]}, fc2 {fc2[0]}x{fc2[1]}), so the low-rank FFN weight "
                    f"gradient is never rank-limited and saves nothing; use a rank below {full} "
                    "(e.g. 32), or --no-mecefo-lowrank-ffn"
                )
        if self.grad_error_interval < 0:
            raise MecefoConfigError(
                f"--mecefo-grad-error-interval={self.grad_error_interval}: must be >= 0"
            )
        if self.grad_error_interval and distributed_optimizer:
            raise MecefoConfigError(
                f"--mecefo-grad-error-interval={self.grad_error_interval} needs the full "
                "gradient on every rank, which the "
                "distributed optimizer's reduce-scatter does not leave; drop one of the two "
                "flags (--use-distributed-optimizer)"
            )
        if self.policy in ("neighbor", "spread", "auto") and t.skip_attention:
            if calculate_per_token_loss:
                raise MecefoConfigError(
                    f"--mecefo-policy={self.policy} with --calculate-per-token-loss is not "
                    "supported yet (the MHA re-weighting is per micro-batch); use the mean "
                    "loss, or --mecefo-policy exact/drop"
                )
        if self.policy in ("neighbor", "spread", "auto") and t.any_technique and full_recompute:
            raise MecefoConfigError(
                f"--mecefo-policy={self.policy} mixes exact and takeover micro-batches, which "
                "--recompute-granularity=full cannot do; use selective recompute or none"
            )
        if virtual_pipeline and self.policy in ("spread", "auto"):
            raise MecefoConfigError(
                f"--mecefo-policy={self.policy} gives replicas different micro-batch counts "
                "(spread, shrink), which the "
                "interleaved schedule (--num-layers-per-virtual-pipeline-stage) cannot run; use "
                "--mecefo-policy neighbor/exact/drop or no virtual pipeline"
            )
        schedule = self.build_schedule(data_parallel_size, train_iters)  # raises if bad
        late = [e for e in schedule.events if e.fail_iteration > train_iters]
        if late:
            named = ", ".join(
                f"replica {e.replica} at iteration {e.fail_iteration}" for e in late[:5]
            )
            more = f" and {len(late) - 5} more" if len(late) > 5 else ""
            warnings.append(
                f"{len(late)} failure event(s) start after the last iteration "
                f"(--train-iters={train_iters}) and never happen: {named}{more}"
            )
        return warnings

    def build_schedule(self, data_parallel_size: int, train_iters: int) -> Any:
        """The :class:`~megatron_mecefo.takeover.failure_schedule.FailureSchedule` of the flags."""
        from megatron_mecefo.takeover.failure_schedule import FailureSchedule, ScheduleError

        kind = self.failure_schedule
        if self.fail and kind != "scripted":
            raise MecefoConfigError(
                f"--mecefo-fail is only read by --mecefo-failure-schedule=scripted, not {kind}; "
                "drop one of them"
            )
        if self.failure_trace and kind != "replay":
            raise MecefoConfigError(
                f"--mecefo-failure-trace={self.failure_trace} is only read by "
                f"--mecefo-failure-schedule=replay, not {kind}; add "
                "--mecefo-failure-schedule replay or drop the trace"
            )
        for flag, value in (
            ("--mecefo-mtbf-hours", self.mtbf_hours),
            ("--mecefo-mttr-hours", self.mttr_hours),
        ):
            if value is not None and kind != "poisson":
                raise MecefoConfigError(
                    f"{flag}={value} is only read by --mecefo-failure-schedule=poisson, not "
                    f"{kind}; add --mecefo-failure-schedule poisson or drop {flag}"
                )
        needs_time = kind in ("low", "mid", "high", "poisson")
        if needs_time and not self.nominal_step_time_s:
            raise MecefoConfigError(
                f"--mecefo-failure-schedule={kind} is in hours; give "
                "--mecefo-nominal-step-time SECONDS (the failure-free time of one iteration) to "
                "map it to iterations"
            )
        step = self.nominal_step_time_s
        if step is not None and not 0 < step <= MAX_NOMINAL_STEP_TIME_S:
            raise MecefoConfigError(
                f"--mecefo-nominal-step-time={step}: give the failure-free seconds of one "
                f"iteration, above 0 and at most {MAX_NOMINAL_STEP_TIME_S:g} (one hour)"
            )
        try:
            if kind == "none":
                return FailureSchedule.none(data_parallel_size)
            if kind == "scripted":
                if not self.fail:
                    raise MecefoConfigError(
                        "--mecefo-failure-schedule=scripted needs at least one --mecefo-fail "
                        "REPLICA:FAIL[:RECOVER], e.g. --mecefo-fail 1:30:60"
                    )
                return FailureSchedule.scripted(self.fail, data_parallel_size)
            if kind in ("low", "mid", "high"):
                return FailureSchedule.paper(
                    kind, data_parallel_size, train_iters, self.nominal_step_time_s, self.seed
                )
            if kind == "poisson":
                if not self.mtbf_hours or not self.mttr_hours:
                    raise MecefoConfigError(
                        "--mecefo-failure-schedule=poisson needs --mecefo-mtbf-hours and "
                        "--mecefo-mttr-hours (both positive)"
                    )
                return FailureSchedule.poisson(
                    data_parallel_size,
                    train_iters,
                    self.nominal_step_time_s,
                    self.mtbf_hours,
                    self.mttr_hours,
                    self.seed,
                )
            if not self.failure_trace:
                raise MecefoConfigError(
                    "--mecefo-failure-schedule=replay needs --mecefo-failure-trace JSON"
                )
            return FailureSchedule.replay(
                self.failure_trace, data_parallel_size, self.nominal_step_time_s
            )
        except ScheduleError as err:
            flag = {
                "scripted": "--mecefo-fail",
                "replay": "--mecefo-failure-trace",
            }.get(kind, "--mecefo-failure-schedule")
            raise MecefoConfigError(f"{flag}: {err}") from None
