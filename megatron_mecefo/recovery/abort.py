"""Leaving a world: the backend-specific part behind one interface.

On gloo nothing can interrupt a blocked collective (``Backend.abort()``/``shutdown()`` do
nothing for it, measured in ``docs/real-failures-on-cpu.md``); what releases the peers is
that every rank which leaves *drops every reference* to the old groups, so gloo closes its
sockets and the peers' pending reads fail ("Connection closed by peer"): the cascade.
:class:`GlooRelease` does that. On NCCL, :class:`NcclAbort` first aborts the communicators
(``ProcessGroupNCCL.abort()``, or ``_abort_process_group``), which wakes a rank blocked in a
collective, and can be triggered by :class:`GenerationWatchdog` when the membership store
announces a new generation while the main thread is still blocked. The NCCL path is written
for review; CI (CPU only) cannot run it.
"""

from __future__ import annotations

import gc
import ipaddress
import os
import socket
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from megatron_mecefo.recovery import abortable_waits


def release_megatron(chunks: Iterable[Any], ddp_models: Iterable[Any], config: Any) -> None:
    """Break the reference cycles that keep Megatron's groups alive after the model is
    dropped: DDP's gradient-accumulator hooks (C++ autograd nodes, which Python's GC cannot
    traverse), its bucket maps, and the hooks stored on the TransformerConfig."""
    import torch

    from megatron_mecefo.recovery.state.grad_buffers import ddp_buffers

    for ddp in ddp_models:
        # The gradient buffers die with the world (nothing carries them), but an interrupted
        # backward's graph keeps DDP's hooks, and through them the buckets, alive past the
        # world's end (seen: a failure in the backward kept a whole gradient buffer resident
        # through the next generation). Free their memory now, whoever still refers to them.
        for buffer in ddp_buffers([ddp]):
            grad_data = getattr(buffer, "grad_data", None)
            if isinstance(grad_data, torch.Tensor) and grad_data.untyped_storage().resizable():
                grad_data.untyped_storage().resize_(0)
        for name in ("grad_accs", "buffers", "expert_parallel_buffers", "bucket_groups",
                     "expert_parallel_bucket_groups"):  # fmt: skip
            value = getattr(ddp, name, None)
            if isinstance(value, list):
                value.clear()
        for name in ("param_to_bucket_group", "param_to_buffer"):
            value = getattr(ddp, name, None)
            if isinstance(value, dict):
                value.clear()
    if config is not None:
        for name in ("finalize_model_grads_func", "grad_scale_func", "no_sync_func",
                     "grad_sync_func", "param_sync_func"):  # fmt: skip
            if hasattr(config, name):
                setattr(config, name, None)
    for chunk in chunks:
        for module in chunk.modules():
            for name in ("pg_collection", "tp_group", "cp_group", "pp_group", "embd_group"):
                if name in module.__dict__:
                    module.__dict__[name] = None


