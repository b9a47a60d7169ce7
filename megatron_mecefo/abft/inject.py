"""Seeded fault injection into a chosen GEMM output (tests and demos only).

A rule is ``key=value`` pairs separated by commas (``--mecefo-abft-inject``, repeatable)::

    kind=bitflip,op=scores,layer=2,every=10          # a bit flip every 10th iteration
    kind=nan,op=proj,layer=*,iter=30,mb=1,rank=0     # one NaN at iteration 30, micro-batch 1

============  =============================================================================
key           meaning (default)
============  =============================================================================
``kind``      ``bitflip`` (ATTNChecker's: exponent MSB if ``|x| < 2``, else the next bit),
              ``inf``, ``nan`` or ``near_inf`` (writes ``1e20``) (``bitflip``)
``op``        ``qkv``, ``scores``, ``context``, ``proj`` or ``*`` (``*``: seeded choice)
``layer``     global 1-based layer number, or ``*`` (``*``)
``iter``      inject at this iteration (1-based, as logged) …
``every``     … or at every N-th iteration, from ``start`` (N); one of the two is required
``mb``        micro-batch index within the step (0)
``rank``      global rank whose GEMM is hit (0); other ranks see a fault-free step
``pattern``   ``point`` (one element), ``line`` (two in one token-sum line), ``row`` (two in
              one row: same token, two columns) or ``block`` (2×2) (``point``)
============  =============================================================================

Positions are drawn from ``(seed, iteration, micro-batch, layer, op)``, so every run with the
same flags hits the same elements. Zeros are avoided (a flipped zero is a harmless 2.0), and
for ``scores`` only positions the causal mask keeps (key ≤ query) are drawn, because a fault
in a masked score cannot change the result. A rule fires once per (iteration, micro-batch),
so a recomputed forward (activation recompute) sees no second fault.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Set, Tuple

from megatron_mecefo.abft.choices import OPS, AbftConfigError
from megatron_mecefo.abft.metrics import classify

if TYPE_CHECKING:
    import torch

KINDS = ("bitflip", "inf", "nan", "near_inf")
PATTERNS = ("point", "line", "row", "block")
NEAR_INF_VALUE = 1e20


@dataclass(frozen=True)
class FaultRule:
    """One parsed ``--mecefo-abft-inject`` rule."""

    kind: str = "bitflip"
    op: Optional[str] = None
    layer: Optional[int] = None
    iteration: Optional[int] = None
    every: Optional[int] = None
    start: Optional[int] = None
    microbatch: int = 0
    rank: int = 0
    pattern: str = "point"

    def fires_at(self, iteration: int) -> bool:
        if self.iteration is not None:
            return iteration == self.iteration
        start = self.start if self.start is not None else self.every
        return iteration >= start and (iteration - start) % self.every == 0


def parse_rule(spec: str) -> FaultRule:
    """Parse one rule; raises :class:`AbftConfigError` naming the flag, the value and the fix."""
    where = f"--mecefo-abft-inject {spec!r}"
    fields: Dict[str, object] = {}
    keys = {"kind", "op", "layer", "iter", "every", "start", "mb", "rank", "pattern"}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key not in keys:
            raise AbftConfigError(
                f"{where}: {part!r} is not KEY=VALUE with KEY in {sorted(keys)}; "
                "e.g. kind=inf,op=scores,layer=1,iter=10"
            )
        if key == "kind":
            if value not in KINDS:
                raise AbftConfigError(f"{where}: kind={value}; use one of {KINDS}")
            fields["kind"] = value
        elif key == "op":
            if value not in (*OPS, "*"):
                raise AbftConfigError(f"{where}: op={value}; use one of {OPS} or *")
            fields["op"] = None if value == "*" else value
        elif key == "pattern":
            if value not in PATTERNS:
                raise AbftConfigError(f"{where}: pattern={value}; use one of {PATTERNS}")
            fields["pattern"] = value
        elif key == "layer" and value == "*":
            fields["layer"] = None
        else:
            try:
                number = int(value)
            except ValueError:
                raise AbftConfigError(f"{where}: {key}={value} is not an integer") from None
            lowest = 0 if key in ("mb", "rank") else 1
            if number < lowest:
                raise AbftConfigError(f"{where}: {key}={number} must be >= {lowest}")
            name = {"iter": "iteration", "mb": "microbatch"}.get(key, key)
            fields[name] = number
    if ("iteration" in fields) == ("every" in fields):
        raise AbftConfigError(f"{where}: give exactly one of iter=I or every=N")
    if "start" in fields and "every" not in fields:
        raise AbftConfigError(f"{where}: start= needs every=N")
    return FaultRule(**fields)  # type: ignore[arg-type]


@dataclass
class Injected:
    """One element written by the injector, in the op's line coordinates."""

    layer: int
    op: str
    block: int
    position: int
    line: int
    kind: str
    """What the element became: ``nan``, ``inf``, ``near_inf`` or ``error``."""
    iteration: int
    microbatch: int


