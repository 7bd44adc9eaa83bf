"""The package declares what its code imports, as ranges the tested pins (requirements.txt) satisfy."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement

REPO_ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
OURS = {"tasks", "stagewise_airflow", "examples", "__future__"}
# Imported through another declared distribution that requires it (botocore comes with s3fs, FastAPI with Airflow).
COMES_WITH = {"aiobotocore": "s3fs", "botocore": "s3fs", "fastapi": "apache-airflow"}
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
            if wanted not in extras and not (module == "airflow.providers.cncf" and
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
