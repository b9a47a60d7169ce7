"""The data pipeline on two spawned gloo ranks: ``build_gpt_datasets`` on every rank against the
real megatron-core 0.16.1 dataset code (no mocks)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from megatron_mecefo.data import (
    ByteTokenizer,
    PretrainingSampler,
    build_data_iterator,
    build_gpt_datasets,
    prepare_stdlib_dataset,
)

SMALL_BYTES = 200_000
SEQ = 64


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A ~200 KB stdlib dataset, prepared twice into separate directories."""
    root = tmp_path_factory.mktemp("data")
    prefix_a, prefix_b = str(root / "a" / "stdlib"), str(root / "b" / "stdlib")
    stats_a = prepare_stdlib_dataset(prefix_a, max_bytes=SMALL_BYTES)
    stats_b = prepare_stdlib_dataset(prefix_b, max_bytes=SMALL_BYTES)
    return {"prefix": prefix_a, "stats": stats_a, "prefix_b": prefix_b, "stats_b": stats_b}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dist_worker(rank: int, world: int, port: int, prefix: str, cache: str, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        train, valid, _ = build_gpt_datasets(
            data_path=[prefix],
            mock=False,
            seq_length=SEQ,
            seed=5,
            split="90,10,0",
            num_samples=(16, 4, 0),
            tokenizer=ByteTokenizer(),
            cache_dir=cache,
        )
        batch = next(build_data_iterator(train, PretrainingSampler(16, 0, 2, rank, world)))
        result = {
            "len": [len(train), len(valid)],
            "sample3": train[3]["tokens"].tolist(),
            "batch": batch["tokens"].tolist(),
        }
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned ranks each import megatron-core: ~10 s
def test_build_gpt_datasets_on_every_gloo_rank(small: dict, tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    cache = tmp_path / "cache"
    mp.spawn(
        _dist_worker,
        args=(2, _free_port(), small["prefix"], str(cache), str(tmp_path)),
        nprocs=2,
    )
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert r0["len"] == r1["len"] and r0["sample3"] == r1["sample3"]
    assert r0["batch"] != r1["batch"]  # each rank reads its own micro-batch
    assert any(name.endswith("shuffle_index.npy") for name in os.listdir(cache))