class WorldAborter:
    """Interface: ``abort()`` interrupts what is in flight (may be a no-op); ``destroy()``
    tears the world down once the caller has dropped its references."""

    name = "base"

    def open_world(self) -> None:
        """A world is about to be built (before its store client and ``init_process_group``)."""

    def seal_world(self) -> None:
        """The world's groups are built (default: nothing to note)."""

    def arm(self) -> None:
        """A new world exists (after ``init_process_group``)."""

    def abort(self) -> None:
        """Interrupt in-flight collectives (thread-safe; may run on a watchdog thread)."""

    def retain_groups(self) -> None:
        """Before the groups are destroyed: keep what must outlive them (default: nothing)."""

    def destroy(self) -> None:
        """Destroy Megatron's parallel state and every torch.distributed group."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        try:
            ps.destroy_model_parallel()
        except Exception:
            pass
        # destroy_model_parallel (0.16.1) misses _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP(_GLOO),
        # which is DDP's data-parallel group: left referenced, its sockets stay open and the
        # peers blocked on this rank wait for the backstop timeout. Drop every group global.
        for name, value in list(vars(ps).items()):
            if isinstance(value, dist.ProcessGroup) or (
                isinstance(value, (list, tuple))
                and value
                and all(isinstance(v, dist.ProcessGroup) for v in value)
            ):
                setattr(ps, name, None)

        self.retain_groups()
        t_pg = time.time()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        if not dist.is_initialized():
            reset_group_names()
        t0 = time.time()
        gc.collect()  # close the sockets now: this releases the peers still blocked
        self.last_split = {"destroy_pg": t0 - t_pg, "gc": time.time() - t0}


def reset_group_names() -> None:
    """Name the next world's groups from the start, as every rank of it will.

    torch names each group, the default one included, after a per-process counter, and resets
    it only when ``destroy_process_group`` runs to its end. A world that failed inside
    ``init_process_group`` (its rendezvous timed out, or was aborted) has nothing to destroy,
    so the counter kept that attempt: the ranks whose world failed later, and was destroyed,
    then named the next world's groups differently, and each waited for keys the others never
    wrote, in that world and in every later one (seen under Slurm: 18 generations in a row
    with no rank lost)."""
    from torch.distributed import distributed_c10d as c10d

    world = getattr(c10d, "_world", None)
    if world is not None and hasattr(world, "group_count"):
        world.group_count = 0


def _socket_inodes() -> Dict[int, int]:
    """This process's sockets: inode -> file descriptor (from ``/proc/self/fd``)."""
    inodes: Dict[int, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (or listdir's own descriptor)
        if target.startswith("socket:["):
            inodes[int(target[len("socket:[") : -1])] = int(fd)
    return inodes


def _normalized_ip(ip: str) -> str:
    """``ip`` in one spelling: an IPv4-mapped IPv6 address (``::ffff:a.b.c.d``, what an
    AF_INET6 socket reports for an IPv4 peer) as its IPv4 address; no zone index."""
    address = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address)


def store_endpoints(addresses: Sequence[str]) -> Set[Tuple[str, int]]:
    """The ``(ip, port)`` pairs a connection to one of the stores ``HOST:PORT`` can show as
    its peer: every address ``HOST`` resolves to, and, only where ``HOST`` is a loopback
    address, this machine's loopback spellings (``127.0.0.1``, ``::1``, what ``localhost``
    resolves to), since a client of ``localhost`` may reach the store through either.

    A host that does not resolve contributes nothing (its connections cannot exist).
    """
    endpoints: Set[Tuple[str, int]] = set()
    for address in addresses:
        host, port_text = address.rsplit(":", 1)
        port = int(port_text)
        ips = _resolve(host.strip("[]"), port)
        if any(ipaddress.ip_address(ip).is_loopback for ip in ips):
            ips |= {"127.0.0.1", "::1"} | _resolve("localhost", port)
        endpoints |= {(ip, port) for ip in ips}
    return endpoints


def _resolve(host: str, port: int) -> Set[str]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return set()
    return {_normalized_ip(str(info[4][0])) for info in infos}


class GlooRelease(WorldAborter):
    """gloo: no abort API exists. ``abort()`` shuts down (without closing: gloo owns them)
    the world's TCP sockets; gloo's pair loop then sees the connection end and fails every
    pending operation, as when a peer dies. That does not wake a send of an unbound buffer
    (a gloo bug), so ``abort()`` then releases the training thread from its wait
    (:mod:`.abortable_waits`); before that change such a rank waited for the backstop
    timeout (measured: 25-31 s at TP2xPP2xDP2). Dropping every reference afterwards
    (``destroy``) closes the sockets, except those of an aborted world's groups, kept until
    the backstop has released gloo's threads.

    The world's sockets are those this process opened (or accepted) while the world was
    being built, between :meth:`open_world` and :meth:`seal_world`, less the connections to
    a membership store (same host *and* port), which must stay up. Any other socket of the
    process (a metrics logger's, an upload's, opened before or after) is left alone.

    Args:
        store_addresses: ``HOST:PORT`` of the membership store (and of its standby).
        hold_s: How long an aborted world's groups are kept (the collective timeout and a
            margin).
    """

    name = "gloo"

    def __init__(self, store_addresses: Sequence[str] = (), hold_s: float = 60.0) -> None:
        self.store_endpoints = store_endpoints(store_addresses)
        self.hold_s = hold_s
        self._before: Optional[Set[int]] = None
        """Sockets open before the world was being built; None: no world opened."""
        self._world: Optional[Set[int]] = None
        """The world's sockets once sealed; None: still being built (or none opened)."""

    def open_world(self) -> None:
        """Before the world's store client and ``init_process_group``: every socket open now
        is someone else's."""
        self._before, self._world = set(_socket_inodes()), None

    def seal_world(self) -> None:
        """After the world's groups exist (their connections are made when a group is
        built): the sockets opened since :meth:`open_world` are the world's; later ones are
        not."""
        if self._before is not None:
            self._world = set(_socket_inodes()) - self._before

    def arm(self) -> None:
        abortable_waits.STATE.arm()

    def retain_groups(self) -> None:
        from torch.distributed import distributed_c10d as c10d

        waits = abortable_waits.STATE
        waits.disarm()
        groups = list(c10d._world.pg_map.keys()) if waits.aborted.is_set() else []
        waits.retain(groups, self.hold_s)

    def abort(self) -> None:
        self.shutdown_world_sockets()
        # After the sockets: the training thread, once released, leaves and closes them.
        abortable_waits.STATE.abort()

    def is_store_peer(self, peer: Tuple[Any, ...]) -> bool:
        """Whether a socket's peer address is one of the membership stores."""
        return (_normalized_ip(str(peer[0])), int(peer[1])) in self.store_endpoints

    def shutdown_world_sockets(self) -> List[Tuple[str, int]]:
        """Shut down the world's sockets (see the class doc); returns their peers.

        Without :meth:`open_world` (a caller that does not mark the world), every TCP socket
        but the stores' counts as the world's. Before :meth:`seal_world`, those opened since
        :meth:`open_world`.
        """
        shut: List[Tuple[str, int]] = []
        for inode, fd in _socket_inodes().items():
            if self._world is not None and inode not in self._world:
                continue
            if self._world is None and self._before is not None and inode in self._before:
                continue
            try:
                sock = socket.socket(fileno=fd)
            except OSError:
                continue
            try:
                if sock.family in (socket.AF_INET, socket.AF_INET6):
                    peer = sock.getpeername()
                    if not self.is_store_peer(peer):
                        sock.shutdown(socket.SHUT_RDWR)
                        shut.append((str(peer[0]), int(peer[1])))
            except OSError:
                pass  # a listener (no peer) or already closed
            finally:
                sock.detach()  # the fd stays gloo's (or the store's)
        return shut


class NcclAbort(WorldAborter):
    """NCCL: abort every communicator, so a rank blocked in a collective returns at once."""

    name = "nccl"

    def abort(self) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        if not dist.is_initialized():
            return
        abort_group = getattr(c10d, "_abort_process_group", None)
        for pg in list(c10d._world.pg_map.keys()):
            try:
                if abort_group is not None:
                    abort_group(pg)
                else:
                    pg._get_backend(torch.device("cuda")).abort()
            except Exception:
                pass


def build_aborter(
    backend: str, store_addresses: Sequence[str] = (), hold_s: float = 60.0
) -> WorldAborter:
    return NcclAbort() if backend == "nccl" else GlooRelease(store_addresses, hold_s)


class GenerationWatchdog:
    """Calls ``aborter.abort()`` when the store's generation moves past ``generation`` to a
    failure while the rank is busy (NCCL: aborts the communicators; gloo: shuts the sockets).

    Args:
        current: Returns the store's current generation number.
        generation: This world's generation.
        aborter: What to call.
        interval_s: Poll interval (with ``wait_after``: the longest single wait).
        is_failure: Whether a generation number is a failure (planned ones do not abort).
        wait_after: Blocks until a generation above its first argument exists or its second
            argument (seconds) passes, e.g. :meth:`.MembershipStore.wait_generation_after`.
    """

    def __init__(
        self,
        current: Callable[[], int],
        generation: int,
        aborter: WorldAborter,
        interval_s: float,
        is_failure: Callable[[int], bool] = lambda number: True,
        wait_after: Optional[Callable[[int, float], None]] = None,
    ) -> None:
        self.current, self.generation, self.aborter = current, generation, aborter
        self.interval_s = interval_s
        self.is_failure = is_failure
        self._stop = threading.Event()
        # Blocks until a generation above the given one appears (or the interval passes);
        # by default a plain sleep, i.e. polling every interval.
        self.wait_after = wait_after or (lambda number, timeout: self._stop.wait(timeout))
        self._lock = threading.Lock()
        self.fired: Optional[int] = None
        self.latest = generation
        """The store's generation number at the last poll."""
        self.cpu_s = 0.0
        """CPU seconds this thread has used (the supervisor's overhead accounting)."""
        self.thread = threading.Thread(target=self._run, name="mecefo-watchdog", daemon=True)

    def start(self) -> GenerationWatchdog:
        self.thread.start()
        return self

    def _run(self) -> None:
        fired = False
        checked = self.generation  # every generation up to this one was looked at
        while not self._stop.is_set():
            try:
                self.wait_after(self.latest, self.interval_s)
                now = self.current()
                self.latest = now
                self.cpu_s = time.thread_time()
                if fired:
                    continue  # after firing: only keep ``latest`` fresh
                # Every generation since the last look, not only the latest: a failure ends
                # this world even when a planned one (a rejoin) was published right after it
                # (measured: a member that saw only the rejoin waited out the 30 s store
                # timeout in the world's rendezvous).
                failure = any(self.is_failure(n) for n in range(checked + 1, now + 1))
                checked = max(checked, now)
                if not failure:
                    continue
            except Exception:  # noqa: BLE001
                # Looked at again, never given up: a watchdog that ended at a store error
                # (etcd mode: a takeover under way) could no longer abort this world, and its
                # rank stayed in a collective a newer generation had ended.
                self._stop.wait(min(self.interval_s, 0.5))
                continue
            with self._lock:
                if self._stop.is_set():
                    return
                self.fired, fired = now, True
                self.aborter.abort()

    def stop(self) -> None:
        """After this returns the watchdog never aborts (it may be mid-abort until then)."""
        with self._lock:
            self._stop.set()
