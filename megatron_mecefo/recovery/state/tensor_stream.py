"""Sending a nested state (dicts, lists, tensors) from one rank to others, tensor by tensor.

Only the structure travels pickled: names, shapes, dtypes, scalars and the small tensors (RNG
states, step counters; as their bytes, :class:`InlineTensor`). The large tensors travel as
bytes, point to point, in messages of at most :attr:`StreamConfig.bucket_bytes`, straight into
the receiver's buffers: where the receiver's own state has a tensor of that shape and dtype at
the same place (its model's parameters, its optimizer's moments), the bytes land there;
elsewhere one is allocated once. Small tensors share a staging bucket; a large one is sent from
its own storage in slices, so the staging memory is one bucket per side (two on the sender,
which overlaps a bucket's checksum with the previous bucket's send). Every message is waited on
with its own deadline, so a transfer of any size is bounded per bucket, never as a whole (cf.
torchft's process-group checkpoint transport, which also pickles only metadata). The messages
are dealt round robin over up to :attr:`StreamConfig.connections` groups of the same ranks,
each its own connection: one TCP connection's receive path runs on one core at a time.

Each message has a checksum (:mod:`.checksum`), computed on the tensor's device on both sides;
the sender sends its list at the end and the receiver compares bucket by bucket.
"""

from __future__ import annotations

import datetime
import os
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, List, Optional, Sequence, Tuple

import torch

from megatron_mecefo.recovery.state.checksum import as_bytes, bytes_checksum
from megatron_mecefo.recovery.state.memory import Prefaulter

MiB = 1 << 20


@dataclass(frozen=True)
class StreamConfig:
    """How a state is cut into messages and how long each may take."""

    bucket_bytes: int = 16 * MiB
    """Largest message. The staging memory is one bucket on the receiver and two on the
    sender; larger buckets cost memory, smaller ones a per-message overhead (about 0.1 ms
    over gloo on loopback)."""

    inline_bytes: int = 64 * 1024
    """Tensors smaller than this travel pickled with the structure (RNG states, counters)."""

    direct_bytes: int = 1 * MiB
    """Tensors of at least this size (or half a bucket, if smaller) travel in messages of
    their own, from and into their own storage; smaller ones are packed into a staging bucket
    (a copy on each side)."""

    in_flight: int = 8
    """Messages in flight per receiver: the sender's sends not yet completed, the receiver's
    receives posted ahead (at most one of them staged, so more cost no memory). gloo sends a
    message once its receive is posted: measured on loopback, 1 GiB in 12 MiB messages went
    at 0.84-0.87 of one tensor's bandwidth with 4 in flight, 0.89-0.98 with 8."""

    connections: int = 2
    """Most groups over the same two ranks (each its own gloo connection) that the messages are
    dealt over, round robin: one TCP connection's receive path runs on one core at a time, and
    two keep both cores busy. Measured on loopback (``benchmarks/heal_stream.py``), 1 GiB in
    12 MiB tensors with checksums went at 0.76-0.87 of gloo's one tensor over one connection
    and 0.93-1.04 over two; the 1.6 GiB heal in the job from 0.44 to 0.40 s (medians of
    ``recovery_scale.py``'s A/B). The session passes Megatron's gloo data-parallel group
    beside its data-parallel group (:func:`.heal.stream_groups`)."""

    bucket_timeout_s: float = 600.0
    """Deadline of one message; it starts anew with every message, so the whole transfer has
    no deadline from its size (the session passes ``--collective-timeout``)."""

    delay_s: float = 0.0
    """Sleep before each message (tests only: a transfer slower than the collective timeout
    on purpose). Read from ``MECEFO_TEST_HEAL_DELAY_S`` by :func:`stream_config`."""


