"""Fail-slow: detect a straggling data-parallel replica and hand part of its micro-batches to
the others, exactly (``--mecefo-fail-slow {off,detect,rebalance}``).

* :mod:`.config`: the settings (:class:`FailSlowConfig`) and their start-up checks;
* :mod:`.arguments`: the flags, for any argparse parser;
* :mod:`.detector`: per-replica compute time per micro-batch, smoothed, against the group's
  median (:class:`FailSlowDetector`); a pure function of the exchanged numbers;
* :mod:`.rebalance`: how many micro-batches each slow replica gives away and to whom
  (:func:`plan_rebalance`), and the takeover-policy wrapper that turns it into a plan
  (:class:`RebalancePolicy`);
* :mod:`.compute_clock`: the compute timer, on the device the compute runs on (CUDA events
  on a GPU, where host timings only see the kernels being queued);
* :mod:`.monitor`: the trainer glue (timing, the piggybacked exchange, records, summary);
* :mod:`.duty_cycle`: an outside SIGSTOP/SIGCONT duty cycle that slows a process down (tests
  and the benchmark).

Torch-free except :mod:`.compute_clock` and :mod:`.monitor`.
"""

from __future__ import annotations

from megatron_mecefo.failslow.config import MODES, FailSlowConfig, FailSlowConfigError
from megatron_mecefo.failslow.detector import FailSlowDetector, SlowState
from megatron_mecefo.failslow.rebalance import Assignment, RebalancePolicy, plan_rebalance

__all__ = [
    "MODES",
    "Assignment",
    "FailSlowConfig",
    "FailSlowConfigError",
    "FailSlowDetector",
    "RebalancePolicy",
    "SlowState",
    "plan_rebalance",
]
