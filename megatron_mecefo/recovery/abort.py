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
import threading
import time
from typing import Any, Callable, Iterable, Optional, Sequence

from megatron_mecefo.recovery import abortable_waits


def release_megatron(chunks: Iterable[Any], ddp_models: Iterable[Any], config: Any) -> None:
    """Break the reference cycles that keep Megatron's groups alive after the model is
    dropped: DDP's gradient-accumulator hooks (C++ autograd nodes, which Python's GC cannot
    traverse), its bucket maps, and the hooks stored on the TransformerConfig."""
    for ddp in ddp_models:
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
        t0 = time.time()
        gc.collect()  # close the sockets now: this releases the peers still blocked
        self.last_split = {"destroy_pg": t0 - t_pg, "gc": time.time() - t0}


class GlooRelease(WorldAborter):
    """gloo: no abort API exists. ``abort()`` shuts down (without closing: gloo owns them)
    this process's TCP sockets except those to the membership store; gloo's pair loop then
    sees the connection end and fails every pending operation, as when a peer dies. That
    does not wake a send of an unbound buffer (a gloo bug), so ``abort()`` then releases the
    training thread from its wait (:mod:`.abortable_waits`); before that change such a rank
    waited for the backstop timeout (measured: 25-31 s at TP2xPP2xDP2). Dropping every
    reference afterwards (``destroy``) closes the sockets, except those of an aborted world's
    groups, kept until the backstop has released gloo's threads.

    Args:
        store_ports: Ports of the membership store (and of its standby), whose connections
            stay up.
        hold_s: How long an aborted world's groups are kept (the collective timeout and a
            margin).
    """

    name = "gloo"

    def __init__(self, store_ports: Sequence[int] = (), hold_s: float = 60.0) -> None:
        self.store_ports = set(store_ports)
        self.hold_s = hold_s

    def arm(self) -> None:
        abortable_waits.STATE.arm()

    def retain_groups(self) -> None:
        from torch.distributed import distributed_c10d as c10d

        waits = abortable_waits.STATE
        waits.disarm()
        groups = list(c10d._world.pg_map.keys()) if waits.aborted.is_set() else []
        waits.retain(groups, self.hold_s)

    def abort(self) -> None:
        self._shutdown_sockets()
        # After the sockets: the training thread, once released, leaves and closes them.
        abortable_waits.STATE.abort()

    def _shutdown_sockets(self) -> None:
        import os
        import socket

        for fd in os.listdir("/proc/self/fd"):
            try:
                if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                    continue
                sock = socket.socket(fileno=int(fd))
            except OSError:
                continue
            try:
                if sock.family in (socket.AF_INET, socket.AF_INET6):
                    peer = sock.getpeername()
                    if peer[1] not in self.store_ports:
                        sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            finally:
                sock.detach()  # the fd stays gloo's (or the store's)


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
    backend: str, store_ports: Sequence[int] = (), hold_s: float = 60.0
) -> WorldAborter:
    return NcclAbort() if backend == "nccl" else GlooRelease(store_ports, hold_s)


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
        while not self._stop.is_set():
            try:
                self.wait_after(self.latest, self.interval_s)
                now = self.current()
                self.latest = now
                self.cpu_s = time.thread_time()
                if fired or now == self.generation or not self.is_failure(now):
                    continue  # after firing: only keep ``latest`` fresh
            except Exception:
                return
            with self._lock:
                if self._stop.is_set():
                    return
                self.fired, fired = now, True
                self.aborter.abort()

    def stop(self) -> None:
        """After this returns the watchdog never aborts (it may be mid-abort until then)."""
        with self._lock:
            self._stop.set()
