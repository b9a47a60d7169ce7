"""Real process death: detect, regroup in-process, take over, commit, rejoin and heal.

Where :mod:`megatron_mecefo.takeover` simulates failures (a "failed" replica's processes stay
alive), this subpackage handles a rank that really dies (SIGKILL, OOM killer, a lost node):

* :mod:`.supervisor` starts the ranks of one node (like torchrun, without killing survivors),
  reports deaths and starts replacements (:mod:`.replacement`); its flags are
  :mod:`.supervisor_args`, its process handling :mod:`.processes`, its SIGINT / SIGTERM
  :mod:`.signals` and its CPU account :mod:`.cost_account`. :mod:`.store_host` hosts the
  membership store outside every training rank (``--store-mode etcd``: the leader elected on
  etcd, :mod:`.etcd_control`, :mod:`.store_etcd`) and, beside it, runs the :mod:`.coordinator`,
  the single writer of the membership generations (:mod:`.membership`);
* in each rank, :mod:`.session` drives the example trainer through generations: detection
  (:mod:`.heartbeat`, collective errors), release and rebuild of the world (:mod:`.regroup`,
  :mod:`.abort`), the commit vote (:mod:`.commit`), takeover from membership
  (:mod:`.membership_schedule`), the carried state and the heal by tensors (:mod:`.state`),
  fault injection (:mod:`.fault_injection`) and the recovery records (:mod:`.records`).

Config: :class:`.config.RecoveryConfig`. Used by ``examples/pretrain_gpt/pretrain_gpt.py`` and
``benchmarks/recovery_latency.py``.
"""
