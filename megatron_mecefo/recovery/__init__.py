"""Real process death: detect, regroup in-process, take over, commit, rejoin and heal.

Where :mod:`megatron_mecefo.takeover` simulates failures (a "failed" replica's processes stay
alive), this subpackage handles a rank that really dies (SIGKILL, OOM killer, a lost node):

* :mod:`.supervisor` starts the ranks of one node (like torchrun, without killing survivors),
  hosts the membership store outside every training rank, reports deaths, starts
  replacements (:mod:`.replacement`) and, on the first node, runs the :mod:`.coordinator`,
  the single writer of the membership generations (:mod:`.membership`);
* in each rank, :mod:`.session` drives the example trainer through generations: detection
  (:mod:`.heartbeat`, collective errors), release and rebuild of the world (:mod:`.regroup`,
  :mod:`.abort`), the commit vote (:mod:`.commit`), takeover from membership
  (:mod:`.membership_schedule`), rejoin and heal (:mod:`.state_transfer`), fault injection
  (:mod:`.fault_injection`) and the recovery records (:mod:`.records`).

Config: :class:`.config.RecoveryConfig`. Used by ``examples/pretrain_gpt/pretrain_gpt.py`` and
``benchmarks/recovery_latency.py``.
"""
