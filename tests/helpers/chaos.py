"""The chaos scenario of issue 44 as a test: seeded SIGKILLs of random trainer processes.

The plan is the tails benchmark's own (``benchmarks/recovery_latency.py``,
``tail_schedule("chaos", ...)``): event ``k`` waits for its window (an iteration) and for a full
world (every slot is a member of the newest generation and trains in it: the previous victim's
replacement rejoined and ran its first iteration), sleeps a random delay, and SIGKILLs a random
rank, or one of its data-loader workers (Megatron-LM with ``--num-workers 1``). It then waits
for the failure generation that lost the victim and for its redone iteration, and times the
event from the kill with the benchmark's :func:`event_timing`, from the members' absolute
timestamps in the membership store.

A death between a rejoin's publication and its boundary is therefore not part of this plan
(``rejoin-kill`` and ``test_death_during_the_rejoin`` kill there).
"""

from __future__ import annotations

import os
import random
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

from conftest import REPO

from megatron_mecefo.recovery.membership import MembershipStore

sys.path.insert(0, str(REPO / "benchmarks"))
import recovery_latency as rl  # noqa: E402

SEED = 44
"""The benchmark's seed: Megatron-LM's four events kill two loader workers (of slots 0 and 2)
and two ranks (0, the logging rank, and 1); the example trainer's kill ranks 2, 0, 2, 0."""
EVENT_TIMEOUT_S = 180.0
"""How long one event may wait for its window and full world, or for its redone iteration,
before the test fails (a lost event or a stuck recovery; a cold rejoin at load 15 is ~30 s)."""
FAILURE_GENERATION = re.compile(
    r"\[coordinator\] generation (\d+) \([^)]*, now\):.* lost \[([^]]*)\]"
)
"""The coordinator's line of a failure generation (``now``, not at a boundary) and its lost
slots."""


def plan(trainer: str, kills: int, spacing: int) -> List[Dict[str, Any]]:
    """The seeded chaos plan of ``kills`` events, one per ``spacing`` iterations."""
    return rl.tail_schedule("chaos", trainer, kills, SEED, spacing)


def train_iters(kills: int, spacing: int) -> int:
    """Iterations of a run of ``kills`` events (as the benchmark's): a window of ``spacing``
    after the last event, for its replacement to rejoin."""
    return 8 + (kills + 1) * spacing


def run(
    events_plan: List[Dict[str, Any]],
    pid_file: Path,
    store_file: Path,
    alive: Callable[[], bool],
) -> List[Dict[str, Any]]:
    """Carry out ``events_plan`` against a running supervised DP4 job (its ``--pid-file`` and
    ``--store-file``; ``alive()`` while it runs). Returns one dict per event: the kill (slot,
    pid, what), the failure generations it caused, and ``detect_s``... ``total_s`` from the
    kill. Raises AssertionError if the job ends early or an event does not complete."""
    rng = random.Random(f"{SEED}/chaos/victims")
    deadline = time.time() + EVENT_TIMEOUT_S
    while not (store_file.exists() and store_file.read_text().strip()):
        _poll(alive, deadline, "no store address")
    ms = MembershipStore.connect(store_file.read_text().strip(), 30)
    out: List[Dict[str, Any]] = []
    for ev in events_plan:
        deadline = time.time() + EVENT_TIMEOUT_S
        while not (int(ms.get_str("progress") or 0) >= ev["window"] and _full(ms)):
            _poll(alive, deadline, f"event {ev['event']}: window {ev['window']} or a full world")
        start_gen = ms.generation_number()
        time.sleep(ev["delay_s"])
        victim = ev["victims"][0]
        inc, pid = rl._rank_pids(pid_file)[victim]
        target, what = pid, "rank"
        if ev["target"] == "worker":
            workers = rl._loader_workers(pid)
            while not workers:
                _poll(alive, deadline, f"event {ev['event']}: rank {victim} has no loader worker")
                workers = rl._loader_workers(pid)
            target, what = rng.choice(workers), "loader worker"
        t_kill = time.time()
        os.kill(target, signal.SIGKILL)
        # The failure generations since the kill, until one lost the victim and every member
        # of the last one finished its redone iteration.
        deadline = time.time() + EVENT_TIMEOUT_S
        while True:
            gens = [
                n
                for n in range(start_gen + 1, ms.generation_number() + 1)
                if ms.generation(n).at_iteration is None
            ]
            if any(victim in ms.generation(n).lost for n in gens):
                last = ms.generation(gens[-1])
                times = [ms.get_json(f"rt/{last.number}/{s}") or {} for s in last.members]
                if all(t.get("done") for t in times):
                    break
            _poll(alive, deadline, f"event {ev['event']}: no redone iteration after the kill")
        rts = [
            {str(s): ms.get_json(f"rt/{n}/{s}") or {} for s in ms.generation(n).members}
            for n in gens
        ]
        timing = rl.event_timing(t_kill, rts)
        out.append({"event": ev["event"], "slot": victim, "incarnation": inc, "pid": target,
                    "what": what, "generations": gens, **timing})  # fmt: skip
        print(f"chaos event {ev['event']}: {what} of slot {victim} killed; generations {gens}; "
              f"kill -> redone {timing['total_s']} s")  # fmt: skip
    return out


