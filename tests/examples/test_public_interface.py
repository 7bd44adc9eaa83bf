"""User code imports one module of the project: every example reaches Stagewise through tasks.spec only."""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PUBLIC = "tasks.spec"


def project_imports(path: Path) -> list[str]:
    """The project modules (tasks, stagewise_airflow, plugins) a file imports, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from tasks import spec` imports tasks.spec
            names = [f"{node.module}.{alias.name}" if node.module == "tasks" else node.module for alias in node.names]
        else:
            continue
        found += [name for name in names if name.split(".")[0] in ("tasks", "stagewise_airflow", "plugins")]
    return found


def test_examples_import_only_the_public_module():
    """examples/ are written as a user writes them: model specs and scripts import tasks.spec and nothing else of ours."""
    files = sorted((REPO_ROOT / "examples").glob("*.py"))
    assert len(files) >= 4, files
    offending = {path.name: names for path in files if (names := [n for n in project_imports(path) if n != PUBLIC])}
    assert offending == {}, offending
    assert all(project_imports(path) for path in files), "each example uses the public interface"


def test_the_check_sees_internal_imports(tmp_path):
    """Internal modules are caught in every import form; tasks.spec passes."""
    sample = tmp_path / "sample.py"
    sample.write_text("from tasks.spec import Regressor\nfrom tasks import spec, model\nimport tasks.preprocess\n"
                      "def f():\n    from stagewise_airflow import steps\n")
    assert project_imports(sample) == ["tasks.spec", "tasks.spec", "tasks.model", "tasks.preprocess", "stagewise_airflow"]
