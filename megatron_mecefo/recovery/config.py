"""``RecoveryConfig``: the supervisor's and the ranks' recovery settings, and their checks."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Optional

# Re-exported: ``from megatron_mecefo.recovery.config import RecoveryConfigError`` is public.
from megatron_mecefo.recovery.config_error import RecoveryConfigError
from megatron_mecefo.recovery.replacement import build_replacement

__all__ = ["ENV", "RecoveryConfig", "RecoveryConfigError"]

ENV = "MECEFO_RECOVERY"
"""Environment variable through which the supervisor hands the config (JSON) to its ranks."""


@dataclass
class RecoveryConfig:
    """Recovery settings. Timeouts form a hierarchy, checked by :meth:`validate`:
    ``heartbeat_interval_s < heartbeat_timeout_s < collective_timeout_s < init_timeout_s``."""

    store: str = ""
    """``HOST:PORT`` of the membership TCPStore (hosted by the first node's supervisor)."""

    heartbeat_interval_s: float = 1.0
    """Seconds between two heartbeats of a rank (a background thread; a hung process,
    e.g. SIGSTOPped, stops beating). Also how often the coordinator checks them and half how
    often a supervisor looks for kill requests. A beat costs a store round trip, 0.1-0.3 ms
    of CPU on a loaded node; a death is reported at once by the supervisor, not by beats."""

    heartbeat_timeout_s: float = 8.0
    """A rank whose heartbeat has not moved for this long is treated as dead: its
    supervisor SIGKILLs it, which closes its sockets and releases the survivors."""

    collective_timeout_s: float = 30.0
    """Backstop timeout of every process group (the default group and Megatron's): gloo
    cannot abort a blocked collective, and an in-flight send/recv is not always woken by a
    peer's death."""

    init_timeout_s: float = 90.0
    """Timeout of a new generation's rendezvous (``init_process_group``); longer than the
    collective backstop, so a survivor still blocked in the old world can make it."""

    poll_interval_s: float = 0.01
    """How often the coordinator, the commit vote and waiting spares poll the store."""

    replace: str = "never"
    """When the supervisor starts a replacement for a dead rank: ``never``,
    ``immediately`` or ``after:SECONDS`` (emulates a repair)."""

    orphan: str = "wait"
    """What the live TP/PP siblings of a dead rank do: ``wait`` as spares for the rejoin,
    or ``exit`` cleanly (their slots are then replaced like dead ones)."""

    join_margin_iterations: int = 3
    """A rejoin is scheduled this many iterations after the last committed one, so every
    member sees the plan before it reaches the switch boundary."""

    vote_group_size: int = 32
    """Nodes per group of the two-level commit vote (:mod:`.group_vote`), with the node vote
    (:mod:`.node_vote_host`): a generation of more nodes than this gathers each group's node
    votes on its head (the group's first live node), which casts one vote on the leader's
    hot store; 0: never. At 2,048 nodes: 64 votes on the hot store, 32 on each head."""

    warm_heap: bool = True
    """A CPU rank that joins (a replacement, a rejoining node, a spare) faults in a heap block
    of its slot's state size while it waits for its world, so that its heal writes into
    resident pages (:mod:`.state.warm_heap`). No effect on GPU ranks."""

    records_file: Optional[str] = None
    """JSONL file for the recovery records (also written to the trainer's metrics file)."""

    def validate(self) -> RecoveryConfig:
        """Check the timeout hierarchy and the policies; raise :class:`RecoveryConfigError`."""
        chain = [
            ("--heartbeat-interval", self.heartbeat_interval_s),
            ("--heartbeat-timeout", self.heartbeat_timeout_s),
            ("--collective-timeout", self.collective_timeout_s),
            ("--init-timeout", self.init_timeout_s),
        ]
        if self.poll_interval_s <= 0 or chain[0][1] <= 0:
            raise RecoveryConfigError(
                f"--heartbeat-interval={self.heartbeat_interval_s} and the poll interval "
                f"({self.poll_interval_s}) must be positive"
            )
        for (name_a, a), (name_b, b) in zip(chain, chain[1:], strict=False):
            if not a < b:
                raise RecoveryConfigError(
                    f"{name_a}={a} must be below {name_b}={b}: the timeouts must grow "
                    "heartbeat interval < heartbeat timeout < collective timeout < init "
                    f"timeout; raise {name_b} or lower {name_a}"
                )
        build_replacement(self.replace)  # raises on a bad value
        if self.orphan not in ("wait", "exit"):
            raise RecoveryConfigError(f"--orphan={self.orphan}: use wait or exit")
        if self.vote_group_size < 0:
            raise RecoveryConfigError(
                f"--vote-group-size={self.vote_group_size}: must be >= 0 (0: no groups)"
            )
        if self.join_margin_iterations < 2:
            raise RecoveryConfigError(
                f"--join-margin={self.join_margin_iterations}: must be >= 2 (ranks of one "
                "world can be one iteration apart)"
            )
        return self

    def to_env(self) -> str:
        """The JSON form handed to the ranks through :data:`ENV`."""
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, environ: Optional[dict] = None) -> Optional[RecoveryConfig]:
        """The config the supervisor handed over, or ``None`` outside a supervisor."""
        raw = (environ if environ is not None else os.environ).get(ENV)
        if not raw:
            return None
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in json.loads(raw).items() if k in known})
