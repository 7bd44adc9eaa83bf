"""Run a sub-job as a child process group and stream its output into the Airflow task log.

One process (``python -m stagewise.X``) or a torchrun job, per the stage's profile. The child gets its
own session, and its group plus every descendant (torchrun's ranks have sessions of their own) is
ended together: on task timeout, on SIGTERM from Airflow (mark failed, kill). If the task process
itself dies, the child is SIGKILLed (PDEATHSIG) and torchrun's ranks die with it (stagewise.training.rank_guard).
A sub-job that reports a user error (bad config or data) fails the task without retry.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import psutil

from stagewise.core import contract
from stagewise.definitions.config import Profile
from stagewise.training import torchrun_command

log = logging.getLogger("stagewise.launch")

# Airflow's supervisor SIGKILLs a task 5 s after its SIGTERM; our group kill must land before that.
_TERMINATE_GRACE_S = 3.0


def _die_with_parent() -> None:
    # Linux: if the Airflow task process dies, nobody reads or waits for the sub-job, so it goes at once, ranks too.
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def command(module: str, args: list[str], profile: Profile, distributed: bool, script: str | None = None) -> list[str]:
    """The argv: torchrun for a distributed sub-job, else python; ``script`` (a file) replaces ``-m module``.

    torchrun runs through stagewise.training.local_torchrun, which keeps its rendezvous store on 127.0.0.1.
    """
    entry = [script] if script else ["-m", module]
    if distributed:
        return torchrun_command.command(entry, args, profile.processes_per_node, profile.max_restarts)
    return [sys.executable, *entry, *args]


def child_env(profile: Profile, error_file: str, import_paths: Sequence[str] = ()) -> dict[str, str]:
    """The sub-job's environment: threads pinned, the config's model.import_paths importable (``stagewise`` is
    installed)."""
    env = dict(os.environ)
    threads = str(profile.threads_per_process)
    env.update({"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1",
                contract.ERROR_FILE: error_file,
                "PYTHONPATH": os.pathsep.join(p for p in (*import_paths, env.get("PYTHONPATH", "")) if p)})
    if profile.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _job_processes(process: subprocess.Popen) -> list[psutil.Process]:
    """The child and its descendants now, in any session (psutil refuses to signal a pid reused since)."""
    if process.returncode is not None:
        return []  # reaped: its pid may belong to another process by now
    try:
        child = psutil.Process(process.pid)
        return [child, *child.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _signal_job(process: subprocess.Popen, members: Iterable[psutil.Process], signum: int) -> None:
    """Signal the child's process group and each of ``members``, whichever are still there."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signum)
    for member in members:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            member.send_signal(signum)


def _kill_group(process: subprocess.Popen, members: Iterable[psutil.Process] = ()) -> None:
    """SIGKILL the group, ``members`` (listed at the SIGTERM) and whatever descends from the child now."""
    _signal_job(process, {*members, *_job_processes(process)}, signal.SIGKILL)


def terminate(process: subprocess.Popen) -> None:
    """SIGTERM the child's group and all its descendants, then SIGKILL what is left after a grace period."""
    if process.poll() is not None:
        return
    # Listed before any signal: once torchrun's agent dies, its ranks are no longer its descendants.
    members = _job_processes(process)
    _signal_job(process, members, signal.SIGTERM)
    deadline = time.monotonic() + _TERMINATE_GRACE_S
    while time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.1)
    _kill_group(process, members)
    process.wait()


RESULT_FILE_ENV = contract.RESULT_FILE

_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING, "ERROR": logging.ERROR,
           "CRITICAL": logging.CRITICAL}