def flip_exponent(value: torch.Tensor) -> torch.Tensor:
    """ATTNChecker's bit flip on one element: exponent MSB if ``|x| < 2``, else the next bit."""
    import torch

    big = bool(value.abs() >= 2)
    if value.dtype == torch.float32:
        bits, mask = value.view(torch.int32), (1 << 29) if big else (1 << 30)
    elif value.dtype in (torch.bfloat16, torch.float16):
        bits, mask = value.view(torch.int16), (1 << 13) if big else (1 << 14)
    elif value.dtype == torch.float64:
        bits, mask = value.view(torch.int64), (1 << 61) if big else (1 << 62)
    else:
        raise TypeError(f"cannot flip bits of {value.dtype}")
    return (bits ^ mask).view(value.dtype)


class FaultInjector:
    """Applies the rules to this process's GEMM outputs; seeded and deterministic."""

    def __init__(
        self, rules: Sequence[FaultRule], seed: int, rank: int, near_inf: float = 1e10
    ) -> None:
        self.rules = list(rules)
        self.near_inf = near_inf
        self.seed = seed
        self.rank = rank
        self.sites: List[Tuple[int, str]] = []
        self._fired: Set[Tuple[int, int, int]] = set()
        self.log: List[Injected] = []

    def bind_sites(self, sites: Sequence[Tuple[int, str]]) -> None:
        """The (layer, op) sites of this process's model, for ``layer=*`` / ``op=*``."""
        self.sites = sorted(set(sites))

    def reset(self) -> None:
        self._fired.clear()
        self.log.clear()

    def _target(self, k: int, rule: FaultRule, iteration: int) -> Optional[Tuple[int, str]]:
        sites = [
            s
            for s in self.sites
            if (rule.layer is None or s[0] == rule.layer) and (rule.op is None or s[1] == rule.op)
        ]
        if not sites:
            return None
        return random.Random(f"{self.seed}:{k}:{iteration}:site").choice(sites)

    def inject(
        self,
        layer: int,
        op: str,
        lines: torch.Tensor,
        iteration: int,
        microbatch: int,
        causal: bool = False,
    ) -> List[Injected]:
        """Write this site's faults (if any) into ``lines`` (``[B, n, m]`` view, in place)."""
        if self.rank not in {r.rank for r in self.rules}:
            return []
        done: List[Injected] = []
        for k, rule in enumerate(self.rules):
            if rule.rank != self.rank or rule.microbatch != microbatch:
                continue
            if not rule.fires_at(iteration) or (k, iteration, microbatch) in self._fired:
                continue
            if self._target(k, rule, iteration) != (layer, op):
                continue
            self._fired.add((k, iteration, microbatch))
            rng = random.Random(f"{self.seed}:{k}:{iteration}:{microbatch}:{layer}:{op}")
            for block, pos, line in self._positions(rule.pattern, lines, rng, causal):
                done.append(self._write(rule, lines, (block, pos, line), (layer, op),
                                        (iteration, microbatch)))  # fmt: skip
        self.log.extend(done)
        return done

    @staticmethod
    def _positions(
        pattern: str, lines: torch.Tensor, rng: random.Random, causal: bool
    ) -> List[Tuple[int, int, int]]:
        nb, n, m = lines.shape
        for _ in range(64):  # avoid zeros (a flipped zero is a harmless 2.0)
            b = rng.randrange(nb)
            j = rng.randrange(m - 1 if pattern in ("row", "block") and m > 1 else m)
            lo = j if causal else 0  # scores: query position >= key position
            hi = n - 1 if pattern in ("line", "block") and n - lo > 1 else n
            i = rng.randrange(lo, hi)
            points = {"point": [(b, i, j)], "line": [(b, i, j), (b, i + 1, j)]}.get(pattern)
            if pattern == "row":
                points = [(b, i, j), (b, i, j + 1)]
            elif pattern == "block":
                points = [(b, i, j), (b, i + 1, j), (b, i, j + 1), (b, i + 1, j + 1)]
            if all(float(lines[p[0], p[1], p[2]].detach()) != 0.0 for p in points):
                return points
        return points

    def _write(self, rule, lines, where, site, when) -> Injected:
        import torch

        block, pos, line = where
        with torch.no_grad():
            cell = lines[block, pos, line]
            if rule.kind == "bitflip":
                new = flip_exponent(cell.detach().clone().reshape(1)).reshape(())
            else:
                value = {"inf": float("inf"), "nan": float("nan"), "near_inf": NEAR_INF_VALUE}
                new = torch.tensor(value[rule.kind], dtype=lines.dtype)
            lines[block, pos, line] = new
            written = float(lines[block, pos, line].detach())
        return Injected(*site, *where, classify(written, self.near_inf), *when)


def build_injector(
    specs: Sequence[str], seed: int, rank: int, near_inf: float = 1e10
) -> Optional[FaultInjector]:
    """An injector for the rule strings, or None without rules."""
    if not specs:
        return None
    return FaultInjector([parse_rule(s) for s in specs], seed, rank, near_inf)
