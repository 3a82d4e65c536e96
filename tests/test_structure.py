"""The package's floors (docs/design.md, "Code layout"): every relative import, top-level or inside a function,
goes to the importing module's own floor or one below it, so no floor imports a higher one and no two floors
import each other. Computed from the code's import statements (ast), not from a picture."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "atom_convert"
# bottom to top; a floor may import its own modules and any lower floor
FLOORS = [("errors", "_version", "inflight"), ("files",), ("layout",), ("store",), ("serve",), ("runtime",),
          ("check",), ("hub",), ("engine",), ("cli", "synth"), ("load", "manifest", "__init__")]
RANK = {name: i for i, names in enumerate(FLOORS) for name in names}


def _arrows() -> list[tuple[str, str, str]]:
    out = []
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        here = parts[0] if parts else "__init__"
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = parts if is_pkg else parts[:-1]
                base = base[:len(base) - (node.level - 1)]
                target = [*base, *(node.module.split(".") if node.module else [])]
                names = [target[0]] if target else [a.name for a in node.names]
                for t in names:
                    out.append((here, t, f"{'.'.join(parts) or '__init__'} (line {node.lineno})"))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                for m in mods:
                    if m.startswith("atom_convert."):
                        out.append((here, m.split(".")[1], f"{'.'.join(parts)} (line {node.lineno}, absolute)"))
    return out


def test_every_module_is_on_a_floor():
    tops = {p.relative_to(PKG).parts[0].removesuffix(".py") for p in PKG.glob("*") if p.name != "__pycache__"
            and (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert tops - set(RANK) == set(), "a module or package outside the floors: add it to docs/design.md and FLOORS"


def test_no_import_runs_up_a_floor():
    up = [f"{where}: {a} -> {b}" for a, b, where in _arrows() if b in RANK and RANK[b] > RANK[a]]
    assert not up, "\n".join(up)


def test_no_two_floors_import_each_other():
    pairs = {(a, b) for a, b, _ in _arrows() if a != b and b in RANK}
    both = sorted((a, b) for a, b in pairs if (b, a) in pairs and RANK[a] != RANK[b])
    assert not both, both
