"""The package declares what its code imports, as ranges the tested pins (requirements.txt) satisfy; it installs as
one package under the project's name, with its UI plugin behind Airflow's entry point."""

from __future__ import annotations

import ast
import os
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement

REPO_ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
OURS = {"stagewise", "__future__"}
# Imported through another declared distribution that requires it (botocore comes with s3fs; FastAPI, and SQLAlchemy
# for the pages' queries of Airflow's own DB, with Airflow).
COMES_WITH = {"aiobotocore": "s3fs", "botocore": "s3fs", "fastapi": "apache-airflow", "sqlalchemy": "apache-airflow"}
TEST_TOOLS = {"pytest", "pytest-xdist", "pytest-timeout", "ruff", "playwright", "moto", "apache-airflow-client"}


def _name(requirement: str) -> str:
    return Requirement(requirement).name.lower()


def _imports() -> set[str]:
    """Top-level third-party modules tasks/ and plugins/ import (airflow.providers.<x> kept whole)."""
    found = set()
    for path in [*REPO_ROOT.joinpath("tasks").rglob("*.py"), *REPO_ROOT.joinpath("plugins").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for name in names:
                top = name.split(".")[0]
                if top not in OURS and top not in sys.stdlib_module_names:
                    found.add(".".join(name.split(".")[:3]) if name.startswith("airflow.providers.") else top)
    return found


def test_every_import_is_a_declared_dependency_or_extra():
    """Installing the package (with the extra of a backend) gives each module its code imports."""
    declared = {_name(r) for r in PROJECT["dependencies"]}
    extras = {_name(r) for group in PROJECT["optional-dependencies"].values() for r in group}
    distributions = packages_distributions()
    missing = []
    for module in sorted(_imports()):
        if module.startswith("airflow.providers."):
            wanted = "apache-airflow-providers-" + module.split(".")[2].replace("_", "-")
            if wanted not in extras | declared and not (module == "airflow.providers.cncf" and
                                             "apache-airflow-providers-cncf-kubernetes" in extras):
                missing.append(f"{module} ({wanted})")
            continue
        names = {d.lower() for d in distributions.get(module, [])} or {module}
        if not names & (declared | extras) and COMES_WITH.get(module) not in declared:
            missing.append(f"{module} ({', '.join(sorted(names))})")
    assert missing == [], f"imported but not declared in pyproject.toml: {missing}"


def test_every_range_admits_the_tested_pin_and_no_test_tool_is_a_runtime_dependency():
    """requirements.txt stays usable as constraints of `pip install stagewise`; pytest and friends stay out."""
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (REPO_ROOT / "requirements.txt").read_text(), re.M))
    pins = {name.lower().replace("_", "-"): version for name, version in pins.items()}
    groups = [PROJECT["dependencies"], *PROJECT["optional-dependencies"].values()]
    for requirement in (Requirement(r) for group in groups for r in group):
        name = requirement.name.lower()
        assert name in pins, f"{name} is declared but requirements.txt does not pin it (untested)"
        assert requirement.specifier.contains(pins[name], prereleases=True), f"{requirement} excludes the pin {pins[name]}"
        assert name not in TEST_TOOLS


SETUPTOOLS = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
OLD_NAMES = ("tasks", "examples", "stagewise_airflow")
OLD_IN_PROSE = re.compile(r"^\s*(?:from|import) (tasks|examples|stagewise_airflow)\b", re.M)  # code blocks in pages
OLD_WORD = re.compile(r"\b(?:tasks|examples|stagewise_airflow)\b")
SKIP = {".venv", ".venv-mlflow", ".git", ".airflow", "artifacts", "results", "build"}


def _repo_files(suffixes: tuple[str, ...]) -> list[Path]:
    """The repository's files ending in ``suffixes``, never descending into SKIP's folders (a glob over the whole
    tree walks the virtual environments: seconds)."""
    found = []
    for root, folders, names in os.walk(REPO_ROOT):
        folders[:] = [folder for folder in folders if folder not in SKIP]
        found += [Path(root, name) for name in names if name.endswith(suffixes)]
    return found


def _old_imports(path: Path) -> list[int]:
    """Lines of ``path`` importing an old top-level name: real imports of a .py file (a team's own ``from tasks
    import ...`` written into a test's string is not one), import lines of a page or config."""
    text = path.read_text()
    if path.suffix != ".py":
        return [text[:match.start()].count("\n") + 1 for match in OLD_IN_PROSE.finditer(text)]
    if not OLD_WORD.search(text):
        return []  # an import of a name holds the name as a word: most files need no parse
    found = []
    for node in ast.walk(ast.parse(text, str(path))):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
        found += [node.lineno for name in names if name.split(".")[0] in OLD_NAMES]
    return found


def test_no_code_or_page_imports_the_old_top_level_names():
    """Code, examples, configs and docs import stagewise.<module>; `tasks`, `examples` and `stagewise_airflow` are
    folders of the repository, never module names (they are not installed)."""
    files = _repo_files((".py", ".md", ".yaml"))
    assert len(files) > 100
    hits = [f"{path.relative_to(REPO_ROOT)}:{line}" for path in files for line in _old_imports(path)]
    assert hits == []


def test_the_import_check_sees_code_and_pages_but_not_strings(tmp_path):
    """Guard for the guard: a real import and a page's import line count, a string holding one does not."""
    code, page = tmp_path / "a.py", tmp_path / "a.md"
    code.write_text('import os\nfrom tasks.spec import report\nTEAM = """\nfrom tasks import x\n"""\n'
                    "def f():\n    import examples.diabetes\n")
    page.write_text("```python\nfrom stagewise.spec import report\nfrom stagewise_airflow import dags\n```\n")
    assert (_old_imports(code), _old_imports(page)) == ([2, 7], [3])


def test_every_package_folder_ships_in_the_wheel():
    """Each folder of tasks/, plugins/stagewise_airflow/ and examples/ holding Python is a package the wheel lists:
    a new subpackage left out installs a Stagewise that fails at its first import of it."""
    setuptools = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    found = set()
    for package, folder in setuptools["package-dir"].items():
        for init in (REPO_ROOT / folder).rglob("*.py"):
            parts = init.parent.relative_to(REPO_ROOT / folder).parts
            if "__pycache__" not in parts:
                found.add(".".join((package, *parts)))
    assert found - listed == set(), f"add to pyproject.toml's packages: {sorted(found - listed)}"
