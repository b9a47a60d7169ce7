"""Megatron-LM's ``--data-path`` convention, parsed and checked without importing torch.

The trainer validates its flags before torch and megatron-core are imported (so a bad flag
fails in well under a second); the dataset builder uses the same functions.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence

INDEX_HEADER = b"MMIDIDX\x00\x00"
"""Magic bytes of a Megatron ``.idx`` file (megatron.core.datasets.indexed_dataset)."""

DTYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}
"""Byte size of each ``.idx`` dtype code (uint8, int8, int16, int32, int64, float64, float32,
uint16)."""


class DatasetFileError(ValueError):
    """A damaged ``.bin``/``.idx`` pair; the message names the file and the fix."""


def check_indexed_dataset_files(prefix: str) -> None:
    """Cheap consistency checks of ``<prefix>.idx`` and ``<prefix>.bin``, reading ~50 bytes.

    The header (magic, version, dtype code, counts) must be Megatron's, the ``.idx`` size must
    match its counts, and the ``.bin`` must be long enough for its last sequence. Otherwise
    megatron-core fails later with a bare ``EOFError``, ``bad header`` or ``offset must be
    non-negative`` that does not say which file is damaged.

    Raises:
        DatasetFileError: Naming the damaged file and what to do.
    """
    idx, binf = prefix + ".idx", prefix + ".bin"
    fix = (
        "; the file is damaged or not a Megatron indexed dataset: rebuild it (the default "
        "corpus: examples/pretrain_gpt/prepare_data.py --force)"
    )
    size = os.path.getsize(idx)
    if size < 34:
        raise DatasetFileError(f"{idx}: {size} bytes, shorter than the 34-byte header{fix}")
    with open(idx, "rb") as f:
        head = f.read(34)
        if head[:9] != INDEX_HEADER:
            raise DatasetFileError(f"{idx}: bad header {head[:9]!r}{fix}")
        version, code, sequences, documents = struct.unpack("<QBQQ", head[9:34])
        if version != 1 or code not in DTYPE_SIZES:
            raise DatasetFileError(f"{idx}: version {version}, dtype code {code}{fix}")
        expected = 34 + 12 * sequences + 8 * documents
        if size not in (expected, expected + sequences):  # + sequence modes (multimodal)
            raise DatasetFileError(
                f"{idx}: {size} bytes, but its header ({sequences} sequences, {documents} "
                f"documents) needs {expected}{fix}"
            )
        if sequences == 0:
            return
        f.seek(34 + 4 * (sequences - 1))
        (length,) = struct.unpack("<i", f.read(4))
        f.seek(34 + 4 * sequences + 8 * (sequences - 1))
        (pointer,) = struct.unpack("<q", f.read(8))
    need = pointer + length * DTYPE_SIZES[code]
    have = os.path.getsize(binf)
    if length < 0 or pointer < 0 or have < need:
        raise DatasetFileError(
            f"{binf}: {have} bytes, but {idx} places its last sequence at bytes "
            f"{pointer}..{need}; the .bin is truncated or belongs to another .idx{fix}"
        )


def check_data_prefix(prefix: str) -> None:
    """Check that the indexed dataset ``<prefix>.bin``/``<prefix>.idx`` exists.

    Args:
        prefix: Dataset path prefix, without extension.

    Raises:
        FileNotFoundError: Naming every missing file (and hinting when ``prefix`` itself
            carries a ``.bin``/``.idx`` extension).
        DatasetFileError: If the pair fails :func:`check_indexed_dataset_files`.
    """
    missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
    if not missing:
        check_indexed_dataset_files(prefix)
        return
    msg = f"indexed dataset {prefix!r} is incomplete: missing {', '.join(missing)}"
    if prefix.endswith((".bin", ".idx")):
        msg += f" (pass the prefix without extension, e.g. {prefix[:-4]!r})"
    else:
        msg += " (create it with examples/pretrain_gpt/prepare_data.py)"
    raise FileNotFoundError(msg)


def parse_data_path(
    data_path: Sequence[str] | str,
) -> tuple[list[str], list[float] | None]:
    """Parse Megatron-LM's ``--data-path`` list into a blend ``(prefixes, weights)``.

    Accepts either plain prefixes (``["a", "b"]``) or alternating weight/prefix pairs
    (``["0.3", "a", "0.7", "b"]``). A single string is split on whitespace. The weight of a lone
    prefix is dropped, so it is read as a plain ``GPTDataset`` rather than a one-way blend.

    Args:
        data_path: The list (or whitespace-separated string).

    Returns:
        The prefixes and their weights (``None`` when unweighted).

    Raises:
        ValueError: On an empty list, a mix of numeric and non-numeric entries in the weight
            positions, or negative / all-zero weights.
    """
    items = data_path.split() if isinstance(data_path, str) else [str(p).strip() for p in data_path]
    items = [p for p in items if p]
    if not items:
        raise ValueError("data_path is empty")

    def as_float(text: str) -> float | None:
        try:
            return float(text)
        except ValueError:
            return None

    if len(items) % 2 == 1:
        return items, None
    weights = [as_float(w) for w in items[0::2]]
    if all(w is None for w in weights):
        return items, None
    if any(w is None for w in weights):
        raise ValueError(
            f"data_path {items} mixes weights and prefixes; use either 'prefix ...' or "
            "'weight prefix weight prefix ...'"
        )
    prefixes = items[1::2]
    if any(w < 0 for w in weights) or sum(weights) <= 0:  # type: ignore[operator]
        raise ValueError(f"data_path weights must be >= 0 and not all 0, got {weights}")
    if len(prefixes) == 1:
        return prefixes, None
    return prefixes, [float(w) for w in weights]  # type: ignore[arg-type]


TOKEN_SCAN_BYTES = 64 * 2**20
"""How much of a ``.bin`` the token-id check reads at most: all of a small dataset, evenly
spaced chunks of a larger one (a sample, which the check's report says)."""


def scan_token_ids(prefix: str, max_bytes: int = TOKEN_SCAN_BYTES) -> tuple[int, int, int, int]:
    """The largest token id of ``<prefix>.bin`` (all of it, or a sample of ``max_bytes``).

    Returns:
        ``(largest id, tokens read, tokens in the file, documents)``; the largest id is -1
        for an empty dataset.
    """
    import numpy as np

    with open(prefix + ".idx", "rb") as f:
        head = f.read(34)
        _, code, sequences, documents = struct.unpack("<QBQQ", head[9:34])
        lengths = np.frombuffer(f.read(4 * sequences), dtype=np.int32)
    total = int(lengths.sum(dtype=np.int64)) if sequences else 0
    if total == 0:
        return -1, 0, 0, max(documents - 1, 0)
    dtype = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
             7: np.float32, 8: np.uint16}[code]  # fmt: skip
    tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r")[:total]
    size = DTYPE_SIZES[code]
    if total * size <= max_bytes:
        return int(tokens.max()), total, total, documents - 1
    chunks, per = 64, max_bytes // size // 64  # 64 evenly spaced windows
    starts = np.linspace(0, total - per, chunks).astype(np.int64)
    largest = max(int(tokens[s : s + per].max()) for s in starts)
    return largest, chunks * per, total, documents - 1
