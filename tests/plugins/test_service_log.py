"""make up's service logs rotate by size (stagewise.airflow.service_log): a component writes at most
(backups + 1) x max-bytes, whole lines per file, newest last; the writer outlives a stop signal until the pipe closes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from stagewise.airflow.service_log import RotatingFile
from tests.conftest import REPO_ROOT


def _files(log) -> list:
    return sorted(log.parent.glob(log.name + "*"))


def test_the_log_rolls_over_before_it_passes_its_size_and_keeps_its_backups(tmp_path):
    """100 lines of 100 bytes through a 1,000-byte file with 2 backups: three files, none past 1,000 bytes, each
    holding whole lines, and together the newest lines in order (the older ones dropped)."""
    log = tmp_path / "scheduler.log"
    target = RotatingFile(str(log), max_bytes=1000, backups=2)
    lines = [f"{n:04d} ".encode() + b"x" * 94 + b"\n" for n in range(100)]
    for line in lines:
        target.write(line)
    target.close()
    assert [path.name for path in _files(log)] == ["scheduler.log", "scheduler.log.1", "scheduler.log.2"]
    assert all(path.stat().st_size <= 1000 for path in _files(log))
    kept = (log.with_name("scheduler.log.2").read_bytes() + log.with_name("scheduler.log.1").read_bytes()
            + log.read_bytes())
    assert kept == b"".join(lines[-len(kept) // 100:]) and len(kept) >= 2000


def test_a_chunk_of_many_lines_is_cut_at_a_line_end_and_an_overlong_line_is_split(tmp_path):
    """One write holding many lines fills the file with the lines that fit; a single line longer than a whole file
    is split rather than let the file grow past its bound."""
    log = tmp_path / "api-server.log"
    target = RotatingFile(str(log), max_bytes=100, backups=3)
    target.write(b"a" * 60 + b"\n" + b"b" * 60 + b"\n")
    assert log.with_name("api-server.log.1").read_bytes() == b"a" * 60 + b"\n"
    target.write(b"c" * 250)
    target.close()
    assert all(path.stat().st_size <= 100 for path in _files(log))
    assert b"".join(p.read_bytes() for p in sorted(_files(log), reverse=True)).endswith(b"b" * 60 + b"\n" + b"c" * 250)


def test_an_existing_log_is_appended_to_and_counts_toward_the_bound(tmp_path):
    """A restart of make up continues the component's log: its bytes count, so the first rollover comes in time."""
    log = tmp_path / "dag-processor.log"
    log.write_bytes(b"before\n" * 114)  # 798 bytes: no line of what follows fits
    target = RotatingFile(str(log), max_bytes=800, backups=1)
    target.write(b"after\n" * 10)
    target.close()
    assert log.with_name("dag-processor.log.1").read_bytes() == b"before\n" * 114
    assert log.read_bytes() == b"after\n" * 10


def test_the_writer_keeps_a_stopped_services_last_lines(tmp_path):
    """As make up runs it, a service piped into the writer, one process group: a stop signal to the group ends the
    service, and the writer still writes what the service printed on its way out, then ends with the pipe."""
    log = tmp_path / "scheduler.log"
    service = ("import signal, sys, time\n"
               "signal.signal(signal.SIGTERM, lambda *a: (print('shutting down', flush=True), sys.exit(0)))\n"
               "print('x' * 300, flush=True)\n"
               "time.sleep(60)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    group = subprocess.Popen(
        ["bash", "-c", f'"{sys.executable}" -c "$0" 2>&1 | exec "{sys.executable}" -m stagewise.airflow.service_log '
                       f'"{log}" --max-bytes 200 --backups 2', service],
        env=env, start_new_session=True)
    deadline = time.monotonic() + 60
    while not (log.exists() and log.with_name("scheduler.log.1").exists()) and time.monotonic() < deadline:
        time.sleep(0.2)
    try:
        os.killpg(group.pid, signal.SIGTERM)  # what make down sends first
        while not log.read_bytes().endswith(b"shutting down\n") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert log.read_bytes().endswith(b"shutting down\n")
        assert all(path.stat().st_size <= 200 for path in _files(log))
    finally:
        group.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group.pid, signal.SIGKILL)


def test_make_up_starts_every_component_through_the_writer():
    """scripts/airflow_up.sh pipes each component it starts into stagewise.airflow.service_log, sizes stated."""
    script = (REPO_ROOT / "scripts" / "airflow_up.sh").read_text()
    assert "| exec python -m stagewise.airflow.service_log" in script
    assert "10 MiB" in script and "STAGEWISE_SERVICE_LOG_MAX_MB" in script
    assert "> \"$AIRFLOW_HOME/logs/$name.log\"" not in script, "a plain redirect grows without bound"
