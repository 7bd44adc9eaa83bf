"""The sub-job launcher: results come back, user errors do not retry, and no process outlives its task."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowFailException

from stagewise.airflow import launch
from stagewise.definitions.config import Profile
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


def test_a_user_error_every_rank_hit_is_named_once():
    """Each rank that hits the user's error writes it to the error file; the task's failure names it once."""
    with pytest.raises(AirflowFailException) as caught:
        launch.run("tests.plugins.fake_subjob", ["user-error-every-rank"], Profile())
    assert str(caught.value).count("column 'label' is missing") == 1


def test_crash_is_retryable():
    """Any other non-zero exit is an ordinary exception, which Airflow retries with backoff."""
    with pytest.raises(RuntimeError, match="exited with code 7"):
        launch.run("tests.plugins.fake_subjob", ["crash"], Profile())


def test_torchrun_command_follows_the_profile():
    """A distributed sub-job runs under the loopback torchrun with the profile's process count and restarts."""
    argv = launch.command("stagewise.train", ["--stage", "s2"], Profile(processes_per_node=2, max_restarts=1), distributed=True)
    assert argv[1:3] == ["-m", "stagewise.training.local_torchrun"]
    assert "--nproc-per-node=2" in argv and "--max-restarts=1" in argv
    assert argv[-3:] == ["stagewise.train", "--stage", "s2"]


