"""Resident memory against live memory over repeated kill/rejoin cycles: does a recovery leak?

The example trainer runs under the recovery supervisor at ``--dp`` and one of
``recovery_scale.py``'s sizes. Rank 1 is SIGKILLed in its forward pass at each of ``--kills``
iterations and replaced a second later from a warm standby, which rejoins and is healed. Every
rank prints at each iteration boundary (``MECEFO_MEM_TRACE=1``,
:func:`megatron_mecefo.recovery.state.memory.mem_trace`):

* ``now``: its RSS at the boundary; ``peak``: its highest RSS during the iteration;
* glibc's own figures (``mallinfo2``): ``heap_in_use + mmapped`` is the memory the process's
  C/C++ code holds (every tensor on the CPU), whatever the heap's layout; ``heap_free`` is free
  space in the allocator's arenas, which stays resident once touched.

Phases per slot: ``steady`` is iterations 2 to the first kill - 1; ``after j`` is from two
iterations after the j-th rejoin to the next kill - 1 (or the end). The survivors' slots are the
same process all along; each joiner (a new incarnation of slot 1) is compared with slot 1's
first incarnation. Per phase: the medians of the boundary figures and the highest peak; their
ratios to steady.

The control (``--control``, on by default): the same job with no kill, run first in the same
invocation, its figures taken over the failure run's phases. A training process's heap drifts
on its own (glibc's free space grows as a step's temporaries land in other places), so what a
recovery leaves behind is the failure run's figure against the control's, not against steady.

Usage::

    python benchmarks/heap_after_recovery.py --size 0.4 --dp 4 --kills 8,20,32
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import recovery_scale as rs  # noqa: E402
from recovery_scale_gpu import parse_mem  # noqa: E402
from run_header import run_header  # noqa: E402

MIB = 1 << 20
FIGURES = ("now", "live", "heap_free")
"""The boundary figures whose median a phase reports (``live`` = heap_in_use + mmapped)."""


def phases(kills: Sequence[int], rejoins: Sequence[int], last: int) -> Dict[str, Tuple[int, int]]:
    """Iteration ranges (inclusive) of ``steady`` and ``after j``: the degraded iterations
    between a kill and its rejoin, and the first iteration after a heal, are in none."""
    out = {"steady": (2, kills[0] - 1)}
    for j, rejoin in enumerate(rejoins):
        end = kills[j + 1] - 1 if j + 1 < len(kills) else last
        if rejoin + 2 <= end:
            out[f"after {j + 1}"] = (rejoin + 2, end)
    return out


def slot_phases(
    mem: List[Dict[str, Any]], ranges: Dict[str, Tuple[int, int]]
) -> Dict[str, Dict[str, Any]]:
    """Per process (``slot.inc``) and phase: the medians of :data:`FIGURES` at the iteration
    boundaries, the highest peak, and each over the steady phase of the slot's first
    incarnation."""
    rows: Dict[str, Dict[str, Any]] = {}
    # ``live`` derived per line, without writing into the caller's parsed trace.
    its = [
        {**m, "live": m["heap_in_use"] + m.get("mmapped", 0)} if "heap_in_use" in m else m
        for m in mem
        if m["point"] == "iteration"
    ]
    for slot, inc in sorted({(m["slot"], m["inc"]) for m in its}):
        mine = [m for m in its if (m["slot"], m["inc"]) == (slot, inc)]
        row: Dict[str, Any] = {}
        for name, (lo, hi) in ranges.items():
            sel = [m for m in mine if lo <= m["iteration"] <= hi]
            if not sel:
                continue
            ph: Dict[str, Any] = {"iterations": [lo, hi], "points": len(sel),
                                  "peak": max(m["peak"] for m in sel)}  # fmt: skip
            for f in FIGURES:
                vals = [m[f] for m in sel if f in m]
                ph[f] = int(statistics.median(vals)) if vals else None
            row[name] = ph
        rows[f"{slot}.{inc}"] = row
    for key, row in rows.items():
        steady = rows.get(f"{key.split('.')[0]}.0", {}).get("steady")
        for name, ph in row.items():
            if steady is None or name == "steady":
                continue
            for f in ("peak", "now", "live"):
                if ph.get(f) and steady.get(f):
                    ph[f"{f}_over_steady"] = round(ph[f] / steady[f], 4)
            if ph.get("heap_free") is not None and steady.get("heap_free") is not None:
                ph["heap_free_growth_mib"] = round((ph["heap_free"] - steady["heap_free"]) / MIB, 1)
    return rows


def summarize(rows: Dict[str, Dict[str, Any]], kill_slot: int = 1) -> Dict[str, Any]:
    """Per ``after j`` phase, over the survivors (every slot but ``kill_slot``) and over the
    joiners: the highest peak, boundary RSS and live memory over steady, and the largest growth
    of free heap."""
    out: Dict[str, Any] = {}
    # In cycle order ("after 10" after "after 9", not after "after 1").
    names = sorted({n for row in rows.values() for n in row if n != "steady"},
                   key=lambda n: int(n.split()[-1]))  # fmt: skip
    for name in names:
        for group in ("survivors", "joiners"):
            phs = [
                row[name]
                for key, row in rows.items()
                if name in row and (int(key.split(".")[0]) == kill_slot) == (group == "joiners")
            ]
            if not phs:
                continue

            def top(field: str, phs: List[Dict[str, Any]] = phs) -> Optional[float]:
                vals = [p[field] for p in phs if p.get(field) is not None]
                return max(vals) if vals else None

            out.setdefault(name, {})[group] = {
                f: top(f)
                for f in ("peak_over_steady", "now_over_steady", "live_over_steady",
                          "heap_free_growth_mib")  # fmt: skip
            }
    return out


def summary_line(
    a: argparse.Namespace, summary: Dict[str, Any], control: Optional[Dict[str, Any]] = None
) -> str:
    """One line: per cycle, the survivors' peak RSS and live memory over steady and the free
    heap's growth; with a control, its survivors' peak RSS over steady in brackets."""
    parts = []
    for name, groups in summary.items():
        s = groups.get("survivors") or {}
        ctl = ""
        if control is not None:
            c = (control.get(name) or {}).get("survivors") or {}
            ctl = f" (no failure x{c.get('peak_over_steady')})"
        parts.append(
            f"{name}: peak RSS x{s.get('peak_over_steady')}{ctl}, "
            f"live x{s.get('live_over_steady')}, free heap +{s.get('heap_free_growth_mib')} MiB"
        )
    return (f"heap_after_recovery: example DP{a.dp} {a.size} GiB, rank 1 killed at {a.kills}; "
            f"survivors (max over slots) " + "; ".join(parts))  # fmt: skip


def run_job(a: argparse.Namespace, kills: List[int], work: Path) -> Dict[str, Any]:
    """The supervised job; its log, records and status. Every process it started is ended."""
    work.mkdir(parents=True, exist_ok=True)
    log, records = work / "log.txt", work / "records.jsonl"
    for f in (log, records, work / "pids.txt", work / "store.txt"):
        f.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "megatron_mecefo.recovery.supervisor",
           f"--nproc-per-node={a.dp}", "--pid-file", str(work / "pids.txt"),
           "--store-file", str(work / "store.txt"), "--records", str(records),
           "--replace", "after:1.0", "--replace-ranks", "1", "--standby", "1",
           "--max-replacements", str(len(kills) + 1),
           "--heartbeat-interval", "1", "--heartbeat-timeout", "8",
           "--collective-timeout", "300", "--init-timeout", "360", "--",
           *rs._trainer_args("example", a.size, a.dp, a.iterations, None),
           *[f"--mecefo-kill=1:{k}:forward" for k in kills]]  # fmt: skip
    t0 = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env={**rs._env(), "MECEFO_MEM_TRACE": "1"},
                                stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    try:
        proc.wait(timeout=a.timeout)
        status = "finished" if proc.returncode == 0 else f"exited (rc {proc.returncode})"
    except subprocess.TimeoutExpired:
        status = f"timed out after {a.timeout:.0f} s"
    finally:
        rs._kill(proc)
    recs = [r for r in rs._read_jsonl(records) if r.get("type") == "recovery"]
    return {"status": status, "wall_s": round(time.time() - t0, 1), "records": recs,
            "log": log.read_text(errors="replace")}  # fmt: skip


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", default="0.4", choices=sorted(rs.SIZES),
                   help="state per rank in GiB (recovery_scale.py's model sizes)")  # fmt: skip
    p.add_argument("--dp", type=int, default=4)
    p.add_argument(
        "--kills",
        default="8,20,32",
        help="iterations at which rank 1 is SIGKILLed (its forward), comma-separated",
    )
    p.add_argument("--iterations", type=int, default=44)
    p.add_argument(
        "--control",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="first run the same job without a kill, as the reference for the heap's own drift",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole job")
    p.add_argument("--output", default=str(REPO / "results" / "heap_after_recovery.json"))
    p.add_argument("--workdir", default=str(REPO / "results" / "heap_after_recovery"))
    a = p.parse_args(argv)
    try:
        kills = sorted(int(k) for k in a.kills.split(","))
    except ValueError:
        p.error(f"--kills={a.kills}: expected iterations separated by commas, e.g. 8,20,32")
    gaps = [later - earlier for earlier, later in zip(kills, kills[1:], strict=False)]
    if not kills or kills[0] < 4 or any(gap < 6 for gap in gaps):
        p.error(
            f"--kills={a.kills}: the first kill at iteration >= 4 (a steady phase before "
            f"it) and kills >= 6 iterations apart (a rejoin and an after phase between)"
        )
    if kills[-1] + 6 > a.iterations:
        p.error(
            f"--iterations={a.iterations}: at least the last kill + 6 ({kills[-1] + 6}) for "
            f"an after phase behind it"
        )
    if a.dp < 2:
        p.error(f"--dp={a.dp}: at least 2 (a survivor to heal from)")
    result = run_header("heap_after_recovery")
    result["config"] = {
        "trainer": "example", "size_gib": a.size, "dp": a.dp, "kills": kills,
        "kill": "rank 1, forward", "replace": "after:1.0, --standby 1, --replace-ranks 1",
        "iterations": a.iterations, "layers_hidden_heads": rs.SIZES[a.size],
        "figures": "RSS now/peak (/proc), heap_in_use + mmapped = live, heap_free (mallinfo2)",
    }  # fmt: skip
    # The control first, so that a machine growing busier over the invocation does not
    # favour the failure run.
    ctl_job = run_job(a, [], Path(a.workdir) / "control") if a.control else None
    if ctl_job is not None and ctl_job["status"] != "finished":  # no reference: stop here
        raise SystemExit(f"heap_after_recovery: the control {ctl_job['status']} "
                         f"(see {Path(a.workdir) / 'control' / 'log.txt'})")  # fmt: skip
    job = run_job(a, kills, Path(a.workdir))
    rejoins = [r["iteration"] for r in job["records"] if r.get("kind") == "rejoin"]
    ranges = phases(kills, rejoins, a.iterations)
    rows = slot_phases(parse_mem(job["log"]), ranges)
    summary = summarize(rows)
    control = None
    if ctl_job is not None:
        ctl_rows = slot_phases(parse_mem(ctl_job["log"]), ranges)
        # Its "joiners" are slot 1's first process: never killed in this run.
        control = {"status": ctl_job["status"], "wall_s": ctl_job["wall_s"],
                   "slots": ctl_rows, "per_cycle": summarize(ctl_rows)}  # fmt: skip
    result.update({
        "status": job["status"], "wall_s": job["wall_s"], "rejoin_iterations": rejoins,
        "phases": ranges, "slots": rows, "per_cycle": summary,
        "recoveries": [{k: r.get(k) for k in ("kind", "generation", "iteration", "ranks_lost",
                                              "ranks_joined", "total_s", "heal_s")}
                       for r in job["records"]],
        "control": control,
    })  # fmt: skip
    result["summary"] = summary_line(a, summary, control and control["per_cycle"])
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(result["summary"])
    if job["status"] != "finished" or len(rejoins) != len(kills):
        raise SystemExit(f"heap_after_recovery: {job['status']}; {len(rejoins)} of {len(kills)} "
                         f"rejoins (see {Path(a.workdir) / 'log.txt'})")  # fmt: skip


if __name__ == "__main__":
    main()
