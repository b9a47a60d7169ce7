"""A coordinator over ranks marked ready under named supervisors, for its heartbeat tests."""

from __future__ import annotations

from typing import Dict, Tuple

from megatron_mecefo.recovery.config import RecoveryConfig
from megatron_mecefo.recovery.coordinator import Coordinator
from megatron_mecefo.recovery.membership import MembershipStore


def coordinator_over(
    store: str, timeout_s: float, supervisor_of: Dict[int, str], world: int = 8
) -> Tuple[MembershipStore, Coordinator]:
    """Ranks ``supervisor_of`` (slot -> supervisor id) ready and beating once, each supervisor
    beating once, and a coordinator of ``world`` slots that has scanned them (a 0.5 s heartbeat
    interval, ``timeout_s`` timeout). Returns a client of the store and the coordinator."""
    cfg = RecoveryConfig(store=store, heartbeat_interval_s=0.5, heartbeat_timeout_s=timeout_s)
    ms = MembershipStore.connect(store)
    for slot, supervisor in supervisor_of.items():
        ms.mark_ready(slot, 0, {"pid": 100 + slot, "supervisor": supervisor})
        ms.heartbeat(slot, 0)
    for supervisor in sorted(set(supervisor_of.values())):
        ms.supervisor_heartbeat(supervisor)
    coord = Coordinator(MembershipStore.connect(store), world, cfg, log=lambda line: None)
    coord._rescan()
    return ms, coord
