"""Sending a state tensor by tensor (``recovery/state/tensor_stream.py``): the message plan,
the pickled structure, receiving in place, and real transfers over gloo between processes
(one sender, two receivers; a corrupted message; a slow sender; a stalled one)."""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import traceback
from collections import OrderedDict
from typing import Any, Callable, Dict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_mecefo.recovery.state.tensor_stream import (
    ChecksumMismatch,
    InlineTensor,
    MiB,
    StreamConfig,
    TensorSlot,
    destinations,
    fill_tree,
    plan_messages,
    recv_tensors,
    send_tensors,
    slots_of,
    split_tree,
)


def test_plan_slices_large_tensors_and_packs_small_ones() -> None:
    # Half a bucket or more goes alone, in slices of at most a bucket; smaller ones are
    # packed in stream order (the pack is sent when full, or last).
    plan = plan_messages([10, 20, 100, 5, 5, 30], bucket_bytes=40)
    assert [m.parts for m in plan] == [
        [(1, 0, 20)],
        [(2, 0, 40)], [(2, 40, 40)], [(2, 80, 20)],
        [(5, 0, 30)],
        [(0, 0, 10), (3, 0, 5), (4, 0, 5)],
    ]  # fmt: skip
    plan = plan_messages([15, 15, 15], bucket_bytes=40)
    assert [m.parts for m in plan] == [[(0, 0, 15), (1, 0, 15)], [(2, 0, 15)]]


def test_structure_round_trip_with_aliases_inline_tensors_and_metadata() -> None:
    big, other = torch.randn(1000), torch.randn(300)
    sd: Any = OrderedDict(w=big, tied=big, b=torch.ones(3))
    sd._metadata = {"": {"version": 1}}
    state = {"model": [sd], "opt": {"state": {0: {"m": other, "step": torch.tensor(5.0)}}},
             "iteration": 7, "pair": (other, "x")}  # fmt: skip
    skeleton, tensors = split_tree(state, inline_bytes=1024)
    assert [t.data_ptr() for t in tensors] == [big.data_ptr(), other.data_ptr()]
    assert isinstance(skeleton["model"][0]["tied"], TensorSlot)
    assert skeleton["model"][0]["tied"].alias_of == 0
    assert isinstance(skeleton["model"][0]["b"], InlineTensor)  # 12 bytes: pickled inline
    assert skeleton["model"][0]._metadata == {"": {"version": 1}}
    assert [s.index for s in slots_of(skeleton)] == [0, 1]
    out = fill_tree(skeleton, [t.clone() for t in tensors])
    assert (
        torch.equal(out["model"][0]["w"], big) and out["model"][0]["tied"] is out["model"][0]["w"]
    )
    assert torch.equal(out["pair"][0], other) and out["pair"][1] == "x" and out["iteration"] == 7
    assert isinstance(out["model"][0], OrderedDict) and out["model"][0]._metadata


