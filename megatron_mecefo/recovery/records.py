"""Recovery records: one JSONL record and one log line per recovery event, and the summary.

Every member of a new generation writes its own timestamps (``rt/<g>/<slot>``: when it
detected the failure, left the old world, had the new one built, finished the first
iteration). After that iteration the new rank 0 assembles one record:

* ``detect_s``: kill (unknown: its first report, a reap or a detection) -> the last
  survivor noticed;
* ``regroup_s``: -> every member had the new world and model built (release, rendezvous,
  ``init_process_group``, Megatron parallel state, GPTModel/DDP/optimizer, state restored);
* ``redo_s``: -> every member finished the redone iteration (committed);
* ``total_s``: kill -> every member finished the redone iteration, the sum of the three
  (none is negative: see :func:`phases`);
* for a rejoin, ``heal_s`` (state copy + checksum) and ``rejoin_s`` (boundary -> first step).

Times are wall clock (``time.time``) of processes on one machine; across machines they
need synchronised clocks.
"""

from __future__ import annotations

import json
import statistics
from typing import Any, Dict, List, Optional, Sequence


def build_record(
    generation: Any,
    times: Dict[int, Dict[str, float]],
    kills: Dict[int, float],
    deaths: Dict[int, Dict[str, Any]],
    iteration: int,
    redone: bool,
    global_batch_size: int,
) -> Dict[str, Any]:
    """The record of the change into ``generation`` (see the module docstring).

    Args:
        generation: The new :class:`~.membership.Generation`.
        times: Per member slot, its timestamps (``detect``, ``left``, ``built``, ``healed``,
            ``done``).
        kills: Injected kill time per lost slot (``--mecefo-kill``), when known.
        deaths: The supervisor's report per lost slot (exit code, signal, reap time).
        iteration: The first iteration run in the new generation.
        redone: Whether that iteration had been in flight when the failure struck.
        global_batch_size: Samples of one iteration (the samples redone).
    """

    def latest(key: str) -> Optional[float]:
        vals = [t[key] for t in times.values() if t.get(key)]
        return max(vals) if vals else None

    def earliest(key: str) -> Optional[float]:
        vals = [t[key] for t in times.values() if t.get(key)]
        return min(vals) if vals else None

    planned = generation.at_iteration is not None
    rec: Dict[str, Any] = {
        "type": "recovery",
        "kind": "rejoin" if planned else "failure",
        "generation": generation.number,
        "reason": generation.reason,
        "iteration": iteration,
        "ranks_lost": list(generation.lost),
        "exit_codes": {str(s): d.get("exit_code") for s, d in deaths.items()},
        "ranks_joined": list(generation.joined),
        "replicas": list(generation.replicas),
        "world_size": generation.world_size,
        "samples_redone": global_batch_size if redone else 0,
    }
    built, done = latest("built"), latest("done")
    kept = [int(t["carry_kept_bytes"]) for t in times.values() if "carry_kept_bytes" in t]
    if kept:  # carried weights a survivor could not free after copying (state/carry.py)
        rec["carry_kept_bytes"] = max(kept)
    reused = [int(t["grad_buffers_reused"]) for t in times.values() if "grad_buffers_reused" in t]
    if reused:  # of the members that kept their gradient buffers, the fewest reused (0: a miss)
        rec["grad_buffers_reused"] = min(reused)
    roles = {s: t["heal_role"] for s, t in times.items() if t.get("heal_role")}
    if roles:  # the heal by tensors (state/heal.py): who sent, received, only waited
        received = [t for s, t in times.items() if roles.get(s) == "joiner"]
        rec["heal_roles"] = {str(s): r for s, r in sorted(roles.items())}
        rec["heal_written_bytes"] = {
            str(s): int(times[s].get("heal_written_bytes", 0)) for s in sorted(roles)
        }
        rec["heal_bytes"] = sum(int(t.get("heal_bytes", 0)) for t in received)
        # The receivers' heap faulted in before their world formed (state/warm_heap.py), and
        # the pages their receive still had to fault in.
        rec["heal_warm_bytes"] = sum(int(t.get("warm_heap_bytes", 0)) for t in received)
        rec["heal_page_faults"] = sum(int(t.get("heal_page_faults", 0)) for t in received)
        links = [float(t["heal_link_gbps"]) for t in received if "heal_link_gbps" in t]
        if links:  # MECEFO_HEAL_LINK_PROBE (state/link_probe.py): gloo in the job's processes
            rec["heal_link_gbps"] = min(links)
        # Where the heal's time went: the slowest member's duration of each step (the
        # sender's export and structure, a joiner's transfer and import, anyone's wait).
        steps = [t["heal_steps_s"] for t in times.values() if t.get("heal_steps_s")]
        if steps:
            rec["heal_steps_s"] = {
                name: round(max(s[name] for s in steps if name in s), 4)
                for name in ("export", "structure", "transfer", "import", "wait", "release")
                if any(name in s for s in steps)
            }
        transfer = max((t.get("heal_transfer_s", 0.0) for t in received), default=0.0)
        rec["heal_transfer_s"] = round(transfer, 4)
        if transfer > 0:  # bytes into one receiver per second of its transfer
            rec["heal_gbps"] = round(rec["heal_bytes"] / len(received) / transfer / 1e9, 4)
    # Where the regroup time goes: the slowest member's duration of each step.
    if planned:  # the joiners' waiting as spares is not part of the switch
        times = {s: t for s, t in times.items() if s not in set(generation.joined)} or times
    steps = [
        ("release", "left", "released"),
        ("release.export", "left", "exported"),
        ("release.drop", "exported", "dropped"),
        ("release.destroy", "dropped", "released"),
        ("membership", "released", "membership"),
        ("rendezvous", "membership", "arrived"),
        ("init_world", "arrived", "world"),
        ("build", "world", "constructed"),
        ("restore", "constructed", "built"),
    ]
    for key in ("destroy_pg", "gc"):
        vals = [t[key] for t in times.values() if key in t]
        if vals:
            rec.setdefault("release_split_s", {})[key] = round(max(vals), 4)
    rec["regroup_steps_s"] = {
        name: round(max(t[b] - t[a] for t in times.values() if t.get(a) and t.get(b)), 4)
        for name, a, b in steps
        if any(t.get(a) and t.get(b) for t in times.values())
    }
    if planned:
        # The switch starts when the state holders leave at the boundary; a spare (a dead
        # rank's sibling) "left" when its replica failed, long before.
        joined = set(generation.joined)
        lefts = [t["left"] for s, t in times.items() if t.get("left") and s not in joined]
        left = min(lefts) if lefts else earliest("left")
        heals = _heal_seconds(times)
        rec["heal_s"] = round(max(heals), 4) if heals else 0.0
        rec["regroup_s"] = _diff(built, left)
        rec["rejoin_s"] = _diff(done, left)
        return rec
    reaped = [d["t"] for d in deaths.values() if d.get("t")]
    detects = [t["detect"] for t in times.values() if t.get("detect")]
    reports = reaped + detects
    # From the kill; unknown, from its first report (the supervisor's reap or a survivor's
    # detection, whichever came first).
    t0 = min(kills.values()) if kills else (min(reports) if reports else None)
    rec["kill_time_known"] = bool(kills)
    if kills and reports and min(reports) < t0:
        # Reported before it happened: another process's clock (or a stale timestamp).
        rec["kill_after_first_report_s"] = round(t0 - min(reports), 4)
    heals = _heal_seconds(times)
    if generation.joined and heals:  # a replacement that joined the failure's own world
        rec["heal_s"] = round(max(heals), 4)
    rec.update(phases(t0, latest("detect"), built, done))
    if reaped and t0 is not None:
        rec["reap_s"] = max(0.0, _diff(min(reaped), t0) or 0.0)
    return rec


