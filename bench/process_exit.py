"""A sub-job process's CPU with and without its last garbage collection at exit (stagewise.core.cli's
skip_final_collection, which every sub-job's entry registers).

Run: ``python -m bench --only subjob_exit_cpu``. Both sides are the same fresh ``python -c`` process: it imports what a
training rank imports (stagewise.train, torch), builds an optimizer (which loads torch._dynamo, as every rank does),
then enters the sub-job's logging setup and exits. The baseline unregisters the exit hook first, so Python's shutdown
collects the whole heap as it would without Stagewise's hook. CPU is the child's own (user + system, from wait4),
median of REPEATS, the two sides interleaved.
ratio = our CPU / the baseline's CPU.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
REPEATS = 5
_PROGRAM = """
import torch
import stagewise.train
from stagewise.core.cli import setup_logging
setup_logging(quiet=True)
module = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
if {baseline}:
    import atexit, gc
    atexit.unregister(gc.freeze)
"""


def _cpu_of(baseline: bool) -> float:
    """The CPU seconds one such process spent, start to exit."""
    child = subprocess.Popen([sys.executable, "-c", _PROGRAM.format(baseline=baseline)], cwd=REPO_ROOT,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise RuntimeError(f"the probe process exited {child.returncode}")
    return usage.ru_utime + usage.ru_stime


def subjob_exit_cpu(rows: int | None = None) -> dict[str, Any]:
    """CPU of a rank-like sub-job process: exit without the last collection vs with it."""
    ours, baseline = [], []
    for _ in range(REPEATS):
        ours.append(_cpu_of(baseline=False))
        baseline.append(_cpu_of(baseline=True))
    return {"ours": round(statistics.median(ours), 3), "baseline": round(statistics.median(baseline), 3),
            "unit": "CPU-s per process", "details": {"repeats": REPEATS, "ours_all": ours, "baseline_all": baseline}}
