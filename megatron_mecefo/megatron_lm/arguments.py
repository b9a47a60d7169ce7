"""``--mecefo`` and the ``--mecefo-*`` flags, their config dataclass and start-up checks.

``add_arguments(parser)`` adds the flags to any argparse parser (Megatron-LM's
``extra_args_provider`` or the example trainer's); :meth:`FaultToleranceConfig.from_args`
turns them into a config, and :meth:`FaultToleranceConfig.validate` checks them against the
job, raising :class:`MecefoConfigError` with a message that names the flag, the value and the
fix, before any collective runs.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, List, NoReturn, Optional

from megatron_mecefo.errors import fail
from megatron_mecefo.techniques.config import BASIS_METHODS, MecefoConfig

POLICY_NAMES = ("neighbor", "spread", "exact", "drop", "auto")
SCHEDULES = ("none", "scripted", "low", "mid", "high", "poisson", "replay")
MAX_NOMINAL_STEP_TIME_S = 3600.0
"""Largest ``--mecefo-nominal-step-time``: an iteration longer than an hour is a unit mistake
(the paper's scenarios fail a replica every 0.5-2 h)."""


class MecefoConfigError(ValueError):
    """A bad ``--mecefo-*`` flag (combination); the message names the flag and the fix."""


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the MeCeFO flags to ``parser`` (returns it, as Megatron's extra-args providers do)."""
    g = parser.add_argument_group("MeCeFO fault tolerance (megatron_mecefo)")
    g.add_argument(
        "--mecefo",
        action="store_true",
        help="Train through data-parallel replica failures with MeCeFO (arXiv 2510.16415).",
    )
    g.add_argument(
        "--mecefo-policy",
        choices=POLICY_NAMES,
        default="neighbor",
        help="Who takes over a failed replica's micro-batches: neighbor (the paper: the next "
        "alive replica, all its work in takeover mode), spread (dealt over all alive "
        "replicas, only absorbed ones in takeover mode), exact (neighbour runs both exactly), "
        "drop (skip the failed replica's samples), auto (the recovery planner picks one per "
        "failure event within the budgets below).",
    )
    g.add_argument(
        "--mecefo-sample-loss-budget",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="auto: share of a step's samples that may be skipped (drop). Default 0: the "
        "global batch is always kept.",
    )
    g.add_argument(
        "--mecefo-approx-budget",
        type=float,
        default=1.0,
        metavar="SHARE",
        help="auto: most takeover (approximate) micro-batches per step, as a share of the "
        "global batch; bounds the gradient error. Default 1 (no bound); 0: exact choices only.",
    )
    g.add_argument(
        "--mecefo-rank-min",
        type=int,
        default=None,
        help="auto: smallest low-rank r the planner may pick (default: --mecefo-rank).",
    )
    g.add_argument(
        "--mecefo-rank-max",
        type=int,
        default=None,
        help="auto: largest low-rank r the planner may pick (default: --mecefo-rank).",
    )
    g.add_argument(
        "--mecefo-memory-headroom-mb",
        type=float,
        default=0.0,
        help="auto: activation memory (MiB) a replica may use above the failure-free peak "
        "before takeover micro-batches recompute the FFN.",
    )
    g.add_argument(
        "--mecefo-planner-profile",
        default="results/planner_profile.json",
        metavar="JSON",
        help="auto: the calibrated cost profile (python -m megatron_mecefo.planner.calibration).",
    )
    g.add_argument(
        "--mecefo-planner-calibrate-steps",
        type=int,
        default=3,
        metavar="N",
        help="auto, example trainer: rescale the profile to this machine by the measured / "
        "predicted critical path of the first N failure-free steps after the first (0: off).",
    )
    g.add_argument(
        "--mecefo-allow-shrink",
        action="store_true",
        help="auto: shrinking data parallelism to the survivors (charged the measured regroup "
        "and rejoin) is a choice.",
    )
    g.add_argument("--mecefo-rank", type=int, default=128, help="r of the low-rank FFN wgrad.")
    g.add_argument(
        "--mecefo-basis-interval",
        type=int,
        default=200,
        help="tau: iterations between refreshes of the low-rank basis V.",
    )
    g.add_argument("--mecefo-basis-method", choices=BASIS_METHODS, default="eigh")
    for name, what in (
        ("skip-attention", "no backward through attention in takeover mode"),
        ("recompute-ffn", "store only the FFN input in takeover mode"),
        ("lowrank-ffn", "low-rank FFN weight gradients in takeover mode"),
    ):
        g.add_argument(
            f"--mecefo-{name}",
            action=argparse.BooleanOptionalAction,
            default=True,
            help=f"Technique: {what} (default on).",
        )
    g.add_argument(
        "--mecefo-failure-schedule",
        choices=SCHEDULES,
        default=None,
        help="Simulated failures: scripted (--mecefo-fail), the paper's low/mid/high "
        "scenarios, poisson (--mecefo-mtbf-hours/--mecefo-mttr-hours), replay "
        "(--mecefo-failure-trace). Default: scripted if --mecefo-fail is given, else none.",
    )
    g.add_argument(
        "--mecefo-fail",
        action="append",
        default=[],
        metavar="REPLICA:FAIL[:RECOVER]",
        help="Replica REPLICA (data-parallel index) is down from iteration FAIL until "
        "RECOVER (exclusive; omitted: until the end). Repeatable.",
    )
    g.add_argument(
        "--mecefo-nominal-step-time",
        type=float,
        default=None,
        metavar="SECONDS",
        help="Failure-free seconds per iteration, to map the time-based schedules "
        "(low/mid/high, poisson, traces in seconds) to iterations.",
    )
    g.add_argument("--mecefo-mtbf-hours", type=float, default=None)
    g.add_argument("--mecefo-mttr-hours", type=float, default=None)
    g.add_argument("--mecefo-failure-trace", default=None, metavar="JSON")
    g.add_argument(
        "--mecefo-seed",
        type=int,
        default=None,
        help="Seed of the failure schedule and the basis (default: --seed).",
    )
    g.add_argument(
        "--mecefo-grad-error-interval",
        type=int,
        default=0,
        metavar="K",
        help="Every K degraded iterations, also compute the failure-free gradient of the same "
        "batch and log ||g_hat - g|| / ||g||. Costs one extra forward-backward. 0: off.",
    )
    from megatron_mecefo.abft.arguments import add_abft_arguments

    add_abft_arguments(parser)  # --mecefo-abft*: attention checksums, independent of --mecefo
    return parser


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

    sample_loss_budget: float = 0.0
    """``auto``: share of a step's samples that may be skipped."""

    approx_budget: float = 1.0
    """``auto``: most takeover micro-batches per step, as a share of the global batch."""

    rank_min: Optional[int] = None
    """``auto``: smallest r the planner may pick (None: ``techniques.rank``)."""

    rank_max: Optional[int] = None
    """``auto``: largest r the planner may pick (None: ``techniques.rank``)."""

    memory_headroom_mb: float = 0.0
    """``auto``: activation MiB allowed above the failure-free peak before FFN recompute."""

    planner_profile: str = "results/planner_profile.json"
    """``auto``: the cost profile file."""

    allow_shrink: bool = False
    """``auto``: whether shrinking data parallelism is a choice."""

    planner_calibrate_steps: int = 3
    """``auto`` (example trainer): failure-free steps that rescale the profile to this machine."""

    def planner_config(self, data_parallel_size: int = 1) -> Any:
        """The :class:`~megatron_mecefo.planner.recovery_planner.PlannerConfig` of the flags.

        The failure-rate prior is the schedule's when it has one (Poisson's MTBF and MTTR; a
        paper scenario's cluster interval times the replica count), else the planner's.
        """
        from megatron_mecefo.planner.recovery_planner import CHOICES, PlannerConfig
        from megatron_mecefo.takeover.failure_schedule import PAPER_SCENARIOS

        mtbf, mttr = self.mtbf_hours, self.mttr_hours
        if self.failure_schedule in PAPER_SCENARIOS:
            every, recover = PAPER_SCENARIOS[self.failure_schedule]
            mtbf, mttr = every * data_parallel_size, recover
        t = self.techniques
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
        )

    def build_policy(
        self, data_parallel_size: int = 1, state: Any = None, modules: Any = None
    ) -> Any:
        """The takeover policy object; for ``auto`` an
        :class:`~megatron_mecefo.planner.auto_policy.AutoPolicy` whose decisions set the FFN
        recompute and the rank of ``state`` (and drop the bases of ``modules`` on a new r)."""
        from megatron_mecefo.takeover.policies import build_policy

        if self.policy != "auto":
            return build_policy(self.policy, self.techniques.skip_attention)
        from megatron_mecefo.planner.auto_policy import AutoPolicy, technique_hook
        from megatron_mecefo.planner.calibration import load_profile

        hook = technique_hook(state, modules) if state is not None else None
        return AutoPolicy(
            load_profile(self.planner_profile),
            self.planner_config(data_parallel_size),
            self.techniques.skip_attention,
            hook,
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
            sample_loss_budget=args.mecefo_sample_loss_budget,
            approx_budget=args.mecefo_approx_budget,
            rank_min=args.mecefo_rank_min,
            rank_max=args.mecefo_rank_max,
            memory_headroom_mb=args.mecefo_memory_headroom_mb,
            planner_profile=args.mecefo_planner_profile,
            allow_shrink=args.mecefo_allow_shrink,
            planner_calibrate_steps=args.mecefo_planner_calibrate_steps,
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

        self._validate_planner(data_parallel_size, hidden_size, virtual_pipeline)
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

    def _validate_planner(self, dp: int, hidden_size: int, virtual_pipeline: bool) -> None:
        """The ``auto`` flags: budgets in [0, 1], rank bounds, a readable profile."""
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
        if self.planner_calibrate_steps != 3:
            given.append(f"--mecefo-planner-calibrate-steps={self.planner_calibrate_steps}")
        if self.policy != "auto":
            if given:
                raise MecefoConfigError(
                    f"{given[0]} is read only by --mecefo-policy auto (the recovery planner), "
                    f"not {self.policy}; add --mecefo-policy auto or drop it"
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
        lo = self.rank_min or self.techniques.rank
        hi = self.rank_max or self.techniques.rank
        if not 1 <= lo <= hi:
            raise MecefoConfigError(
                f"--mecefo-rank-min={lo} / --mecefo-rank-max={hi}: need 1 <= min <= max "
                "(each defaults to --mecefo-rank)"
            )
        if self.techniques.lowrank_ffn and hi > hidden_size:
            raise MecefoConfigError(
                f"--mecefo-rank-max={hi} exceeds --hidden-size={hidden_size}; use at most "
                f"{hidden_size}"
            )
        if self.planner_calibrate_steps < 0:
            raise MecefoConfigError(
                f"--mecefo-planner-calibrate-steps={self.planner_calibrate_steps}: must be >= 0"
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
        from megatron_mecefo.planner.calibration import load_profile

        try:
            load_profile(self.planner_profile)
        except (FileNotFoundError, ValueError) as err:
            raise MecefoConfigError(f"--mecefo-planner-profile: {err}") from None

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


def exit_with_config_error(message: object, prog: str = "pretrain_gpt.py") -> NoReturn:
    """Print ``prog: error: message`` once and exit 2 on every rank (:func:`errors.fail`)."""
    fail(message, prog)


VALUE_FLAGS = ("--mecefo-fail",)
"""Flags whose value may start with ``-`` (``--mecefo-fail -1:5:10``), which argparse would
otherwise read as an option (and fail with "expected one argument")."""


def normalize_argv(argv: List[str]) -> List[str]:
    """``argv`` with ``--mecefo-fail -1:5:10`` joined into ``--mecefo-fail=-1:5:10``, so a
    negative replica reaches the schedule check, which names it, instead of argparse."""
    out: List[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if arg in VALUE_FLAGS and nxt is not None and nxt[:1] == "-" and nxt[1:2].isdigit():
            out.append(f"{arg}={nxt}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def mecefo_flags_given(args: Any, parser: argparse.ArgumentParser) -> Optional[str]:
    """The first ``--mecefo-*`` flag (with its value) that differs from its default."""
    for action in parser._actions:  # noqa: SLF001 (argparse has no public action list)
        dest = action.dest
        value = getattr(args, dest, None)
        if dest.startswith("mecefo_") and value != action.default:
            return f"{action.option_strings[0]}={value}"
    return None
