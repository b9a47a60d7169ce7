"""Performance models that choose and predict the cost of a recovery.

:mod:`.step_cost_model` is the critical-path model of one data-parallel iteration under a
takeover plan, ``max_r sum(cost(mb)) + optimizer + sync(n)``, with the physical limits of an
exact and a takeover method. The benchmarks calibrate it and check it against real multi-rank
runs (``benchmarks/degraded_throughput.py``) and walk failure traces through it
(``benchmarks/failure_trace.py``).

Uses: :mod:`megatron_mecefo.takeover` (the real plans of the real policies). Used by: the
benchmarks.
"""
