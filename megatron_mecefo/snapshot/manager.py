"""``SnapshotManager``: when to snapshot, the two-slot rotation, the commit and the restore."""

from __future__ import annotations

import os
import time
import weakref
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_mecefo.snapshot.checksum import crc32
from megatron_mecefo.snapshot.config import SnapshotConfig
from megatron_mecefo.snapshot.contents import (
    TrainingState,
    collect,
    dist_opt_map,
    reshard,
    restore,
)
from megatron_mecefo.snapshot.copier import Copier
from megatron_mecefo.snapshot.slots import Slot, plan_layout


def default_store() -> Any:
    """The job's TCPStore (torch.distributed's default store, a prefix store over it)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


class SnapshotManager:
    """One per rank. Call :meth:`before_optimizer_step` before every ``optimizer.step()`` and
    :meth:`after_step` after it; :meth:`restore` at start-up.

    Args:
        config: Interval, holder directory, redundancy.
        rank: This process's global rank (names its directory under the holder's).
        world_size: Ranks that must commit a snapshot for it to count; None: the current
            torch.distributed world's size, read at each commit.
        store: A ``torch.distributed.Store`` shared by the job; None: the current world's
            default store, read at each commit (under the recovery supervisor that is the
            membership store, under the generation's prefix).
        log: Where to print (rank 0 usually passes ``print``; others a no-op).
        parity_group: With redundancy m > 0: returns the current data-parallel process group,
            over which each snapshot's parity is exchanged (read at each exchange, so it
            follows a regroup).
        slot_id: This process's stable identity in parity records (the recovery slot, i.e.
            the original global rank); default ``rank``.
    """

    def __init__(
        self,
        config: SnapshotConfig,
        rank: int,
        world_size: Optional[int] = None,
        store: Any = None,
        log: Any = None,
        parity_group: Any = None,
        slot_id: Optional[int] = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.parity_group = parity_group
        self.slot_id = rank if slot_id is None else slot_id
        self.parity_s = 0.0
        """Seconds the training thread spent exchanging parity (part of main_thread_s)."""
        self.parity_bytes = 0
        """Bytes of parity this rank holds for its newest snapshot."""
        self.should_abort: Any = None
        """Optional ``() -> bool``: stop waiting for peers' commits (e.g. the recovery
        supervisor announced a new generation: a peer died)."""
        self._world_size = world_size
        self._store = store
        self.log = log or (lambda line: None)
        directory = None
        if config.directory is not None:
            directory = os.path.join(config.directory, f"rank{rank}")
            os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.slots = [Slot(0, directory), Slot(1, directory)]
        self.copier = Copier()
        self._next = 0
        self._in_flight: Optional[int] = None  # iteration being copied
        self._in_flight_slot: Optional[Slot] = None
        self._map: Any = None
        self._map_of: Optional[weakref.ref] = None
        self._uncounted: Optional[int] = None  # copied locally, not yet added to the store
        self.last_committed: Optional[int] = None
        self.taken: List[int] = []
        self.copy_wait_s = 0.0
        """Seconds the training thread spent waiting on copies (fences and joins)."""
        self.commit_wait_s = 0.0
        """Seconds the training thread waited for peers to commit (part of main_thread_s)."""
        self.main_thread_s = 0.0
        """Seconds the training thread spent in snapshot code (waits, commits, starting
        copies): the snapshots' whole cost on the training path."""
        # A restarted job must not read the previous incarnation's counters.
        self._key_prefix = f"mecefo_snapshot/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"

    @property
    def store(self) -> Any:
        return self._store if self._store is not None else default_store()

    @property
    def world_size(self) -> int:
        return self._world_size if self._world_size is not None else dist.get_world_size()

    # ------------------------------------------------------------------ taking
    def due(self, iteration: int) -> bool:
        return self.config.enabled and iteration % self.config.interval == 0

    def before_optimizer_step(self) -> None:
        """The copy reads the live parameters and optimizer state, which the step writes."""
        t0 = time.perf_counter()
        self.copier.fence()
        dt = time.perf_counter() - t0
        self.copy_wait_s += dt
        self.main_thread_s += dt

    def after_step(self, state: TrainingState, iteration: int) -> bool:
        """Snapshot ``state`` if ``iteration`` is due; returns whether one was started."""
        if not self.due(iteration):
            return False
        t0 = time.perf_counter()
        self.take(state, iteration)
        self.main_thread_s += time.perf_counter() - t0
        return True

    def take(self, state: TrainingState, iteration: int) -> None:
        """Start copying ``state`` into the slot not holding the newest snapshot."""
        self._finish_local()
        previous = self._uncounted_commit()
        if previous is not None:
            # The slot about to be written may hold the last snapshot every rank committed:
            # only overwrite it once the newer one (``previous``) counts everywhere.
            self.wait_committed(previous)
        tensors, meta = collect(state)
        meta["iteration"] = iteration
        if self.config.redundancy:
            meta["dist_opt_map"] = self._dist_opt_map(state)
        entries, nbytes = plan_layout(tensors)
        slot = self.slots[self._next]
        slot.invalidate()
        buffer = slot.ensure(nbytes)
        header = {
            "iteration": iteration,
            "rank": self.rank,
            "world_size": self.world_size,
            "nbytes": nbytes,
            "entries": [[e.name, list(e.shape), e.dtype, e.offset, e.nbytes] for e in entries],
            "meta": meta,
        }

        def finish() -> None:
            header["crc32"] = crc32(buffer[:nbytes])
            slot.seal(header)

        self.copier.start(buffer, tensors, entries, finish)
        self._in_flight, self._in_flight_slot = iteration, slot
        self._next = 1 - self._next
        self.taken.append(iteration)

    def _finish_local(self) -> None:
        if self._in_flight is None:
            return
        t0 = time.perf_counter()
        self.copier.join()
        self.copy_wait_s += time.perf_counter() - t0
        self._uncounted, self._in_flight = self._in_flight, None
        if self.config.redundancy and self.parity_group is not None:
            # Before the commit: a snapshot counts only once its parity is stored.
            self._exchange_parity(self._in_flight_slot)

    def _dist_opt_map(self, state: TrainingState) -> Any:
        """:func:`dist_opt_map` of the live optimizer, computed once per optimizer (it only
        changes when a regroup builds a new one). Held by weak reference: the old world's
        optimizer must be freed with its process groups."""
        cached = self._map_of() if self._map_of is not None else None
        if cached is not state.optimizer:
            self._map, self._map_of = dist_opt_map(state), weakref.ref(state.optimizer)
        return self._map

    def _exchange_parity(self, slot: Slot) -> None:
        from megatron_mecefo.snapshot.parity import exchange_parity

        t0 = time.perf_counter()
        header = slot.header()
        slot.parity = exchange_parity(
            slot.buffer, header, self.config.redundancy, self.parity_group(), self.slot_id
        )
        self.parity_bytes = slot.parity.nbytes
        self.parity_s += time.perf_counter() - t0

    def abandon(self) -> None:
        """The world failed: wait for a copy in flight (it reads live tensors) and forget it;
        a snapshot without its parity exchanged and committed never counts."""
        try:
            self.copier.join()
        except RuntimeError:
            pass
        if self._in_flight_slot is not None and self._in_flight is not None:
            self._in_flight_slot.invalidate()
        self._in_flight, self._in_flight_slot, self._uncounted = None, None, None

    def _uncounted_commit(self) -> Optional[int]:
        """Add this rank's commit of the last finished snapshot to the store."""
        iteration, self._uncounted = self._uncounted, None
        if iteration is not None:
            self.store.add(f"{self._key_prefix}/{iteration}", 1)
        return iteration

    def commits(self, iteration: int) -> int:
        """How many ranks have committed the snapshot of ``iteration``."""
        return int(self.store.add(f"{self._key_prefix}/{iteration}", 0))

    def wait_committed(self, iteration: int) -> None:
        """Block until every rank has committed ``iteration``'s snapshot."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.config.commit_timeout_s
        while self.commits(iteration) < self.world_size:
            if self.should_abort is not None and self.should_abort():
                raise RuntimeError(
                    f"snapshot of iteration {iteration}: the world changed while waiting for "
                    "the peers' commits"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"snapshot of iteration {iteration}: only {self.commits(iteration)} of "
                    f"{self.world_size} ranks committed it within "
                    f"{self.config.commit_timeout_s:.0f} s"
                )
            time.sleep(0.001)
        self.commit_wait_s += time.perf_counter() - t0
        self.last_committed = iteration

    def flush(self) -> Optional[int]:
        """Finish the copy in flight and its commit (at the end of training); returns the
        newest snapshot every rank committed."""
        self._finish_local()
        last = self._uncounted_commit()
        if last is not None:
            self.wait_committed(last)
        return self.last_committed

    # ------------------------------------------------------------------ restoring
    def local_snapshots(self, verify: bool = True) -> Dict[int, Tuple[Slot, Dict[str, Any]]]:
        """This rank's snapshots by iteration: sealed (header present) and, with ``verify``,
        intact (checksum matching)."""
        out = {}
        for slot in self.slots:
            header = slot.verify() if verify else slot.header()
            if header is not None and (verify or slot.attach()):
                if slot.buffer.numel() >= header["nbytes"]:
                    out[int(header["iteration"])] = (slot, header)
        return out

    def restore(
        self, state: TrainingState, group: Optional[dist.ProcessGroup] = None
    ) -> Optional[Dict[str, Any]]:
        """Collective over ``group``: restore the newest snapshot that every rank holds intact.

        Returns:
            ``{"path": "local", "iteration": N, "seconds": s}``, or None when the ranks have no
            common intact snapshot (the caller falls back to disk).
        """
        t0 = time.perf_counter()
        # Sealed snapshots first; only the one chosen is checksummed (a full read).
        mine = self.local_snapshots(verify=False)
        while True:
            iteration, every = _newest_common(mine, group)
            if iteration is None:
                held = sum(1 for e in every if e)
                self.log(
                    f"> MeCeFO snapshot: no snapshot held intact by every rank ({held} of "
                    f"{len(every)} ranks hold one); starting from --load (disk) or from scratch"
                )
                return None
            slot, header = mine[iteration]
            ok = torch.tensor([int(crc32(slot.buffer[: header["nbytes"]]) == header["crc32"])])
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
            if int(ok):
                break
            self.log(
                f"> MeCeFO snapshot: iteration {iteration} failed its checksum on some rank; "
                "trying an older one"
            )
            del mine[iteration]
        tensors = slot.read(header)
        restore(state, tensors, header["meta"])
        # The next snapshot must not overwrite the one just restored.
        self._next = 1 - slot.index
        self.last_committed = iteration
        seconds = time.perf_counter() - t0
        nbytes = torch.tensor([header["nbytes"]], dtype=torch.int64)
        dist.all_reduce(nbytes, group=group)
        self.log(
            f"> MeCeFO snapshot: recovery path local (holder memory): iteration {iteration}, "
            f"{int(nbytes) / 2**20:.1f} MiB over {len(every)} ranks, {seconds:.3f} s"
        )
        return {"path": "local", "iteration": iteration, "seconds": seconds}

    # ------------------------------------------------------------------ takeover
    def parity_snapshots(self) -> Dict[int, Slot]:
        """This rank's snapshots whose parity was exchanged, by iteration."""
        out = {}
        for slot in self.slots:
            if slot.parity is not None and slot.header() is not None:
                out[slot.parity.iteration] = slot
        return out

    def takeover(self, state: TrainingState, group: dist.ProcessGroup) -> Optional[Dict[str, Any]]:
        """Collective over the world after a real death: roll every rank back to the newest
        snapshot that every rank holds with its parity, rebuild the lost members' slots in each
        data-parallel group (``group``, the new world's), and load the state, the optimizer
        re-sharded over the new group.

        Returns:
            ``{"path": "peers+parity", "iteration": s, "seconds": t, "rebuilt": {slot: digest}}``,
            or None when no snapshot with parity is held by every rank.

        Raises:
            SnapshotLost: More than m members of a group lost, or a rebuilt slot fails its
                checksum.
        """
        from megatron_mecefo.snapshot.erasure import SnapshotLost
        from megatron_mecefo.snapshot.parity import optimizer_digest, read_tensors, rebuild_group

        t0 = time.perf_counter()
        mine = self.parity_snapshots()
        iteration, _ = _newest_common(mine, None)
        if iteration is None:
            return None
        slot = mine[iteration]
        lost_here: Optional[SnapshotLost] = None
        try:
            shards = rebuild_group(slot.buffer, slot.parity, group, self.slot_id)
        except SnapshotLost as err:  # raised after the group's last collective
            lost_here = err
        # One verdict for the whole world before any rank writes its state: another group
        # (another TP/PP position) may have lost its snapshot while this one rebuilt its own.
        everywhere = _agree(lost_here is None)
        if lost_here is not None:
            raise lost_here
        if not everywhere:
            raise SnapshotLost(
                f"snapshot of iteration {iteration}: another data-parallel group lost more "
                "members than the redundancy covers: the in-memory snapshot cannot be rebuilt; "
                "falling back to the disk checkpoint (--load)"
            )
        t_rebuilt = time.perf_counter()
        own_header, own_bytes = shards[self.slot_id]
        tensors = read_tensors(own_header, own_bytes)
        sizes = {
            f"model{i}.{name}": p.numel()
            for i, chunk in enumerate(state.model_chunks)
            for name, p in chunk.named_parameters()
        }
        new_map = dist_opt_map(state)
        if new_map is None:
            raise RuntimeError("takeover from parity needs the distributed optimizer")
        optim = reshard(
            [(h["meta"], read_tensors(h, data)) for h, data in shards.values()], new_map, sizes
        )
        merged = {n: t for n, t in tensors.items() if not n.startswith("optim")}
        merged.update(optim)
        restore(state, merged, own_header["meta"])
        self._next = 1 - slot.index  # keep the snapshot rolled back to
        self.last_committed = iteration
        lost = [s for s in slot.parity.members if s not in self._survivors(group)]
        rebuilt = {s: optimizer_digest(*shards[s]) for s in lost}
        seconds = time.perf_counter() - t0
        self.log(
            f"> MeCeFO snapshot: recovery path peers+parity: iteration {iteration}, rebuilt "
            f"the slots of ranks {lost} from {len(shards) - len(lost)} peers and "
            f"m={slot.parity.m} parity (checksums verified) in {t_rebuilt - t0:.3f} s, "
            f"optimizer re-sharded over {dist.get_world_size(group)} replicas; {seconds:.3f} s"
        )
        return {
            "path": "peers+parity",
            "iteration": iteration,
            "seconds": seconds,
            "rebuild_s": t_rebuilt - t0,
            "rebuilt": rebuilt,
        }

    def forget(self) -> None:
        """Drop every snapshot (slots and parity): the state was put back from elsewhere
        (the disk checkpoint), so these belong to a discarded timeline and must never be
        restored. The slots' buffers stay allocated for the next snapshots."""
        self.abandon()
        for slot in self.slots:
            slot.invalidate()  # drops its parity too
        self.last_committed = None

    def _survivors(self, group: dist.ProcessGroup) -> List[int]:
        every: List[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, self.slot_id, group=group)
        return [int(s) for s in every]


def _agree(ok: bool) -> bool:
    """Collective over the world: whether every rank passes ``ok``."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _newest_common(
    held: Iterable[int], group: Optional[dist.ProcessGroup]
) -> Tuple[Optional[int], List[List[int]]]:
    """Collective over ``group``: the newest iteration that every rank holds a snapshot of
    (None if there is none), and the iterations each rank holds."""
    every: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, sorted(held), group=group)
    common = set(every[0]).intersection(*map(set, every[1:]))
    return (max(common) if common else None), every
