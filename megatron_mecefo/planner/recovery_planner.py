"""The recovery planner behind ``--mecefo-policy auto``: one decision per failure event.

A pure function (:func:`plan_recovery`): from the failure state, a calibrated
:class:`CostProfile`, the memory headroom and the user's budgets (:class:`PlannerConfig`) it
returns a :class:`Decision`: the takeover policy (``neighbor``, ``spread``, ``exact``,
``drop``, or ``shrink``: data parallelism shrunk to the survivors, who split the global batch
exactly), whether takeover micro-batches recompute the FFN, the low-rank r, and the predicted
step time and transition cost. It makes no ``torch.distributed`` call and no random draw, so
every rank that calls it with the same arguments gets the same decision.

Each candidate is costed on the real plan of the real policy (:mod:`megatron_mecefo.takeover`):

* step time ``T = max_r (e_r exact + t_r takeover(recompute, r)) + optimizer + sync(n')``
  (the critical path of :mod:`.step_cost_model`; ``n' = n - k`` after a shrink), plus the
  basis refresh amortised over τ steps on a replica that runs takeover micro-batches;
* transition cost ``C``: a basis computation when takeover starts; the measured regroup and
  rejoin for ``shrink`` (a simulated or in-process takeover keeps every process: no regroup);
* horizon ``H``: the expected time until the failed set changes, ``1 / ((n-k)/MTBF + k/MTTR)``
  from the observed failure and repair rates;
* objective: time per processed sample, ``J = T (1 + C / H) / (P / nM)`` (``P`` processed of
  ``nM`` micro-batches), i.e. the inverse of the amortised throughput. The smallest ``J``
  wins; ties go to the larger r (more accurate gradient), then to the order of
  :data:`CHOICES`.

Budgets: ``drop`` only when the share of samples it skips is within ``sample_loss_budget``;
takeover micro-batches at most ``approx_budget`` of the global batch; r within
``[rank_min, rank_max]``. Gradient quality: each candidate's gradient relative error is
predicted (:mod:`.gradient_error_model`, from its takeover or skipped share, its policy and r),
and the fastest candidate whose prediction is within ``grad_error_budget`` wins; when none is
within it, the candidate of least predicted error is taken, with a note.

FFN recomputation is switched on only when the plan's predicted
peak activation memory (saved activations of the micro-batches in flight) without it exceeds
the failure-free peak plus ``memory_headroom_bytes``; a candidate that exceeds it even with
recomputation is not allowed. ``exact`` keeps every gradient exact and every sample; when no
candidate fits, it is taken with a note.

Snapshot-based recovery (in-memory snapshots, the snapshot issue) is not a choice yet: its
costs have not been measured in this repository.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, FrozenSet, Iterable, List, Optional, Tuple

from megatron_mecefo.planner.gradient_error_model import GradErrorModel
from megatron_mecefo.takeover.plan import TAKEOVER
from megatron_mecefo.takeover.policies import TakeoverPolicy, build_policy
from megatron_mecefo.takeover.policies.shrink import ShrinkPolicy

CHOICES = ("spread", "neighbor", "exact", "shrink", "drop")
"""Every recovery choice, in tie-break order."""

TAKEOVER_CHOICES = ("spread", "neighbor")
"""Choices that run takeover (approximate) micro-batches."""


@dataclass(frozen=True)
class CostProfile:
    """Calibrated costs of one replica, all times in ms and memory in bytes.

    Built by :mod:`.calibration` from a start-up profile or the benchmark result files.
    """

    exact_ms: float
    """One exact micro-batch, forward and backward, the whole model."""

    takeover_ms: float
    """One takeover micro-batch without FFN recomputation, at ``profile_rank``."""

    takeover_recompute_ms: float
    """One takeover micro-batch with FFN recomputation, at ``profile_rank``."""

    optimizer_ms: float
    """The optimizer step, once per step on every replica."""

    sync_ms: float
    """The gradient all-reduce measured with ``sync_replicas`` replicas."""

    sync_replicas: int
    """Replica count of ``sync_ms``; other counts scale as the ring term ``2(n-1)/n``."""

    profile_rank: int = 32
    """The low-rank r at which ``takeover_ms``, ``takeover_recompute_ms`` and
    ``basis_refresh_ms`` were measured."""

    takeover_ms_per_rank: float = 0.0
    """d(takeover micro-batch)/dr: the low-rank weight gradient's time per unit of r."""

    basis_refresh_ms: float = 0.0
    """One basis computation of every FFN weight on a replica, at ``profile_rank``."""

    regroup_ms: float = 0.0
    """Rebuilding the world without the failed replicas (``shrink``); measured on real
    rank deaths (``results/recovery_latency_*.json``)."""

    rejoin_ms: float = 0.0
    """Growing the world back when the failed replica returns (``shrink``)."""

    activation_exact_bytes: float = 0.0
    """Activations saved for backward by one exact micro-batch."""

    activation_takeover_bytes: float = 0.0
    """Activations saved by one takeover micro-batch without recomputation, at
    ``profile_rank``."""

    activation_takeover_recompute_bytes: float = 0.0
    """Activations saved by one takeover micro-batch with FFN recomputation, at
    ``profile_rank``."""

    activation_bytes_per_rank: float = 0.0
    """d(takeover activations)/dr: the saved ``X V`` grows with r."""

    in_flight: int = 1
    """Micro-batches whose activations are alive at once on one rank (1 with PP = 1; up to
    the pipeline depth with 1F1B)."""

    source: str = ""
    """Where the numbers come from, for the logs."""

    def takeover_time(self, recompute: bool, rank: int) -> float:
        """One takeover micro-batch at low-rank ``rank``."""
        base = self.takeover_recompute_ms if recompute else self.takeover_ms
        return base + self.takeover_ms_per_rank * (rank - self.profile_rank)

    def takeover_activation(self, recompute: bool, rank: int) -> float:
        """Activations saved by one takeover micro-batch at ``rank``."""
        base = (
            self.activation_takeover_recompute_bytes
            if recompute
            else self.activation_takeover_bytes
        )
        return base + self.activation_bytes_per_rank * (rank - self.profile_rank)

    def sync_time(self, n: int) -> float:
        """Ring all-reduce time at ``n`` replicas."""
        m = self.sync_replicas
        if n <= 1:
            return 0.0
        return self.sync_ms * ((n - 1) / n) / ((m - 1) / m) if m > 1 else self.sync_ms

    def failure_free_step(self, n: int, microbatches: int) -> float:
        """Step time with every replica up."""
        return microbatches * self.exact_ms + self.optimizer_ms + self.sync_time(n)

    def to_json(self) -> Dict[str, Any]:
        """The profile, for logs and result files."""
        return asdict(self)


