"""The API page (``docs/api.md``, filled by ``scripts/mkdocs_hooks.py``) renders each public
name once (issue 45: ``FaultToleranceConfig`` rendered twice), and names what the patches
call."""

from __future__ import annotations

import importlib
import sys
from collections import Counter
from typing import Any, List

from conftest import REPO


def _entries() -> List[str]:
    """Every ``::: dotted.name`` of the built page: the hook's public names, then the page's."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import mkdocs_hooks
    finally:
        sys.path.remove(str(REPO / "scripts"))
    page = (REPO / "docs" / "api.md").read_text()
    page = page.replace(mkdocs_hooks.API_MARKER, mkdocs_hooks._public_api())  # noqa: SLF001
    return [line[4:].strip() for line in page.splitlines() if line.startswith("::: ")]


def _load(dotted: str) -> Any:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_each_public_name_renders_once() -> None:
    entries = _entries()
    twice = [name for name, n in Counter(entries).items() if n > 1]
    assert not twice, f"rendered twice: {twice}"
    # The same object under two paths (a re-export) is also one name twice.
    by_object: dict = {}
    for dotted in entries:
        obj = _load(dotted)
        if isinstance(obj, (dict, list, str, int)):  # a constant (POLICIES): by its path
            continue
        by_object.setdefault(id(obj), []).append(dotted)
    same = [paths for paths in by_object.values() if len(paths) > 1]
    assert not same, f"one object rendered under several names: {same}"


def test_what_the_patches_call_is_on_the_page() -> None:
    names = {dotted.rpartition(".")[2] for dotted in _entries()}
    for called in ("extra_args_provider", "install", "maybe_wrap_for_inprocess_restart"):
        assert called in names, called
    for tag in ("core_v0.16.1", "core_v0.19.0"):
        patch = (REPO / "patches" / f"megatron-lm-{tag}.patch").read_text()
        for called in ("extra_args_provider", "install", "maybe_wrap_for_inprocess_restart"):
            assert f"mecefo.{called}(" in patch or f".{called}(" in patch, (tag, called)
