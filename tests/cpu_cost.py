"""A pytest plugin: what each test cost in CPU, printed after the run beside ``--durations``.

The suite is bound by its two cores, so wall time says little about which test to make cheaper: a test waiting on
a server looks as slow as one training a model. Each test's cost is the CPU its worker used and the CPU of the
processes it started and waited for (sub-jobs, torchrun ranks, ``airflow dags test``, a stopped stack), from its
setup to its teardown. A module fixture is counted in the test that started or stopped it; the session fixtures a
worker stops after its last test (a shared live stack, MLflow servers) are a line of their own; a child is counted in
the test during which it was reaped. The summary lists the most costly tests and the total by what they need (marker).
"""

from __future__ import annotations

import resource
import time
from collections import defaultdict

import pytest

CPU_PROPERTY = "cpu_s"
MIN_SHOWN_S = 0.05  # a worker's end that stopped no fixture costs milliseconds: no line for it
SESSION_TEARDOWN = "fixtures stopped after a worker's last test ({nodeid})"
# The markers of pytest.ini a test is grouped by, most telling first; a test with none of them is "fast".
GROUPS = ("browser", "airflow", "torchrun", "service", "gpu", "subprocess", "slow")
_cpu_at_setup = pytest.StashKey[float]()
_cpu_at_last_teardown = pytest.StashKey[float]()  # set only for a process's last test: session fixtures stop in it
_costs: list[tuple[float, str, str]] = []  # (CPU-s, node id, group), gathered by the process that reports
# A fixed pure-Python loop timed after the run: the suite's CPU-s compare between machines only in its units (the
# cores of two sessions differed twofold: importing torch took 1.0 CPU-s on one and 2.4 on the other).
REFERENCE_STEPS = 5_000_000


def cpu_now() -> float:
    """CPU seconds of this process and of every child it has waited for."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def group_of(marks: set[str]) -> str:
    return next((name for name in GROUPS if name in marks), "fast")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_cpu_at_setup] = cpu_now()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    if nextitem is None:
        item.stash[_cpu_at_last_teardown] = cpu_now()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """The teardown's report carries the test's CPU and group (xdist sends it to the controller with the report)."""
    report = yield
    if report.when == "teardown" and _cpu_at_setup in item.stash:
        now, marks = cpu_now(), {mark.name for mark in item.iter_markers()}
        ended = item.stash.get(_cpu_at_last_teardown, now)
        costs = [(CPU_PROPERTY, (round(ended - item.stash[_cpu_at_setup], 2), group_of(marks), report.nodeid))]
        if now - ended >= MIN_SHOWN_S:
            costs.append((CPU_PROPERTY, (round(now - ended, 2), "session fixtures",
                                         SESSION_TEARDOWN.format(nodeid=report.nodeid))))
        report.user_properties = [*report.user_properties, *costs]  # a new list: the earlier reports share the item's
    return report


def pytest_runtest_logreport(report):
    for name, value in report.user_properties:
        if name == CPU_PROPERTY and report.when == "teardown":
            _costs.append((value[0], value[2], value[1]))


def reference_cpu() -> float:
    """CPU seconds this machine takes for REFERENCE_STEPS steps of a Python loop."""
    started, total = time.process_time(), 0
    for step in range(REFERENCE_STEPS):
        total += step
    return time.process_time() - started


def summary(costs: list[tuple[float, str, str]], top: int, reference_s: float | None = None) -> list[str]:
    """The lines printed: the total (and, given ``reference_s``, in reference loops), the total per group, and the
    ``top`` most costly tests."""
    by_group: dict[str, list[float]] = defaultdict(list)
    for cpu, _, group in costs:
        by_group[group].append(cpu)
    total = sum(cpu for cpu, _, _ in costs)
    lines = [f"{total:.0f} CPU-s in {len(costs)} tests; by what they need:"]
    if reference_s:
        lines.insert(0, f"this machine runs a {REFERENCE_STEPS:,}-step Python loop in {reference_s:.2f} CPU-s: the "
                        f"suite is {total / reference_s:,.0f} such loops")
    for group, values in sorted(by_group.items(), key=lambda entry: -sum(entry[1])):
        lines.append(f"{sum(values):9.0f} CPU-s  {len(values):5d} tests  {group}")
    lines.append(f"the {min(top, len(costs))} most costly:")
    lines += [f"{cpu:9.1f} CPU-s  {nodeid}" for cpu, nodeid, _ in sorted(costs, reverse=True)[:top]]
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _costs or hasattr(config, "workerinput"):  # an xdist worker: its controller prints the summary
        return
    terminalreporter.write_sep("=", "CPU per test (this process and the children it waited for)")
    for line in summary(_costs, top=20, reference_s=reference_cpu()):
        terminalreporter.write_line(line)
