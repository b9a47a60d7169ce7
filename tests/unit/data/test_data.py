"""Tests of the data pipeline against the real megatron-core 0.16.1 dataset code (no mocks)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.tokenizers import MegatronTokenizerBase

from megatron_mecefo.data import (
    ByteTokenizer,
    PretrainingSampler,
    build_data_iterator,
    build_gpt_datasets,
    check_data_prefix,
    iter_stdlib_docstrings,
    parse_data_path,
    prepare_stdlib_dataset,
    prepared_dataset_stats,
    samples_of_global_batch,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
SMALL_BYTES = 200_000
SEQ = 64


@pytest.fixture(scope="module")
def tok() -> ByteTokenizer:
    return ByteTokenizer()


@pytest.fixture(scope="module")
def docs() -> list[str]:
    """The docstrings the small dataset is made of (parsing the stdlib is the slow part)."""
    return list(iter_stdlib_docstrings(SMALL_BYTES))


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A ~200 KB stdlib dataset, prepared twice into separate directories."""
    root = tmp_path_factory.mktemp("data")
    prefix_a, prefix_b = str(root / "a" / "stdlib"), str(root / "b" / "stdlib")
    stats_a = prepare_stdlib_dataset(prefix_a, max_bytes=SMALL_BYTES)
    stats_b = prepare_stdlib_dataset(prefix_b, max_bytes=SMALL_BYTES)
    return {"prefix": prefix_a, "stats": stats_a, "prefix_b": prefix_b, "stats_b": stats_b}


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_unicode(tok: ByteTokenizer) -> None:
    text = "Grüße, 世界! 🚀 naïve café\n\tend"
    ids = tok.tokenize(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.detokenize(ids) == text
    # Special ids are skipped wherever they appear; numpy input works too.
    assert tok.detokenize(np.array([tok.pad] + ids + [tok.eod, tok.pad])) == text
    assert tok.detokenize([0xFF]) == "\ufffd"


def test_tokenizer_special_ids_and_vocab(tok: ByteTokenizer) -> None:
    assert tok.vocab_size == 258
    assert (tok.eod, tok.eod_id, tok.pad, tok.pad_id) == (256, 256, 257, 257)
    assert tok.eod != tok.pad
    assert isinstance(tok, MegatronTokenizerBase)
    assert len(tok.vocab) == tok.vocab_size == len(tok.inv_vocab)
    assert tok.inv_vocab[tok.eod] == "<eod>" and tok.vocab["<pad>"] == tok.pad
    # Megatron json-dumps the identifiers into its cache descriptions.
    assert json.loads(json.dumps(tok.unique_identifiers))["vocab_size"] == 258


# ----------------------------------------------------------------------------- corpus


def test_stdlib_docstrings_capped_and_unique(docs: list[str]) -> None:
    # Determinism: test_prepared_dataset_matches_docstrings compares two independent runs.
    sizes = [len(d.encode("utf-8")) for d in docs]
    assert len(docs) > 100
    assert SMALL_BYTES - max(sizes) < sum(sizes) <= SMALL_BYTES
    assert min(len(d) for d in docs) >= 64
    assert len(set(docs)) == len(docs)
    assert all(d == d.strip() for d in docs)


def test_stdlib_walk_rules_and_source_order(tmp_path: Path) -> None:
    long = "x" * 70

    def write(rel: str, content: str | bytes) -> None:
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())

    write(
        "b.py",
        f'"""module B {long}"""\n'
        f'class C:\n    """class C {long}"""\n'
        f'    def m(self):\n        """method m {long}"""\n'
        f'        def inner():\n            """inner {long}"""\n'
        f'if True:\n    async def f():\n        """async f {long}"""\n'
        f'def short():\n    """too short"""\n'
        f'def dup():\n    """module B {long}"""\n',
    )
    write("a.py", f'"""module A {long}\n\n    indented"""\n')
    write("pkg/z.py", f'"""pkg z {long}"""\n')
    write("broken.py", f'"""broken {long}"""\ndef (:\n')
    write("latin.py", b'"""bad \xff bytes ' + long.encode() + b'"""\n')
    write("notes.txt", f'"""txt {long}"""\n')
    for skipped in ("test", "tests", "site-packages", "idlelib", "lib2to3", "ensurepip"):
        write(f"{skipped}/m.py", f'"""{skipped} {long}"""\n')

    docs = list(iter_stdlib_docstrings(root=str(tmp_path)))
    assert docs == [
        f"module A {long}\n\nindented",
        f"module B {long}",
        f"class C {long}",
        f"method m {long}",
        f"inner {long}",
        f"async f {long}",
        f"pkg z {long}",
    ]
    assert list(iter_stdlib_docstrings(len(docs[0].encode()) + 5, root=str(tmp_path))) == docs[:1]
    with pytest.raises(ValueError):
        list(iter_stdlib_docstrings(-1))