def test_building_a_torchrun_command_imports_no_torch():
    """The Airflow task process builds a DDP stage's command without importing torch (about 2 CPU-s a task)."""
    code = ("import sys; from stagewise.airflow import launch; from stagewise.definitions.config import Profile; "
            "launch.command('stagewise.train', [], Profile(processes_per_node=2), distributed=True); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env=dict(os.environ))
    assert result.stdout.strip() == "[]", result.stdout


def test_child_env_pins_threads_and_hides_gpus_on_cpu_profiles():
    """Threads per process come from the profile; a cpu profile never touches CUDA."""
    env = launch.child_env(Profile(threads_per_process=3, device="cpu"), "/tmp/x")
    assert env["OMP_NUM_THREADS"] == "3" and env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["PYTHONPATH"] == os.environ.get("PYTHONPATH", ""), "stagewise is installed: no path of ours is added"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (already dead, not yet reaped) counts as gone.
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.subprocess
def test_sigterm_to_the_task_ends_the_whole_process_group(tmp_path):
    """When Airflow SIGTERMs the task (kill, mark failed), the sub-job and its children die too."""
    pid_file = tmp_path / "grandchild.pid"
    script = (
        f"import sys; sys.path[:0] = [{str(REPO_ROOT)!r}]\n"
        "from stagewise.airflow import launch\n"
        "from stagewise.definitions.config import Profile\n"
        f"launch.run('tests.plugins.fake_subjob', ['hang', '--pid-file', {str(pid_file)!r}], Profile())\n"
    )
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


@pytest.mark.parametrize("mask", ["", "-1"])
def test_an_inference_shard_on_cuda_without_a_gpu_is_refused_before_launch(monkeypatch, tmp_path, mask):
    """A single-process sub-job (an inference shard) on a cuda profile, on a worker that sees no GPU, fails at once
    without retry, saying it needs 1 GPU and this worker has 0; nothing launches."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mask)
    marker = tmp_path / "launched"
    with pytest.raises(AirflowFailException, match=r"device cuda for a single-process sub-job.*needs 1 GPU.*sees 0 GPU"):
        launch.run("tests.plugins.fake_subjob", ["hang", "--pid-file", str(marker)], Profile(device="cuda"))
    assert not marker.exists(), "nothing may launch"


def test_gpu_check_counts_one_gpu_for_a_single_process_subjob(monkeypatch):
    """A single-process sub-job needs one GPU whatever processes_per_node says (it runs one process); a torchrun job on
    the same profile needs one per process; cpu and auto profiles are never refused."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    two = Profile(device="cuda", processes_per_node=2)
    launch.check_devices(two, distributed=False)
    with pytest.raises(AirflowFailException, match=r"2 process\(es\)"):
        launch.check_devices(two, distributed=True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    for device in ("cpu", "auto"):
        launch.check_devices(Profile(device=device), distributed=False)


@pytest.mark.subprocess
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


@pytest.mark.torchrun
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


# Lines as a sub-job under torchrun really prints them (captured from stagewise.training.local_torchrun, one rank raising).
_TORCHRUN_CRASH = [
    "2026-11-23 11:15:01,838 INFO stagewise.train: epoch 1/3 step 10 lr 0.05 loss 1.2 ETA 0:01:00",
    "2026-11-23 11:15:01,838 WARNING stagewise.train: loss is rising",
    "/tmp/lx/crash.py:8: UserWarning: a user warning",
    '  warnings.warn("a user warning")',
    "plain print line",
    "Traceback (most recent call last):",
    '  File "/tmp/lx/crash.py", line 11, in <module>',
    '    raise ValueError("boom on rank 1")',
    "ValueError: boom on rank 1",
    "E1123 11:15:01.919000 17897 /venv/site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] "
    "failed (exitcode: 1) local_rank: 1 (pid: 17904) of binary: /venv/bin/python",
    "Traceback (most recent call last):",
    '  File "/venv/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent',
    "    raise ChildFailedError(",
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    "============================================================",
    "/tmp/lx/crash.py FAILED",
    "2026-11-23 11:15:02,001 INFO stagewise.train: a record after the crash summary",
]


def test_subjob_lines_keep_their_level_and_lose_the_duplicate_prefix():
    """Each sub-job line gets the level it was written at; records lose timestamp/level and keep a short logger name."""
    lines = launch.SubjobLines()
    got = [lines.classify(line) for line in _TORCHRUN_CRASH]
    info, warning, error = logging.INFO, logging.WARNING, logging.ERROR
    assert got[0] == (info, "train: epoch 1/3 step 10 lr 0.05 loss 1.2 ETA 0:01:00")
    assert got[1] == (warning, "train: loss is rising")
    assert [level for level, _ in got[2:4]] == [warning, warning], "a Python warning and its source line"
    assert got[4] == (info, "plain print line"), "a plain print stays INFO"
    assert [level for level, _ in got[5:9]] == [error] * 4, "the rank's traceback, frames and exception line"
    assert got[9] == (error, "torch: failed (exitcode: 1) local_rank: 1 (pid: 17904) of binary: /venv/bin/python")
    assert [level for level, _ in got[10:16]] == [error] * 6, "torchrun's own traceback and failure summary"
    assert got[16] == (info, "train: a record after the crash summary"), "a new record ends the traceback"


@pytest.mark.parametrize(("line", "expected"), [
    ("INFO stagewise.sweep: trial 3 pruned", (logging.INFO, "sweep: trial 3 pruned")),
    ("2026-11-23 11:15:01,838 ERROR stagewise: train failed on bad input, not retrying: x.parquet: column 'y'",
     (logging.ERROR, "train failed on bad input, not retrying: x.parquet: column 'y'")),
    ("WARNING:my_module:disk almost full", (logging.WARNING, "my_module: disk almost full")),
    ("WARNING:root:no GPU, using CPU", (logging.WARNING, "no GPU, using CPU")),
    ("2026-11-23 11:15:01,838 CRITICAL optuna.study: study lost", (logging.CRITICAL, "optuna.study: study lost")),
    ("[W1123 11:15:01.919000000 socket.cpp:204] [c10d] hostname not resolved",
     (logging.WARNING, "torch: [c10d] hostname not resolved")),
    ("I1123 11:15:01.919000 17897 torch/distributed/run.py:766] Using nproc_per_node=2.",
     (logging.INFO, "torch: Using nproc_per_node=2.")),
    ("step 10/100 loss=0.5 100% done", (logging.INFO, "step 10/100 loss=0.5 100% done")),
    ("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/debug_logger.cc:9] ERROR failed to connect, retry=1",
     (logging.ERROR, "torch: failed to connect, retry=1")),
    ("[rank1]: 2026-11-23 11:15:01,838 WARNING stagewise.train: loss is rising",
     (logging.WARNING, "[rank1]: train: loss is rising")),
    ("ERRORS: 0 (a user's print that only looks like a level)", (logging.INFO, "ERRORS: 0 (a user's print that only looks like a level)")),
])
def test_one_line_maps_to_its_level(line, expected):
    """Our record format, logging's default format, torch's glog lines and plain prints each map to the right level."""
    assert launch.SubjobLines().classify(line) == expected


def test_rank_prefixed_tracebacks_are_errors_per_rank():
    """torch's "[rankN]: " crash output stays prefixed; each rank's traceback is an error until that rank logs again."""
    lines = launch.SubjobLines()
    got = [lines.classify(line) for line in [
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "/tmp/job.py", line 7, in <module>',
        "[rank1]: 2026-11-23 11:15:01,838 INFO stagewise.train: epoch 2/3",
        "[rank0]: RuntimeError: Connection closed by peer [127.0.0.1]:393.",
        "[rank1]: step 20",
    ]]
    assert got == [
        (logging.ERROR, "[rank0]: Traceback (most recent call last):"),
        (logging.ERROR, '[rank0]:   File "/tmp/job.py", line 7, in <module>'),
        (logging.INFO, "[rank1]: train: epoch 2/3"),
        (logging.ERROR, "[rank0]: RuntimeError: Connection closed by peer [127.0.0.1]:393."),
        (logging.INFO, "[rank1]: step 20"),
    ]


def test_subjob_warning_reaches_the_task_log_as_a_warning(caplog):
    """End to end: a real sub-job's WARNING/ERROR records become warning/error records of the launcher's logger,
    without a second timestamp or level; its plain prints stay INFO."""
    caplog.set_level(logging.INFO, logger="stagewise.launch")
    launch.run("tests.plugins.fake_subjob", ["noisy"], Profile())
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "stagewise.launch"]
    assert (logging.WARNING, "train: validation loss rose two epochs in a row") in records, records
    assert (logging.ERROR, "train: checkpoint upload failed, retrying") in records, records
    assert (logging.INFO, "train: epoch 1/3 step 10 lr 0.05 loss 1.2 ETA 0:00:42") in records, records
    assert (logging.INFO, "a plain line from a user's print") in records, records
    assert not [m for _, m in records if " INFO " in m or " WARNING " in m], "no level prefix left in a message"
