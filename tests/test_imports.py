"""The architecture the file tree shows, checked on the imports themselves: every
import statement of meshd/, shards/ and protocol/ (read with ast, so the ones inside
functions and under ``if TYPE_CHECKING:`` count too) forms no circle; protocol/, the wire
format, is the lowest layer and imports nothing of meshd or shards (nor torch); shards/
imports nothing of meshd; only the entry points import the node; the control plane imports
nothing of the serving side or the tools, and the serving side nothing of the tools."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("meshd", "shards", "protocol")
ENTRY_POINTS = {"meshd.tools.cli"}


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


MODULES = modules()


def _resolve(name: str) -> str | None:
    """The module an imported name lives in (``meshd.errors.ModelError`` -> ``meshd.errors``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in PACKAGES and (target := _resolve(name)) and target != module:
                found.add(target)
    return found


GRAPH = {m: imports_of(m) for m in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), or of one
    module that imports itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_check_sees_imports_and_circles():
    # Lazy and TYPE_CHECKING imports are read like any other.
    assert "meshd.node" in GRAPH["meshd.tools.cli"]  # imported inside a function
    assert "meshd.control.peers" in GRAPH["meshd.control.mesh"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
    found = cycles(GRAPH)
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def group(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "meshd" and len(parts) > 2:
        return ".".join(parts[:2])  # meshd.control, meshd.serving, meshd.tools
    return parts[0] if parts[0] != "meshd" else "meshd"


@pytest.mark.parametrize("importer, forbidden", [
    ("shards", {"meshd", "meshd.control", "meshd.serving", "meshd.tools"}),
    ("protocol", {"meshd", "meshd.control", "meshd.serving", "meshd.tools", "shards"}),
    ("meshd.control", {"meshd.serving", "meshd.tools"}),
    ("meshd.serving", {"meshd.tools"}),
])
def test_layers(importer, forbidden):
    wrong = sorted(f"{a} -> {b}" for a, targets in GRAPH.items() if group(a) == importer
                   for b in targets if group(b) in forbidden)
    assert not wrong, wrong


def test_only_entry_points_import_the_node():
    importers = {m for m, targets in GRAPH.items() if "meshd.node" in targets}
    assert importers <= ENTRY_POINTS, sorted(importers - ENTRY_POINTS)


def test_the_wire_format_imports_without_torch_or_the_rest_of_meshd():
    """protocol/ is what a tool that only speaks the wire needs: importing its codec loads
    neither torch nor any module of meshd or shards."""
    probe = ("import sys, protocol.codec, protocol.messages\n"
             "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'meshd', 'shards'))\n"
             "print(','.join(bad))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"importing protocol/ loaded {done.stdout.strip()}"