def test_prepared_dataset_matches_docstrings(
    small: dict, docs: list[str], tok: ByteTokenizer
) -> None:
    stats = small["stats"]
    ds = IndexedDataset(small["prefix"])
    assert len(ds) == stats["documents"] == len(docs)
    assert ds.index.dtype == np.uint16
    assert (
        int(ds.sequence_lengths.sum()) == stats["tokens"] == sum(len(d.encode()) + 1 for d in docs)
    )
    assert stats["bytes"] == sum(len(d.encode()) for d in docs)
    for i in (0, 1, len(docs) // 2, len(docs) - 1):
        assert ds[i].tolist() == tok.tokenize(docs[i]) + [tok.eod]
    with open(small["prefix"] + ".json", encoding="utf-8") as f:
        assert json.load(f) == stats
    # No temporary files are left behind, and a second run writes identical bytes.
    assert sorted(os.listdir(os.path.dirname(small["prefix"]))) == [
        "stdlib.bin",
        "stdlib.idx",
        "stdlib.json",
    ]
    for ext in (".bin", ".idx"):
        a = Path(small["prefix"] + ext).read_bytes()
        assert a == Path(small["prefix_b"] + ext).read_bytes()


def test_prepared_dataset_stats_detects_incomplete(tmp_path: Path) -> None:
    prefix = str(tmp_path / "d")
    assert prepared_dataset_stats(prefix) is None
    stats = prepare_stdlib_dataset(prefix, max_bytes=5_000)
    assert prepared_dataset_stats(prefix) == stats
    with open(prefix + ".bin", "ab") as f:  # a .bin that does not match its stats
        f.write(b"\0\0")
    assert prepared_dataset_stats(prefix) is None
    prepare_stdlib_dataset(prefix, max_bytes=5_000)
    os.remove(prefix + ".json")
    assert prepared_dataset_stats(prefix) is None
    with pytest.raises(ValueError, match="max_bytes"):
        prepare_stdlib_dataset(str(tmp_path / "e"), max_bytes=10)
    assert not (tmp_path / "e.bin").exists() and not (tmp_path / "e.idx").exists()


def test_prepare_cli_reuses_unless_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = importlib.util.spec_from_file_location(
        "prepare_data", REPO_ROOT / "examples" / "pretrain_gpt" / "prepare_data.py"
    )
    assert spec is not None and spec.loader is not None
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    monkeypatch.chdir(tmp_path)
    args = ["--max-bytes", "20000"]

    assert cli.main(args) == 0
    assert "wrote data/stdlib_text_document" in capsys.readouterr().out
    first = (tmp_path / "data" / "stdlib_text_document.json").read_text()
    assert cli.main(args) == 0
    assert "reusing" in capsys.readouterr().out
    assert cli.main([*args, "--force"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert (
        json.loads(first)["documents"]
        == prepared_dataset_stats("data/stdlib_text_document")["documents"]
    )


# ----------------------------------------------------------------------------- sampler


def _take(sampler: PretrainingSampler, n: int) -> list[list[int]]:
    it = iter(sampler)
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("mbs,dp,gbs,consumed", [(2, 4, 16, 0), (3, 2, 12, 36), (1, 1, 5, 10)])
def test_sampler_global_batch_partition(mbs: int, dp: int, gbs: int, consumed: int) -> None:
    total = 1000
    n_micro = gbs // (mbs * dp)
    seen: list[int] = []
    for rank in range(dp):
        batches = _take(PretrainingSampler(total, consumed, mbs, rank, dp), n_micro)
        assert all(len(b) == mbs for b in batches)
        assert batches == samples_of_global_batch(consumed, gbs, mbs, dp, rank)
        seen.extend(i for b in batches for i in b)
    assert sorted(seen) == list(range(consumed, consumed + gbs))


def test_sampler_resume_is_tail_of_uninterrupted_run() -> None:
    total, mbs, dp, gbs = 203, 2, 3, 12
    n_micro = gbs // (mbs * dp)
    for rank in range(dp):
        full = list(PretrainingSampler(total, 0, mbs, rank, dp))
        assert len(full) == total // (mbs * dp) == len(PretrainingSampler(total, 0, mbs, rank, dp))
        for k in (1, 5, 15):
            resumed = list(PretrainingSampler(total, k * gbs, mbs, rank, dp))
            assert resumed == full[k * n_micro :]
            assert resumed[:n_micro] == samples_of_global_batch(k * gbs, gbs, mbs, dp, rank)


def test_sampler_drop_last_false_yields_partial_tail() -> None:
    # 11 samples, mbs 2 x dp 2: two full chunks, then [8, 9, 10] split as [8, 9] / [10].
    tails = {r: list(PretrainingSampler(11, 0, 2, r, 2, drop_last=False)) for r in range(2)}
    assert tails[0][-1] == [8, 9] and tails[1][-1] == [10]
    assert {r: len(PretrainingSampler(11, 0, 2, r, 2, drop_last=False)) for r in range(2)} == {
        0: 3,
        1: 3,
    }
    # With dp 4 ranks 2 and 3 have nothing in the tail and yield no empty batch.
    assert list(PretrainingSampler(9, 8, 1, 3, 4, drop_last=False)) == []
    assert list(PretrainingSampler(9, 8, 1, 0, 4, drop_last=False)) == [[8]]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"total_samples": 0},
        {"consumed_samples": 100},
        {"consumed_samples": 150},
        {"consumed_samples": -1},
        {"micro_batch_size": 0},
        {"data_parallel_size": 0},
        {"data_parallel_rank": 4},
        {"data_parallel_rank": -1},
        {"micro_batch_size": 2.0},
        {"data_parallel_rank": True},
    ],
)
def test_sampler_rejects_bad_arguments(kwargs: dict) -> None:
    args = {
        "total_samples": 100,
        "consumed_samples": 0,
        "micro_batch_size": 2,
        "data_parallel_rank": 0,
        "data_parallel_size": 4,
    }
    args.update(kwargs)
    with pytest.raises(ValueError):
        PretrainingSampler(**args)