def _full(ms: MembershipStore, world: int = 4) -> bool:
    """Every slot is a member of the newest generation, and that generation trains: each
    member finished its first iteration in it (a rejoin published for a later boundary does
    not count until the joiner runs)."""
    g = ms.generation_number()
    if g < 0 or len(ms.generation(g).members) != world:
        return False
    return g == 0 or all(
        (ms.get_json(f"rt/{g}/{s}") or {}).get("done") for s in ms.generation(g).members
    )


def _poll(alive: Callable[[], bool], deadline: float, what: str) -> None:
    if not alive():
        raise AssertionError(f"the job ended before the chaos plan was done ({what})")
    if time.time() > deadline:
        raise AssertionError(f"timed out after {EVENT_TIMEOUT_S} s: {what}")
    time.sleep(0.02)


def check_records(
    events: List[Dict[str, Any]], records: List[Dict[str, Any]], log: str
) -> List[float]:
    """One failure generation and one failure record per kill event, each losing exactly the
    victim (a dead loader worker's rank exits 75), none without a lost rank; each record's
    detect, regroup and redo non-negative and summing to its total, under 10 s, and not more
    than the test's own kill -> redone; every rejoin's switch under 10 s too. Returns the
    records' totals."""
    gens = [(int(g), lost) for g, lost in FAILURE_GENERATION.findall(log)]
    assert [lost for _, lost in gens] == [str(e["slot"]) for e in events], gens
    spurious = [m.group(0) for m in rl.TAIL_GENERATION.finditer(log) if "now" in m.group(2)]
    assert not spurious, f"failure generations with no rank lost: {spurious}"
    assert [e["generations"] for e in events] == [[g] for g, _ in gens], (events, gens)
    failures = [r for r in records if r["kind"] == "failure"]
    assert [r["ranks_lost"] for r in failures] == [[e["slot"]] for e in events], failures
    totals = []
    for ev, rec in zip(events, failures, strict=True):
        assert rec["generation"] == ev["generations"][0], (ev, rec)
        if ev["what"] == "loader worker":  # the rank left for its dead worker
            assert rec["exit_codes"] == {str(ev["slot"]): 75}, rec
        parts = [rec["detect_s"], rec["regroup_s"], rec["redo_s"]]
        assert all(p is not None and p >= 0 for p in parts), rec
        assert abs(sum(parts) - rec["total_s"]) <= 1e-3, rec
        # The store timeout (30 s) or the collective timeout would show here.
        assert rec["total_s"] < 10 and ev["total_s"] is not None and ev["total_s"] < 10, (ev, rec)
        # The record starts at the first report, after the kill; both end at the same done.
        assert rec["total_s"] <= ev["total_s"] + 0.05, (ev, rec)
        totals.append(rec["total_s"])
    # The survivors' stall at each replacement's rejoin (the switch): under the same bound.
    switches = [r["regroup_s"] for r in records if r["kind"] == "rejoin"]
    assert all(s is not None and 0 <= s < 10 for s in switches), switches
    return totals
