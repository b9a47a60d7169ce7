"""The per-node snapshot holder: a process outside every trainer that owns the node's slots.

``python -m megatron_mecefo.snapshot.holder --dir /dev/shm/mecefo-<job>`` creates the
directory, writes ``holder.pid`` and keeps every slot file under it mapped, so the snapshots
stay in memory when a trainer process dies (SIGKILL, OOM kill, a crash). Trainers started
with ``--mecefo-snapshot-dir`` write into it and, when restarted, read their shard back from
it with no network traffic. On SIGTERM/SIGINT the holder removes the directory (the job is
over) unless ``--keep`` is given. ``--status`` prints what the directory holds and exits.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import shutil
import signal
import sys
import time
from typing import Dict, List, Optional

PID_FILE = "holder.pid"


def holder_pid(directory: str) -> Optional[int]:
    """The pid of the live holder of ``directory``, or None."""
    try:
        with open(os.path.join(directory, PID_FILE)) as f:
            pid = int(f.read().strip())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def describe(directory: str) -> List[str]:
    """One line per rank: its slots' iterations (``-`` for a slot without a snapshot)."""
    lines = []
    for name in sorted(os.listdir(directory)):
        sub = os.path.join(directory, name)
        if not (name.startswith("rank") and os.path.isdir(sub)):
            continue
        slots = []
        indices = sorted(  # slot<i>.bin; not slots.slot_indices: the holder stays torch-free
            int(n[4:-4]) for n in os.listdir(sub) if re.fullmatch(r"slot\d+\.bin", n)
        )
        for i in indices or [0, 1]:
            try:
                with open(os.path.join(sub, f"slot{i}.json")) as f:
                    slots.append(str(json.load(f)["iteration"]))
            except (OSError, ValueError, KeyError):
                slots.append("-")
        lines.append(f"{name}: slots {' '.join(slots)}")
    return lines


def _map_new(directory: str, maps: Dict[str, mmap.mmap]) -> None:
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            if not name.endswith(".bin"):
                continue
            size = os.path.getsize(path)
            old = maps.get(path)
            if old is not None and len(old) == size:
                continue
            if size == 0:
                continue
            with open(path, "r+b") as f:
                maps[path] = mmap.mmap(f.fileno(), size)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="shared-memory directory (/dev/shm/...)")
    parser.add_argument("--keep", action="store_true", help="keep the directory on exit")
    parser.add_argument("--status", action="store_true", help="print the slots and exit")
    args = parser.parse_args(argv)
    if args.status:
        print(f"holder pid {holder_pid(args.dir)}")
        print("\n".join(describe(args.dir)))
        return 0
    other = holder_pid(args.dir) if os.path.isdir(args.dir) else None
    if other is not None and other != os.getpid():
        print(f"--dir {args.dir}: already held by pid {other}", file=sys.stderr)
        return 2
    os.makedirs(args.dir, exist_ok=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    tmp = os.path.join(args.dir, PID_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, os.path.join(args.dir, PID_FILE))
    print(f"[snapshot holder] pid {os.getpid()} holds {args.dir}", flush=True)
    maps: Dict[str, mmap.mmap] = {}
    while not stop:
        _map_new(args.dir, maps)
        time.sleep(0.2)
    for m in maps.values():
        m.close()
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
