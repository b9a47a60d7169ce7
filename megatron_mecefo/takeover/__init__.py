"""The data-parallel manager: who computes a failed replica's share of the global batch.

Per iteration: :mod:`.failure_schedule` says which replicas are down (a seeded schedule that
every rank computes alike); a policy of :mod:`.policies` (``neighbor``, ``spread``, ``exact``,
``drop``) turns that into a :class:`~.plan.StepPlan` (each replica's micro-batches, their
modes and the re-weighting factors); :mod:`.data_remap` reads an absorbed micro-batch's samples
by index and checks that the global batch is covered exactly once; :mod:`.controller` runs the
plan through Megatron's ``forward_backward_func`` and re-weights the gradients in
``finalize_model_grads``. :mod:`.topology` names the ranks of each replica (the failure unit).
:mod:`.virtual_replicas` runs every replica's part of a plan in one process (the example
trainer's ``--mecefo-virtual-replicas``: convergence studies at n = 32 without 32 processes).

Uses: :mod:`megatron_mecefo.techniques` (per-micro-batch modes) and :mod:`megatron_mecefo.data`
(the sampler order). Used by: :mod:`megatron_mecefo.megatron_lm`, the example trainer,
:mod:`megatron_mecefo.planner` and the benchmarks.
"""
