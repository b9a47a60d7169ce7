"""Two (or more) ranks as spawned processes, each writing its results as JSON: started, waited
for, and ended by PID whatever happens."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path
from typing import Any, Callable, Dict, List


def run_ranks(
    target: Callable[..., None], args: List[tuple], join_s: float, out: Path
) -> List[Dict[str, Any]]:
    """Run ``target(*args[r])`` for each rank ``r`` in a spawned process, wait ``join_s`` for
    each, assert that every one exited 0, and return each rank's ``out/rank{r}.json``. A
    process still alive at the end is killed."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=a) for a in args]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(join_s)
        assert [p.exitcode for p in procs] == [0] * len(procs)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(len(procs))]