@dataclass(frozen=True)
class PlannerConfig:
    """The user's budgets and the planner's knobs (``--mecefo-*`` flags)."""

    sample_loss_budget: float = 0.0
    """Share of the global batch's samples a step may skip (``drop``). 0: the global batch is
    always kept (``--mecefo-sample-loss-budget``)."""

    approx_budget: float = 1.0
    """Most takeover micro-batches per step, as a share of the global batch's micro-batches;
    it bounds the gradient error (``--mecefo-approx-budget``). 0 allows only exact choices."""

    rank_min: int = 32
    """Smallest low-rank r the planner may pick."""

    rank_max: int = 32
    """Largest low-rank r the planner may pick."""

    memory_headroom_bytes: float = 0.0
    """Memory a replica may use above the failure-free peak before takeover micro-batches
    must recompute the FFN."""

    recompute_ffn: bool = True
    """Whether FFN recomputation is available (``--[no-]mecefo-recompute-ffn``); when off, a
    takeover plan that needs it is not allowed."""

    allow_shrink: bool = False
    """Whether shrinking data parallelism is a choice (needs the real-failure regroup)."""

    policies: Tuple[str, ...] = CHOICES
    """The choices the planner may take, a subset of :data:`CHOICES`."""

    basis_interval: int = 200
    """τ: steps between basis refreshes on a replica that keeps running takeover work."""

    skip_attention: bool = True
    """``MecefoConfig.skip_attention``: passed to the policies' plans."""

    mtbf_hours: float = 16.0
    """Per-replica mean time between failures used for the horizon until failures are
    observed (the paper's high frequency at 32 replicas: one failure every 0.5 h)."""

    mttr_hours: float = 2.0
    """Mean time to repair used for the horizon until repairs are observed."""

    grad_error_budget: float = math.inf
    """Largest predicted gradient relative error ``||g_hat - g|| / ||g||`` of a choice: the
    fastest candidate within it wins; when none is within it, the one of least predicted error
    is taken. ``inf`` (here): no bound; the flag ``--mecefo-grad-error-budget`` has a finite
    default (:data:`megatron_mecefo.planner.config.DEFAULT_GRAD_ERROR_BUDGET`)."""

    grad_error_model: Optional[GradErrorModel] = field(default=None, compare=False)
    """The error predictor; None: the calibrated default
    (:data:`megatron_mecefo.planner.gradient_error_model.DEFAULT_MODEL`)."""

    def error_model(self) -> GradErrorModel:
        """The gradient-error predictor in use."""
        from megatron_mecefo.planner.gradient_error_model import DEFAULT_MODEL

        return self.grad_error_model or DEFAULT_MODEL

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field, the value and the fix."""
        if not 0.0 <= self.sample_loss_budget <= 1.0:
            raise ValueError(
                f"sample_loss_budget={self.sample_loss_budget}: must be a share in [0, 1]"
            )
        if not 0.0 <= self.approx_budget <= 1.0:
            raise ValueError(f"approx_budget={self.approx_budget}: must be a share in [0, 1]")
        if not 1 <= self.rank_min <= self.rank_max:
            raise ValueError(
                f"rank bounds [{self.rank_min}, {self.rank_max}]: need 1 <= rank_min <= rank_max"
            )
        bad = [p for p in self.policies if p not in CHOICES]
        if bad or not self.policies:
            raise ValueError(f"policies={self.policies}: use a non-empty subset of {CHOICES}")
        if self.memory_headroom_bytes < 0:
            raise ValueError(f"memory_headroom_bytes={self.memory_headroom_bytes}: must be >= 0")
        if self.mtbf_hours <= 0 or self.mttr_hours <= 0:
            raise ValueError("mtbf_hours and mttr_hours must be positive")
        if not self.grad_error_budget >= 0:  # also refuses NaN
            raise ValueError(
                f"grad_error_budget={self.grad_error_budget}: must be >= 0 (inf: no bound)"
            )


@dataclass(frozen=True)
class FailureState:
    """What the planner knows at a failure event."""

    num_replicas: int
    """n, the data-parallel size of the job."""

    failed: FrozenSet[int]
    """The replicas down now."""

    microbatches: int
    """M, micro-batches per replica in the failure-free plan."""

    mtbf_hours: Optional[float] = None
    """Observed per-replica mean time between failures; None: the config's prior."""

    mttr_hours: Optional[float] = None
    """Observed mean time to repair; None: the config's prior."""


