"""The default training corpus: docstrings of the installed Python standard library.

Every machine that runs this project has them, they are real English prose about code, and
reading them needs no download. The corpus is a deterministic function of the Python build
(the version is recorded in the stats), so two runs on one machine write identical files.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import platform
import sysconfig
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_MAX_BYTES",
    "MIN_DOCSTRING_CHARS",
    "SKIPPED_DIRS",
    "iter_stdlib_docstrings",
    "prepare_stdlib_dataset",
    "prepared_dataset_stats",
]

DEFAULT_MAX_BYTES = 8_000_000
"""Cap on the corpus text; CPython 3.11's stdlib has only ~1.5 MB, so by default it is all used."""

MIN_DOCSTRING_CHARS = 64
"""Shorter docstrings ("Return self.") carry little language and are skipped."""

SKIPPED_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idlelib",
        "lib2to3",
        "turtledemo",
        "ensurepip",
        "__pycache__",
    }
)
"""Directory names never descended into: third-party code, test suites, demos, vendored wheels."""

# Statement-holding nodes whose children may define functions/classes (`def` inside `if`, `try`,
# `with`, `match` ...); expressions cannot contain docstrings, so they are not visited.
_CONTAINERS = (ast.stmt, ast.excepthandler, ast.match_case)
_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _stdlib_py_files(root: str) -> list[str]:
    """All ``.py`` files under ``root`` outside :data:`SKIPPED_DIRS`, sorted by relative path."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), root)
                found.append(rel.replace(os.sep, "/"))
    # Sorting the relative paths (not relying on os.walk order) makes the order filesystem-proof.
    found.sort()
    return [os.path.join(root, *rel.split("/")) for rel in found]


def _docstrings_in_source_order(tree: ast.Module) -> Iterator[str]:
    """Module, class and function docstrings of ``tree``, pre-order in source order."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, _DOCUMENTED):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                yield doc
        children = [c for c in ast.iter_child_nodes(node) if isinstance(c, _CONTAINERS)]
        # An explicit stack rather than recursion: deep nesting cannot hit the recursion limit.
        stack.extend(reversed(children))


def iter_stdlib_docstrings(
    max_bytes: int | None = None, *, root: str | None = None
) -> Iterator[str]:
    """Yield the standard library's docstrings, deterministically.

    Files are visited in sorted relative-path order; each is parsed with :mod:`ast` (files that
    fail to decode or parse are skipped) and its module, class and function docstrings are
    yielded in source order, cleaned with ``inspect.cleandoc`` semantics and stripped. Docstrings
    shorter than :data:`MIN_DOCSTRING_CHARS` characters, and exact repeats of an earlier one
    (inherited/copied docstrings), are skipped.

    Args:
        max_bytes: Stop before the UTF-8 size of the yielded text would exceed this; ``None``
            means no cap.
        root: Directory to walk; defaults to ``sysconfig.get_paths()["stdlib"]``.

    Yields:
        One docstring per item.

    Raises:
        ValueError: If ``max_bytes`` is negative.
    """
    if max_bytes is not None and max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0 or None, got {max_bytes}")
    root = root if root is not None else sysconfig.get_paths()["stdlib"]
    total = 0
    seen: set[str] = set()
    for path in _stdlib_py_files(root):
        try:
            with open(path, "rb") as f:
                source = f.read()
            with warnings.catch_warnings():
                # Old stdlib modules trigger "invalid escape sequence" warnings when parsed.
                warnings.simplefilter("ignore")
                tree = ast.parse(source, filename=path)
        except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
            continue
        for doc in _docstrings_in_source_order(tree):
            doc = doc.strip()
            if len(doc) < MIN_DOCSTRING_CHARS or doc in seen:
                continue
            size = len(doc.encode("utf-8"))
            if max_bytes is not None and total + size > max_bytes:
                return
            seen.add(doc)
            total += size
            yield doc