def test_sampler_accepts_numpy_ints() -> None:
    # consumed_samples often comes back from a checkpoint as a numpy integer.
    sampler = PretrainingSampler(100, np.int64(8), np.int32(2), np.int64(1), 4)
    assert next(iter(sampler)) == [10, 11]
    assert samples_of_global_batch(np.int64(8), 16, 2, 4, 1) == [[10, 11], [18, 19]]


def test_samples_of_global_batch_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="multiple"):
        samples_of_global_batch(0, 10, 2, 4, 0)
    with pytest.raises(ValueError):
        samples_of_global_batch(0, 16, 2, 4, 4)
    with pytest.raises(ValueError):
        samples_of_global_batch(-2, 16, 2, 4, 0)


# ----------------------------------------------------------------------------- datasets


@pytest.mark.parametrize(
    "data_path,expected",
    [
        (["a", "b"], (["a", "b"], None)),
        (["p"], (["p"], None)),
        (["0.3", "a", "0.7", "b"], (["a", "b"], [0.3, 0.7])),
        (["1", "only"], (["only"], None)),
        ("2 x 6 y", (["x", "y"], [2.0, 6.0])),
    ],
)
def test_parse_data_path(data_path: list[str] | str, expected: tuple) -> None:
    assert parse_data_path(data_path) == expected


