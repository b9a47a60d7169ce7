"""docs/flags.md is generated from the parsers (scripts/render_flags.py) and must match them."""

from __future__ import annotations

import argparse
import importlib.util
from types import ModuleType
from typing import List

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


def _flags_without_help(parser: argparse.ArgumentParser, prefix: str = "") -> List[str]:
    """The flags (and positionals) of ``parser`` that start with ``prefix`` and whose help
    text is missing, blank or suppressed (its row in docs/flags.md would be empty)."""
    empty = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        names = action.option_strings or [action.dest]
        if not any(n.startswith(prefix) for n in names):
            continue
        text = action.help
        if text is None or text is argparse.SUPPRESS or not text.strip():
            empty.append(names[-1])
    return empty


def test_every_flag_has_help_text() -> None:
    """Every flag of the three parsers has a help text: the adapter's (every --mecefo* flag
    Megatron-LM gets), every supervisor flag and every flag of the example trainer, its
    Megatron-named ones (--num-layers, --lr, ...) too: --help is their only documentation."""
    script = _script()
    empty = {
        "megatron_mecefo.megatron_lm.extra_args_provider": _flags_without_help(
            script.adapter_parser()
        ),
        "examples/pretrain_gpt/arguments.py": _flags_without_help(script.trainer_parser()),
        "megatron_mecefo.recovery.supervisor": _flags_without_help(script.supervisor_parser()),
    }
    empty = {where: flags for where, flags in empty.items() if flags}
    assert not empty, f"flags without help text (add a one-line help=...): {empty}"


def test_every_arguments_module_gives_help_text() -> None:
    """Each module that adds MeCeFO flags, on a parser of its own (not only through the
    adapter, which could stop including one of them)."""
    from megatron_mecefo.abft.arguments import add_abft_arguments
    from megatron_mecefo.planner.arguments import add_planner_arguments
    from megatron_mecefo.recovery.arguments import add_arguments as add_recovery
    from megatron_mecefo.snapshot.arguments import add_arguments as add_snapshot
    from megatron_mecefo.takeover.arguments import add_arguments as add_takeover

    empty = {}
    for add in (add_takeover, add_planner_arguments, add_recovery, add_snapshot,
                add_abft_arguments):  # fmt: skip
        parser = argparse.ArgumentParser()
        add(parser)
        flags = {s for a in parser._actions for s in a.option_strings}
        assert any(f.startswith("--mecefo") for f in flags), f"{add.__module__}: no flags"
        if missing := _flags_without_help(parser):
            empty[add.__module__] = missing
    assert not empty, f"flags without help text (add a one-line help=...): {empty}"


def test_the_help_check_finds_an_empty_help() -> None:
    """The check itself: a flag without help, one with blank help and a suppressed one are
    found; one with help is not."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--none")
    parser.add_argument("--blank", help="  ")
    parser.add_argument("--hidden", help=argparse.SUPPRESS)
    parser.add_argument("--fine", help="seconds between two checks")
    assert _flags_without_help(parser) == ["--none", "--blank", "--hidden"]
