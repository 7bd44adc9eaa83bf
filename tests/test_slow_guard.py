"""The suite's guard on slow tests (tests/slow_guard.py), run on a scratch suite of its own."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

SCRATCH_SUITE = textwrap.dedent("""
    import time

    import pytest


    def test_quick():
        pass


    def test_long_unmarked():
        time.sleep(0.6)


    @pytest.mark.slow
    def test_long_marked():
        time.sleep(0.6)
""")


@pytest.mark.subprocess
def test_a_test_past_the_limit_fails_unless_marked_slow(tmp_path):
    """With the limit at 0.3 s, the unmarked 0.6 s test fails naming its duration and the marker; the marked one and
    the quick one pass."""
    (tmp_path / "test_scratch.py").write_text(SCRATCH_SUITE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n")
    env = {**os.environ, "STAGEWISE_SLOW_TEST_S": "0.3", "PYTHONPATH": str(REPO)}
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)  # the scratch suite runs in one process: the limit is 0.3 s as set
    ran = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.slow_guard", "-p", "no:cacheprovider", "-q",
                          "-rf", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 1, ran.stdout + ran.stderr
    assert "1 failed, 2 passed" in ran.stdout, ran.stdout
    assert re.search(r"test_long_unmarked took \d+ s, more than 0.3 s: mark it @pytest.mark.slow", ran.stdout), ran.stdout
    assert "test_long_marked" not in ran.stdout.split("short test summary")[-1], ran.stdout


def test_the_limit_grows_with_the_workers_sharing_each_core(monkeypatch):
    """Four xdist workers on two cores give each test half a core: its limit doubles; one process keeps the limit."""
    from tests import slow_guard

    monkeypatch.setenv("STAGEWISE_SLOW_TEST_S", "60")
    monkeypatch.setattr(slow_guard.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    assert slow_guard.slow_test_s() == 120
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT")
    assert slow_guard.slow_test_s() == 60
