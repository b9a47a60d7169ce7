"""``SnapshotManager``: when to snapshot, the slot rotation, the commit and the restore."""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np
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
from megatron_mecefo.snapshot.slots import Slot, plan_layout, slot_indices
from megatron_mecefo.snapshot.worker import ParityWorker


def default_store() -> Any:
    """The job's TCPStore (torch.distributed's default store, a prefix store over it)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def megatron_snapshot_manager(config: SnapshotConfig, slot: int, log: Any) -> "SnapshotManager":
    """A manager whose parity group (with redundancy) is Megatron's data-parallel group of the
    current world, looked up at each :meth:`SnapshotManager.prepare`: over gloo, on GPU too,
    since the slots are host memory. Its commit counters go to the current world's store (the
    membership store's generation prefix under the recovery supervisor)."""
    from megatron.core import parallel_state as ps

    def dp_group() -> Any:
        return ps.get_data_parallel_group_gloo() or ps.get_data_parallel_group()

    return SnapshotManager(
        config, slot, log=log, parity_group=dp_group if config.redundancy else None
    )


def _slot_count(config: SnapshotConfig, directory: Optional[str]) -> int:
    """The configured number of slots, or more when the holder's directory has more (an
    earlier incarnation ran with more slots: its snapshots stay readable)."""
    found = slot_indices(directory) if directory is not None else []
    return max([config.n_slots] + [i + 1 for i in found])


