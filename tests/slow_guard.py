"""A pytest plugin: a test whose call takes longer than a minute must carry ``@pytest.mark.slow`` (which
``make test-fast`` leaves out), or it fails saying how long it took. tests/conftest.py loads it for the whole suite.

The limit is ``STAGEWISE_SLOW_TEST_S`` (default 60 s) of a test with the machine's cores to itself; under pytest-xdist
it grows with the workers sharing each core (``make test``: 3 workers on 2 cores, 90 s), so a test near the minute is
not failed by its neighbours' load.
"""

from __future__ import annotations

import os

import pytest


def slow_test_s() -> float:
    """The limit for this process: the configured seconds times the xdist workers per core (at least 1)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return float(os.environ.get("STAGEWISE_SLOW_TEST_S", "60")) * max(1.0, workers / cores)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A passing call past the limit, without the slow marker, is reported failed with its duration and the fix."""
    report = yield
    limit = slow_test_s()
    if report.when == "call" and report.passed and report.duration > limit and item.get_closest_marker("slow") is None:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} took {report.duration:.0f} s, more than {limit:g} s: mark it "
                           "@pytest.mark.slow (make test-fast leaves it out) or make it faster")
    return report
