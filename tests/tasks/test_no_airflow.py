"""tasks/ is plain Python: no file under it imports airflow or the Airflow glue (stagewise.airflow, installed beside
it), so every sub-job runs without Airflow."""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
_IMPORTERS = {"import_module", "__import__"}  # importlib.import_module("airflow..."), __import__("airflow")


def _is_airflow(module: str | None) -> bool:
    return module is not None and any(module == top or module.startswith(top + ".") for top in ("airflow", "stagewise.airflow"))


def airflow_imports(source: str, filename: str) -> list[str]:
    """``file:line: statement`` for each import of airflow in ``source``, at any depth (also inside functions)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, filename)):
        names: list[str | None] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in _IMPORTERS and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        if any(_is_airflow(name) for name in names):
            found.append((node.lineno, f"{filename}:{node.lineno}: {ast.get_source_segment(source, node)}"))
    return [text for _, text in sorted(found)]


def test_the_check_sees_every_way_of_importing_airflow():
    """Each import form is caught (top level, aliased, from-import, inside a function, dynamic), look-alikes are not."""
    source = "\n".join([
        "import os, airflow",
        "import airflow.sdk as sdk",
        "from airflow.sdk import dag",
        "def f():\n    from airflow.sdk.exceptions import AirflowFailException",
        "import importlib; importlib.import_module('airflow.models')",
        "__import__('airflow')",
        "import airflowlike",
        "from airflow_helpers import x",
        "from . import airflow",
        "print('airflow')",
        "from stagewise.airflow import launch",
        "from stagewise.airflowish import x",
    ])
    hits = airflow_imports(source, "sample.py")
    assert [hit.split(":")[1] for hit in hits] == ["1", "2", "3", "5", "6", "7", "12"], hits


def test_tasks_never_imports_airflow():
    """No module under tasks/ imports airflow (Airflow glue belongs in plugins/stagewise_airflow)."""
    files = sorted((REPO_ROOT / "tasks").rglob("*.py"))
    assert len(files) > 10, f"expected the tasks/ modules, found {files}"
    hits = [hit for path in files for hit in airflow_imports(path.read_text(), str(path.relative_to(REPO_ROOT)))]
    assert hits == [], "tasks/ must not import airflow:\n" + "\n".join(hits)
