"""The package's layers (docs/architecture.md): imports between srupp's modules point down.

Read from the source with ``ast``, so a module that imports upward, even inside
a function, fails here by name.
"""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "srupp"

# bottom (0) to top: a module may import from a lower layer, or from its own package
LAYERS = [
    {"errors", "_files", "_ranges", "_extras", "allocator"},
    {"_format"},
    {"runs"},
    {"ops"},
    {"nn"},
    {"models", "data", "compat", "demo"},
    {"inference"},
    {"hf", "onnx"},
    {"train"},
    {"cli"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _imported(path: Path) -> set:
    """The top-level srupp modules/packages that ``path`` imports."""
    rel = path.relative_to(SRC)
    here = ["srupp", *rel.parts[:-1]]                    # the importing file's package
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - (node.level - 1)]
                targets = ([base + node.module.split(".")] if node.module
                           else [base + [a.name] for a in node.names])
            elif node.module and node.module.split(".")[0] == "srupp":
                targets = [node.module.split(".")]
            else:
                continue
        elif isinstance(node, ast.Import):
            targets = [a.name.split(".") for a in node.names if a.name.split(".")[0] == "srupp"]
        else:
            continue
        found |= {t[1] for t in targets if len(t) > 1}
    return found


def test_every_module_has_a_layer():
    tops = {p.stem if p.is_file() else p.name for p in SRC.iterdir()
            if (p.suffix == ".py" or (p / "__init__.py").exists())} - {"__init__", "__main__"}
    assert tops - RANK.keys() == set(), "add the new module to LAYERS and docs/architecture.md"


def test_imports_point_down():
    upward = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        top = rel.parts[0] if len(rel.parts) > 1 else path.stem
        if top in ("__init__", "__main__"):
            continue
        for other in _imported(path) - {top}:
            if RANK[other] >= RANK[top]:
                upward.append(f"{rel} imports srupp.{other}")
    assert not upward, "imports that point up or sideways:\n" + "\n".join(upward)
