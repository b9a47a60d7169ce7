"""Which failure inside a generation is the generation's (the rank leaves the world) and which
ends the rank; and the line a job with no trained state left stops with.

The real case: Megatron-Core's dataset builder, on a gloo world whose peer has exited, raises
a plain ``Exception`` from the barrier's ``RuntimeError``; the generation loop took only a
``RuntimeError`` or an ``OSError`` as the generation's, so the rank exited and was counted as
a death.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch.distributed as dist
from conftest import free_port

from megatron_mecefo.recovery import failures
from megatron_mecefo.recovery.abortable_waits import WorldAborted
from megatron_mecefo.recovery.fault_injection import PHASES, RANDOM_PHASES, parse_kills
from megatron_mecefo.recovery.generations import describe, world_aborted
from megatron_mecefo.recovery.membership import Generation, MembershipStore
from megatron_mecefo.recovery.state.heal import NoTrainedState, heal_target
from megatron_mecefo.recovery.world_store import WorldBuildAborted

GLOO = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:58055"
)


def _wrapped(inner: BaseException, outer: BaseException, how: str = "cause") -> BaseException:
    """``outer`` raised while handling ``inner``: ``from inner`` (cause), implicitly
    (context), or ``from None`` (context kept, suppressed)."""
    try:
        try:
            raise inner
        except BaseException as err:
            if how == "cause":
                raise outer from err
            if how == "none":
                raise outer from None
            raise outer  # noqa: B904  (the implicit context is the case tested)
    except BaseException as err:  # noqa: BLE001
        return err


@pytest.mark.parametrize("how", ["cause", "context", "none"])
@pytest.mark.parametrize(
    "inner",
    [
        RuntimeError(GLOO),
        dist.DistBackendError("NCCL communicator was aborted"),
        dist.DistNetworkError("Connection reset by peer"),
        WorldAborted("a failure ended this world while it waited in a collective"),
        WorldBuildAborted("a newer generation was announced"),
        ConnectionResetError(104, "Connection reset by peer"),
    ],
    ids=["gloo", "dist-backend", "dist-network", "world-aborted", "build-aborted", "conn-reset"],
)
def test_a_collective_error_in_the_chain_is_the_generations(inner: Exception, how: str) -> None:
    err = _wrapped(inner, Exception("MockGPTDataset failed to build as a mock data generator"), how)
    assert not isinstance(err, (RuntimeError, OSError))  # what the loop caught before
    assert failures.generation_failure(err, world_aborted=False)
    assert failures.root_collective_error(err) is inner


def test_a_deep_chain_and_a_cycle() -> None:
    inner = _wrapped(RuntimeError(GLOO), KeyError("batch"), "context")
    middle = _wrapped(inner, ValueError("the sampler failed"))
    outer = _wrapped(middle, AssertionError("data iterators"))
    assert failures.generation_failure(outer, world_aborted=False)
    # A chain that loops back on itself ends (Python allows it by assignment).
    a, b = ValueError("a"), TypeError("b")
    a.__context__, b.__context__ = b, a
    assert list(failures.causes(a)) == [a, b]
    assert not failures.generation_failure(a, world_aborted=False)


@pytest.mark.parametrize(
    "err",
    [
        ValueError("bad shape"),
        _wrapped(RuntimeError("CUDA error: device-side assert triggered"), ValueError("x")),
        _wrapped(KeyError("tokens"), Exception("MockGPTDataset failed to build")),
        AssertionError("user code"),
    ],
    ids=["plain", "non-collective-runtime-cause", "key-error-cause", "assertion"],
)
def test_a_users_error_ends_the_rank(err: BaseException) -> None:
    """Without a collective error in its chain and with the world intact, an error that is
    not a RuntimeError or an OSError is the rank's own: it exits (and is counted dead)."""
    assert not failures.generation_failure(err, world_aborted=False)
    assert failures.generation_failure(err, world_aborted=True)


def test_runtime_and_os_errors_stay_the_generations() -> None:
    assert failures.generation_failure(RuntimeError("anything"), world_aborted=False)
    assert failures.generation_failure(TimeoutError("store wait"), world_aborted=False)


def test_describe_names_the_wrapped_collective_error() -> None:
    err = _wrapped(RuntimeError(GLOO + "\nmore"), Exception("MockGPTDataset failed to build"))
    assert describe(err) == (
        "Exception: MockGPTDataset failed to build (from RuntimeError: " + GLOO[:200] + ")"
    )
    assert describe(ValueError("")) == "ValueError: "


