"""``benchmarks/coordinator_at_scale.py`` end to end at a small size (slow: two store processes
and a heartbeat writer each way): both runs come back, the section is added beside what the
file held, and the counts have the shape the M1 change promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO


@pytest.mark.slow
def test_small_run_adds_the_coordinator_section(tmp_path: Path) -> None:
    out = tmp_path / "commit_at_scale.json"
    out.write_text(json.dumps({"benchmark": "commit_at_scale", "summary": "kept"}))
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "coordinator_at_scale.py"), "--nodes", "16",
         "--ranks-per-node", "4", "--seconds", "2", "--output", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["summary"] == "kept"
    section = data["coordinator"]
    assert section["config"]["ranks"] == 64 and section["summary"] in done.stdout
    before, after = section["runs"]["before"], section["runs"]["after"]
    # Before: the err/ scan alone is a request per rank each check; after: a few, whatever
    # the size. An event: every slot reread before, one slot after.
    assert before["coordinator_requests_per_check"] > 64
    assert after["coordinator_requests_per_check"] <= 5
    assert before["event_requests"] > 64 and after["event_requests"] <= 16
    assert after["heartbeat_requests_per_s"] < before["heartbeat_requests_per_s"]
    assert before["ranks_declared_dead"] == after["ranks_declared_dead"] == 0
