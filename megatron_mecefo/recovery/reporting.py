"""The session's reports: the recovery record of each generation, the summary rows and the
armed-supervisor cost account (:mod:`.records` formats them)."""

from __future__ import annotations

import json
import time
from typing import Any, Dict, List

from megatron_mecefo.recovery import records as rec_mod
from megatron_mecefo.recovery.membership import Generation


def write_record(session: Any, trainer: Any) -> None:
    """Each member publishes its recovery timings; rank 0 gathers them and emits the record."""
    gen = session.gen
    session.ms.set_json(f"rt/{gen.number}/{session.slot}", session.times)
    if session.rank != 0:
        return
    keys = [f"rt/{gen.number}/{s}" for s in gen.members]
    deadline = time.time() + session.cfg.collective_timeout_s
    while not session.ms.store.check(keys) and time.time() < deadline:
        session.sleep()
    times = {s: session.ms.get_json(f"rt/{gen.number}/{s}") or {} for s in gen.members}
    # A failure generation that was never formed (a replacement came up during the
    # regroup, so a planned generation superseded it before its rendezvous) still gets
    # its own record, timed by this generation's members.
    for skipped in session.ms.unformed_failures(gen.number):
        emit_record(session, trainer, skipped, times, superseded_by=gen.number)
    emit_record(session, trainer, gen, times)


def emit_record(
    session: Any, trainer: Any, gen: Generation, times: Dict[int, Any], superseded_by: int = 0
) -> None:
    """Build the record of generation ``gen``, store it, log it and append it to the records."""
    kills, deaths = {}, {}
    # The incarnations this generation lost: those of the generation before it. (The slot's
    # last dead incarnation may be a later death, when this record is written late: a
    # failure generation superseded before it formed.)
    previous = f"gen/{gen.number - 1}"
    known = gen.number > 0 and session.ms.store.check([previous])
    before = session.ms.generation(gen.number - 1).members if known else {}
    for s in gen.lost:
        inc = before[s] if s in before else last_inc(session, s)
        k = session.ms.get_json(f"killed/{s}/{inc}")
        if k:
            kills[s] = k["t"]
        d = session.ms.dead_info(s, inc)
        if d:
            deaths[s] = d
    record = rec_mod.build_record(
        gen,
        times,
        kills,
        deaths,
        trainer.iteration,
        redone=gen.at_iteration is None,
        global_batch_size=session.args.global_batch_size,
    )
    if superseded_by:
        record["superseded_by"] = superseded_by
    if session.takeover_info is not None and not superseded_by:
        record.update(session.takeover_info)
        session.takeover_info = None
    # On etcd too (--store-mode etcd): after the leader's loss, the scan for unformed failures
    # (MembershipStore.unformed_failures) stops at a recorded generation, and the summary
    # lists the records, from the state the new leader restored.
    session.ms.set_durable(f"record/{gen.number}", json.dumps(record))
    trainer.emit(record)
    rec_mod.append_jsonl(session.cfg.records_file, record)
    print(rec_mod.log_line(record), flush=True)


def last_inc(session: Any, slot: int) -> int:
    """The last incarnation of ``slot`` known dead (its kill record's key)."""
    text = session.ms.get_str(f"inc/{slot}")
    inc = int(text) if text else 0
    while inc > 0 and session.ms.dead_info(slot, inc) is None:
        inc -= 1
    return inc


def summary_rows(session: Any) -> List[tuple]:
    """The summary's recovery rows: commit-vote times and one row per recovery record."""
    rows = []
    if session.vote_s:
        votes = sorted(session.vote_s)
        rows.append(
            (
                "commit vote",
                f"p50 {1000 * votes[len(votes) // 2]:.1f} ms, max {1000 * votes[-1]:.1f} ms"
                f" per iteration ({len(votes)} votes on rank 0)",
            )
        )
    records = []
    for g in range(1, session.generation + 1):
        r = session.ms.get_json(f"record/{g}")
        if r:
            records.append(r)
    return rows + rec_mod.summary_rows(records)


def armed_cost(session: Any, trainer: Any) -> Dict[str, Any]:
    """What the armed supervisor cost this rank in a run without failures: the commit
    votes this rank completed (no waiting for a peer: the training thread's wait for the
    decision after the overlap, and the store round trips themselves), the boundary
    hooks, and the CPU of the heartbeat, watchdog and vote threads; with the step time.
    ``benchmarks/recovery_latency.py`` aggregates these over the ranks."""
    watchdog_cpu = session.watchdog_cpu_s + (session.watchdog.cpu_s if session.watchdog else 0.0)
    steps = [r["step_time_s"] for r in trainer.history if r.get("type") == "train"]
    return {
        "type": "armed_cost",
        "slot": session.slot,
        "iterations": session.iterations_run,
        "vote_s": list(session.vote_s),
        "vote_last_s": list(session.vote_last_s),
        "vote_protocol_s": list(session.vote_protocol_s),
        "hooks_s": list(session.hooks_s),
        "thread_cpu_s": session.heartbeat.cpu_s + watchdog_cpu + session.voter.cpu_s,
        "thread_cpu_split_s": {
            "heartbeat": session.heartbeat.cpu_s,
            "watchdog": watchdog_cpu,
            "vote": session.voter.cpu_s,
        },
        "process_cpu_s": time.process_time(),
        "step_time_s": steps,
    }


# ------------------------------------------------------------------ leaving a world