def test_world_aborted_by_the_watchdog_or_a_later_failure_generation() -> None:
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    ms = MembershipStore(server)
    gen = Generation(number=1, replicas=(0, 1), members={0: 0, 1: 0})
    ms.publish(gen)
    session = SimpleNamespace(ms=ms, watchdog=None)
    assert not world_aborted(session, gen)  # type: ignore[arg-type]
    session.watchdog = SimpleNamespace(fired=None)
    ms.publish(Generation(number=2, replicas=(0, 1), members={0: 0, 1: 0}, at_iteration=9))
    assert not world_aborted(session, gen)  # type: ignore[arg-type]  # a planned one
    ms.publish(Generation(number=3, replicas=(0,), members={0: 0}))
    assert world_aborted(session, gen)  # type: ignore[arg-type]  # a failure after it
    session.watchdog = SimpleNamespace(fired=3)
    assert world_aborted(SimpleNamespace(ms=None, watchdog=session.watchdog), gen)  # type: ignore[arg-type]


def _rank(rank: int, port: int, out: str) -> None:
    """One rank of a 2-rank gloo world: rank 1 exits at once; rank 0 builds Megatron-Core's
    mock GPT datasets, whose barrier fails, and writes what it caught."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=20))
    if rank == 1:
        os._exit(0)
    time.sleep(0.5)
    from megatron_mecefo.data import ByteTokenizer, build_gpt_datasets

    caught: Optional[BaseException] = None
    try:
        build_gpt_datasets(
            data_path=None, mock=True, seq_length=16, seed=1, split="1,1,1",
            num_samples=(8, 8, 8), tokenizer=ByteTokenizer(), cache_dir=None,
        )  # fmt: skip
    except Exception as err:  # noqa: BLE001
        caught = err
    with open(out, "w") as f:
        json.dump(
            {
                "type": type(caught).__name__,
                "loop_caught_before": isinstance(caught, (RuntimeError, OSError)),
                "generation": caught is not None
                and failures.generation_failure(caught, world_aborted=False),
                "describe": describe(caught) if caught is not None else "",
            },
            f,
        )
    os._exit(0)


@pytest.mark.slow  # two spawned ranks import megatron-core: 23 s at a load average of 20
def test_megatron_cores_dataset_builder_wraps_the_barriers_error(tmp_path: Path) -> None:
    """The real thing: gloo's error in the builder's barrier, wrapped by Megatron-Core."""
    ctx = mp.get_context("spawn")
    port, out = free_port(), str(tmp_path / "rank0.json")
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        result: Any = json.loads(Path(out).read_text())
    finally:
        for p in procs:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGKILL)
                p.join()
    assert result["type"] == "Exception" and not result["loop_caught_before"], result
    assert result["generation"], result
    assert result["describe"].startswith(
        "Exception: MockGPTDataset failed to build as a mock data generator (from RuntimeError:"
    ), result
    assert "Connection closed by peer" in result["describe"], result


def test_no_trained_state_names_the_last_checkpoint(tmp_path: Path) -> None:
    assert heal_target([(0, True, 5), (1, False, -1)]) == 5
    with pytest.raises(NoTrainedState, match=r"\(slots 2, 3\) are joiners"):
        heal_target([(2, False, -1), (3, False, -1)])
    save, load = tmp_path / "save", tmp_path / "load"
    args = SimpleNamespace(save=str(save), load=str(load))
    assert failures.checkpoint_line(args).startswith("last checkpoint: none")
    load.mkdir()
    (load / "latest_checkpointed_iteration.txt").write_text("4\n")
    assert failures.checkpoint_line(args) == (
        f"last checkpoint: iteration 4 in {load}; resume with --load {load}"
    )
    save.mkdir()
    (save / "latest_checkpointed_iteration.txt").write_text("8")
    assert failures.last_checkpoint(args) == (str(save), "8")  # --save first: the newer
    # Megatron-LM's job flags hide save and load from the session; the line still finds them.
    hidden = SimpleNamespace(save=None, load=None, checkpoint_dirs=(None, str(load)))
    assert failures.last_checkpoint(hidden) == (str(load), "4")


def test_the_dataset_build_phase_parses_and_random_draws_are_unchanged() -> None:
    (kill,) = parse_kills(["2:4:dataset-build"], 4, 10, 0)
    assert kill.phase == "dataset-build" and "dataset-build" in PHASES
    assert "dataset-build" not in RANDOM_PHASES and RANDOM_PHASES == PHASES[:7]
