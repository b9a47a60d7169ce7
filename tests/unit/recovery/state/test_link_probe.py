"""The link probe (``state/link_probe.py``): gloo's one tensor between a heal's sender and its
joiner, in their own processes, from and into their gradient buffers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from conftest import REPO, child_env, free_port

from megatron_mecefo.recovery.state import link_probe


def _run(reps: int) -> dict:
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "workers" / "link_probe_worker.py")],
            env=child_env(MASTER_PORT=port, RANK=str(r), REPS=str(reps)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        for r in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
    results = {}
    for out, err in outs:
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert lines, out[-2000:] + err[-4000:]
        r = json.loads(lines[-1][len("RESULT ") :])
        results[r["rank"]] = r
    return results


def test_the_sender_sends_its_gradient_buffer_and_the_joiner_gets_it_zeroed_after() -> None:
    r = _run(reps=2)
    sender, joiner = r[0], r[1]
    assert joiner["gbps"] is not None and joiner["gbps"] > 0
    assert sender["gbps"] is None  # the receiver reports
    # The buffer really travelled, twice: the kernel counted the sender's socket writes.
    assert sender["written"] >= 2 * sender["buffer_bytes"]
    assert joiner["written"] < sender["buffer_bytes"] // 100
    assert sender["nonzero_before"] and sender["unchanged"]
    assert joiner["nonzero_before"] and joiner["zero"]


def test_no_repetitions_moves_nothing() -> None:
    r = _run(reps=0)
    assert r[0]["gbps"] is None and r[1]["gbps"] is None
    assert r[0]["written"] < r[0]["buffer_bytes"] // 100
    assert r[1]["unchanged"] and not r[1]["zero"]


@pytest.mark.parametrize("value,reps", [("", 0), ("3", 3), ("0", 0), ("x", 0), ("-2", 0)])
def test_the_environment_sets_the_repetitions(monkeypatch, value: str, reps: int) -> None:
    monkeypatch.setenv(link_probe.ENV, value)
    assert link_probe.repetitions() == reps
