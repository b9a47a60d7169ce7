"""docs/recovery-records.md lists every field the code writes to the recovery records (and no
field it does not), and its plot command reads a records file the code wrote."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Set

import pytest
from conftest import REPO

from megatron_mecefo.recovery import records
from megatron_mecefo.recovery.membership import Generation

PAGE = (REPO / "docs" / "recovery-records.md").read_text()
RECOVERY = REPO / "megatron_mecefo" / "recovery"
SCRIPT = REPO / "benchmarks" / "plot_recovery.py"


def _function(path: Path, name: str) -> ast.AST:
    tree = ast.parse(path.read_text())
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def _written_keys(node: ast.AST) -> Set[str]:
    """String keys a function writes: dict-literal keys, ``x["k"] = ...`` and
    ``x.setdefault("k", ...)``."""
    keys: Set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Dict):
            keys |= {k.value for k in n.keys if isinstance(k, ast.Constant)}
        elif isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store):
            if isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str):
                keys.add(n.slice.value)
        elif isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "setdefault":
            if n.args and isinstance(n.args[0], ast.Constant):
                keys.add(n.args[0].value)
    return keys


def _takeover_info_keys() -> Set[str]:
    """Keys of every ``<x>.takeover_info = {...}`` (merged into a failure's record)."""
    keys: Set[str] = set()
    for path in RECOVERY.glob("*.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict):
                if any(getattr(t, "attr", "") == "takeover_info" for t in n.targets):
                    keys |= {k.value for k in n.value.keys if isinstance(k, ast.Constant)}
    return keys


def _records_from_the_code() -> Dict[str, Dict[str, Any]]:
    """A failure and a rejoin record built by ``records.build_record`` with every timestamp."""
    steps = [
        "detect", "left", "exported", "dropped", "released", "membership", "arrived", "world",
        "constructed", "healed", "built", "done",
    ]  # fmt: skip
    times = {
        slot: {**{k: 100.0 + i + slot / 10 for i, k in enumerate(steps)}, "destroy_pg": 0.1,
               "gc": 0.05, "carry_kept_bytes": 0, "grad_buffers_reused": 1, "heal_role": role,
               "heal_bytes": 1 << 20,
               "heal_transfer_s": 0.5, "heal_written_bytes": 1 << 20,
               "heal_steps_s": {"export": 0.01, "structure": 0.02, "transfer": 0.5,
                                "import": 0.01, "wait": 0.03, "release": 0.001}}
        for slot, role in ((0, "sender"), (1, "joiner"), (2, "bystander"))
    }  # fmt: skip
    failure = Generation(number=1, replicas=(0, 1), members={0: 0, 1: 1, 2: 0}, joined=(1,),
                         lost=(3,), reason="death")  # fmt: skip
    rejoin = Generation(number=2, replicas=(0, 1, 2), members={0: 0, 1: 1, 2: 0}, joined=(1,),
                        at_iteration=9, reason="rejoin")  # fmt: skip
    deaths = {3: {"exit_code": -9, "t": 100.5}}
    return {
        "failure": records.build_record(failure, times, {3: 99.0}, deaths, 5, True, 8),
        "rejoin": records.build_record(rejoin, times, {}, {}, 9, False, 8),
    }


def _fields() -> Dict[str, Set[str]]:
    """Every field per record type, nested keys included."""
    built = _records_from_the_code()
    recovery = _written_keys(_function(RECOVERY / "records.py", "build_record"))
    recovery |= _written_keys(_function(RECOVERY / "records.py", "phases"))
    recovery |= _written_keys(_function(RECOVERY / "reporting.py", "emit_record"))
    recovery |= _takeover_info_keys()
    for rec in built.values():
        recovery |= set(rec)
        for key in ("regroup_steps_s", "release_split_s", "heal_steps_s"):
            recovery |= set(rec.get(key, {}))
    armed = _written_keys(_function(RECOVERY / "reporting.py", "armed_cost"))
    cost = _written_keys(_function(RECOVERY / "cost_account.py", "record"))
    return {"recovery": recovery, "armed_cost": armed, "supervisor_cost": cost}


def _section(title: str) -> str:
    """The page's text from the heading naming ``title`` to the next ``## `` heading."""
    start = PAGE.index(f"## `{title}`")
    end = PAGE.find("\n## ", start + 1)
    return PAGE[start : end if end > 0 else len(PAGE)]


@pytest.mark.parametrize("kind", ["recovery", "armed_cost", "supervisor_cost"])
def test_page_lists_every_field_the_code_writes(kind: str) -> None:
    """Each field (nested ones too) is named in backticks in its record type's section."""
    fields = _fields()[kind]
    assert len(fields) >= {"recovery": 40, "armed_cost": 14, "supervisor_cost": 6}[kind], fields
    section = _section(kind)
    missing = sorted(f for f in fields if f"`{f}`" not in section)
    assert not missing, f"docs/recovery-records.md, section {kind}: not described: {missing}"


def test_every_field_row_is_a_field_the_code_writes() -> None:
    """No row describes a field that no longer exists."""
    fields = set().union(*_fields().values())
    rows = re.findall(r"^\| `([^`]+)` \|", PAGE, flags=re.M)
    assert len(rows) >= 50, rows
    stale = sorted(set(rows) - fields)
    assert not stale, f"docs/recovery-records.md describes fields the code does not write: {stale}"


def test_the_plot_command_reads_the_records(tmp_path: Path) -> None:
    """The page's command (without --out) prints one line per record from a file the code
    wrote, with kill -> redone's p50; the page names that command."""
    built = _records_from_the_code()
    path = tmp_path / "recovery.jsonl"
    for rec in built.values():
        records.append_jsonl(str(path), rec)
    records.append_jsonl(str(path), {"type": "supervisor_cost", "node": 0, "cpu_s": 1.5,
                                     "wall_s": 30.0})  # fmt: skip
    assert "benchmarks/plot_recovery.py --records results/demo/recovery.jsonl" in PAGE
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--records", str(path)],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    lines = out.splitlines()
    failure, rejoin = built["failure"], built["rejoin"]
    assert any(line.startswith("failure") and " 5 " in line for line in lines), out
    assert any(line.startswith("rejoin") and " 9 " in line for line in lines), out
    assert f"p50 {failure['total_s']:.2f} s" in out, (failure["total_s"], out)
    assert f"heal {rejoin['heal_s']:.2f}" in out, out
    assert "supervisor node 0: 1.50 s CPU" in out, out


def test_the_plot_is_written(tmp_path: Path) -> None:
    """With matplotlib (the plot extra), --out writes a PNG."""
    pytest.importorskip("matplotlib")
    path = tmp_path / "recovery.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _records_from_the_code().values()))
    png = tmp_path / "plots" / "recovery.png"
    subprocess.run(
        [sys.executable, str(SCRIPT), "--records", str(path), "--out", str(png)],
        check=True, timeout=120,
    )  # fmt: skip
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_missing_records_file_is_one_line(tmp_path: Path) -> None:
    """A wrong path ends with one line naming the flag and the fix."""
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--records", str(tmp_path / "nope.jsonl")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 2
    assert "--records" in res.stderr and "--records FILE" in res.stderr, res.stderr
