"""Membership: the job's layout, the generations and the store keys everyone agrees on.

The store (a ``TCPStore`` hosted by the first node's supervisor, never by a training rank; in
``--store-mode etcd`` by the leader's, with the durable keys on etcd, :mod:`.store_etcd`)
holds, under fixed keys:

* ``gen``: the current generation number ``g``; ``gen/<g>``: its :class:`Generation` (JSON),
  written once by the coordinator, the single writer of membership;
* ``dead/<slot>/<inc>``: a death, written by the supervisor that reaped the process;
* ``hb/node/<id>``: the beats of a node, written by its supervisor each heartbeat interval
  (JSON: its own beat count and its ranks', which beat to it locally: :mod:`.heartbeat`);
  ``hb/<slot>/<inc>``: the counter of a rank that beats to the store itself (no supervisor);
  ``ready/<slot>/<inc>``: a process is up;
* ``err/<g>/<slot>``: a rank left generation ``g`` after a collective error; ``err/<g>``
  counts them (the coordinator looks at one key, not one per member);
* ``events``: the event count; ``event/<n>``: the key event ``n`` wrote ("" for none), so
  that the coordinator rereads only the slots that changed;
* ``vote/<g>/<iteration>/<slot>``: the commit vote; ``progress``: the last committed iteration.

A *slot* is a global rank of the original job (its TP, PP and data-parallel coordinates never
change); an *incarnation* counts the processes that have held the slot.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron_mecefo.recovery.store_forwarding import tcp_client


@dataclass(frozen=True)
class JobLayout:
    """The original job: TP x PP x DP ranks in Megatron's default order ``tp-cp-ep-dp-pp``.

    Args:
        tp: Tensor-parallel size.
        pp: Pipeline-parallel size.
        dp: Data-parallel size (number of replicas) of the full job.
    """

    tp: int
    pp: int
    dp: int

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, slot: int) -> Tuple[int, int, int]:
        """(tp, dp, pp) coordinates of original global rank ``slot``."""
        return slot % self.tp, (slot // self.tp) % self.dp, slot // (self.tp * self.dp)

    def replica_of(self, slot: int) -> int:
        return self.coords(slot)[1]

    def replica_slots(self, replica: int) -> List[int]:
        """The slots (original global ranks) of data-parallel replica ``replica``."""
        return sorted(
            t + self.tp * replica + self.tp * self.dp * p
            for t in range(self.tp)
            for p in range(self.pp)
        )

    def rank_in(self, slot: int, replicas: Sequence[int]) -> int:
        """Global rank of ``slot`` in a world made of ``replicas`` (same order as Megatron)."""
        t, d, p = self.coords(slot)
        return t + self.tp * list(replicas).index(d) + self.tp * len(replicas) * p


class CompleteReplicas:
    """Rank-assignment policy: a replica trains only while every one of its ranks is alive.

    The live siblings of a dead rank become spares (they wait for the rejoin, or exit).
    """

    name = "complete-replicas"

    def assign(self, layout: JobLayout, alive: Sequence[int]) -> Tuple[List[int], List[int]]:
        """(replicas that train, alive slots that do not) for the ``alive`` slots."""
        alive_set = set(alive)
        replicas = [
            r for r in range(layout.dp) if all(s in alive_set for s in layout.replica_slots(r))
        ]
        members = {s for r in replicas for s in layout.replica_slots(r)}
        return replicas, sorted(alive_set - members)


@dataclass(frozen=True)
class Generation:
    """One membership generation: who trains, in which world, from which boundary."""

    number: int
    replicas: Tuple[int, ...]
    """Data-parallel replicas (original indices) that train in this generation."""
    members: Dict[int, int]
    """Training slot -> incarnation."""
    spares: Tuple[int, ...] = ()
    """Alive slots that do not train (siblings of a dead rank, joiners not yet admitted)."""
    joined: Tuple[int, ...] = ()
    """Members that receive their state from a data-parallel peer (rejoin/heal)."""
    lost: Tuple[int, ...] = ()
    """Slots found dead since the previous generation."""
    at_iteration: Optional[int] = None
    """Planned change (rejoin): members switch after committing iteration ``at_iteration - 1``.
    ``None``: a failure, members switch at once and redo the in-flight iteration."""
    reason: str = ""
    abort: Optional[str] = None
    """Set when the job cannot go on (no complete replica left): the message to print."""
    published_at: float = field(default_factory=time.time)
    layout: Optional[Dict[str, int]] = None

    def rank_of(self, slot: int) -> int:
        assert self.layout is not None
        return JobLayout(**self.layout).rank_in(slot, self.replicas)

    @property
    def world_size(self) -> int:
        return len(self.members)

    def to_json(self) -> str:
        d = asdict(self)
        d["members"] = {str(k): v for k, v in self.members.items()}
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str | bytes) -> Generation:
        d = json.loads(text)
        d["members"] = {int(k): v for k, v in d["members"].items()}
        for key in ("replicas", "spares", "joined", "lost"):
            d[key] = tuple(d[key])
        return cls(**d)


class MembershipStore:
    """Typed access to the membership keys of one TCPStore client (see the module docstring).

    Args:
        store: A ``torch.distributed.TCPStore`` client (or the server object).
    """

    def __init__(self, store: Any, address: str = "") -> None:
        self.store = store
        self._address = address  # HOST:PORT of a plain client (an EtcdStore knows its own)
        self._counters: set = set()  # heartbeat keys known to exist (read in one multi_get)

    @staticmethod
    def connect(
        address: str, timeout_s: float = 60.0, raise_on_failover: bool = False
    ) -> MembershipStore:
        """A new client of the store at ``HOST:PORT``, or of the leader's store found through
        etcd at an ``etcd://`` address (:class:`~.store_etcd.EtcdStore`)."""
        if address.startswith("etcd://"):  # --store-mode etcd: the leader's store, via etcd
            from megatron_mecefo.recovery.store_etcd import EtcdStore

            return MembershipStore(EtcdStore(address, timeout_s, raise_on_failover))
        address = address.strip()
        return MembershipStore(tcp_client(address, timeout_s), address)

    def address(self) -> str:
        """The ``HOST:PORT`` this client talks to now (etcd mode: the current leader's)."""
        return getattr(self.store, "address", None) or self._address

    # -------------------------------------------------------------- raw helpers
    def get_str(self, key: str) -> Optional[str]:
        if not self.store.check([key]):
            return None
        return self.store.get(key).decode()

    def set_durable(self, key: str, value: str) -> None:
        """Set a key that must outlive the store's host: a generation, the fatal message, the
        committed and logged iteration, a recovery record (etcd mode:
        :meth:`~.store_etcd.EtcdStore.set` writes them to etcd first)."""
        self.store.set(key, value)

    def set_json(self, key: str, value: Any) -> None:
        self.store.set(key, json.dumps(value))

    def get_json(self, key: str) -> Any:
        text = self.get_str(key)
        return None if text is None else json.loads(text)

    # -------------------------------------------------------------- generations
    def generation_number(self) -> int:
        text = self.get_str("gen")
        return -1 if text is None else int(text)

    def generation(self, number: int) -> Generation:
        return Generation.from_json(self.store.get(f"gen/{number}"))

    def wait_generation_after(self, number: int, timeout_s: float) -> None:
        """Block until generation ``number + 1`` is published or ``timeout_s`` passes; the
        store wakes the caller when the key appears (no polling). Holds this client's lock
        while it waits: use a client of its own."""
        self.wait_for(f"gen/{number + 1}", timeout_s)

    def wait_for(self, key: str, timeout_s: float) -> None:
        """Block until ``key`` exists or ``timeout_s`` passes (the store answers the moment
        it is set). Holds this client's lock while it waits."""
        from torch.distributed import DistStoreError

        try:
            self.store.wait([key], timedelta(seconds=max(timeout_s, 0.001)))
        except DistStoreError:
            pass

    def publish(self, gen: Generation) -> None:
        """Write ``gen`` and make it current (the coordinator only); an event, so that the
        supervisors, which look at the store only when the event count moves, see it."""
        # etcd first (EtcdStore.set: fenced on the leader's term, gen == n - 1): a leader that
        # takes over numbers the next one above every generation a rank may have seen.
        self.set_durable(f"gen/{gen.number}", gen.to_json())
        self.set_durable("gen", str(gen.number))
        self.notify()

    def set_fatal(self, message: str) -> None:
        """Stop the job with ``message`` (every rank and supervisor exits); an event."""
        self.set_durable("fatal", message)
        self.notify()

    def unformed_failures(self, number: int) -> List[Generation]:
        """The failure generations just below ``number`` whose world never formed (not every
        member arrived: a newer generation superseded them during the regroup) and that lost
        ranks, oldest first.
        The scan stops at the first generation that formed or already has a record."""
        found = []
        for g in range(number - 1, 0, -1):
            old = self.generation(g)
            if self.store.check([f"arrive/{g}/{s}" for s in old.members]):
                break
            if self.get_str(f"record/{g}") is not None:
                break
            # A failure generation that lost no rank (a collective error seen before the
            # death was known) is a step towards the next one, whose record covers the death.
            if old.at_iteration is None and not old.abort and old.lost:
                found.append(old)
        return found[::-1]

    # -------------------------------------------------------------- processes
    def report_dead(self, slot: int, inc: int, info: Dict[str, Any]) -> None:
        self.set_json(f"dead/{slot}/{inc}", info)
        self.notify(f"dead/{slot}/{inc}")

    def dead_info(self, slot: int, inc: int) -> Optional[Dict[str, Any]]:
        return self.get_json(f"dead/{slot}/{inc}")

    def mark_ready(self, slot: int, inc: int, info: Dict[str, Any]) -> None:
        self.set_json(f"ready/{slot}/{inc}", info)
        self.notify(f"ready/{slot}/{inc}")

    def heartbeat(self, slot: int, inc: int) -> int:
        return int(self.store.add(f"hb/{slot}/{inc}", 1))

    def node_heartbeat(self, supervisor: str, beat: int, ranks: Dict[str, int]) -> None:
        """A node's beats, written by its supervisor ``supervisor``: its own count ``beat`` and
        its ranks' (``"<slot>/<inc>"`` -> count), one key per node (``hb/node/<id>``)."""
        self.store.set(f"hb/node/{supervisor}", json.dumps({"beat": beat, "ranks": ranks}))

    def supervisor_heartbeat(self, supervisor: str) -> int:
        """A beat of the supervisor ``supervisor`` (:data:`.heartbeat.SUPERVISOR_ENV`)."""
        return int(self.store.add(f"hb/supervisor/{supervisor}", 1))

    def heartbeats(
        self, keys: Sequence[Tuple[int, int]], supervisors: Sequence[str] = ()
    ) -> List[int]:
        """The heartbeat counts of ``(slot, inc)`` processes, then of ``supervisors``, in one
        round trip once each counter exists (``multi_get`` would wait for a missing key: a
        new one is created at 0 by an ``add`` of 0 first)."""
        names = [f"hb/{s}/{i}" for s, i in keys] + [f"hb/supervisor/{s}" for s in supervisors]
        if not names:
            return []
        for name in names:
            if name not in self._counters:
                self.store.add(name, 0)
                self._counters.add(name)
        return [int(v) for v in self.store.multi_get(names)]

    def report_error(self, gen: int, slot: int, message: str) -> None:
        self.set_json(f"err/{gen}/{slot}", {"t": time.time(), "error": message[:500]})
        self.store.add(f"err/{gen}", 1)
        self.notify(f"err/{gen}/{slot}")

    def events(self) -> int:
        """How many events (a death, a ready process, an error, a kill request) so far."""
        return int(self.store.add("events", 0))

    def notify(self, key: str = "") -> None:
        """Count an event, then publish its key ``event/<count>`` (its value: ``key``, what the
        event wrote), which wakes a coordinator waiting in :meth:`wait_event_after` (no polling
        while nothing happens)."""
        self.store.set(f"event/{int(self.store.add('events', 1))}", key)

    def wait_event_after(self, number: int, timeout_s: float) -> None:
        """Block until event ``number + 1`` is published or ``timeout_s`` passes (a writer
        killed between counting and publishing costs the waiter one timeout). Holds this
        client's lock while it waits: use a client of its own."""
        self.wait_for(f"event/{number + 1}", timeout_s)
