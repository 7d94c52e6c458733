"""The package's imports go one way: lower layers never import higher ones, and no two
packages import each other. Read from the source (ast), lazy imports inside functions
included: a lazy import is still a dependency."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "megatrain"

# Lower rank = lower layer. A package may import its own modules and any lower rank.
RANKS = {
    "errors": 0, "config": 0,
    "plan": 1, "memory": 1, "kernels": 1, "models": 1,
    "optim": 2,
    "runtime": 3,
    "compiler": 4,
    "distributed": 5,
    "train": 6,
    "cli": 7, "__init__": 8, "__main__": 8,
}


def _part(module_path: Path) -> str:
    rel = module_path.relative_to(ROOT)
    return rel.parts[0].removesuffix(".py")


def _imported_parts(path: Path) -> set[str]:
    """The top-level megatrain parts a source file imports (absolute or relative)."""
    tree = ast.parse(path.read_text())
    here = path.relative_to(ROOT).parts[:-1]  # the package the file sits in
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(here[:len(here) - (node.level - 1)]) if node.level > 1 else list(here)
                mod = ".".join(base + ([node.module] if node.module else []))
                names = [mod] if node.module else [".".join(base + [a.name]) for a in node.names]
                names = ["megatrain." + n if n else "megatrain" for n in names]
            else:
                names = [node.module or ""]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "megatrain" and len(parts) > 1:
                out.add(parts[1])
    return out


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        part = _part(path)
        edges.setdefault(part, set()).update(p for p in _imported_parts(path) if p != part)
    return edges


def test_every_part_has_a_rank():
    assert set(_graph()) <= set(RANKS), set(_graph()) - set(RANKS)


def test_the_plan_imports_no_compiler_runtime_or_optimizer():
    assert _graph()["plan"] <= {"errors", "config"}, _graph()["plan"]


def test_the_memory_floor_imports_nothing_above_it():
    assert _graph()["memory"] <= {"errors", "config"}, _graph()["memory"]


def test_no_part_imports_a_higher_layer():
    upward = sorted((a, b) for a, bs in _graph().items() for b in bs
                    if RANKS[b] > RANKS[a])
    assert not upward, upward


def test_no_two_parts_import_each_other():
    g = _graph()
    cycles = sorted((a, b) for a, b in itertools.combinations(sorted(g), 2) if b in g[a] and a in g[b])
    assert not cycles, cycles