def stream_config(bucket_timeout_s: float) -> StreamConfig:
    """The configuration of a heal: ``MECEFO_HEAL_BUCKET_MB`` overrides the bucket size,
    ``MECEFO_HEAL_CONNECTIONS`` the connections (a benchmark's A/B)."""
    mb = float(os.environ.get("MECEFO_HEAL_BUCKET_MB", "16"))
    delay = float(os.environ.get("MECEFO_TEST_HEAL_DELAY_S", "0"))
    connections = max(1, int(os.environ.get("MECEFO_HEAL_CONNECTIONS", "2")))
    return StreamConfig(
        bucket_bytes=max(1, int(mb * MiB)), bucket_timeout_s=bucket_timeout_s, delay_s=delay,
        connections=connections,
    )  # fmt: skip


@dataclass(frozen=True)
class TensorSlot:
    """A tensor's place in the pickled structure: its index in the stream and its layout."""

    index: int
    shape: Tuple[int, ...]
    dtype: torch.dtype
    alias_of: int = -1
    """Index of an earlier slot with the same storage (tied weights): sent once."""

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class InlineTensor:
    """A small tensor in the pickled structure, as its bytes: torch pickles a tensor through
    ``torch.save`` of its storage and unpickles it through ``torch.load``, about 0.1 ms each
    way per tensor; a structure of a few hundred (biases, norms, their moments, step
    counters) took 18 ms to pickle and about 40 ms to unpickle at 1.6 GiB per rank, longer
    than the rest of a heal's fixed costs together."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    on_host: bool
    """The sender's tensor was in host memory (RNG states, Adam's step): the receiver's is
    too; otherwise it goes to the receiver's own device, not the sender's device index."""
    data: bytes

    @staticmethod
    def fits(x: torch.Tensor) -> bool:
        """A plain dense tensor (a subclass, such as a ``Parameter``, keeps torch's pickling)."""
        return type(x) is torch.Tensor and x.layout == torch.strided and not x.is_quantized

    @classmethod
    def of(cls, x: torch.Tensor) -> "InlineTensor":
        t = x.detach()
        t = t if t.is_contiguous() else t.contiguous()
        data = as_bytes(t).cpu().numpy().tobytes() if t.numel() else b""
        return cls(tuple(t.shape), t.dtype, t.device.type == "cpu", data)

    def tensor(self, device: torch.device) -> torch.Tensor:
        """The tensor, on the host or on ``device`` (see :attr:`on_host`)."""
        if not self.data:
            out = torch.empty(self.shape, dtype=self.dtype)
        else:
            raw = torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
            out = raw.view(self.dtype).reshape(self.shape)
        return out if self.on_host else out.to(device)


def _map_containers(x: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn`` applied to the items of a dict, list or plain tuple (an ``OrderedDict`` stays
    one, with its ``_metadata``: ``Module.load_state_dict`` reads the versions there)."""
    if isinstance(x, dict):
        out = OrderedDict if isinstance(x, OrderedDict) else dict
        mapped = out((k, fn(v)) for k, v in x.items())
        if hasattr(x, "_metadata"):
            mapped._metadata = x._metadata  # type: ignore[attr-defined]
        return mapped
    if isinstance(x, list):
        return [fn(v) for v in x]
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(fn(v) for v in x)
    return x


def split_tree(obj: Any, inline_bytes: int) -> Tuple[Any, List[torch.Tensor]]:
    """``obj`` with each large tensor replaced by a :class:`TensorSlot`, and those tensors in
    stream order (aliases of one storage appear once)."""
    tensors: List[torch.Tensor] = []
    seen: dict = {}

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if x.numel() * x.element_size() < inline_bytes:
                return InlineTensor.of(x) if InlineTensor.fits(x) else x
            key = (x.data_ptr(), tuple(x.shape), x.dtype, x.device)
            if key in seen:
                return TensorSlot(len(tensors), tuple(x.shape), x.dtype, alias_of=seen[key])
            seen[key] = len(tensors)
            t = x.detach()
            tensors.append(t if t.is_contiguous() else t.contiguous())
            return TensorSlot(len(tensors) - 1, tuple(x.shape), x.dtype)
        return _map_containers(x, walk)

    return walk(obj), tensors


def slots_of(skeleton: Any) -> List[TensorSlot]:
    """The :class:`TensorSlot` leaves of ``skeleton`` in stream order (aliases excluded)."""
    out: List[TensorSlot] = []

    def walk(x: Any) -> None:
        if isinstance(x, TensorSlot):
            if x.alias_of < 0:
                out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(skeleton)
    return out


def destinations(skeleton: Any, own: Any, device: torch.device) -> List[torch.Tensor]:
    """A receive buffer per slot of ``skeleton``: the tensor at the same place in ``own`` (the
    receiver's own state) where its shape and dtype match and it is contiguous, else a new
    (uninitialised) one on ``device``. Aliases are resolved by the caller (:func:`fill_tree`)."""
    found: dict = {}

    def walk(x: Any, mine: Any) -> None:
        if isinstance(x, TensorSlot):
            if x.alias_of >= 0:
                return
            if (
                isinstance(mine, torch.Tensor)
                and tuple(mine.shape) == x.shape
                and mine.dtype == x.dtype
                and mine.is_contiguous()
            ):
                found[x.index] = mine.detach()
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, mine.get(k) if isinstance(mine, dict) else None)
        elif isinstance(x, (list, tuple)):
            other = mine if isinstance(mine, (list, tuple)) else ()
            for i, v in enumerate(x):
                walk(v, other[i] if i < len(other) else None)

    walk(skeleton, own)
    return [
        found[s.index] if s.index in found else torch.empty(s.shape, dtype=s.dtype, device=device)
        for s in slots_of(skeleton)
    ]


def fill_tree(
    skeleton: Any, tensors: Sequence[torch.Tensor], device: Optional[torch.device] = None
) -> Any:
    """``skeleton`` with every :class:`TensorSlot` replaced by its received tensor and every
    :class:`InlineTensor` by its tensor (on the host, or on ``device``: the receiver's own,
    default the first received tensor's, else the host)."""
    by_index = {s.index: t for s, t in zip(slots_of(skeleton), tensors, strict=True)}
    if device is None:
        device = tensors[0].device if tensors else torch.device("cpu")

    def walk(x: Any) -> Any:
        if isinstance(x, TensorSlot):
            return by_index[x.alias_of if x.alias_of >= 0 else x.index]
        if isinstance(x, InlineTensor):
            return x.tensor(device)
        return _map_containers(x, walk)

    return walk(skeleton)


@dataclass
class Message:
    """One message: a slice of one tensor (``direct``), or whole small tensors packed."""

    parts: List[Tuple[int, int, int]] = field(default_factory=list)
    """(tensor position in the stream, first byte, bytes) per part."""

    @property
    def nbytes(self) -> int:
        return sum(n for _, _, n in self.parts)

    @property
    def direct(self) -> bool:
        return len(self.parts) == 1


def plan_messages(
    sizes: Sequence[int], bucket_bytes: int, direct_bytes: Optional[int] = None
) -> List[Message]:
    """Cut tensors of ``sizes`` bytes into messages of at most ``bucket_bytes``: a tensor of at
    least ``direct_bytes`` (at most half a bucket) alone, in slices; smaller ones packed
    together in stream order. Both sides compute it from the slots alone."""
    direct = bucket_bytes // 2 if direct_bytes is None else min(direct_bytes, bucket_bytes // 2)
    out: List[Message] = []
    pack = Message()
    for i, n in enumerate(sizes):
        if n >= max(1, direct):
            for start in range(0, n, bucket_bytes):
                out.append(Message([(i, start, min(bucket_bytes, n - start))]))
            continue
        if pack.parts and pack.nbytes + n > bucket_bytes:
            out.append(pack)
            pack = Message()
        pack.parts.append((i, 0, n))
    if pack.parts:
        out.append(pack)
    # A packed message of one part would look direct: it is, byte for byte, the same thing.
    return out


@dataclass
class StreamStats:
    """What one side of a transfer did."""

    bytes: int = 0
    messages: int = 0
    seconds: float = 0.0
    staging_bytes: int = 0
    prefaulted_bytes: int = 0
    """Receiver: of its destinations, the bytes faulted in ahead of the transfer
    (:class:`.memory.Prefaulter`)."""
    structure_s: float = 0.0
    """Seconds of the pickled structure's exchange before the transfer (:mod:`.heal`)."""
    import_s: float = 0.0
    """Receiver: seconds to place the received tree into its trainer (:mod:`.heal`)."""


def _wait(work: Any, timeout_s: float, what: str) -> None:
    try:
        work.wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as err:
        raise RuntimeError(f"{what}: {str(err).splitlines()[0] if str(err) else err}") from err


def _staging_device(device: torch.device, group: Any) -> torch.device:
    """Where a bucket is staged: the tensors' device, except that gloo moves host memory only
    (a GPU tensor over gloo goes through a host bucket)."""
    import torch.distributed as dist

    if device.type != "cpu" and dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    return device


def send_tensors(
    tensors: Sequence[torch.Tensor],
    dsts: Sequence[int],
    group: Any,
    config: StreamConfig,
    on_progress: Optional[Callable[[int, int], None]] = None,
    more_groups: Sequence[Any] = (),
) -> StreamStats:
    """Send ``tensors`` to every global rank of ``dsts``: each receives the same messages, in
    turn per message, so that no receiver waits for another's whole transfer. Message ``k``
    goes over ``[group, *more_groups][k % n]`` (groups over the same ranks: connections of
    their own); the per-message checksums go last, over ``group``."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    lanes = [group, *more_groups]
    views = [as_bytes(t) for t in tensors]
    plan = plan_messages([v.numel() for v in views], config.bucket_bytes, config.direct_bytes)
    stats = StreamStats()
    sums = torch.zeros(len(plan), 2, dtype=torch.int64)
    staging: List[Optional[torch.Tensor]] = [None, None]
    pending: List[Tuple[int, list]] = []  # (staging bucket in use or -1, works), oldest first

    def retire(keep: int, free: Optional[int] = None) -> None:
        """Wait for the oldest sends until at most ``keep`` are in flight and none of them
        uses staging bucket ``free``."""
        while pending and (len(pending) > keep or any(b == free for b, _ in pending)):
            _, works = pending.pop(0)
            for w in works:
                _wait(w, config.bucket_timeout_s, "heal: a message was not received in time")

    for k, msg in enumerate(plan):
        if config.delay_s:
            time.sleep(config.delay_s)
        device = views[msg.parts[0][0]].device
        staged_on = _staging_device(device, group)
        if msg.direct and staged_on == device:  # from the tensor's own storage
            i, start, n = msg.parts[0]
            buf, bucket = views[i][start : start + n], -1
            sums[k] = bytes_checksum(buf).cpu()
            retire(config.in_flight - 1)
        else:
            bucket = k % 2
            retire(config.in_flight - 1, free=bucket)
            if staging[bucket] is None:
                staging[bucket] = torch.empty(config.bucket_bytes, dtype=torch.uint8,
                                              device=staged_on)  # fmt: skip
                stats.staging_bytes += config.bucket_bytes
            buf, at = staging[bucket][: msg.nbytes], 0
            for i, start, n in msg.parts:
                buf[at : at + n].copy_(views[i][start : start + n])
                at += n
            sums[k] = bytes_checksum(buf).cpu()
        lane = lanes[k % len(lanes)]
        pending.append((bucket, [dist.isend(buf, dst, group=lane) for dst in dsts]))
        stats.bytes += msg.nbytes * len(dsts)
        stats.messages += 1
        if on_progress is not None:
            on_progress(k + 1, len(plan))
    retire(0)
    for dst in dsts:
        _wait(dist.isend(sums, dst, group=group), config.bucket_timeout_s, "heal: checksums")
    stats.seconds = time.perf_counter() - t0
    return stats


class ChecksumMismatch(RuntimeError):
    """A message's bytes differ from what the sender sent."""


def recv_tensors(
    dests: Sequence[torch.Tensor],
    src: int,
    group: Any,
    config: StreamConfig,
    more_groups: Sequence[Any] = (),
) -> StreamStats:
    """Receive the messages of :func:`send_tensors` from global rank ``src`` into ``dests``
    (over the same ``group`` and ``more_groups``) and check each message's checksum against
    the sender's.

    Raises:
        ChecksumMismatch: Naming the first message that differs.
    """
    import torch.distributed as dist

    t0 = time.perf_counter()
    lanes = [group, *more_groups]
    views = [as_bytes(t) for t in dests]
    plan = plan_messages([v.numel() for v in views], config.bucket_bytes, config.direct_bytes)
    stats = StreamStats()
    mine = torch.zeros(len(plan), 2, dtype=torch.int64)
    staging: Optional[torch.Tensor] = None

    def is_direct(k: int) -> bool:
        """Whether message ``k`` lands in its destination without staging."""
        device = views[plan[k].parts[0][0]].device
        return plan[k].direct and _staging_device(device, group) == device

    def post(k: int) -> Tuple[Any, torch.Tensor, bool]:
        """Post message ``k``'s receive: (work, buffer, staged)."""
        nonlocal staging
        msg = plan[k]
        if is_direct(k):  # straight into the destination
            i, start, n = msg.parts[0]
            buf = views[i][start : start + n]
            return dist.irecv(buf, src, group=lanes[k % len(lanes)]), buf, False
        if staging is None:
            device = _staging_device(views[msg.parts[0][0]].device, group)
            staging = torch.empty(config.bucket_bytes, dtype=torch.uint8, device=device)
            stats.staging_bytes += config.bucket_bytes
        buf = staging[: msg.nbytes]
        return dist.irecv(buf, src, group=lanes[k % len(lanes)]), buf, True

    posted: Deque[Tuple[Any, torch.Tensor, bool]] = deque()
    next_k = 0

    def refill() -> None:
        """Post receives in plan order, up to ``in_flight``, one staged at a time."""
        nonlocal next_k
        while next_k < len(plan) and len(posted) < config.in_flight:
            if any(staged for _, _, staged in posted) and not is_direct(next_k):
                return  # the staging bucket is in use: its message must be unpacked first
            posted.append(post(next_k))
            next_k += 1

    # The destinations' bytes in the order the messages write them, host memory only.
    ranges = [
        (views[i][start:].data_ptr(), n)
        for msg in plan
        for i, start, n in msg.parts
        if views[i].device.type == "cpu"
    ]
    with Prefaulter(ranges) as prefaulter:
        refill()
        for k, msg in enumerate(plan):
            work, buf, staged = posted.popleft()
            _wait(
                work, config.bucket_timeout_s, f"heal: message {k} of {len(plan)} from rank {src}"
            )
            if not staged:
                refill()  # this buffer is the destination itself: keep the link busy meanwhile
            mine[k] = bytes_checksum(buf).cpu()
            if staged:
                at = 0
                for i, start, n in msg.parts:
                    views[i][start : start + n].copy_(buf[at : at + n])
                    at += n
                refill()  # the staging bucket is free again
            stats.bytes += msg.nbytes
            stats.messages += 1
    stats.prefaulted_bytes = prefaulter.populated
    theirs = torch.zeros(len(plan), 2, dtype=torch.int64)
    _wait(dist.irecv(theirs, src, group=group), config.bucket_timeout_s, "heal: checksums")
    bad = [k for k in range(len(plan)) if not torch.equal(mine[k], theirs[k])]
    if bad:
        k = bad[0]
        raise ChecksumMismatch(
            f"message {k} of {len(plan)} ({plan[k].nbytes} bytes; {len(bad)} message(s) "
            f"differ) arrived with checksum {mine[k].tolist()}, sent with {theirs[k].tolist()}"
        )
    stats.seconds = time.perf_counter() - t0
    return stats
