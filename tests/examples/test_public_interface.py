"""User code imports one module of the project: every example reaches Stagewise through stagewise.spec only."""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PUBLIC = "stagewise.spec"


def project_imports(path: Path) -> list[str]:
    """The project modules (stagewise and all under it, and the repository's old top-level names) a file imports, at
    any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from stagewise import spec` imports stagewise.spec
            names = [f"{node.module}.{alias.name}" if node.module == "stagewise" else node.module for alias in node.names]
        else:
            continue
        found += [name for name in names if name.split(".")[0] in ("stagewise", "tasks", "plugins")]
    return found


def test_examples_import_only_the_public_module():
    """examples/ are written as a user writes them: model specs and scripts import stagewise.spec and nothing else of ours."""
    files = sorted(path for path in (REPO_ROOT / "examples").glob("*.py") if path.name != "__init__.py")
    assert len(files) >= 4, files
    offending = {path.name: names for path in files if (names := [n for n in project_imports(path) if n != PUBLIC])}
    assert offending == {}, offending
    assert all(project_imports(path) for path in files), "each example uses the public interface"


def test_the_check_sees_internal_imports(tmp_path):
    """Internal modules are caught in every import form; stagewise.spec passes."""
    sample = tmp_path / "sample.py"
    sample.write_text("from stagewise.spec import Regressor\nfrom stagewise import spec, model\nimport stagewise.preprocess\n"
                      "import tasks.train\ndef f():\n    from stagewise.airflow import steps\n")
    assert project_imports(sample) == ["stagewise.spec", "stagewise.spec", "stagewise.model", "stagewise.preprocess",
                                       "tasks.train", "stagewise.airflow"]