@dataclass(frozen=True)
class Decision:
    """The planner's answer for one failed set."""

    policy: str
    """One of :data:`CHOICES`, or ``"none"`` with every replica up or every replica down."""
    recompute_ffn: bool
    """Whether takeover micro-batches recompute the FFN."""
    rank: Optional[int]
    """The low-rank r of takeover micro-batches (None: the choice runs none)."""
    step_time_ms: float
    """Predicted steady-state step time, basis refresh amortised over τ."""
    transition_ms: float
    """Predicted one-off cost of entering this choice (basis computation, regroup, rejoin)."""
    horizon_s: float
    """Expected time until the failed set changes."""
    objective: float
    """Amortised ms per failure-free step's worth of samples (smaller is better)."""
    throughput_rel: float
    """Amortised samples/s relative to failure-free (``failure_free_step / objective``)."""
    peak_memory_bytes: float
    """Predicted peak activation memory of the worst replica."""
    failure_free_peak_bytes: float
    """The same with every replica up."""
    takeover_share: float
    """Takeover micro-batches as a share of the global batch."""
    samples_lost_share: float
    """Share of the global batch skipped per step."""
    notes: Tuple[str, ...] = ()
    """Why, in a few words (fallbacks, budget or memory limits)."""
    grad_error: float = 0.0
    """Predicted gradient relative error ``||g_hat - g|| / ||g||`` of the choice."""

    def summary(self) -> Dict[str, Any]:
        """The metrics-record fields of the decision."""
        d = asdict(self)
        d["notes"] = list(self.notes)
        return d


