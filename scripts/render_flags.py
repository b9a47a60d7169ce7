"""Render docs/flags.md from the plugin's own argparse parsers.

The flags are read from the parsers the code builds, never copied: the Megatron-LM adapter's
``extra_args_provider`` (every ``--mecefo*`` flag Megatron-LM's ``pretrain_gpt.py`` accepts),
the example trainer's ``build_parser`` (the MeCeFO flags only it has) and the recovery
supervisor's ``build_parser``. Nothing here imports torch.

Usage::

    python scripts/render_flags.py            # rewrite docs/flags.md
    python scripts/render_flags.py --check    # exit 1 if docs/flags.md is out of date
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Iterable, List, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "flags.md"
TRAINER_ARGUMENTS = REPO / "examples" / "pretrain_gpt" / "arguments.py"
REGENERATE = "make flags-doc  (or: python scripts/render_flags.py)"


def adapter_parser() -> argparse.ArgumentParser:
    """Every flag Megatron-LM's parser gets from ``megatron_mecefo.megatron_lm``."""
    from megatron_mecefo.megatron_lm import extra_args_provider

    saved = list(sys.argv)
    try:  # the provider normalises sys.argv in place; keep the caller's
        return extra_args_provider()(argparse.ArgumentParser(add_help=False))
    finally:
        sys.argv[:] = saved


def supervisor_parser() -> argparse.ArgumentParser:
    """The recovery supervisor's command line."""
    from megatron_mecefo.recovery.supervisor import build_parser

    return build_parser()


def trainer_parser() -> argparse.ArgumentParser:
    """The example trainer's command line (``examples/`` is not a package: load it by path)."""
    spec = importlib.util.spec_from_file_location("_trainer_arguments", TRAINER_ARGUMENTS)
    if spec is None or spec.loader is None:
        raise SystemExit(f"render_flags.py: error: cannot load {TRAINER_ARGUMENTS}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_parser()


def _escape(text: str) -> str:
    """Markdown-safe table cell text."""
    for char in ("\\", "|", "*", "_", "<", ">", "`"):
        text = text.replace(char, "\\" + char)
    return " ".join(text.split())


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "switch"
    if action.choices:
        return " \\| ".join(f"`{c}`" for c in action.choices)
    if action.metavar:
        return f"`{action.metavar}`"
    if action.type is not None:
        return getattr(action.type, "__name__", str(action.type))
    return "str"


def _default(action: argparse.Action) -> str:
    value = action.default
    if value is None or value == [] or value is argparse.SUPPRESS:
        return "–"
    if action.nargs == 0 and isinstance(action, argparse._StoreTrueAction):  # noqa: SLF001
        return "off" if value is False else f"`{value}`"
    if action.nargs == 0 and isinstance(action, argparse._StoreFalseAction):  # noqa: SLF001
        return "off" if value is True else f"`{value}`"  # a --no-X switch: not given
    if isinstance(value, bool) and isinstance(action, argparse.BooleanOptionalAction):
        return "on" if value else "off"
    return f"`{value}`"


def _help(action: argparse.Action, parser: argparse.ArgumentParser) -> str:
    text = action.help or ""
    if "%" in text:  # argparse's own expansion (%(default)s, %(prog)s, ...)
        params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
        params["prog"] = parser.prog
        text = text % params
    extra = " Repeatable." if isinstance(action, argparse._AppendAction) else ""  # noqa: SLF001
    if "repeatable" in text.lower():
        extra = ""
    return _escape(text + extra) if (text or extra) else ""


def _rows(
    parser: argparse.ArgumentParser, keep: Optional[Iterable[str]] = None
) -> List[tuple[str, List[str]]]:
    """(group title, table rows) per argument group, in the parser's order."""
    wanted = None if keep is None else set(keep)
    out = []
    for group in parser._action_groups:  # noqa: SLF001
        rows = []
        for action in group._group_actions:  # noqa: SLF001
            if isinstance(action, argparse._HelpAction):  # noqa: SLF001
                continue
            names = action.option_strings or [action.dest]
            if wanted is not None and not wanted.intersection(names):
                continue
            flag = ", ".join(f"`{n}`" for n in names)
            if action.required:
                flag += " (required)"
            rows.append(
                f"| {flag} | {_value(action)} | {_default(action)} | {_help(action, parser)} |"
            )
        if rows:
            title = group.title if group.title not in ("options", "optional arguments") else ""
            out.append((title or "general", rows))
    return out


def _tables(sections: Sequence[tuple[str, List[str]]], level: str = "###") -> List[str]:
    lines: List[str] = []
    for title, rows in sections:
        lines += [f"{level} {title[0].upper() + title[1:]}", ""]
        lines += ["| flag | value | default | what it does |", "|---|---|---|---|", *rows, ""]
    return lines


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}  # noqa: SLF001


def render() -> str:
    """The whole page, as the parsers define it now."""
    adapter = adapter_parser()
    adapter_sections = _rows(adapter)
    trainer = trainer_parser()
    trainer_only = sorted(f for f in _flags(trainer) - _flags(adapter) if f.startswith("--mecefo"))
    lines = [
        "# Flags",
        "",
        "<!-- Generated by scripts/render_flags.py from the parsers; do not edit by hand.",
        f"     Regenerate: {REGENERATE}.",
        "     tests/unit/docs/test_flags_page.py fails when this page and the parsers disagree.",
        "-->",
        "",
        "Every MeCeFO flag, read from the parsers the code builds (group, value, default and",
        "help text as `--help` prints them). Regenerate this page with `make flags-doc`.",
        "",
        "## MeCeFO flags (Megatron-LM and the example trainer)",
        "",
        "What `megatron_mecefo.megatron_lm.extra_args_provider()` adds to Megatron-LM's parser;",
        "the example trainer (`examples/pretrain_gpt/pretrain_gpt.py`) takes the same flags.",
        "How they work together: [Training through failures](training-through-failures.md),",
        "[Surviving real rank deaths](real-failures.md), [Snapshots](snapshots.md) and",
        "[Attention checksums](attention-checksums.md).",
        "",
        *_tables(adapter_sections),
        "## Example trainer only",
        "",
        "MeCeFO flags of the example trainer's parser that Megatron-LM does not get. Its other",
        "flags follow Megatron-LM's names: see [The example trainer](example-trainer.md#flags).",
        "",
        *_tables(_rows(trainer, keep=trainer_only)),
        "## Recovery supervisor",
        "",
        "`python -m megatron_mecefo.recovery.supervisor [flags] -- script.py [args]`; see",
        "[Surviving real rank deaths](real-failures.md) and",
        "[Running on a cluster](cluster.md).",
        "",
        *_tables(_rows(supervisor_parser())),
    ]
    while lines and lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Write docs/flags.md, or with ``--check`` report whether it is current."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text(encoding="utf-8") != text:
            print(f"{PAGE.relative_to(REPO)} is out of date; regenerate: {REGENERATE}")
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