class SnapshotManager:
    """One per rank. Call :meth:`before_optimizer_step` before every ``optimizer.step()`` and
    :meth:`after_step` after it; :meth:`restore` at start-up.

    **Slots.** ``config.n_slots`` host slots (3 at one snapshot per iteration, else 2). A new
    snapshot goes into an empty slot, else into one whose snapshot is older than the newest
    snapshot every rank has committed (``L``), else into the oldest slot newer than ``L``
    once that one is committed everywhere (the wait; it then becomes ``L``): the slot holding
    ``L`` is never written. With 2 slots that wait is for the previous snapshot, i.e. a
    world-wide barrier at every snapshot; with 3 it is for the one before, normally long done.

    **Parity** (redundancy m > 0). A finished copy is handed to a background worker
    (:mod:`.worker`) that exchanges its parity over a gloo group of its own with the
    data-parallel group's members (:func:`.parity.clone_group`; built collectively by
    :meth:`prepare`, and again by the first :meth:`take` of a new world), then commits it: a
    snapshot counts only with its parity.

    Args:
        config: Interval, holder directory, redundancy, slots.
        rank: This process's global rank (names its directory under the holder's).
        world_size: Ranks that must commit a snapshot for it to count; None: the current
            torch.distributed world's size, read at each commit.
        store: A ``torch.distributed.Store`` shared by the job; None: the current world's
            default store, read at each commit (under the recovery supervisor that is the
            membership store, under the generation's prefix).
        log: Where to print (rank 0 usually passes ``print``; others a no-op).
        parity_group: With redundancy m > 0: returns the current data-parallel process group
            (read at each snapshot, so a regroup is followed); the parity is exchanged over a
            clone of it.
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
        """Seconds the background worker spent exchanging parity (not on the training
        thread)."""
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
        self.slots = [Slot(i, directory) for i in range(_slot_count(config, directory))]
        self.copier = Copier()
        self._in_flight: Optional[int] = None  # iteration being copied
        self._in_flight_slot: Optional[Slot] = None
        self._in_flight_header: Dict[str, Any] = {}
        self._map: Any = None
        self._map_of: Optional[weakref.ref] = None
        self._epoch = 0
        """The world: bumped by :meth:`abandon`; a snapshot's commit can only be learned in
        the world that took it."""
        self._held: List[Optional[Tuple[int, int]]] = [None] * len(self.slots)
        """Per slot: (iteration, world) of the sealed snapshot it holds, or None."""
        for slot in self.slots:  # an earlier incarnation's snapshots (holder directory)
            header = slot.header()
            if header is not None:
                self._held[slot.index] = (int(header["iteration"]), -1)
        self._everywhere: set = set()
        """Iterations known to be committed by every rank."""
        self._lock = threading.Lock()
        self._worker: Optional[ParityWorker] = None
        self._worker_of: Optional[weakref.ref] = None  # the data-parallel group it clones
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

    def prepare(self) -> None:
        """Collective over the world (every rank, at start-up of each world): build this
        world's parity group and worker (no-op without redundancy)."""
        if self.config.redundancy and self.parity_group is not None:
            self._ensure_worker()

    def _ensure_worker(self) -> ParityWorker:
        source = self.parity_group()
        current = self._worker_of() if self._worker_of is not None else None
        if self._worker is None or current is not source:
            from megatron_mecefo.snapshot.parity import clone_group

            if self._worker is not None:
                self._worker.close()
            t0 = time.perf_counter()
            store, epoch = self.store, self._epoch
            self._worker = ParityWorker(
                clone_group(source), on_idle=lambda: self._learn_commits(store, epoch)
            )
            # Weak: the old world's data-parallel group must be freed with its world.
            self._worker_of = weakref.ref(source)
            self.log(
                f"> MeCeFO snapshot: parity group built ({dist.get_world_size(source)} members, "
                f"background worker) in {time.perf_counter() - t0:.3f} s"
            )
        return self._worker

    def before_optimizer_step(self) -> None:
        """The copy reads the live parameters and optimizer state, which the step writes."""
        t0 = time.perf_counter()
        self.copier.fence()
        self.copy_wait_s += time.perf_counter() - t0
        if self._in_flight is not None and not self.copier.busy:
            self._finish_local()  # CPU: the copy is done; commit it or start its parity now
        self.main_thread_s += time.perf_counter() - t0

    def after_step(self, state: TrainingState, iteration: int) -> bool:
        """Snapshot ``state`` if ``iteration`` is due; returns whether one was started."""
        if not self.due(iteration):
            return False
        t0 = time.perf_counter()
        self.take(state, iteration)
        self.main_thread_s += time.perf_counter() - t0
        return True

    def take(self, state: TrainingState, iteration: int) -> None:
        """Start copying ``state`` into a slot that holds no snapshot still needed."""
        if self.config.redundancy and self.parity_group is not None:
            self._ensure_worker()  # a new world: a collective, at the same point on every rank
        self._finish_local()
        slot = self._slot_to_write()
        tensors, meta = collect(state)
        meta["iteration"] = iteration
        if self.config.redundancy:
            meta["dist_opt_map"] = self._dist_opt_map(state)
        entries, nbytes = plan_layout(tensors)
        with self._lock:
            for other in self.slots:
                held = self._held[other.index]
                # ``slot``, and any snapshot of this iteration or later: another timeline (the
                # run restarted from an older point), which must not shadow this one.
                if other is slot or (held is not None and held[0] >= iteration):
                    self._held[other.index] = None
                    other.invalidate()
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
        self._in_flight_header = header
        self.taken.append(iteration)

    def _slot_to_write(self) -> Slot:
        """A slot whose snapshot is not needed (class doc); waits for a commit if none is."""
        while True:
            held = {i: h for i, h in enumerate(self._held) if h is not None}
            empty = [i for i in range(len(self.slots)) if i not in held]
            if empty:
                return self.slots[empty[0]]
            safe = [it for it, _ in held.values() if it in self._everywhere]  # or the worker's
            newest = max(safe) if safe else None
            # Free: older than the newest everywhere-committed snapshot, or taken in an earlier
            # world and not that one (its commit can no longer be learned; it is not needed).
            free = [
                i
                for i, (it, world) in held.items()
                if it != newest and ((newest is not None and it < newest) or world != self._epoch)
            ]
            if free:
                return self.slots[min(free, key=lambda i: held[i][0])]
            self.wait_committed(min(it for it, _ in held.values() if it != newest))

    def _finish_local(self) -> None:
        """The copy in flight is done: commit it, or (with parity) hand it to the worker,
        which commits it once its parity is stored."""
        if self._in_flight is None:
            return
        t0 = time.perf_counter()
        self.copier.join()
        self.copy_wait_s += time.perf_counter() - t0
        iteration, slot = self._in_flight, self._in_flight_slot
        self._in_flight, self._in_flight_slot = None, None
        self._held[slot.index] = (iteration, self._epoch)
        store, key = self.store, f"{self._key_prefix}/{iteration}"
        if self.config.redundancy and self.parity_group is not None:
            self._submit_parity(slot, iteration, self._in_flight_header, store, key)
        else:
            store.add(key, 1)

    def _submit_parity(self, slot: Slot, iteration: int, header: Any, store: Any, key: str) -> None:
        worker, epoch = self._worker, self._epoch
        assert worker is not None

        def job() -> None:
            if epoch != self._epoch:
                return  # the world was abandoned: its collectives are not run
            parity = self._exchange_parity(slot, header, worker.group)
            with self._lock:
                if epoch != self._epoch or self._held[slot.index] != (iteration, epoch):
                    return
                slot.parity = parity
                self.parity_bytes = parity.nbytes
                self.parity_s += parity.seconds
            store.add(key, 1)  # after the parity: a snapshot counts only with it

        worker.submit(job)

    def _learn_commits(self, store: Any, epoch: int) -> None:
        """On the idle worker: which of this world's held snapshots every rank has committed
        (the store round trips run here, so the training thread usually finds the snapshot
        it must wait for already known; commits happen in snapshot order)."""
        if epoch != self._epoch:
            return  # the world was abandoned: its store may be gone
        world = self.world_size
        pending = sorted(
            h[0]
            for h in list(self._held)
            if h is not None and h[1] == epoch and h[0] not in self._everywhere
        )
        for it in pending:
            if int(store.add(f"{self._key_prefix}/{it}", 0)) < world:
                break
            with self._lock:
                if epoch != self._epoch:
                    return
                self._everywhere.add(it)

    def _exchange_parity(self, slot: Slot, header: Dict[str, Any], group: Any) -> Any:
        """On the worker: :func:`.parity.exchange_parity` of ``slot`` over ``group``."""
        from megatron_mecefo.snapshot.parity import exchange_parity

        return exchange_parity(slot.buffer, header, self.config.redundancy, group, self.slot_id)

    def _dist_opt_map(self, state: TrainingState) -> Any:
        """:func:`dist_opt_map` of the live optimizer, computed once per optimizer (it only
        changes when a regroup builds a new one). Held by weak reference: the old world's
        optimizer must be freed with its process groups."""
        cached = self._map_of() if self._map_of is not None else None
        if cached is not state.optimizer:
            self._map, self._map_of = dist_opt_map(state), weakref.ref(state.optimizer)
        return self._map

    def abandon(self) -> None:
        """The world failed: wait for a copy in flight (it reads live tensors) and forget it;
        a snapshot without its parity exchanged and committed never counts. The parity worker
        is let go without waiting: blocked in a collective of the dead world, it ends when
        gloo fails that collective (a peer's socket closes when the world is destroyed, or the
        group's timeout), and whatever it finishes is discarded."""
        try:
            self.copier.join()
        except RuntimeError:
            pass
        with self._lock:
            self._epoch += 1
            if self._in_flight_slot is not None and self._in_flight is not None:
                self._held[self._in_flight_slot.index] = None
                self._in_flight_slot.invalidate()
            self._in_flight, self._in_flight_slot = None, None
            worker, self._worker, self._worker_of = self._worker, None, None
        if worker is not None:
            worker.close()

    def commits(self, iteration: int) -> int:
        """How many ranks have committed the snapshot of ``iteration``."""
        return int(self.store.add(f"{self._key_prefix}/{iteration}", 0))

    def wait_committed(self, iteration: int) -> None:
        """Block until every rank has committed ``iteration``'s snapshot."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.config.commit_timeout_s
        while self.commits(iteration) < self.world_size:
            if self._worker is not None:
                self._worker.raise_error()
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
        held = {h[0] for h in self._held if h is not None}
        with self._lock:
            self._everywhere = {it for it in self._everywhere if it in held} | {iteration}
        self.last_committed = max(iteration, self.last_committed or iteration)

    def flush(self) -> Optional[int]:
        """Finish the copy in flight, its parity and its commit (at the end of training);
        returns the newest snapshot every rank committed."""
        self._finish_local()
        if self._worker is not None:
            self._worker.drain()
        mine = [h[0] for h in self._held if h is not None and h[1] == self._epoch]
        if mine:
            self.wait_committed(max(mine))
        return self.last_committed

    def _rolled_back_to(self, slot: Slot, iteration: int) -> None:
        """After restoring ``iteration``: drop the newer snapshots (another timeline: the run
        goes on from ``iteration`` and would take them again) and keep this one safe."""
        with self._lock:
            for other in self.slots:
                held = self._held[other.index]
                if other is not slot and held is not None and held[0] >= iteration:
                    self._held[other.index] = None
                    other.invalidate()
            self._held[slot.index] = (iteration, self._epoch)
        self._everywhere = {iteration}
        self.last_committed = iteration

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
        self._rolled_back_to(slot, iteration)  # the next snapshots must not overwrite it
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
        re-sharded over the new group. Data moved: the blocks each lost slot's stripes need, to
        its rebuilder (:func:`.parity.rebuild_slots`), then to each rank only the parts of the
        old optimizer shards that overlap its new shard (:func:`.parity.fetch_ranges`).

        Returns:
            ``{"path": "peers+parity", "iteration": s, "seconds": t, "rebuilt": {slot: digest}}``,
            or None when no snapshot with parity is held by every rank.

        Raises:
            SnapshotLost: More than m members of a group lost, or a rebuilt slot fails its
                checksum.
        """
        from megatron_mecefo.snapshot.erasure import SnapshotLost
        from megatron_mecefo.snapshot.parity import (
            fetch_ranges,
            optimizer_digest,
            read_tensors,
            rebuild_slots,
        )

        t0 = time.perf_counter()
        mine = self.parity_snapshots()
        iteration, _ = _newest_common(mine, None)
        if iteration is None:
            return None
        slot = mine[iteration]
        parity = slot.parity
        lost_here: Optional[SnapshotLost] = None
        try:
            done = rebuild_slots(slot.buffer, parity, group, self.slot_id)
        except SnapshotLost as err:  # raised after the group's last collective, on every member
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
        new_map = dist_opt_map(state)  # the same answer on every rank (same optimizer flags)
        if new_map is None:
            raise RuntimeError("takeover from parity needs the distributed optimizer")
        own_header = parity.headers[parity.members.index(self.slot_id)]
        own_bytes = slot.buffer[: own_header["nbytes"]].numpy()
        tensors = read_tensors(own_header, own_bytes)
        sizes = {
            f"model{i}.{name}": p.numel()
            for i, chunk in enumerate(state.model_chunks)
            for name, p in chunk.named_parameters()
        }
        # Only the parts of the old optimizer shards that overlap this rank's new shard travel,
        # each from the member holding it (its owner, or its rebuilder for a lost slot).
        local = {self.slot_id: own_bytes}
        local.update({s: data for s, (_, data) in done.slots.items()})
        holders = {s: done.ranks[done.rebuilders.get(s, s)] for s in parity.members}
        plan = _optimizer_ranges(parity.members, parity.headers, new_map)
        wants = [(s, off, n) for s, _, pieces in plan for _, _, _, off, n in pieces if n]
        got = fetch_ranges(local, holders, wants, group)
        optim = reshard(_optimizer_shards(plan, got), new_map, sizes)
        merged = {n: t for n, t in tensors.items() if not n.startswith("optim")}
        merged.update(optim)
        restore(state, merged, own_header["meta"])
        self._rolled_back_to(slot, iteration)  # keep the snapshot rolled back to
        lost = done.lost
        digests: List[Any] = [None] * dist.get_world_size(group)
        mine_digests = {s: optimizer_digest(h, data) for s, (h, data) in done.slots.items()}
        dist.all_gather_object(digests, mine_digests, group=group)
        rebuilt = {s: d for part in digests for s, d in part.items()}
        seconds = time.perf_counter() - t0
        self.log(
            f"> MeCeFO snapshot: recovery path peers+parity: iteration {iteration}, rebuilt "
            f"the slots of ranks {lost} from {len(parity.members) - len(lost)} peers and "
            f"m={parity.m} parity (checksums verified) in {t_rebuilt - t0:.3f} s, "
            f"optimizer re-sharded over {dist.get_world_size(group)} replicas; {seconds:.3f} s"
        )
        return {
            "path": "peers+parity",
            "iteration": iteration,
            "seconds": seconds,
            "rebuild_s": t_rebuilt - t0,
            "rebuilt": rebuilt,
        }

    def regrow(
        self, state: TrainingState, group: dist.ProcessGroup, iteration: int, joiner: bool
    ) -> Dict[str, Any]:
        """Collective over the world after a rejoin (a grown data-parallel ``group``, the new
        world's): the members that trained hold the snapshot of ``iteration`` (the planned
        boundary, taken and flushed before the old world was left: :meth:`seal_boundary`);
        a ``joiner`` holds none. Every member fetches the parts of the old layout's optimizer
        shards that overlap its new shard (:func:`.parity.fetch_ranges`, bounded messages),
        re-shards the optimizer over the grown group and loads it; a joiner also fetches and
        loads the model tensors of a peer at the same TP/PP coordinates.

        Returns:
            ``{"path": "regrow", "iteration": N, "seconds": s, "from": [slots]}``.

        Raises:
            SnapshotLost: A member that trained holds no intact snapshot of ``iteration``
                (one verdict for the whole world, before any rank writes its state).
        """
        from megatron_mecefo.snapshot.erasure import SnapshotLost
        from megatron_mecefo.snapshot.parity import fetch_ranges

        t0 = time.perf_counter()
        held = None if joiner else self.local_snapshots(verify=True).get(iteration)
        if not _agree(joiner or held is not None):
            raise SnapshotLost(
                f"rejoin under the distributed optimizer: a member holds no intact snapshot of "
                f"iteration {iteration}, the boundary the replica rejoins at"
            )
        header = None if held is None else held[1]
        size = dist.get_world_size(group)
        every: List[Any] = [None] * size
        dist.all_gather_object(every, (self.slot_id, header), group=group)
        new_map = dist_opt_map(state)  # the same answer on every rank (same optimizer flags)
        if new_map is None:
            raise RuntimeError("regrow needs the distributed optimizer")
        sizes = {
            f"model{i}.{name}": p.numel()
            for i, chunk in enumerate(state.model_chunks)
            for name, p in chunk.named_parameters()
        }
        # Only what this rank's new shard needs travels: the overlapping parts of the trained
        # members' optimizer shards and, to a joiner, the model tensors of the first of them.
        ranks = dist.get_process_group_ranks(group)
        trained = [(int(slot), h, ranks[g]) for g, (slot, h) in enumerate(every) if h is not None]
        holders = {slot: rank for slot, _, rank in trained}
        plan = _optimizer_ranges([t[0] for t in trained], [t[1] for t in trained], new_map)
        wants = [(s, off, n) for s, _, pieces in plan for _, _, _, off, n in pieces if n]
        first_slot, first_header, _ = trained[0]
        model = [e for e in first_header["entries"] if not e[0].startswith("optim")]
        if held is None:
            wants += [(first_slot, int(e[3]), int(e[4])) for e in model if int(e[4])]
        local = {} if held is None else {self.slot_id: held[0].buffer[: header["nbytes"]].numpy()}
        got = fetch_ranges(local, holders, wants, group)
        optim = reshard(_optimizer_shards(plan, got), new_map, sizes)
        if held is not None:
            own_header, own = header, held[0].read(header)
        else:  # a joiner: the model tensors of the first sender (same TP/PP coordinates)
            own_header, own = first_header, {}
            for name, shape, dtype, offset, nbytes in model:
                data = got[(first_slot, int(offset), int(nbytes))] if nbytes else np.empty(0)
                own[name] = _as_tensor(data, dtype, shape)
        merged = {n: t for n, t in own.items() if not n.startswith("optim")}
        merged.update(optim)
        restore(state, merged, own_header["meta"])
        if held is not None:
            self._rolled_back_to(held[0], iteration)
        seconds = time.perf_counter() - t0
        senders = [slot for slot, _, _ in trained]
        self.log(
            f"> MeCeFO snapshot: rejoin at iteration {iteration}: optimizer re-sharded over "
            f"{size} replicas from the shards of ranks {senders}; {seconds:.3f} s"
        )
        return {"path": "regrow", "iteration": iteration, "seconds": seconds, "from": senders}

    def seal_boundary(self, state: TrainingState, iteration: int) -> None:
        """Before a planned regroup: take the snapshot of ``iteration`` if the interval did
        not, and finish its copy, so that :meth:`regrow` finds it sealed in the grown world.
        No collective (its parity is left to the worker, as at every step): a member that
        sees the new generation an iteration late must not leave the others waiting here."""
        if iteration not in self.local_snapshots(verify=False):
            self.take(state, iteration)
        self._finish_local()

    def forget(self) -> None:
        """Drop every snapshot (slots and parity): the state was put back from elsewhere
        (the disk checkpoint), so these belong to a discarded timeline and must never be
        restored. The slots' buffers stay allocated for the next snapshots."""
        self.abandon()
        for slot in self.slots:
            slot.invalidate()  # drops its parity too
        self.last_committed = None


