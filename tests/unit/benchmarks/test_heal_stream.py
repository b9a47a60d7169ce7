"""``benchmarks/heal_stream.py``'s summary: each mode's bandwidth against gloo's one tensor, and
the CPU of both processes per GB, in cores, against gloo's, and the checksum's part of it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmarks"))

import heal_stream as hs  # noqa: E402


def test_summary_divides_the_medians_of_both_processes_cpu_by_the_bytes() -> None:
    nbytes = 2 * 10**9  # 2 GB
    seconds = {m: [1.0, 2.0, 9.0] for m in hs.MODES}  # median 2 s: 1 GB/s
    seconds["gloo_one_warm"] = [1.0, 1.0, 1.0]  # 2 GB/s
    cpu0 = {m: [1.0, 1.0, 1.0] for m in hs.MODES}
    cpu1 = {m: [0.5, 3.0, 1.0] for m in hs.MODES}  # both: 1.5, 4.0, 2.0 -> median 2.0
    cpu1["gloo_one_warm"] = [0.0, 0.0, 0.0]  # both: 1.0
    zero = {m: [0.0, 0.0, 0.0] for m in hs.MODES}
    sums0 = dict(zero, stream_warm=[0.2, 0.4, 0.6])
    sums1 = dict(zero, stream_warm=[0.2, 0.0, 0.6])  # both: 0.4, 0.4, 1.2 -> median 0.4

    out = hs.summarize(nbytes, seconds, [cpu0, cpu1], [sums0, sums1])

    assert out["bytes"] == nbytes
    gloo, stream = out["modes"]["gloo_one_warm"], out["modes"]["stream_warm"]
    assert gloo["gbps"] == 2.0 and gloo["cpu_s_per_gb"] == 0.5 and gloo["cores_busy"] == 1.0
    assert gloo["cpu_vs_gloo_one_warm"] == 1.0 and gloo["ceiling_gbps_2_cores"] == 4.0
    assert stream["median_s"] == 2.0 and stream["vs_gloo_one_warm"] == 0.5
    assert stream["cpu_s_both"] == [1.5, 4.0, 2.0]
    assert stream["cpu_s_per_gb"] == 1.0  # median 2.0 CPU s over 2 GB
    assert stream["cores_busy"] == 1.0  # 2.0 CPU s over a 2 s median
    assert stream["cpu_vs_gloo_one_warm"] == 2.0
    assert stream["ceiling_gbps_2_cores"] == 2.0  # 2 cores / 1 CPU s per GB
    assert stream["checksum_cpu_s_per_gb"] == 0.2
    assert out["modes"]["stream_warm_no_checksum"]["checksum_cpu_s_per_gb"] == 0.0


def test_summary_needs_every_mode_on_both_processes() -> None:
    seconds = {m: [1.0] for m in hs.MODES}
    cpu = {m: [1.0] for m in hs.MODES}
    short = {m: [1.0] for m in hs.MODES if m != "stream_fresh"}
    with pytest.raises(KeyError):
        hs.summarize(10**9, seconds, [cpu, short], [cpu, cpu])
