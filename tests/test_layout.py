"""The package's floor plan holds: a module imports only its own floor or floors below it
(no stage imports a later stage; the decoding library sits below the stages that use it),
there are no import cycles, the top level stays small and no module grows past 450 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "eagletrain"

# lowest first: a module may import from its floor and the floors before it
FLOORS = [
    {"errors", "stages", "embedded", "config"},
    {"runtime"},
    {"target", "drafter"},
    {"decode"},
    {"data"},
    {"extract"},
    {"train"},
    {"export"},
    {"evaluate"},
    {"pipeline", "report", "cli", "__main__", "__init__"},
]


def floor_of(module: str) -> int:
    head = module.split(".")[0]
    return next(i for i, names in enumerate(FLOORS) if head in names)


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        found[".".join(p for p in parts if p != "__init__") or "__init__"] = path
    return found


def imports(path: Path) -> set[str]:
    """eagletrain modules `path` imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        module = getattr(node, "module", None) or ""
        if isinstance(node, ast.ImportFrom) and module.startswith("eagletrain"):
            base = module.removeprefix("eagletrain").lstrip(".")
            names = [f"{base}.{a.name}" if base else a.name for a in node.names]
            out |= {n for n in names if n in modules()} or {base}
        elif isinstance(node, ast.Import):
            out |= {a.name.removeprefix("eagletrain.") for a in node.names
                    if a.name.startswith("eagletrain.")}  # fmt: skip
    return {m for m in out if m}


def test_no_module_imports_a_later_floor():
    wrong = [
        f"{name} -> {target}"
        for name, path in modules().items()
        for target in imports(path)
        if floor_of(target) > floor_of(name)
    ]
    assert not wrong, wrong


def test_no_import_cycles():
    graph = {name: {t for t in imports(path) if t in modules()} for name, path in modules().items()}
    seen: dict[str, int] = {}  # 1 on the path, 2 done

    def visit(node: str, path: list[str]) -> None:
        seen[node] = 1
        for nxt in graph[node]:
            assert seen.get(nxt) != 1, f"import cycle: {' -> '.join([*path, node, nxt])}"
            if nxt not in seen:
                visit(nxt, [*path, node])
        seen[node] = 2

    for name in graph:
        if name not in seen:
            visit(name, [])


def test_the_top_level_is_small_and_modules_stay_short():
    top = [p for p in PACKAGE.glob("*.py")]
    assert len(top) <= 15, sorted(p.name for p in top)
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 450}  # fmt: skip
    assert not long, long
