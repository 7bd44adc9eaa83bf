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
# The sub-jobs of a pipeline run: each runs alone, outside Airflow, so each must keep its command line (a lost
# ``__main__`` block would drop it from MODULES, and from the tests below, silently).
SUB_JOBS = {f"stagewise.{name}" for name in ("preprocess", "sweep", "train", "evaluate", "infer", "data", "config", "report")}
# Sub-jobs whose work imports torch (seconds of CPU) but whose --help answers before it (stagewise.core.cli's
# help_before_imports). Not here: stagewise.training.local_torchrun, whose --help is torchrun's own; node_launch, which
# imports local_torchrun; the examples, user scripts that import torch first as any user's would.
HELP_WITHOUT_TORCH = ("stagewise.evaluate", "stagewise.infer", "stagewise.sweep", "stagewise.train")


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
    assert {"stagewise.airflow.log_server", "stagewise.examples.byo_train", *SUB_JOBS} <= set(MODULES), MODULES


_HELP_IMPORTS = """
import contextlib, io, runpy, sys
for module in sys.argv[1:]:
    sys.argv = [module, "--help"]
    with contextlib.redirect_stdout(io.StringIO()) as shown:
        try:
            runpy.run_module(module, run_name="__main__")
        except SystemExit as exc:
            assert exc.code in (0, None), (module, exc.code)
    assert "usage:" in shown.getvalue(), (module, shown.getvalue())
    if "torch" in sys.modules:
        sys.exit(f"{module} --help imported torch")
"""


def test_help_imports_no_torch():
    """``--help`` of the sub-jobs that use torch answers without importing it (about 2.5 CPU-seconds each); all in one
    process: the first that imports torch is named."""
    done = subprocess.run([sys.executable, "-c", _HELP_IMPORTS, *HELP_WITHOUT_TORCH], capture_output=True, text=True,
                          timeout=TIMEOUT_S, stdin=subprocess.DEVNULL, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("module", [pytest.param(module, marks=_marks(module)) for module in MODULES])
@pytest.mark.subprocess
def test_help_prints_usage_and_exits(module, request, tmp_path):
    if process_needs([sys.executable, "-m", module]):  # a marked test of its own: it starts the process itself
        code, output, folder = (*_help(module, tmp_path), tmp_path)
    else:
        code, output, folder = request.getfixturevalue("helps")[module]
    assert code == 0, output
    # argparse's usage, or (node_launch, whose arguments are torchrun's) a docstring saying how to run it
    assert "usage:" in output.lower() or f"python -m {module}" in output, output
    assert not any(folder.iterdir()), f"--help wrote {sorted(p.name for p in folder.iterdir())}"
