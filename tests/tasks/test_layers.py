"""tasks/ has layers anyone can read: every import (those inside functions too) points down stagewise.LAYERS, no circle
anywhere, jobs never import each other, nothing inside imports the public facades, project imports sit at the top."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

from stagewise import LAYERS

TASKS_DIR = Path(__file__).resolve().parents[2] / "tasks"
PACKAGE = "stagewise"  # what tasks/ is installed as (pyproject.toml's package-dir)


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int
    at_top: bool
    """At module level (or under ``if TYPE_CHECKING``), not inside a function, class or other block."""


def module_name(root: Path, path: Path, package: str) -> str:
    parts = (package, *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def project_imports(root: Path, package: str) -> list[Import]:
    """Every import of a ``root`` module by a ``root`` module (``root`` is imported as ``package``), at any depth,
    resolved to the module it loads."""
    modules = _modules(root, package)
    found = []
    for path in sorted(root.rglob("*.py")):
        importer = module_name(root, path, package)
        tree = ast.parse(path.read_text(), str(path))
        top = {id(node) for node in tree.body}
        top |= {id(child) for node in tree.body if _is_type_checking(node) for child in node.body}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from pkg import mod` loads pkg.mod when that is a module; else the names come from pkg itself
                targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                           for alias in node.names]
            else:
                continue
            for target in dict.fromkeys(targets):
                if target == package or target.startswith(package + "."):
                    found.append(Import(importer, target, node.lineno, id(node) in top))
    return found


def layer_of(module: str, layers=LAYERS) -> tuple[int, str] | None:
    """(rank, the layer entry's prefix) of ``module``: the longest matching entry of ``layers``."""
    matches = [(len(prefix), rank, prefix) for rank, (_, prefixes) in enumerate(layers) for prefix in prefixes
               if module == prefix or module.startswith(prefix + ".")]
    return max(matches)[1:] if matches else None


def layer_problems(imports: list[Import], modules: set[str], layers=LAYERS) -> list[str]:
    """Each import that points up, into another job, into a facade, or sits inside a function; each unplaced module."""
    names = dict(layers)
    jobs, facades = set(names.get("jobs", ())), set(names.get("facades", ()))
    problems = [f"{module}: in no layer of stagewise.LAYERS" for module in sorted(modules)
                if module.count(".") > 0 and layer_of(module, layers) is None]
    for item in imports:
        where = f"{item.importer}:{item.line} imports {item.imported}"
        if item.imported.count(".") == 0 or item.importer == item.imported:
            continue
        if not item.at_top:
            problems.append(f"{where} inside a function or block: project modules are imported at the top")
        mine, theirs = layer_of(item.importer, layers), layer_of(item.imported, layers)
        if mine is None or theirs is None:
            continue
        if item.imported in facades:
            problems.append(f"{where}: the facade is for users; import what it re-exports from where it lives")
        elif item.importer in jobs and item.imported in jobs:
            problems.append(f"{where}: jobs never import each other; move what they share into a library")
        elif theirs[0] > mine[0] or (theirs[0] == mine[0] and theirs[1] != mine[1] and item.importer not in jobs):
            problems.append(f"{where}: '{layers[mine[0]][0]}' may import its own package and lower layers only "
                            f"(this is '{layers[theirs[0]][0]}')")
    return problems


def circles(imports: list[Import]) -> list[list[str]]:
    """Every import circle among modules (Tarjan's strongly connected components of more than one module)."""
    graph: dict[str, set[str]] = {}
    for item in imports:
        if item.importer != item.imported:
            graph.setdefault(item.importer, set()).add(item.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _modules(root: Path, package: str) -> set[str]:
    return {module_name(root, path, package) for path in root.rglob("*.py")}


def test_tasks_has_no_import_circle():
    """No circle anywhere in tasks/, counting the imports inside functions that used to hide one."""
    assert circles(project_imports(TASKS_DIR, PACKAGE)) == []


def test_every_import_points_down_the_declared_layers():
    """Each module is in a layer; imports go to its own package or lower; jobs and facades are never imported inside."""
    assert layer_problems(project_imports(TASKS_DIR, PACKAGE), _modules(TASKS_DIR, PACKAGE)) == []


def test_public_facade_only_re_exports():
    """stagewise.spec defines nothing: it imports and lists in __all__ exactly what users may use."""
    tree = ast.parse((TASKS_DIR / "spec.py").read_text())
    defined = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))]
    assert defined == []
    imported = {alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
                and node.module != "__future__" for alias in node.names}
    import stagewise.spec

    assert set(stagewise.spec.__all__) == imported


@pytest.fixture
def sample_tree(tmp_path: Path):
    """A package ``pkg`` with a leaf, a library, two jobs and a facade; each test adds one bad import."""
    root = tmp_path / "pkg"
    for name in ("core/__init__.py", "core/leaf.py", "lib/__init__.py", "lib/util.py", "job_a.py", "job_b.py",
                 "api.py", "__init__.py"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")
    (root / "lib/util.py").write_text("from pkg.core import leaf\n")
    (root / "job_a.py").write_text("from pkg.lib.util import thing\n")
    (root / "api.py").write_text("from pkg.lib.util import thing\n")
    layers = (("leaves", ("pkg.core",)), ("libraries", ("pkg.lib",)), ("facades", ("pkg.api",)),
              ("jobs", ("pkg.job_a", "pkg.job_b")))
    return root, layers


def test_the_checks_see_each_kind_of_bad_import(sample_tree):
    """Guard for the guards: a clean tree passes, then an upward, a job-to-job, a facade, an in-function import and a
    circle each are reported."""
    root, layers = sample_tree
    assert layer_problems(project_imports(root, "pkg"), _modules(root, "pkg"), layers) == []
    (root / "core/leaf.py").write_text("def f():\n    from pkg.lib import util\n")
    (root / "job_b.py").write_text("from pkg import job_a\nfrom pkg.api import thing\n")
    problems = "\n".join(layer_problems(project_imports(root, "pkg"), _modules(root, "pkg"), layers))
    assert "pkg.core.leaf:2 imports pkg.lib.util inside a function" in problems
    assert "'leaves' may import its own package and lower layers only" in problems
    assert "pkg.job_b:1 imports pkg.job_a: jobs never import each other" in problems
    assert "pkg.job_b:2 imports pkg.api: the facade is for users" in problems
    assert circles(project_imports(root, "pkg")) == [["pkg.core.leaf", "pkg.lib.util"]]


def test_a_module_outside_every_layer_is_named(sample_tree):
    """A new module must be placed in the table: one in no layer fails by name."""
    root, layers = sample_tree
    (root / "stray.py").write_text("")
    assert layer_problems(project_imports(root, "pkg"), _modules(root, "pkg"), layers) == ["pkg.stray: in no layer of stagewise.LAYERS"]