def build_choice(name: str, skip_attention: bool = True) -> TakeoverPolicy:
    """The policy object of a choice: a ``--mecefo-policy`` policy, or ``shrink``."""
    if name == "shrink":
        return ShrinkPolicy(skip_attention=skip_attention)
    return build_policy(name, skip_attention)


@dataclass(frozen=True)
class _PlanShape:
    """A policy's plan reduced to what the cost model needs."""

    pairs: Tuple[Tuple[int, int], ...]
    """Distinct (exact, takeover) micro-batch counts over the alive replicas."""
    processed: int
    takeover: int
    replicas_after: int
    notes: Tuple[str, ...] = field(default=())


REAL_PLAN_LIMIT = 256
"""Largest ``n M`` whose plans are built with the real policy objects; above it (cluster-scale
simulation) :func:`analytic_shape` gives the same counts in O(1) (a test checks they agree)."""


def analytic_shape(policy: str, n: int, k: int, m: int) -> Optional[_PlanShape]:
    """A policy's plan counts from (n, k, M) alone, or None where they depend on which
    replicas are down (more replicas down than up: ring neighbours collide).

    With ``k <= n - k`` the ring rule gives every failed replica its own absorber, so
    ``neighbor`` and ``exact`` have k absorbers of 2M micro-batches; ``spread`` and
    ``shrink`` deal the kM micro-batches round-robin (``floor`` or ``ceil`` of kM/(n-k) each).
    """
    alive = n - k
    if k == 0 or alive <= 0:
        return None
    q, rem = divmod(k * m, alive)
    if policy == "drop":
        return _PlanShape(((m, 0),), alive * m, 0, n)
    if policy in ("spread", "shrink"):
        counts = {q + 1} if rem else set()
        if alive - rem > 0:
            counts.add(q)
        if policy == "spread":
            pairs = tuple(sorted((m, c) for c in counts))
            return _PlanShape(pairs, n * m, k * m, n)
        return _PlanShape(tuple(sorted((m + c, 0) for c in counts)), n * m, 0, alive)
    if k > alive:
        return None
    normal = alive - k
    if policy == "exact":
        pairs = {(2 * m, 0)} | ({(m, 0)} if normal else set())
        return _PlanShape(tuple(sorted(pairs)), n * m, 0, n)
    if policy == "neighbor":
        if normal:
            return _PlanShape(tuple(sorted({(0, 2 * m), (m, 0)})), n * m, 2 * k * m, n)
        return _PlanShape(((m, m),), n * m, k * m, n)
    return None


