"""No torchrun agent or rank outlives its task, however the task or the agent ends (Linux).

Each test runs a real 2-rank CPU torchrun job through the launcher, in a process of its own standing for the
Airflow task process. The ranks ignore SIGTERM, as a rank stuck in a collective does: only a kill ends them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
STUBBORN_RANKS = REPO_ROOT / "tests/plugins/stubborn_ranks.py"
# Far below the ranks' own 120 s and torch's 30 s shutdown wait, well above the launcher's 3 s grace.
GONE_WITHIN_S = 15.0

pytestmark = pytest.mark.torchrun

# The task process: launch.run in its main thread; SIGALRM raises in it as Airflow's execution_timeout does.
_TASK = f"""
import signal, sys
sys.path[:0] = [{str(REPO_ROOT)!r}]
from stagewise.airflow import launch
from stagewise.definitions.config import Profile

def timed_out(signum, frame):
    raise TimeoutError("execution_timeout")

signal.signal(signal.SIGALRM, timed_out)
launch.run("stubborn", [sys.argv[1]], Profile(processes_per_node=2), distributed=True, script={str(STUBBORN_RANKS)!r})
"""


def _alive(pid: int) -> bool:
    """Running; a zombie (dead, not yet reaped by whoever inherited it) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _survivors(pids: list[int], within_s: float) -> list[int]:
    """Those of ``pids`` still alive after waiting up to ``within_s`` for them all to go."""
    deadline = time.monotonic() + within_s
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if _alive(pid)]


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
    return found


@contextlib.contextmanager
def _running_job(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, int, list[int]]]:
    """(task process, agent pid, rank pids) once both ranks are up; every process of the job is SIGKILLed after."""
    pid_dir = tmp_path / "pids"  # unique per test, and on every command line of the job: the cleanup's handle
    pid_dir.mkdir()
    task = subprocess.Popen([sys.executable, "-c", _TASK, str(pid_dir)], cwd=REPO_ROOT)
    try:
        files = [pid_dir / "rank0.pid", pid_dir / "rank1.pid"]
        deadline = time.monotonic() + 180
        while not all(f.exists() for f in files) and task.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(f.exists() for f in files), f"the ranks never came up (task exit code {task.poll()})"
        pairs = [tuple(map(int, f.read_text().split())) for f in files]
        agents = {agent for _, agent in pairs}
        assert len(agents) == 1, f"both ranks have one parent, the agent: {pairs}"
        yield task, agents.pop(), [rank for rank, _ in pairs]
    finally:
        for pid in _processes_mentioning(str(pid_dir)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        task.kill()
        task.wait()


def test_sigkilled_agent_takes_its_ranks_along(tmp_path):
    """SIGKILL of the torchrun agent alone (OOM killer, a stray kill -9) ends its ranks too, and fails the task."""
    with _running_job(tmp_path) as (task, agent, ranks):
        os.kill(agent, signal.SIGKILL)
        assert _survivors(ranks, GONE_WITHIN_S) == [], "ranks outlived their SIGKILLed agent"
        assert task.wait(timeout=60) != 0, "a sub-job whose agent was killed fails the task (a retry may follow)"


def test_sigkilled_task_process_takes_agent_and_ranks_along(tmp_path):
    """SIGKILL of the Airflow task process itself ends the torchrun agent and every rank, with nobody left to wait."""
    with _running_job(tmp_path) as (task, agent, ranks):
        task.kill()
        task.wait()
        assert _survivors([agent, *ranks], GONE_WITHIN_S) == [], "the agent or a rank outlived the killed task"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGALRM], ids=["sigterm", "timeout"])
def test_stopped_task_ends_agent_and_ranks_that_ignore_sigterm(tmp_path, signum):
    """Airflow's SIGTERM (kill from the UI, mark failed) or the task's execution_timeout ends the agent and every
    rank, even ranks that ignore SIGTERM (the launcher's group kill alone reaches the agent, not the ranks)."""
    with _running_job(tmp_path) as (task, agent, ranks):
        task.send_signal(signum)
        assert _survivors([agent, *ranks], GONE_WITHIN_S) == [], "the agent or a rank outlived the stopped task"
        assert task.wait(timeout=60) != 0, "a stopped task fails"
