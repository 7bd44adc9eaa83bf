"""Every command line of the package answers ``--help`` with its usage and exits 0, without side effects (issue 34:
``python -m stagewise.airflow.log_server --help`` started the server). The modules are found by their
``if __name__ == "__main__"`` block, so a new one is covered; they run in parallel, each in an empty folder of its own
that must stay empty."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, process_needs

TIMEOUT_S = 120  # an import under a loaded machine takes seconds; a server that starts never answers
PARALLEL = 4
NOT_YET: dict[str, str] = {}  # a module whose --help is known broken, with why (none today)


def _is_main_guard(node: ast.stmt) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and any(isinstance(value, ast.Constant) and value.value == "__main__" for value in test.comparators))


def cli_modules() -> list[str]:
    """The dotted name of every module of the installed package (pyproject.toml's package-dir) with a
    ``__name__ == "__main__"`` block, or a ``__main__.py``."""
    package_dirs = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found = set()
    for package, folder in package_dirs.items():
        nested = [Path(other) for other in package_dirs.values() if other != folder and other.startswith(folder + "/")]
        for path in (REPO_ROOT / folder).rglob("*.py"):
            relative = path.relative_to(REPO_ROOT / folder)
            if any(path.is_relative_to(REPO_ROOT / inner) for inner in nested) or "__pycache__" in relative.parts:
                continue
            tree = ast.parse(path.read_text(), str(path))
            if path.name == "__main__.py" or any(_is_main_guard(node) for node in tree.body):
                parts = relative.with_suffix("").parts
                parts = parts[:-1] if parts[-1] == "__main__" else parts
                found.add(".".join((package, *parts)))
    return sorted(found)


MODULES = cli_modules()


def _marks(module: str) -> list:
    marks = [getattr(pytest.mark, need) for need in sorted(process_needs([sys.executable, "-m", module]))]
    if module in NOT_YET:
        marks.append(pytest.mark.xfail(reason=NOT_YET[module], strict=False))
    return marks


def _help(module: str, folder: Path) -> tuple[int | None, str]:
    try:
        done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=folder, capture_output=True, text=True,
                              timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        return None, f"still running after {TIMEOUT_S}s: {exc.stdout or ''}{exc.stderr or ''}"
    return done.returncode, done.stdout + done.stderr


@pytest.fixture(scope="module")
def helps(tmp_path_factory) -> dict[str, tuple[int | None, str, Path]]:
    """``--help`` of every module that starts no marked process (those run in their own, marked test), in parallel."""
    plain = [module for module in MODULES if not process_needs([sys.executable, "-m", module])]
    folders = {module: tmp_path_factory.mktemp(module.replace(".", "_")) for module in plain}
    with ThreadPoolExecutor(PARALLEL) as pool:
        results = dict(zip(plain, pool.map(lambda module: _help(module, folders[module]), plain), strict=True))
    return {module: (*results[module], folders[module]) for module in plain}


def test_the_command_lines_are_found():
    assert {"stagewise.config", "stagewise.train", "stagewise.airflow.log_server", "stagewise.examples.byo_train"} \
        <= set(MODULES), MODULES


@pytest.mark.parametrize("module", [pytest.param(module, marks=_marks(module)) for module in MODULES])
def test_help_prints_usage_and_exits(module, request, tmp_path):
    if process_needs([sys.executable, "-m", module]):  # a marked test of its own: it starts the process itself
        code, output, folder = (*_help(module, tmp_path), tmp_path)
    else:
        code, output, folder = request.getfixturevalue("helps")[module]
    assert code == 0, output
    # argparse's usage, or (node_launch, whose arguments are torchrun's) a docstring saying how to run it
    assert "usage:" in output.lower() or f"python -m {module}" in output, output
    assert not any(folder.iterdir()), f"--help wrote {sorted(p.name for p in folder.iterdir())}"