def _optimizer_ranges(
    members: List[int], headers: List[Dict[str, Any]], new_map: List[List[Any]]
) -> List[Tuple[int, List[Any], List[Tuple[str, str, List[int], int, int]]]]:
    """What of the old layout's optimizer shards the new layout's rows (``new_map``, this
    rank's) need: per overlap of an old row with a new row of the same parameter, the old
    member's slot, the row cut to the overlap (``[part, group, index, name, lo, hi]``) and the
    byte ranges of its tensors in that slot (``(name, dtype, shape, offset, nbytes)``: the
    main and state tensors' elements ``lo:hi``, a scalar state such as Adam's step whole)."""
    wanted: Dict[Tuple[int, str], List[Tuple[int, int]]] = {}
    for j, _g, _k, name, start, end in new_map:
        wanted.setdefault((int(j), name), []).append((int(start), int(end)))
    plan = []
    for slot, header in zip(members, headers, strict=True):
        entries = {e[0]: e for e in header["entries"]}
        for j, g, k, name, start, end in header["meta"]["dist_opt_map"]:
            for first, last in wanted.get((int(j), name), []):
                lo, hi = max(first, start), min(last, end)
                if lo >= hi and not (first == last and start <= first <= end):
                    continue  # no overlap (an empty new row still takes the scalars)
                lo, hi = (lo, hi) if lo < hi else (first, first)
                prefix = f"optim{j}.state.{g}.{k}."
                states = sorted(n for n in entries if n.startswith(prefix))
                names = [f"optim{j}.main.{g}.{k}"] + states
                pieces = []
                for tensor in names:
                    _, shape, dtype, offset, nbytes = entries[tensor]
                    if not shape:
                        pieces.append((tensor, dtype, [], int(offset), int(nbytes)))
                        continue
                    size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
                    begin = int(offset) + (lo - start) * size
                    pieces.append((tensor, dtype, [hi - lo], begin, (hi - lo) * size))
                plan.append((slot, [j, g, k, name, lo, hi], pieces))
    return plan


def _as_tensor(data: np.ndarray, dtype: str, shape: List[int]) -> torch.Tensor:
    """Bytes of a slot entry as the tensor it holds (a view)."""
    flat = torch.from_numpy(np.asarray(data, dtype=np.uint8))
    return flat.view(getattr(torch, dtype)).reshape(shape)


def _optimizer_shards(plan: List[Any], got: Dict[Tuple[int, int, int], np.ndarray]) -> List[Any]:
    """``(metadata, tensors)`` for :func:`reshard`, one per row of ``plan`` (see
    :func:`_optimizer_ranges`), from the fetched byte ranges ``got``."""
    shards = []
    for slot, row, pieces in plan:
        tensors = {}
        for name, dtype, shape, offset, nbytes in pieces:
            data = got[(slot, offset, nbytes)] if nbytes else np.empty(0, dtype=np.uint8)
            tensors[name] = _as_tensor(data, dtype, shape)
        shards.append(({"dist_opt_map": [row]}, tensors))
    return shards


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