@functools.lru_cache(maxsize=4096)
def _plan_shape(
    policy: str, failed: FrozenSet[int], n: int, m: int, skip_attention: bool
) -> _PlanShape:
    """The real policy's plan, reduced (cached: the simulator asks for it many times)."""
    if n * m > REAL_PLAN_LIMIT:
        shape = analytic_shape(policy, n, len(failed), m)
        if shape is not None:
            return shape
    plan = build_choice(policy, skip_attention).plan(1, failed, n, m)
    pairs = set()
    for r, work in enumerate(plan.work):
        if r in failed:
            continue
        t = sum(mb.mode is TAKEOVER for mb in work)
        pairs.add((len(work) - t, t))
    after = n - len(failed) if policy == "shrink" else n
    return _PlanShape(tuple(sorted(pairs)), plan.processed, plan.num_takeover, after, plan.notes)


def expected_duration_s(n: int, k: int, mtbf_hours: float, mttr_hours: float) -> float:
    """Expected seconds until the failed set changes: the first of ``n - k`` failures at rate
    1/MTBF each and ``k`` repairs at rate 1/MTTR each."""
    rate = (n - k) / (mtbf_hours * 3600.0) + k / (mttr_hours * 3600.0)
    return math.inf if rate <= 0 else 1.0 / rate


def rank_candidates(cfg: PlannerConfig) -> List[int]:
    """r values tried: the bounds and the powers of two between them."""
    ranks = {cfg.rank_min, cfg.rank_max}
    p = 1
    while p <= cfg.rank_max:
        if p >= cfg.rank_min:
            ranks.add(p)
        p *= 2
    return sorted(ranks)


@dataclass(frozen=True)
class Evaluation:
    """One candidate's predicted costs (``evaluate``), allowed or not."""

    policy: str
    recompute_ffn: bool
    rank: Optional[int]
    step_time_ms: float
    transition_ms: float
    objective: float
    peak_memory_bytes: float
    takeover_share: float
    samples_lost_share: float
    notes: Tuple[str, ...]
    grad_error: float = 0.0
    """Predicted gradient relative error (:mod:`.gradient_error_model`)."""


def evaluate(
    policy: str,
    recompute: bool,
    rank: Optional[int],
    state: FailureState,
    profile: CostProfile,
    cfg: PlannerConfig,
) -> Evaluation:
    """Predicted step time, transition cost, objective and memory of one candidate."""
    n, m, k = state.num_replicas, state.microbatches, len(state.failed)
    shape = _plan_shape(policy, frozenset(state.failed), n, m, cfg.skip_attention)
    r = rank if rank is not None else profile.profile_rank
    t_mb = profile.takeover_time(recompute, r)
    has_takeover = shape.takeover > 0
    # Basis refresh: on the critical path of a takeover replica every τ steps.
    refresh = profile.basis_refresh_ms * r / profile.profile_rank if has_takeover else 0.0
    work = max(e * profile.exact_ms + t * t_mb for e, t in shape.pairs)
    if has_takeover:
        work = max(
            e * profile.exact_ms + t * t_mb + (refresh / cfg.basis_interval if t else 0.0)
            for e, t in shape.pairs
        )
    step = work + profile.optimizer_ms + profile.sync_time(shape.replicas_after)
    transition = refresh
    if policy == "shrink":
        transition += profile.regroup_ms + profile.rejoin_ms
    mtbf = state.mtbf_hours or cfg.mtbf_hours
    mttr = state.mttr_hours or cfg.mttr_hours
    horizon_ms = expected_duration_s(n, k, mtbf, mttr) * 1e3
    frac = shape.processed / (n * m)
    objective = step * (1.0 + transition / horizon_ms) / frac if frac > 0 else math.inf
    # Peak activation memory: the largest micro-batch's saved activations times the
    # micro-batches in flight (Megatron runs a replica's micro-batches one after another, so
    # absorbed ones add to the peak only through the in-flight count under 1F1B).
    in_flight = profile.in_flight
    act_t = profile.takeover_activation(recompute, r)
    peak = 0.0
    for e, t in shape.pairs:
        biggest = max(profile.activation_exact_bytes if e else 0.0, act_t if t else 0.0)
        peak = max(peak, biggest * min(in_flight, e + t))
    takeover_share = shape.takeover / (n * m)
    grad_error = cfg.error_model().predict(
        policy, takeover_share, 1.0 - frac, rank if has_takeover else None
    )
    return Evaluation(
        policy,
        recompute,
        rank if has_takeover else None,
        step,
        transition,
        objective,
        peak,
        takeover_share,
        1.0 - frac,
        shape.notes,
        grad_error,
    )


