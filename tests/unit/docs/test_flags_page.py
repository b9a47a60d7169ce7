"""docs/flags.md is generated from the parsers (scripts/render_flags.py) and must match them."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from conftest import REPO

SCRIPT = REPO / "scripts" / "render_flags.py"
PAGE = REPO / "docs" / "flags.md"
FIX = "regenerate it with `make flags-doc` (python scripts/render_flags.py) and commit it"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("render_flags", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flags_page_matches_the_parsers() -> None:
    """The committed page equals what the parsers render now."""
    assert (
        PAGE.read_text(encoding="utf-8") == _script().render()
    ), f"docs/flags.md differs from the flags the parsers define; {FIX}"


def test_flags_page_lists_every_mecefo_and_supervisor_flag() -> None:
    """Every --mecefo* flag of the adapter and trainer, and every supervisor flag, is a row."""
    script, page = _script(), PAGE.read_text(encoding="utf-8")
    flags = set()
    for parser in (script.adapter_parser(), script.trainer_parser()):
        flags |= {s for a in parser._actions for s in a.option_strings if s.startswith("--mecefo")}
    parser = script.supervisor_parser()
    flags |= {s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")}
    missing = sorted(f for f in flags if f"`{f}`" not in page)
    assert not missing, f"not in docs/flags.md: {missing}; {FIX}"
