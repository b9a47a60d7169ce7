"""The package's import graph (issue 45): no import circle inside ``megatron_mecefo/``, and no
import from a lower subsystem to a higher one.

Every module is read with :mod:`ast`, and every ``import`` / ``from ... import`` counts, at
module level and inside functions alike (a function-level import is still a dependency: it
only runs later). A failure prints the offending edges as ``module:line -> module``.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_mecefo"

LAYERS: List[Tuple[str, ...]] = [
    ("errors", "_optional"),
    ("cli",),
    ("data", "runtime", "gpt", "abft"),
    ("techniques",),
    ("takeover",),
    ("planner",),
    ("failslow",),
    ("snapshot",),
    ("recovery",),
    ("megatron_lm",),
    ("<package>",),
]
"""The subsystems from the bottom up; a module may import its own subsystem and any lower
layer. Taken from the subpackages' ``__init__`` docstrings (each says what it uses and what
uses it) and ``docs/design.md``:

* ``errors`` (the one-line user error) and ``_optional`` (optional imports) use nothing;
  ``cli`` (the command-line helpers both trainers share) uses ``errors``;
* ``data``, ``runtime``, ``gpt`` and ``abft`` use megatron-core only;
* ``techniques`` rewrites ``gpt``'s stock specs;
* ``takeover`` sets the ``techniques``' modes and reads ``data``'s sampler order (its flag
  group also carries ``abft``'s flags);
* ``planner`` plans with ``takeover``'s real policies (``--mecefo-policy auto`` plugs into
  ``takeover`` through :func:`megatron_mecefo.takeover.config.register_auto_policy`);
* ``failslow`` (a straggler's micro-batches handed to its neighbours) wraps ``takeover``'s
  policies in all-exact plans;
* ``snapshot`` copies the training state; ``recovery`` uses ``snapshot`` and ``takeover``;
* ``megatron_lm`` is the glue into Megatron-LM and uses them all;
* ``<package>`` is ``megatron_mecefo/__init__.py``, which names them all (and plugs the
  planner into the takeover).
"""


def _layer_of() -> Dict[str, int]:
    return {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _modules(package: Path = PACKAGE) -> Dict[str, Path]:
    """Dotted module name -> file, for every module of ``package``."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _resolve(name: str, modules: Dict[str, Path]) -> Optional[str]:
    """The package module ``name`` loads (a name inside a module resolves to that module)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(package: Path = PACKAGE) -> Dict[str, Set[Tuple[str, int]]]:
    """Module -> {(imported package module, line)}: module-level and function-level imports."""
    modules = _modules(package)
    graph: Dict[str, Set[Tuple[str, int]]] = {m: set() for m in modules}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the module's package, up level - 1
                    base = module.split(".") if is_package else module.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                # ``from pkg import sub`` imports the submodule ``pkg.sub`` when there is one.
                targets = [
                    f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                    for alias in node.names
                ]
            for target in targets:
                if target.split(".")[0] != package.name:
                    continue
                resolved = _resolve(target, modules)
                if resolved is not None and resolved != module:
                    graph[module].add((resolved, node.lineno))
    return graph


def subsystem(module: str) -> str:
    """``megatron_mecefo.takeover.plan`` -> ``takeover``; the package itself -> ``<package>``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "<package>"


def find_circles(graph: Dict[str, Set[Tuple[str, int]]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    edges = {m: sorted({t for t, _ in targets}) for m, targets in graph.items()}
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    circles: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in edges[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return circles


def _edges_within(graph: Dict[str, Set[Tuple[str, int]]], members: List[str]) -> List[str]:
    inside = set(members)
    return sorted(f"{m}:{line} -> {t}" for m in members for t, line in graph[m] if t in inside)


def test_layers_name_every_subsystem() -> None:
    """Each subpackage and top-level module is in exactly one layer."""
    names = [name for layer in LAYERS for name in layer]
    assert len(names) == len(set(names)), names
    present = {subsystem(m) for m in _modules()}
    assert present == set(
        names
    ), f"not in LAYERS: {present - set(names)}; in LAYERS but gone: {set(names) - present}"


def test_the_scan_sees_function_level_and_relative_imports(tmp_path: Path) -> None:
    """The scan itself, on a small package: a function-level import, a relative one and
    ``from pkg import submodule`` are edges, and their circle is found."""
    pkg = tmp_path / "pkg"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("def f():\n    from pkg.high import b\n")
    (pkg / "low" / "c.py").write_text("from . import a\nimport os\n")
    (pkg / "high.py").write_text("from pkg.low import c\nb = 1\n")
    graph = import_graph(pkg)
    assert graph["pkg.low.a"] == {("pkg.high", 2)}
    assert graph["pkg.low.c"] == {("pkg.low.a", 1)}
    assert graph["pkg.high"] == {("pkg.low.c", 1)}
    assert find_circles(graph) == [["pkg.high", "pkg.low.a", "pkg.low.c"]]
    assert _edges_within(graph, ["pkg.high", "pkg.low.a"]) == ["pkg.low.a:2 -> pkg.high"]


def test_no_import_circle() -> None:
    graph = import_graph()
    circles = find_circles(graph)
    report = "\n\n".join("\n".join(_edges_within(graph, c)) for c in circles)
    assert not circles, f"{len(circles)} import circle(s) in megatron_mecefo/:\n{report}"


def test_no_import_from_a_lower_subsystem_to_a_higher_one() -> None:
    layer = _layer_of()
    graph = import_graph()
    upward = sorted(
        f"{m}:{line} -> {t}  ({subsystem(m)} below {subsystem(t)})"
        for m, targets in graph.items()
        for t, line in targets
        if layer[subsystem(m)] < layer[subsystem(t)]
    )
    assert not upward, "imports that run back up:\n" + "\n".join(upward)
