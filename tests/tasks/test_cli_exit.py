"""A sub-job process skips Python's last garbage collection at exit (stagewise.core.cli.skip_final_collection): with
torch or Airflow loaded that pass cost every shard, trial, rank and `airflow dags test` 0.3 to 2 CPU-seconds. Guarded
by what the pass does: it finalizes cyclic garbage, which a frozen heap leaves to the OS."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

# A cycle with a finalizer, dropped before exit: only a collection finalizes it.
_PROGRAM = """
import atexit
from stagewise.core.cli import setup_logging, skip_final_collection
if {setup}:
    before = atexit._ncallbacks()
    setup_logging(quiet=True)
    print("hooks after the logging setup:", atexit._ncallbacks() - before)
    skip_final_collection()
    print("hooks added:", atexit._ncallbacks() - before)
class Cycle:
    def __del__(self):
        print("finalized at exit")
cycle = Cycle()
cycle.self = cycle
del cycle
"""


def _exit_output(setup: bool) -> str:
    result = subprocess.run([sys.executable, "-c", _PROGRAM.format(setup=setup)], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=60, check=True)
    return result.stdout


@pytest.mark.subprocess
def test_a_sub_job_leaves_its_heap_to_the_os_and_registers_the_hook_once():
    assert "finalized at exit" in _exit_output(setup=False)  # the control: a plain process collects at exit
    output = _exit_output(setup=True)
    assert "finalized at exit" not in output
    assert "hooks after the logging setup: 1" in output  # every sub-job's entry registers it
    assert "hooks added: 1" in output