_GLOG_LEVELS = {"D": logging.DEBUG, "I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}
# stagewise.core.cli.setup_logging's "%(asctime)s %(levelname)s %(name)s: %(message)s" (timestamp optional).
_RECORD = re.compile(r"^(?:\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[,.]\d+)? )?"
                     r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) (\S+?): ?(.*)$")
# Python's logging.basicConfig() default, "LEVEL:name:message".
_BASIC_RECORD = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL):([^:\s]*):(.*)$")
# torch's C++ and torchelastic lines: "W1123 11:15:01.919000 17897 path/api.py:1002] message" (C++ in brackets).
_GLOG_RECORD = re.compile(r"^\[?([DIWEF])\d{4} \d\d:\d\d:\d\d\.\d+ +(?:\d+ +)?[^\]\s]+\] ?(.*)$")
# warnings.warn on stderr: "/path/file.py:8: UserWarning: text", then the indented source line.
_PY_WARNING = re.compile(r"^\S.*:\d+: \w*Warning: ")
# gloo's own lines: "[/path/gloo/transport/tcp/debug_logger.cc:9] ERROR failed to connect, ...".
_SOURCE_RECORD = re.compile(r"^\[\S+:\d+\] (DEBUG|INFO|WARNING|ERROR|CRITICAL) (.*)$")
# torch prefixes what a rank prints on a crash: "[rank0]: Traceback (most recent call last):".
_RANK_PREFIX = re.compile(r"^(\[rank\d+\]: ?)(.*)$")
_TRACEBACK_START = "Traceback (most recent call last):"


def _short_logger(name: str) -> str:
    """``stagewise.train`` -> ``train``; the root logger and ``__main__`` add nothing to a line."""
    short = name.removeprefix("stagewise.")
    return "" if short in ("root", "__main__", "stagewise") else short


class SubjobLines:
    """Turns a sub-job's output lines into (level, text) for the task log, one line at a time.

    Records of the child's logging keep their level and lose their timestamp and level prefix
    (the task log adds its own); the logger name stays once, short. torch's own ``W…]``/``E…]``
    lines and Python warnings keep their level; a traceback is an error until the next record.
    Anything else (a user's print) is INFO. torch's ``[rankN]:`` prefix stays, and each rank's
    traceback is followed on its own.
    """

    def __init__(self) -> None:
        # Per source ('' or '[rankN]: '): the level a traceback's or a warning's following lines inherit.
        self._block_level: dict[str, int] = {}

    def classify(self, line: str) -> tuple[int, str]:
        source, body = "", line
        if match := _RANK_PREFIX.match(line):
            source, body = match.group(1), match.group(2)
        level, text = self._classify(source, body)
        return level, source + text

    def _classify(self, source: str, line: str) -> tuple[int, str]:
        block_level = self._block_level.pop(source, None)
        if match := _RECORD.match(line) or _BASIC_RECORD.match(line):
            level, name, message = _LEVELS[match.group(1)], _short_logger(match.group(2)), match.group(3)
            return level, f"{name}: {message}" if name else message
        if match := _GLOG_RECORD.match(line):
            return _GLOG_LEVELS[match.group(1)], f"torch: {match.group(2)}"
        if match := _SOURCE_RECORD.match(line):
            return _LEVELS[match.group(1)], f"torch: {match.group(2)}"
        if line.startswith(_TRACEBACK_START):
            self._block_level[source] = logging.ERROR
            return logging.ERROR, line
        if _PY_WARNING.match(line):
            self._block_level[source] = logging.WARNING
            return logging.WARNING, line
        if block_level == logging.ERROR:
            self._block_level[source] = logging.ERROR
            return logging.ERROR, line  # frames, the exception line and torchrun's failure summary
        if block_level == logging.WARNING and line[:1].isspace():
            return logging.WARNING, line  # the warning's source line
        return logging.INFO, line


def visible_gpus() -> int:
    """GPUs this worker may use, without touching CUDA in the Airflow process (its task runner forks)."""
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is not None:
        return len([d for d in mask.split(",") if d.strip() and d.strip() != "-1"])
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in listing.splitlines() if line.startswith("GPU "))


