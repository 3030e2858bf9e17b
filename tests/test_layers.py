"""The package's layers (docs/architecture.md): imports between srupp's modules point
down, and no two modules import each other, inside a package too.

Read from the source with ``ast``. Every import statement counts, wherever it
stands: at the top, inside a function (a lazy import still makes one module need
the other, only later) or under ``if TYPE_CHECKING`` (the annotations name the
other module; a check of them imports it). A module that imports upward, or a
cycle of imports, fails here by name.

An import names the module it reads: ``from .config import X`` depends on
``srupp.train.config``, ``from . import cpu_kernels`` on ``srupp.ops.cpu_kernels``,
``from .. import name`` on the package whose ``__init__`` defines ``name``. The
packages that Python runs on the way (``srupp.train`` before ``srupp.train.config``)
are not counted: a package's ``__init__`` that gathers its modules' names would
otherwise be in a cycle with each of them.
"""

import ast
from pathlib import Path
from typing import Dict, List, Set

SRC = Path(__file__).resolve().parents[1] / "src" / "srupp"

# bottom (0) to top: a module may import from a lower layer, or from its own package
LAYERS = [
    {"errors", "_files", "_ranges", "_extras", "allocator"},
    {"_format"},
    {"runs"},
    {"ops"},
    {"nn"},
    {"models", "data", "convert", "demo"},
    {"engine"},
    {"inference"},
    {"hf", "onnx", "serve"},
    {"train"},
    {"cli"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _name(path: Path) -> str:
    """``srupp.train.config`` for src/srupp/train/config.py, ``srupp.train`` for its
    ``__init__.py``."""
    parts = ["srupp", *path.relative_to(SRC).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in SRC.rglob("*.py")}


def _imports(path: Path) -> Set[str]:
    """The srupp modules (and packages, for names their ``__init__`` defines) that
    ``path`` imports, anywhere in the file."""
    name = _name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = ".".join(base[:len(base) - (node.level - 1)])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            if source.split(".")[0] != "srupp":
                continue
            for alias in node.names:  # a submodule, else a name the module defines
                sub = f"{source}.{alias.name}"
                found.add(sub if sub in MODULES else source)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "srupp"}
    return found - {name}


GRAPH: Dict[str, Set[str]] = {name: _imports(path) for name, path in MODULES.items()}


def _top(module: str):
    """The top-level module or package of srupp that ``module`` is part of (None: srupp
    itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """For each group of modules that import one another (Tarjan's strongly connected
    components): one shortest cycle through its first module, in import order and
    that module repeated at the end, then the group's other modules."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    groups: List[Set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for group in groups:
        # the shortest way back to the group's first module, breadth first inside the group
        start = min(group)
        paths = {start: [start]}
        queue = [start]
        while queue:
            v = queue.pop(0)
            for w in sorted(graph[v] & group):
                if w == start:
                    cycle = paths[v] + [start]
                    cycles.append(cycle + sorted(group - set(cycle)))
                    queue = []
                    break
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    queue.append(w)
    return sorted(cycles)


def test_every_module_has_a_layer():
    tops = {p.stem if p.is_file() else p.name for p in SRC.iterdir()
            if (p.suffix == ".py" or (p / "__init__.py").exists())} - {"__init__", "__main__"}
    assert tops - RANK.keys() == set(), "add the new module to LAYERS and docs/architecture.md"


def test_imports_point_down():
    upward = []
    for module, imported in sorted(GRAPH.items()):
        top = _top(module)
        if top in (None, "__main__"):
            continue
        for other in sorted({_top(m) for m in imported} - {top, None}):
            if RANK[other] >= RANK[top]:
                upward.append(f"{module} imports srupp.{other}")
    assert not upward, "imports that point up or sideways:\n" + "\n".join(upward)


def test_no_import_cycles():
    cycles = _cycles(GRAPH)
    lines = []
    for c in cycles:
        loop = c[:c.index(c[0], 1) + 1]
        rest = c[len(loop):]
        lines.append(" -> ".join(loop) + (f" (also in the group: {', '.join(rest)})"
                                          if rest else ""))
    assert not cycles, "modules that import each other:\n" + "\n".join(lines)


def test_the_cycle_check_finds_cycles():
    # a made-up graph: a cycle of three, a pair, and modules that only point down
    graph = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": set(), "e": {"f"}, "f": {"e", "d"}}
    assert _cycles(graph) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    graph["d"] = {"c"}  # a -> b -> d -> c -> a is in the same group, not the shortest way
    assert _cycles(graph) == [["a", "b", "c", "a", "d"], ["e", "f", "e"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
