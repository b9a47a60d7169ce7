"""The twins that tests/conftest.py marks slow by node id exist, and each names a twin that
make test still runs (a renamed test would otherwise drop silently back into make test, or its
twin out of it)."""

from __future__ import annotations

import ast
import re

from conftest import REPO, SLOW_TWINS


def _test_functions(path: str) -> set:
    tree = ast.parse((REPO / path).read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}


def test_every_slow_twin_and_its_kept_twin_exist() -> None:
    """Each node id is a test function of its file, and the twin it names is one too."""
    assert SLOW_TWINS
    for nodeid, kept in SLOW_TWINS.items():
        path, name = nodeid.split("::")
        functions = _test_functions(path)
        assert name in functions, nodeid
        twin = re.match(r"(test_\w+)", kept)
        assert twin and twin.group(1) in functions and twin.group(1) != name, (nodeid, kept)
