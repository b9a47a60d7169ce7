"""Megatron-LM's ``--data-path`` convention, parsed and checked without importing torch.

The trainer validates its flags before torch and megatron-core are imported (so a bad flag
fails in well under a second); the dataset builder uses the same functions.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


def check_data_prefix(prefix: str) -> None:
    """Check that the indexed dataset ``<prefix>.bin``/``<prefix>.idx`` exists.

    Args:
        prefix: Dataset path prefix, without extension.

    Raises:
        FileNotFoundError: Naming every missing file (and hinting when ``prefix`` itself
            carries a ``.bin``/``.idx`` extension).
    """
    missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
    if not missing:
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