@pytest.mark.parametrize("data_path", [[], ["0.3", "a", "b", "c"], ["-1", "a", "2", "b"]])
def test_parse_data_path_rejects(data_path: list[str]) -> None:
    with pytest.raises(ValueError):
        parse_data_path(data_path)


def test_check_data_prefix(tmp_path: Path, small: dict, tok: ByteTokenizer) -> None:
    check_data_prefix(small["prefix"])
    (tmp_path / "half.idx").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"half\.bin") as err:
        check_data_prefix(str(tmp_path / "half"))
    assert "half.idx" not in str(err.value)
    with pytest.raises(FileNotFoundError, match="without extension"):
        check_data_prefix(small["prefix"] + ".bin")
    with pytest.raises(FileNotFoundError, match=r"nope\.idx"):
        build_gpt_datasets(
            data_path=[str(tmp_path / "nope")],
            mock=False,
            seq_length=SEQ,
            seed=1,
            split="1,0,0",
            num_samples=(4, 0, 0),
            tokenizer=tok,
            cache_dir=str(tmp_path / "cache"),
        )


def _expected_text(ds, idx: int, seq_length: int) -> np.ndarray:
    """Sample ``idx`` recomputed from the raw documents, concatenated in document-index order."""
    low = ds.dataset
    i = int(ds.shuffle_index[idx])
    (doc_beg, off_beg), (doc_end, _) = ds.sample_index[i], ds.sample_index[i + 1]
    stream = np.concatenate([low[int(d)] for d in ds.document_index[doc_beg : doc_end + 1]])
    return stream[off_beg : off_beg + seq_length + 1]


def test_build_gpt_datasets_real(small: dict, tok: ByteTokenizer, tmp_path: Path) -> None:
    kwargs = dict(
        data_path=[small["prefix"]],
        mock=False,
        seq_length=SEQ,
        seed=1234,
        split="90,5,5",
        num_samples=(40, 8, 0),
        tokenizer=tok,
        cache_dir=str(tmp_path / "cache"),
    )
    train, valid, test = build_gpt_datasets(**kwargs)
    assert test is None  # 0 samples requested: not built
    assert len(train) >= 40 and len(valid) >= 8
    n_docs = small["stats"]["documents"]
    assert set(train.document_index.tolist()) == set(range(round(0.9 * n_docs)))
    assert set(valid.document_index.tolist()) == set(
        range(round(0.9 * n_docs), round(0.95 * n_docs))
    )
    for ds in (train, valid):
        for idx in (0, 3, len(ds) - 1):
            sample = ds[idx]
            assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}
            assert sample["tokens"].shape == (SEQ,) and sample["labels"].shape == (SEQ,)
            assert torch.equal(sample["labels"][:-1], sample["tokens"][1:])
            text = _expected_text(ds, idx, SEQ)
            assert sample["tokens"].tolist() == text[:-1].tolist()
            assert sample["labels"].tolist() == text[1:].tolist()
            assert torch.equal(sample["position_ids"], torch.arange(SEQ))
            assert bool((sample["loss_mask"] == 1).all())
    assert any(
        name.endswith("GPTDataset-train-shuffle_index.npy")
        for name in os.listdir(tmp_path / "cache")
    )
    # A second build hits the cache and sees the same samples.
    train2, _, _ = build_gpt_datasets(**kwargs)
    assert torch.equal(train2[7]["tokens"], train[7]["tokens"])