def check_devices(profile: Profile, distributed: bool = True) -> None:
    """Refuse, before anything launches, a cuda profile asking for more GPUs than this worker sees: one per process
    of a torchrun job, one for a single-process sub-job (an inference shard, evaluate)."""
    from airflow.sdk.exceptions import AirflowFailException

    if profile.device != "cuda":
        return
    gpus = visible_gpus()
    if distributed and profile.processes_per_node > gpus:
        raise AirflowFailException(f"profile asks for {profile.processes_per_node} process(es) on device cuda, one GPU "
                                   f"each, but this worker sees {gpus} GPU(s); lower processes_per_node or route the "
                                   f"task to a bigger worker (queue)")
    if not distributed and gpus < 1:
        raise AirflowFailException("profile asks for device cuda for a single-process sub-job (inference shard, "
                                   "evaluate), which needs 1 GPU, but this worker sees 0 GPU(s); use device cpu or "
                                   "auto, or route the task to a GPU worker (queue)")


def run(module: str, args: list[str], profile: Profile, *, distributed: bool = False, attempt: int = 1,
        script: str | None = None, extra_env: dict[str, str] | None = None, result_arg: bool = True,
        import_paths: Sequence[str] = ()) -> dict[str, Any]:
    """Run the sub-job to completion; return its JSON result plus ``attempt``.

    Our sub-jobs take ``--result-file``; a user's own script or module (``script``, or
    ``result_arg=False``) finds the path in $STAGEWISE_RESULT_FILE instead and may leave it unwritten; what its
    last stagewise.spec.report recorded ($STAGEWISE_METRICS_FILE) comes back under ``last_report``.
    A user's entrypoint runs in a scratch working directory of its own, removed when the attempt
    ends, so files it writes relative to its cwd never reach a later stage or a later run; a relative
    ``script`` is relative to this process's cwd (a config's scripts are absolute once it is loaded).
    """
    import json

    from airflow.sdk.exceptions import AirflowFailException

    from stagewise.scripting.entrypoint import LAST_REPORT, read_last_report

    check_devices(profile, distributed)
    workdir = tempfile.mkdtemp(prefix="stagewise-")
    result_file = os.path.join(workdir, "result.json")
    error_file = os.path.join(workdir, "user_error.txt")
    metrics_file = os.path.join(workdir, "metrics.json")
    ours = script is None and result_arg
    name, cwd = script or module, None
    if script:
        script = os.path.abspath(script)
    if not ours:
        cwd = os.path.join(workdir, "cwd")
        os.mkdir(cwd)
    argv = command(module, [*args, "--result-file", result_file] if ours else args, profile, distributed, script)
    env = {**child_env(profile, error_file, import_paths), RESULT_FILE_ENV: result_file, contract.METRICS_FILE: metrics_file,
           **(extra_env or {})}
    log.info("launching: %s", " ".join(argv))
    process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True,
                               preexec_fn=_die_with_parent)
    previous = signal.getsignal(signal.SIGTERM)
    stopped = threading.Event()

    def on_term(signum: int, frame: Any) -> None:
        # Don't block in the handler: the loop below keeps draining the sub-job's last words into the log.
        stopped.set()
        members = _job_processes(process)
        _signal_job(process, members, signal.SIGTERM)
        threading.Timer(_TERMINATE_GRACE_S, _kill_group, args=(process, members)).start()
        if callable(previous):
            previous(signum, frame)

    try:
        signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread: PDEATHSIG and the finally below still cover us
        previous = None
    try:
        assert process.stdout is not None
        lines = SubjobLines()
        for line in process.stdout:
            level, text = lines.classify(line.rstrip())
            log.log(level, "%s", text)
        code = process.wait()
    finally:
        terminate(process)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    try:
        if stopped.is_set():
            raise RuntimeError(f"{name} was stopped: the task got SIGTERM (killed, marked failed or timed out)")
        if os.path.exists(error_file):
            with open(error_file) as handle:  # every rank that hit the user's error wrote it: named once
                named = dict.fromkeys(line.strip() for line in handle if line.strip())
            raise AirflowFailException(f"{name}: {' | '.join(named)}")
        if code != 0:
            raise RuntimeError(f"{name} exited with code {code}; retrying if retries are left")
        result = {}
        if ours or os.path.exists(result_file):
            with open(result_file) as handle:
                result = json.load(handle)
        if not ours and (last := read_last_report(metrics_file)) is not None:
            result[LAST_REPORT] = last  # the script's last stagewise.spec.report: byo_result takes its val_metric
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["attempt"] = attempt
    return result