def candidates(
    state: FailureState, cfg: PlannerConfig
) -> Iterable[Tuple[str, bool, Optional[int]]]:
    """Every (policy, recompute, r) the planner considers, allowed or not."""
    for policy in cfg.policies:
        if policy in TAKEOVER_CHOICES:
            for recompute in (False, True):
                for r in rank_candidates(cfg):
                    yield policy, recompute, r
        else:
            yield policy, False, None


def violations(
    ev: Evaluation, state: FailureState, profile: CostProfile, cfg: PlannerConfig
) -> List[str]:
    """Why a candidate is not allowed (empty: allowed)."""
    n, k = state.num_replicas, len(state.failed)
    why = []
    if ev.samples_lost_share > cfg.sample_loss_budget + 1e-12:
        why.append(f"skips {ev.samples_lost_share:.3f} > sample-loss budget")
    if ev.takeover_share > cfg.approx_budget + 1e-12:
        why.append(f"takeover share {ev.takeover_share:.3f} > approx budget")
    if ev.policy == "shrink" and not cfg.allow_shrink:
        why.append("shrink needs the real-failure regroup")
    if ev.policy in ("neighbor", "spread", "exact") and n - k < 1:
        why.append("no replica up")
    limit = ff_peak(state, profile) + cfg.memory_headroom_bytes
    if ev.recompute_ffn:
        if not cfg.recompute_ffn:
            why.append("FFN recompute is switched off")
        no_rc = evaluate(ev.policy, False, ev.rank, state, profile, cfg)
        if no_rc.peak_memory_bytes <= limit:
            why.append("recompute not needed: fits without it")
    if ev.peak_memory_bytes > limit:
        why.append("peak memory above failure-free peak + headroom")
    return why


def ff_peak(state: FailureState, profile: CostProfile) -> float:
    """Failure-free peak activation memory of one replica."""
    return profile.activation_exact_bytes * min(profile.in_flight, state.microbatches)