def test_small_tensors_travel_as_their_bytes_and_come_back_equal() -> None:
    """Every dtype and layout a state holds comes back equal, in its own writable storage,
    and the pickled structure holds no torch storage (torch.save per tensor); a subclass
    (a Parameter) keeps torch's own pickling."""
    small = {
        "bf16": torch.randn(5, 3).to(torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "step": torch.tensor(12.0),
        "ids": torch.arange(7, dtype=torch.int64),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(6, 4).t(),
        "rng": torch.get_rng_state(),
    }
    param = torch.nn.Parameter(torch.randn(4))
    skeleton, tensors = split_tree({**small, "param": param}, inline_bytes=64 * 1024)
    assert tensors == [] and isinstance(skeleton["param"], torch.nn.Parameter)
    assert all(isinstance(skeleton[k], InlineTensor) for k in small)
    assert b"_rebuild_tensor" not in pickle.dumps({k: skeleton[k] for k in small})
    out = fill_tree(pickle.loads(pickle.dumps(skeleton)), [])
    for key, sent in small.items():
        got = out[key]
        assert got.dtype == sent.dtype and got.shape == sent.shape, key
        assert torch.equal(got, sent) and got.device.type == "cpu", key
    out["step"] += 1  # writable, and not shared with another tensor of the structure
    assert float(out["step"]) == 13.0 and float(small["step"]) == 12.0
    assert torch.equal(out["param"], param)


def test_destinations_are_the_receivers_own_tensors_where_they_fit() -> None:
    skeleton, _ = split_tree({"w": torch.randn(100, 10), "m": torch.randn(50)}, 1)
    own_w = torch.zeros(100, 10)
    dests = destinations(skeleton, {"w": own_w, "m": torch.zeros(51)}, torch.device("cpu"))
    assert dests[0].data_ptr() == own_w.data_ptr()  # in place
    assert dests[1].shape == (50,) and dests[1].dtype == torch.float32  # allocated once
    dests = destinations(skeleton, {"w": torch.zeros(100, 10, dtype=torch.float64)},
                         torch.device("cpu"))  # fmt: skip
    assert dests[0].dtype == torch.float32  # a dtype mismatch is never written into


# ---------------------------------------------------------------------------- real transfers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _state(seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(3 * MiB // 4 + 1, generator=g),  # sliced (3 MiB + 4 bytes, 1 MiB buckets)
        *[torch.randn(1000 + 17 * i, generator=g) for i in range(40)],  # packed
        torch.randint(0, 255, (777,), dtype=torch.uint8, generator=g),  # ragged bytes
        torch.randn(400_000, generator=g).to(torch.bfloat16),
    ]


def _worker(rank: int, world: int, port: int, role: Callable, out: Any) -> None:
    try:
        os.environ["OMP_NUM_THREADS"] = "1"
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=60),
        )  # fmt: skip
        out.put((rank, role(rank)))
    except BaseException as err:  # the parent asserts on what each rank says
        out.put((rank, f"{type(err).__name__}: {err}\n{traceback.format_exc()[-800:]}"))


def _run(world: int, role: Callable) -> Dict[int, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, PORT[0], role, out))
             for r in range(world)]  # fmt: skip
    for p in procs:
        p.start()
    results: Dict[int, Any] = {}
    try:
        for _ in range(world):
            rank, value = out.get(timeout=120)
            results[rank] = value
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    PORT[0] = _free_port()
    return results


PORT = [_free_port()]
CONFIG = StreamConfig(bucket_bytes=1 * MiB, inline_bytes=0, bucket_timeout_s=30)


def _one_to_two(rank: int) -> Any:
    if rank == 0:
        stats = send_tensors(_state(0), [1, 2], None, CONFIG)
        return {"bytes": stats.bytes, "staging": stats.staging_bytes}
    dests = [torch.zeros_like(t) for t in _state(1)]
    ptrs = [d.data_ptr() for d in dests]
    stats = recv_tensors(dests, 0, None, CONFIG)
    same = all(torch.equal(a, b) for a, b in zip(dests, _state(0), strict=False))
    in_place = [d.data_ptr() for d in dests] == ptrs
    return {"equal": same, "in_place": in_place, "bytes": stats.bytes,
            "staging": stats.staging_bytes, "messages": stats.messages}  # fmt: skip


def test_one_sender_two_receivers_bytes_exact_and_bounded_staging() -> None:
    got = _run(3, _one_to_two)
    total = sum(t.numel() * t.element_size() for t in _state(0))
    assert got[1]["equal"] and got[2]["equal"], got
    assert got[1]["in_place"] and got[1]["bytes"] == total
    assert got[0]["bytes"] == 2 * total  # to each receiver once
    assert got[0]["staging"] <= 2 * MiB and got[1]["staging"] <= 1 * MiB, got
    assert got[1]["messages"] == len(plan_messages(
        [t.numel() * t.element_size() for t in _state(0)], MiB))  # fmt: skip