def phases(
    t0: Optional[float], detect: Optional[float], built: Optional[float], done: Optional[float]
) -> Dict[str, Optional[float]]:
    """``detect_s``, ``regroup_s``, ``redo_s`` and ``total_s`` from the failure's origin
    ``t0`` (the kill, or its first report) and the last member's ``detect``, ``built`` and
    ``done`` times.

    The timestamps come from several processes (and clocks), so they need not be ordered: a
    phase end earlier than the one before it (e.g. a kill time stamped later than the
    detection) counts as that one, and the phase as 0 s. So no part is negative, and the
    parts sum to the total. A missing time leaves its phase, and those after it, unknown
    (``None``); the total then spans whatever end is known.
    """
    out: Dict[str, Optional[float]] = {
        "detect_s": None, "regroup_s": None, "redo_s": None, "total_s": None
    }  # fmt: skip
    if t0 is None:
        return out
    start, parts = t0, []
    for key, end in (("detect_s", detect), ("regroup_s", built), ("redo_s", done)):
        if end is None:
            break
        end = max(end, start)
        parts.append(round(end - start, 4))
        out[key], start = parts[-1], end
    if len(parts) == 3:
        out["total_s"] = round(sum(parts), 4)
    elif done is not None:
        out["total_s"] = round(max(done, start) - t0, 4)
    return out