def _remove_if_exists(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


def _stats_path(prefix: str) -> str:
    return prefix + ".json"


def prepared_dataset_stats(output_prefix: str) -> dict[str, Any] | None:
    """Return the stats of a completely prepared dataset at ``output_prefix``, else ``None``.

    "Complete" means ``.bin``, ``.idx`` and ``.json`` exist and the ``.bin`` size matches the one
    recorded in the ``.json``, which :func:`prepare_stdlib_dataset` writes last, as its commit
    marker.

    Args:
        output_prefix: Path prefix of the ``.bin``/``.idx``/``.json`` files.

    Returns:
        The stats dict, or ``None`` if the files are missing, unreadable or inconsistent.
    """
    bin_path, idx_path = output_prefix + ".bin", output_prefix + ".idx"
    if not (os.path.isfile(bin_path) and os.path.isfile(idx_path)):
        return None
    try:
        with open(_stats_path(output_prefix), encoding="utf-8") as f:
            stats = json.load(f)
        if int(stats["bin_bytes"]) != os.path.getsize(bin_path):
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return stats


def prepare_stdlib_dataset(
    output_prefix: str,
    max_bytes: int = DEFAULT_MAX_BYTES,
    tokenizer: Any = None,
    progress: Any = None,
) -> dict[str, Any]:
    """Tokenize the stdlib docstrings into a Megatron indexed dataset.

    Each docstring becomes one document, ``tokenize(doc) + [eod]``, written with megatron-core's
    ``IndexedDatasetBuilder`` as ``<output_prefix>.bin``/``.idx`` in the smallest dtype that holds
    the vocabulary. Files are first written under temporary names and renamed into place; the
    ``.json`` stats file is written last, so a crash leaves either no ``.json`` (the set counts as
    not prepared) or no ``.idx`` (Megatron refuses to load it), never a plausible mismatched pair.

    Args:
        output_prefix: Path prefix of the output files; parent directories are created.
        max_bytes: Cap on the UTF-8 size of the docstring text (see :func:`iter_stdlib_docstrings`).
        tokenizer: Object with ``tokenize``, ``eod`` and ``vocab_size``; defaults to
            :class:`~megatron_mecefo.data.tokenizer.ByteTokenizer`.
        progress: Called with a one-line status at the start and every 1,000 documents
            (e.g. ``print``); parsing the stdlib takes tens of seconds on a loaded machine.

    Returns:
        Stats: ``documents``, ``tokens``, ``bytes`` (text), ``bin_bytes``, ``dtype``,
        ``vocab_size``, ``max_bytes``, ``python_version``, ``seconds`` and more.

    Raises:
        ValueError: If no docstring fits in ``max_bytes`` or a token id is out of range.
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    if tokenizer is None:
        from megatron_mecefo.data.tokenizer import ByteTokenizer

        tokenizer = ByteTokenizer()

    t_start = time.perf_counter()
    vocab_size = int(tokenizer.vocab_size)
    eod = int(tokenizer.eod)
    dtype = DType.optimal_dtype(vocab_size)

    output_prefix = os.path.abspath(output_prefix)
    os.makedirs(os.path.dirname(output_prefix), exist_ok=True)
    tmp_prefix = f"{output_prefix}.tmp-{os.getpid()}"
    tmp_bin, tmp_idx, tmp_json = tmp_prefix + ".bin", tmp_prefix + ".idx", tmp_prefix + ".json"

    documents = tokens = text_bytes = 0
    builder = IndexedDatasetBuilder(tmp_bin, dtype=dtype)
    if progress is not None:
        progress(
            f"building {output_prefix}.bin/.idx from the docstrings of the standard library "
            f"(up to {max_bytes / 1e6:.1f} MB of text)"
        )
    try:
        for doc in iter_stdlib_docstrings(max_bytes):
            if progress is not None and documents and documents % 1000 == 0:
                progress(
                    f"  {documents:,} documents, {tokens / 1e6:.2f} M tokens, "
                    f"{time.perf_counter() - t_start:.0f} s"
                )
            ids = np.asarray(list(tokenizer.tokenize(doc)) + [eod], dtype=np.int64)
            if ids.min() < 0 or ids.max() >= vocab_size:
                raise ValueError(f"token id out of range [0, {vocab_size}) in document {documents}")
            # One sequence per document: `lengths` must be [len(document)], or Megatron reads
            # zero-length documents and its sample-index build never terminates.
            builder.add_document(ids.astype(dtype), [int(ids.size)])
            documents += 1
            tokens += int(ids.size)
            text_bytes += len(doc.encode("utf-8"))
        if documents == 0:
            raise ValueError(f"no stdlib docstring fits in max_bytes={max_bytes}")
        builder.finalize(tmp_idx)

        stats: dict[str, Any] = {
            "documents": documents,
            "tokens": tokens,
            "bytes": text_bytes,
            "bin_bytes": os.path.getsize(tmp_bin),
            "dtype": np.dtype(dtype).name,
            "vocab_size": vocab_size,
            "eod": eod,
            "tokenizer": type(tokenizer).__name__,
            "max_bytes": max_bytes,
            "python_version": platform.python_version(),
            "stdlib": sysconfig.get_paths()["stdlib"],
        }

        # Commit: drop the marker and the old pair first, so no mix of old and new looks valid.
        for ext in (".json", ".idx", ".bin"):
            _remove_if_exists(output_prefix + ext)
        os.replace(tmp_bin, output_prefix + ".bin")
        os.replace(tmp_idx, output_prefix + ".idx")
        stats["seconds"] = round(time.perf_counter() - t_start, 3)
        with open(tmp_json, "w", encoding="utf-8") as f:
            json.dump(stats, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp_json, _stats_path(output_prefix))
    except BaseException:
        builder.data_file.close()
        for path in (tmp_bin, tmp_idx, tmp_json):
            _remove_if_exists(path)
        raise
    return stats