def _two_connections(rank: int) -> Any:
    second = dist.new_group([0, 1, 2], backend="gloo")  # every rank creates it
    lanes: list = []
    real_isend, real_irecv = dist.isend, dist.irecv

    def isend(buf: torch.Tensor, dst: int, group: Any = None) -> Any:
        lanes.append(group is second)
        return real_isend(buf, dst, group=group)

    def irecv(buf: torch.Tensor, src: int, group: Any = None) -> Any:
        lanes.append(group is second)
        return real_irecv(buf, src, group=group)

    dist.isend, dist.irecv = isend, irecv
    try:
        if rank == 0:
            send_tensors(_state(0), [1, 2], None, CONFIG, more_groups=[second])
            return {"lanes": lanes}
        dests = [torch.zeros_like(t) for t in _state(1)]
        recv_tensors(dests, 0, None, CONFIG, more_groups=[second])
        same = all(torch.equal(a, b) for a, b in zip(dests, _state(0), strict=True))
        return {"equal": same, "lanes": lanes}
    finally:
        dist.isend, dist.irecv = real_isend, real_irecv


def test_messages_alternate_over_two_connections_and_arrive_exact() -> None:
    got = _run(3, _two_connections)
    n = len(plan_messages([t.numel() * t.element_size() for t in _state(0)], MiB))
    assert n >= 4
    assert got[1]["equal"] and got[2]["equal"], got
    # Message k over the second group when k is odd, on both sides; the checksums (the last
    # send and receive) over the first.
    expected = [k % 2 == 1 for k in range(n)]
    assert got[0]["lanes"] == [lane for lane in expected for _ in (1, 2)] + [False, False]
    assert got[1]["lanes"] == expected + [False] and got[2]["lanes"] == expected + [False]


def _corrupted(rank: int) -> Any:
    if rank == 0:
        send_tensors(_state(0), [1], None, CONFIG)
        return "sent"
    real_irecv, count = dist.irecv, [0]

    class Flipped:  # the transport's fault: one bit of the third message flipped on arrival
        def __init__(self, work: Any, buf: torch.Tensor, k: int) -> None:
            self.work, self.buf, self.k = work, buf, k

        def wait(self, *a: Any) -> Any:
            result = self.work.wait(*a)
            if self.k == 2:
                self.buf[5] ^= 4
            return result

    def irecv(buf: torch.Tensor, src: int, group: Any = None) -> Any:
        count[0] += 1
        return Flipped(real_irecv(buf, src, group=group), buf, count[0] - 1)

    dist.irecv = irecv
    try:
        recv_tensors([torch.zeros_like(t) for t in _state(0)], 0, None, CONFIG)
    except ChecksumMismatch as err:
        return str(err)
    return "no error"


def test_a_corrupted_message_is_named() -> None:
    got = _run(2, _corrupted)
    assert got[1].startswith("message 2 of "), got
    assert "\n" not in got[1]


SLOW = StreamConfig(bucket_bytes=1 * MiB, inline_bytes=0, bucket_timeout_s=1.0, delay_s=0.5)


def _slow(rank: int) -> Any:
    if rank == 0:
        return send_tensors(_state(0), [1], None, SLOW).seconds
    dests = [torch.zeros_like(t) for t in _state(0)]
    stats = recv_tensors(dests, 0, None, SLOW)
    return {
        "seconds": stats.seconds,
        "equal": all(torch.equal(a, b) for a, b in zip(dests, _state(0), strict=False)),
    }


def test_a_transfer_longer_than_the_message_deadline_completes() -> None:
    got = _run(2, _slow)
    assert got[1]["equal"], got
    assert got[1]["seconds"] > 2 * SLOW.bucket_timeout_s, got  # the whole took longer


def _stalled(rank: int) -> Any:
    if rank == 0:
        import time

        time.sleep(4.0)  # never sends within the receiver's 1 s per message
        return "slept"
    try:
        recv_tensors([torch.zeros_like(t) for t in _state(0)], 0, None, SLOW)
    except RuntimeError as err:
        return str(err).splitlines()[0]
    return "no error"


def test_a_stalled_sender_fails_the_message_deadline() -> None:
    got = _run(2, _stalled)
    assert got[1].startswith("heal: message 0 of "), got
