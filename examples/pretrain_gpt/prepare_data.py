"""Prepare the default training data: the Python stdlib's docstrings as a Megatron dataset.

Usage (from the repository root)::

    python examples/pretrain_gpt/prepare_data.py [--output-prefix data/stdlib_text_document]

Writes ``<prefix>.bin``/``.idx`` (Megatron indexed dataset, byte tokens) and ``<prefix>.json``
(stats). If they already exist and are complete, they are reused unless ``--force`` is given.
"""

from __future__ import annotations

import argparse
import sys

from megatron_mecefo.runtime import quiet_cpu_warnings

quiet_cpu_warnings()  # before megatron-core is imported: its Apex/TE notices say nothing here

from megatron_mecefo.data.stdlib_corpus import (  # noqa: E402
    DEFAULT_MAX_BYTES,
    prepare_stdlib_dataset,
    prepared_dataset_stats,
)


def _format(stats: dict) -> str:
    return (
        f"documents={stats['documents']} tokens={stats['tokens']} bytes={stats['bytes']} "
        f"python={stats['python_version']} seconds={stats['seconds']}"
    )


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, then reuse or (re)build the dataset; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output-prefix",
        default="data/stdlib_text_document",
        help="path prefix of the .bin/.idx/.json files, relative to the current directory "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--max-bytes",
        type=int,
        default=DEFAULT_MAX_BYTES,
        help="cap on the docstring text in UTF-8 bytes (default: %(default)s)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if the files exist")
    args = parser.parse_args(argv)

    # Checking is cheap (no megatron-core import), so a second `make demo` returns at once.
    stats = None if args.force else prepared_dataset_stats(args.output_prefix)
    if stats is not None and stats.get("max_bytes") == args.max_bytes:
        print(f"reusing {args.output_prefix}.bin/.idx/.json: {_format(stats)}")
        return 0
    if stats is not None:
        print(f"rebuilding: existing files were made with max_bytes={stats.get('max_bytes')}")
    try:
        stats = prepare_stdlib_dataset(
            args.output_prefix,
            max_bytes=args.max_bytes,
            progress=lambda line: print(line, flush=True),
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.output_prefix}.bin/.idx/.json: {_format(stats)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
