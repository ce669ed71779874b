"""The tree is the architecture (docs/architecture.md): no import circles, layers import downwards only, and
across top-level packages only public names are imported.

Imports are read from the source with ``ast`` (nothing is imported), so a rule broken in a module no test
happens to import is still caught.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "loader": "omnifeed.loader",
    "cache": "omnifeed.cache",
    "bucketing": "omnifeed.bucketing",
    "trainer_adapter": "omnifeed.trainer_adapter",
    "tools": "omnifeed.tools",
}
# The stages inside omnifeed.loader, bottom to top; a stage imports its own rank or lower, never higher.
LOADER_RANKS = {"": 0, "index": 1, "decode": 2, "plan": 3, "feed": 4, "service": 5, "dataloader": 5}


@dataclass(frozen=True)
class Import:
    """One import statement: which module, what it names, and whether it runs when the module is imported."""

    module: str  # the importing module's dotted name
    target: str  # the dotted name imported from (a module or a package)
    names: tuple[str, ...]
    top_level: bool  # at import time (not inside a function, not under TYPE_CHECKING)
    line: int


def module_name(path: Path) -> str:
    folder = path.relative_to(ROOT).parts[0]
    rest = path.relative_to(ROOT / folder).with_suffix("").parts
    parts = [PACKAGES[folder], *rest]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> Iterator[Path]:
    for folder in PACKAGES:
        yield from sorted((ROOT / folder).rglob("*.py"))


def imports_of(path: Path) -> Iterator[Import]:
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))

    def visit(node: ast.AST, top: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                yield from visit(child, False)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield from visit(child, False)
            elif isinstance(child, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - (child.level - 1)] if child.level else []
                target = ".".join([*base, *([child.module] if child.module else [])])
                yield Import(name, target, tuple(a.name for a in child.names), top, child.lineno)
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    yield Import(name, alias.name, (), top, child.lineno)
            else:
                yield from visit(child, top)

    yield from visit(tree, True)


MODULES = {module_name(p): p for p in sources()}
IMPORTS = [i for p in sources() for i in imports_of(p) if i.target.startswith("omnifeed.")]


def resolved(imp: Import) -> list[str]:
    """The omnifeed modules an import loads by name: ``from pkg import mod`` is the module, else the package."""
    found = [f"{imp.target}.{n}" for n in imp.names if f"{imp.target}.{n}" in MODULES]
    return found or [imp.target]


def test_no_module_is_part_of_an_import_circle() -> None:
    """Counting every import, in functions and under TYPE_CHECKING too: a circle put off until run time, or
    kept for the type checker, is still a stage that holds its owner."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for imp in IMPORTS:
        graph[imp.module].update(t for t in resolved(imp) if t in MODULES and t != imp.module)
    cycles = [c for c in _strongly_connected(graph) if len(c) > 1]
    assert not cycles, "import circles: " + "; ".join(" <-> ".join(sorted(c)) for c in cycles)


@pytest.mark.parametrize("folder", ["trainer_adapter", "tools", "cache", "bucketing", "loader"])
def test_across_top_level_packages_only_public_names_are_imported(folder: str) -> None:
    own = PACKAGES[folder]
    private = [
        f"{imp.module}:{imp.line} imports {imp.target} {', '.join(imp.names)}"
        for imp in IMPORTS
        if imp.module.startswith(own)
        and not imp.target.startswith(own)
        and (any(part.startswith("_") for part in imp.target.split(".")) or any(n.startswith("_") for n in imp.names))
    ]
    assert not private, "private names imported across packages:\n" + "\n".join(private)


def test_the_engine_never_imports_the_trainer_adapter_or_the_command_line() -> None:
    engine = ("omnifeed.loader", "omnifeed.cache", "omnifeed.bucketing")
    wrong = [
        f"{imp.module}:{imp.line} imports {imp.target}"
        for imp in IMPORTS
        if imp.module.startswith(engine) and imp.target.startswith(("omnifeed.trainer_adapter", "omnifeed.tools"))
    ]
    assert not wrong, "\n".join(wrong)


def test_cache_tiers_and_bucketing_know_nothing_of_the_loader() -> None:
    wrong = [
        f"{imp.module}:{imp.line} imports {imp.target}"
        for imp in IMPORTS
        if imp.module.startswith(("omnifeed.cache", "omnifeed.bucketing")) and imp.target.startswith("omnifeed.loader")
    ]
    assert not wrong, "\n".join(wrong)


def test_loader_stages_import_downwards_only() -> None:
    def stage(module: str) -> str:
        parts = module.split(".")
        return parts[2] if len(parts) > 3 or (len(parts) == 3 and parts[2] in LOADER_RANKS) else ""

    wrong = []
    for imp in IMPORTS:
        if not (imp.module.startswith("omnifeed.loader.") and imp.target.startswith("omnifeed.loader")):
            continue
        here, there = stage(imp.module), stage(imp.target)
        if imp.module.endswith("loader") or here == there:
            continue
        if LOADER_RANKS[there] > LOADER_RANKS[here] or {here, there} == {"service", "dataloader"}:
            wrong.append(f"{imp.module}:{imp.line} ({here or 'root'}) imports {imp.target} ({there or 'root'})")
    assert not wrong, "a stage imports a higher (or a sibling) stage:\n" + "\n".join(wrong)


def test_loader_stages_import_one_another_through_their_init_only() -> None:
    """A stage's ``__init__`` is its contract: another stage imports what it exports, never a ``_module`` of it."""

    def stage(module: str) -> str | None:
        parts = module.split(".")
        return parts[2] if len(parts) > 2 and parts[2] in LOADER_RANKS else None

    wrong = [
        f"{imp.module}:{imp.line} imports {imp.target} {', '.join(imp.names)}"
        for imp in IMPORTS
        if imp.module.startswith("omnifeed.loader.")
        and imp.target.startswith("omnifeed.loader.")
        and stage(imp.module) is not None
        and stage(imp.target) is not None
        and stage(imp.module) != stage(imp.target)
        and (
            any(part.startswith("_") for part in imp.target.split(".")[3:])
            or any(name.startswith("_") for name in imp.names)
        )
    ]
    assert not wrong, "import the stage's public name (its __init__ exports it):\n" + "\n".join(wrong)


@pytest.mark.parametrize("package", [p for p, path in MODULES.items() if path.name == "__init__.py"])
def test_each_package_exports_a_sorted_all(package: str) -> None:
    tree = ast.parse(MODULES[package].read_text(encoding="utf-8"))
    names = next(
        (
            ast.literal_eval(node.value)
            for node in tree.body
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
        ),
        None,
    )
    if package == "omnifeed.tools":  # the command line: its surface is `omnifeed`, not Python names
        return
    assert names is not None, f"{package} has no __all__"
    assert names == sorted(names), f"{package}.__all__ is not sorted"


def test_no_loader_module_is_over_the_size_guide() -> None:
    over = {
        m: n
        for m, p in MODULES.items()
        if m.startswith("omnifeed.loader") and (n := len(p.read_text(encoding="utf-8").splitlines())) > 450
    }
    assert not over, f"split these (one concern per module, ~350 lines): {over}"


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[set[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    found.append(component)
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found
