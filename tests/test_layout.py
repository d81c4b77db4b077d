"""CPU tier: docs/design.md's layer table names every file of the package, file for file, and
no file that is not there; the package has no import cycle between its modules."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "cupyln"


def _table_files() -> set:
    """The package files the layer table names: a path, or a folder with its files listed in
    parentheses (names or globs)."""
    text = (ROOT / "docs" / "design.md").read_text()
    table = text[text.index("| layer | files |") : text.index("### The path of one call")]
    named = set()
    for row in table.splitlines()[2:]:
        if not row.startswith("|"):
            continue
        cell = row.split("|")[2]
        for folder, inside, path in re.findall(r"`([\w/]+/)` \(([^)]*)\)|`(cupyln/[\w/.]+)`", cell):
            if path:
                named.add(ROOT / path)
                continue
            for name in re.findall(r"`([^`]+)`", inside):
                named.update((ROOT / folder).glob(name))
    return {p.relative_to(ROOT).as_posix() for p in named if p.is_file()}


def _package_files() -> set:
    code = [p for p in PACKAGE.rglob("*") if p.suffix in (".py", ".cu", ".cuh")]
    return {p.relative_to(ROOT).as_posix() for p in code if "__pycache__" not in p.parts}


def test_the_layer_table_names_every_file():
    named, there = _table_files(), _package_files()
    assert not there - named, f"files the layer table does not name: {sorted(there - named)}"
    assert not named - there, f"the layer table names missing files: {sorted(named - there)}"


def _imports(path: Path) -> set:
    """The package modules ``path`` imports, at module level or inside functions."""
    module = path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    package = package.removesuffix(".__init__")
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            target = f"{base}.{node.module}" if node.module else base
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cupyln"):
            out.add(node.module)
    return out


def test_no_import_cycle():
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
        modules[name.removesuffix(".__init__")] = path
    graph = {m: {t for t in _imports(p) if t in modules and t != m} for m, p in modules.items()}
    # a package's __init__ re-exporting its own modules is not a cycle of layers
    for m in graph:
        graph[m] = {t for t in graph[m] if not (t.startswith(m + ".") and m in modules)}
    seen, stack = {}, []

    def visit(m):
        seen[m] = "open"
        stack.append(m)
        for t in graph[m]:
            if seen.get(t) == "open":
                cycle = stack[stack.index(t) :] + [t]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if t not in seen:
                visit(t)
        seen[m] = "done"
        stack.pop()

    for m in sorted(graph):
        if m not in seen:
            visit(m)