def _heal_seconds(times: Dict[int, Dict[str, Any]]) -> List[float]:
    """Per member, its heal: from entering it (``heal_start``: after the members agreed on
    the state; a survivor's own carry is imported before) to every receiver done (and the
    distributed optimizer's regrow). Records written before ``heal_start`` existed began at
    ``constructed``, the survivor's carry import included (0.05 s at 1.6 GiB)."""
    done = [t for t in times.values() if t.get("healed")]
    return [t["healed"] - t.get("heal_start", t["constructed"]) for t in done]


def _diff(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None else round(a - b, 4)


def log_line(rec: Dict[str, Any]) -> str:
    """One run-log line for a record."""
    if rec["kind"] == "rejoin":
        return (
            f"> MeCeFO recovery: generation {rec['generation']}: ranks {rec['ranks_joined']} "
            f"rejoined at iteration {rec['iteration']}; replicas {rec['replicas']} "
            f"({rec['world_size']} ranks); switch {rec['regroup_s']:.2f} s, heal "
            f"{rec['heal_s']:.2f} s, boundary -> first step {rec['rejoin_s']:.2f} s"
        )
    if rec.get("recovery_path") == "disk":  # the distributed optimizer's disk fallback
        redone = (
            f"rolled back to the checkpoint of iteration {rec['rolled_back_to']} (recovery path "
            f"disk, {rec['disk_load_s']:.2f} s), iterations {rec['rolled_back_to'] + 1}-"
            f"{rec['replayed_to']} replayed ({rec['samples_redone']} samples)"
        )
    elif rec.get("recovery_path") == "peers+parity":  # the distributed-optimizer takeover
        redone = (
            f"rolled back to the snapshot of iteration {rec['rolled_back_to']} (recovery path "
            f"peers+parity, {rec['snapshot_restore_s']:.2f} s), iterations "
            f"{rec['rolled_back_to'] + 1}-{rec['replayed_to']} replayed ({rec['samples_redone']} "
            "samples)"
        )
    else:
        redone = f"iteration {rec['iteration']} redone ({rec['samples_redone']} samples)"
    replaced = (
        f"ranks {rec['ranks_joined']} replaced at once (healed in {_fmt(rec.get('heal_s'))}); "
        if rec.get("ranks_joined")
        else ""
    )
    return (
        f"> MeCeFO recovery: generation {rec['generation']}: ranks {rec['ranks_lost']} lost "
        f"(exit {rec['exit_codes']}); replicas {rec['replicas']} ({rec['world_size']} ranks) "
        f"go on; {redone}; {replaced}"
        f"detect {_fmt(rec['detect_s'])}, regroup {_fmt(rec['regroup_s'])}, redo "
        f"{_fmt(rec['redo_s'])}, kill -> redone {_fmt(rec['total_s'])}"
    )


def _fmt(x: Optional[float]) -> str:
    return "?" if x is None else f"{x:.2f} s"


def summary_rows(records: Sequence[Dict[str, Any]]) -> List[tuple]:
    """Summary-table rows: the timeline and p50/max of the latencies."""
    rows: List[tuple] = []
    failures = [r for r in records if r["kind"] == "failure"]
    rejoins = [r for r in records if r["kind"] == "rejoin"]
    for r in records:
        path = r.get("recovery_path")
        what = (
            f"ranks {r['ranks_lost']} lost, {_fmt(r.get('total_s'))} kill -> redone"
            + (f" (recovery path {path}, from iteration {r['rolled_back_to']})" if path else "")
            if r["kind"] == "failure"
            else f"ranks {r['ranks_joined']} rejoined, heal {_fmt(r.get('heal_s'))}"
        )
        rows.append((f"recovery @ iteration {r['iteration']}", f"gen {r['generation']}: {what}"))
    totals = [r["total_s"] for r in failures if r.get("total_s") is not None]
    disk = sum(1 for r in failures if r.get("recovery_path") == "disk")
    if totals:
        rows.append(
            (
                "recovery latency",
                f"kill -> redone p50 {statistics.median(totals):.2f} s, max {max(totals):.2f} s"
                f" ({len(totals)} failures; "
                + (f"{disk} from a disk checkpoint)" if disk else "no checkpoint read)"),
            )
        )
    heals = [r["rejoin_s"] for r in rejoins if r.get("rejoin_s") is not None]
    if heals:
        rows.append(
            (
                "rejoin latency",
                f"boundary -> first step p50 {statistics.median(heals):.2f} s,"
                f" max {max(heals):.2f} s ({len(heals)} rejoins)",
            )
        )
    return rows


def append_jsonl(path: Optional[str], rec: Dict[str, Any]) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")
