"""The profile ``--mecefo-policy auto`` reads when none is given ships with the package, and it is
the one the benchmarks measured (``make bench`` copies it)."""

import json
from pathlib import Path

from megatron_mecefo.planner.calibration import PACKAGED_PROFILE

REPO = Path(__file__).resolve().parents[3]


def test_packaged_profile_is_the_measured_one() -> None:
    packaged = json.loads(Path(PACKAGED_PROFILE).read_text())
    measured = json.loads((REPO / "results" / "planner_profile.json").read_text())
    assert packaged == measured
