"""Performance models that choose and predict the cost of a recovery.

:mod:`.step_cost_model` is the critical-path model of one data-parallel iteration under a
takeover plan, ``max_r sum(cost(mb)) + optimizer + sync(n)``, with the physical limits of an
exact and a takeover method. The benchmarks calibrate it and check it against real multi-rank
runs (``benchmarks/degraded_throughput.py``) and walk failure traces through it
(``benchmarks/failure_trace.py``).

:mod:`.recovery_planner` is ``--mecefo-policy auto``: a pure function that picks, per failure
event, the policy (neighbor / spread / exact / drop / shrink), FFN recomputation and the
low-rank r within the user's budgets, with the predicted step time and transition cost;
:mod:`.auto_policy` runs it inside the controller; :mod:`.calibration` builds its cost profile
from the benchmark results and reports prediction against measurement.

Importing this package plugs ``auto`` into the takeover's config and flags
(:func:`megatron_mecefo.takeover.config.register_auto_policy`: the takeover, below the planner,
does not import it); ``megatron_mecefo/__init__.py`` imports it, so any import of the package
does. Torch-free.

Uses: :mod:`megatron_mecefo.takeover` (the real plans of the real policies). Used by: the
benchmarks, ``benchmarks/cluster_sim.py`` and the trainers (``--mecefo-policy auto``).
"""

from megatron_mecefo.planner.arguments import add_planner_arguments
from megatron_mecefo.planner.config import AutoPolicyConfig
from megatron_mecefo.takeover.config import register_auto_policy

register_auto_policy(AutoPolicyConfig, add_planner_arguments)
