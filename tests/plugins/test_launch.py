"""The sub-job launcher: results come back, user errors do not retry, and no process outlives its task."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowFailException

from stagewise_airflow import launch
from tasks.config import Profile
from tests.live_airflow import is_loopback, listening_sockets, process_tree

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_result_comes_back_with_attempt():
    """The sub-job's JSON result is returned, tagged with the Airflow try number."""
    result = launch.run("tests.plugins.fake_subjob", ["ok"], Profile(), attempt=3)
    assert result["answer"] == 42
    assert result["attempt"] == 3


def test_user_error_fails_without_retry_and_names_the_problem():
    """A bad-input error becomes AirflowFailException (no retry) carrying the sub-job's message."""
    with pytest.raises(AirflowFailException, match="column 'label' is missing"):
        launch.run("tests.plugins.fake_subjob", ["user-error"], Profile())


def test_crash_is_retryable():
    """Any other non-zero exit is an ordinary exception, which Airflow retries with backoff."""
    with pytest.raises(RuntimeError, match="exited with code 7"):
        launch.run("tests.plugins.fake_subjob", ["crash"], Profile())


def test_torchrun_command_follows_the_profile():
    """A distributed sub-job runs under the loopback torchrun with the profile's process count and restarts."""
    argv = launch.command("tasks.train", ["--stage", "s2"], Profile(processes_per_node=2, max_restarts=1), distributed=True)
    assert argv[1:3] == ["-m", "tasks.local_torchrun"]
    assert "--nproc-per-node=2" in argv and "--max-restarts=1" in argv
    assert argv[-3:] == ["tasks.train", "--stage", "s2"]


def test_child_env_pins_threads_and_hides_gpus_on_cpu_profiles():
    """Threads per process come from the profile; a cpu profile never touches CUDA."""
    env = launch.child_env(Profile(threads_per_process=3, device="cpu"), "/tmp/x")
    assert env["OMP_NUM_THREADS"] == "3" and env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["PYTHONPATH"].split(os.pathsep)[0] == launch.REPO_ROOT


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (already dead, not yet reaped) counts as gone.
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().split(")")[-1].split()[0] != "Z"


def test_sigterm_to_the_task_ends_the_whole_process_group(tmp_path):
    """When Airflow SIGTERMs the task (kill, mark failed), the sub-job and its children die too."""
    pid_file = tmp_path / "grandchild.pid"
    script = (
        "import sys; sys.path[:0] = [{root!r}, {plugins!r}]\n"
        "from stagewise_airflow import launch\n"
        "from tasks.config import Profile\n"
        "launch.run('tests.plugins.fake_subjob', ['hang', '--pid-file', {pid!r}], Profile())\n"
    ).format(root=str(REPO_ROOT), plugins=str(REPO_ROOT / "plugins"), pid=str(pid_file))
    task = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    grandchild = int(pid_file.read_text())
    assert _alive(grandchild)
    task.send_signal(signal.SIGTERM)
    task.wait(timeout=60)
    deadline = time.monotonic() + 20
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild), "the sub-job's child outlived the task"


def test_more_processes_than_gpus_is_refused_before_launch(monkeypatch, tmp_path):
    """A cuda profile wanting 2 processes on a 1-GPU worker fails at once, without retry, naming the numbers."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    marker = tmp_path / "launched"
    with pytest.raises(AirflowFailException, match=r"2 process\(es\) on device cuda.*sees 1 GPU"):
        launch.run("tests.plugins.fake_subjob", ["hang", "--pid-file", str(marker)],
                   Profile(device="cuda", processes_per_node=2), distributed=True)
    assert not marker.exists(), "nothing may launch"


def test_task_timeout_ends_the_whole_process_group(tmp_path):
    """Airflow's execution_timeout raises inside the task (SIGALRM); the sub-job's whole group must die with it."""

    class Timeout(Exception):
        pass

    def on_alarm(signum, frame):
        raise Timeout()

    pid_file = tmp_path / "grandchild.pid"
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, 5.0)
    try:
        with pytest.raises(Timeout):
            launch.run("tests.plugins.fake_subjob", ["hang", "--pid-file", str(pid_file)], Profile())
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 20
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild), "the sub-job's child outlived the timed-out task"


def test_torchrun_job_listens_on_loopback_only(tmp_path):
    """Every socket a 2-rank torchrun job listens on (agent store, ranks, gloo) is on loopback, none on */0.0.0.0/::."""
    ready, release = tmp_path / "ready", tmp_path / "release"
    outcome: dict = {}

    def launch_job() -> None:
        try:
            outcome["result"] = launch.run("probe", [str(ready), str(release)], Profile(processes_per_node=2),
                                           distributed=True, script=str(REPO_ROOT / "tests/plugins/rendezvous_probe.py"))
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            outcome["error"] = exc

    job = threading.Thread(target=launch_job)
    job.start()
    seen: set[str] = set()
    try:
        deadline = time.monotonic() + 120
        while job.is_alive() and time.monotonic() < deadline and not ready.exists():
            time.sleep(0.05)
        assert ready.exists(), f"the job never got its process group up: {outcome}"
        agent, total = map(int, ready.read_text().split())
        assert total == 2, "both ranks took part in the all_reduce"
        # The rendezvous is over and the group is up: whatever listens now listens for the whole job.
        for _ in range(10):
            seen.update(listening_sockets(process_tree(agent)))
            time.sleep(0.1)
    finally:
        release.touch()
        job.join(timeout=120)
    assert "error" not in outcome, outcome
    assert seen, "the agent's rendezvous store must show up as a listener (else this test checks nothing)"
    assert all(is_loopback(address) for address in seen), f"listening beyond loopback: {sorted(seen)}"