def test_build_gpt_datasets_blend_and_empty_split(
    small: dict, tok: ByteTokenizer, tmp_path: Path
) -> None:
    common = dict(mock=False, seq_length=SEQ, seed=7, tokenizer=tok, cache_dir=str(tmp_path / "c"))
    train, valid, _ = build_gpt_datasets(
        data_path=["0.25", small["prefix"], "0.75", small["prefix_b"]],
        split="90,10,0",
        num_samples=(40, 8, 0),
        **common,
    )
    assert len(train) >= 40 and len(valid) >= 8
    ids = [int(train[i]["dataset_id"]) for i in range(len(train))]
    assert set(ids) == {0, 1} and ids.count(1) > ids.count(0)
    assert train[0]["tokens"].shape == (SEQ,)
    # "10000,1,0" leaves the valid split of ~600 documents empty.
    with pytest.raises(ValueError, match="no documents"):
        build_gpt_datasets(
            data_path=[small["prefix"]], split="10000,1,0", num_samples=(8, 2, 0), **common
        )
    train, valid, test = build_gpt_datasets(
        data_path=[small["prefix"]], split="10000,1,0", num_samples=(8, 0, 0), **common
    )
    assert len(train) >= 8 and valid is None and test is None


def test_build_gpt_datasets_mock(tok: ByteTokenizer) -> None:
    train, valid, test = build_gpt_datasets(
        data_path=None,
        mock=True,
        seq_length=32,
        seed=1,
        split="98,2,0",
        num_samples=(16, 4, 0),
        tokenizer=tok,
        cache_dir=None,
    )
    assert test is None and len(train) >= 16 and len(valid) >= 4
    sample = train[0]
    assert sample["tokens"].shape == (32,)
    assert torch.equal(sample["labels"][:-1], sample["tokens"][1:])
    assert int(sample["tokens"].max()) < tok.vocab_size


def test_data_iterator_batches(small: dict, tok: ByteTokenizer, tmp_path: Path) -> None:
    train, _, _ = build_gpt_datasets(
        data_path=[small["prefix"]],
        mock=False,
        seq_length=SEQ,
        seed=1,
        split="1,0,0",
        num_samples=(32, 0, 0),
        tokenizer=tok,
        cache_dir=str(tmp_path / "cache"),
    )
    mbs, dp, rank = 4, 2, 1
    sampler = PretrainingSampler(32, 8, mbs, rank, dp)
    batches = list(build_data_iterator(train, sampler))
    assert len(batches) == len(sampler) == 3
    for batch, indices in zip(batches, sampler, strict=True):
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert batch[key].shape == (mbs, SEQ)
        assert torch.equal(batch["tokens"], torch.stack([train[i]["tokens"] for i in indices]))
    assert batches[0]["tokens"].dtype == torch.int64


@pytest.mark.parametrize(
    "damage,names,text",
    [
        ("truncate_bin", ".bin", "truncated"),
        ("empty_idx", ".idx", "shorter than the 34-byte header"),
        ("random_idx", ".idx", "bad header"),
        ("truncate_idx", ".idx", "needs"),
    ],
)
def test_damaged_dataset_files_name_the_file(
    tmp_path: Path, small: dict, damage: str, names: str, text: str
) -> None:
    """Each damage that megatron-core reports as a bare EOFError / 'bad header' / 'offset must
    be non-negative' is caught by the start-up check, which names the file and the fix."""
    import shutil

    from megatron_mecefo.data.data_path import DatasetFileError

    prefix = str(tmp_path / "copy")
    for ext in (".bin", ".idx"):
        shutil.copy(small["prefix"] + ext, prefix + ext)
    bin_path, idx_path = Path(prefix + ".bin"), Path(prefix + ".idx")
    if damage == "truncate_bin":
        bin_path.write_bytes(bin_path.read_bytes()[: bin_path.stat().st_size // 2])
    elif damage == "empty_idx":
        idx_path.write_bytes(b"")
    elif damage == "random_idx":
        idx_path.write_bytes(np.random.default_rng(0).bytes(4096))
    else:
        idx_path.write_bytes(idx_path.read_bytes()[:-8])
    with pytest.raises(DatasetFileError) as err:
        check_data_prefix(prefix)
    message = str(err.value)
    assert message.startswith(prefix + names) and text in message, message
    assert "prepare_data.py --force" in message
