"""The suite's CPU summary (tests/cpu_cost.py), run on a scratch suite of its own."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.cpu_cost import group_of, reference_cpu, summary

REPO = Path(__file__).resolve().parent.parent

SCRATCH_SUITE = textwrap.dedent("""
    import subprocess
    import sys
    import time

    import pytest

    BURN = "import time\\nend = time.process_time() + 0.6\\nwhile time.process_time() < end: pass"


    @pytest.fixture(scope="session")
    def stopped_at_the_end():
        yield
        subprocess.run([sys.executable, "-c", BURN.replace("0.6", "1.0")], check=True)


    def test_quick(stopped_at_the_end):
        pass


    @pytest.mark.slow
    def test_burns_in_a_child():
        subprocess.run([sys.executable, "-c", BURN], check=True)


    def test_waits_without_burning():
        time.sleep(0.6)
""")


@pytest.mark.parametrize("workers", ["0", "2"], ids=["one-process", "xdist"])
@pytest.mark.subprocess
def test_the_summary_counts_a_childs_cpu_and_not_a_wait(tmp_path, workers):
    """The test whose child burns 0.6 CPU-s heads the list with at least that; the one sleeping 0.6 s costs less than
    0.3; a session fixture's 1 CPU-s at its end is a line of its own, in no test; the groups follow the markers; with
    xdist the workers' figures reach the controller's summary. Run from an xdist worker, as make test runs it."""
    (tmp_path / "test_scratch.py").write_text(SCRATCH_SUITE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: slow\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTEST_XDIST_WORKER": "gw9"}  # what a worker's children inherit
    ran = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.cpu_cost", "-p", "no:cacheprovider", "-q",
                          "-n", workers, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    listed = re.findall(r"^\s+([\d.]+) CPU-s  \S+::(test_\w+)$", ran.stdout, re.MULTILINE)
    assert [name for _, name in listed][0] == "test_burns_in_a_child", ran.stdout
    cost = {name: float(cpu) for cpu, name in listed}
    assert cost["test_burns_in_a_child"] >= 0.6 and cost["test_waits_without_burning"] < 0.3, ran.stdout
    assert max(cost.values()) < 1.0, "the session fixture's end is counted in no test"
    [stopped] = re.findall(r"^\s+([\d.]+) CPU-s  fixtures stopped after a worker's last test \(\S+::test_\w+\)$",
                           ran.stdout, re.MULTILINE)
    assert float(stopped) >= 1.0, ran.stdout
    assert re.search(r"^\s+[\d.]+ CPU-s\s+1 tests\s+slow$", ran.stdout, re.MULTILINE), ran.stdout
    assert re.search(r"^\s+[\d.]+ CPU-s\s+2 tests\s+fast$", ran.stdout, re.MULTILINE), ran.stdout


def test_a_test_is_grouped_by_its_most_telling_marker():
    """A browser test that also runs Airflow counts as browser; one with no marker of pytest.ini as fast."""
    assert group_of({"airflow", "browser", "slow"}) == "browser"
    assert group_of({"torchrun", "slow"}) == "torchrun"
    assert group_of({"parametrize"}) == "fast"


def test_the_summary_totals_groups_and_lists_the_most_costly_first():
    lines = summary([(1.0, "a::x", "fast"), (5.0, "b::y", "airflow"), (2.0, "c::z", "fast")], top=2)
    assert lines[0] == "8 CPU-s in 3 tests; by what they need:"
    assert lines[1].split() == ["5", "CPU-s", "1", "tests", "airflow"]
    assert lines[2].split() == ["3", "CPU-s", "2", "tests", "fast"]
    assert [line.split()[-1] for line in lines[4:]] == ["b::y", "c::z"]


def test_the_summary_states_the_suites_cpu_in_reference_loops_of_this_machine():
    """Given the reference loop's CPU, the first line says it and the suite's CPU in those units; a faster machine
    (a shorter loop) counts the same tests as more loops."""
    costs = [(30.0, "a::x", "fast"), (90.0, "b::y", "airflow")]
    slow, fast = summary(costs, top=1, reference_s=1.2), summary(costs, top=1, reference_s=0.6)
    assert slow[0] == "this machine runs a 5,000,000-step Python loop in 1.20 CPU-s: the suite is 100 such loops"
    assert fast[0].endswith("the suite is 200 such loops")
    assert slow[1:] == fast[1:] == summary(costs, top=1)
    assert reference_cpu() > 0