def plan_recovery(state: FailureState, profile: CostProfile, cfg: PlannerConfig) -> Decision:
    """The decision for ``state``: the allowed candidate of smallest amortised time per sample.

    Among the candidates allowed by the budgets and the memory headroom, those whose predicted
    gradient error is within ``cfg.grad_error_budget`` compete on time; when none is within it,
    the one of least predicted error is taken (ties: time), with a note.

    With every replica up the answer is ``"none"`` at the failure-free step time; with every
    replica down it is ``"none"`` with no update. ``exact`` is always allowed otherwise (no
    skipped sample, no approximation); when no candidate fits the memory headroom (several
    micro-batches in flight), ``exact`` is taken with a note. Without ``exact`` among
    ``cfg.policies`` and nothing allowed, a ``ValueError`` says which budgets excluded every
    choice.
    """
    n, m, k = state.num_replicas, state.microbatches, len(state.failed)
    mtbf = state.mtbf_hours or cfg.mtbf_hours
    mttr = state.mttr_hours or cfg.mttr_hours
    horizon = expected_duration_s(n, k, mtbf, mttr)
    ff = profile.failure_free_step(n, m)
    peak0 = ff_peak(state, profile)
    if k == 0 or k >= n:
        return Decision(
            "none", False, None, ff if k == 0 else profile.sync_time(n), 0.0, horizon,
            ff if k == 0 else math.inf, 1.0 if k == 0 else 0.0, peak0, peak0, 0.0,
            0.0 if k == 0 else 1.0,
            () if k == 0 else ("every replica is down: no update",),
        )  # fmt: skip
    best: Optional[Tuple[tuple, Evaluation]] = None
    least_error: Optional[Tuple[tuple, Evaluation]] = None  # when none is within the budget
    rejected: List[str] = []
    for i, (policy, recompute, rank) in enumerate(candidates(state, cfg)):
        ev = evaluate(policy, recompute, rank, state, profile, cfg)
        why = violations(ev, state, profile, cfg)
        if why:
            rejected.append(f"{policy}/rc={int(recompute)}/r={rank}: {why[0]}")
            continue
        key = (ev.objective, -(rank or 0), CHOICES.index(policy), i)
        if ev.grad_error <= cfg.grad_error_budget + 1e-12:
            if best is None or key < best[0]:
                best = (key, ev)
        elif least_error is None or (ev.grad_error, *key) < least_error[0]:
            least_error = ((ev.grad_error, *key), ev)
    notes: Tuple[str, ...] = ()
    if best is None and least_error is not None:
        best = least_error
        notes = (
            f"no choice within the gradient-error budget {cfg.grad_error_budget:g}; least "
            f"predicted error taken ({least_error[1].grad_error:.3f})",
        )
    if best is None and "exact" in cfg.policies:
        # Nothing fits (memory: with several micro-batches in flight a neighbour running
        # twice the micro-batches holds more activations): exact, lossless, over the headroom.
        ev = evaluate("exact", False, None, state, profile, cfg)
        best = ((ev.objective,), ev)
        notes = ("no choice fits the budgets and the memory headroom; exact taken above it",)
    if best is None:
        raise ValueError(
            f"no recovery choice fits the budgets for {k} of {n} replicas down: "
            + "; ".join(rejected[:6])
            + " (allow 'exact' or raise --mecefo-approx-budget / --mecefo-sample-loss-budget)"
        )
    ev = best[1]
    return Decision(
        policy=ev.policy,
        recompute_ffn=ev.recompute_ffn,
        rank=ev.rank,
        step_time_ms=ev.step_time_ms,
        transition_ms=ev.transition_ms,
        horizon_s=horizon,
        objective=ev.objective,
        throughput_rel=ff / ev.objective,
        peak_memory_bytes=ev.peak_memory_bytes,
        failure_free_peak_bytes=peak0,
        takeover_share=ev.takeover_share,
        samples_lost_share=ev.samples_lost_share,
        notes=ev.notes + notes,
        grad_error=ev.grad_error,
    )


def fixed_decision(
    policy: str, state: FailureState, profile: CostProfile, cfg: PlannerConfig
) -> Decision:
    """The same costs for a fixed ``policy`` (the baselines ``auto`` is compared with): its
    recompute is the memory rule's, its r is ``cfg.rank_min``; budgets are not applied."""
    n, k = state.num_replicas, len(state.failed)
    if k == 0 or k >= n:
        return plan_recovery(state, profile, cfg)
    rank = cfg.rank_min if policy in TAKEOVER_CHOICES else None
    ev = evaluate(policy, False, rank, state, profile, cfg)
    if ev.peak_memory_bytes > ff_peak(state, profile) + cfg.memory_headroom_bytes:
        ev = evaluate(policy, True, rank, state, profile, cfg)
    horizon = expected_duration_s(
        n, k, state.mtbf_hours or cfg.mtbf_hours, state.mttr_hours or cfg.mttr_hours
    )
    ff = profile.failure_free_step(n, state.microbatches)
    return Decision(
        policy, ev.recompute_ffn, ev.rank, ev.step_time_ms, ev.transition_ms, horizon,
        ev.objective, ff / ev.objective if ev.objective else 0.0, ev.peak_memory_bytes,
        ff_peak(state, profile), ev.takeover_share, ev.samples_lost_share, ev.notes,
        ev.grad_error,
    )  # fmt: skip


def with_budgets(cfg: PlannerConfig, **changes: Any) -> PlannerConfig:
    """``cfg`` with some fields changed, validated."""
    new = replace(cfg, **changes)
    new.validate()
    return new
