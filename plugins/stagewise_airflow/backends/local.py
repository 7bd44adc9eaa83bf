"""Backend 'local': the stage's processes under torchrun on this worker, their log streamed into the task log.

:func:`run_job` runs a :class:`~stagewise.airflow.stage_job.StageJob` through :func:`stagewise.airflow.launch.run`
(the process group, SIGTERM and the result file are handled there): stagewise.train with its arguments, or the
stage's own script or module with the STAGEWISE_* contract in its environment.
"""

from __future__ import annotations

from typing import Any

from stagewise.airflow import launch
from stagewise.airflow.stage_job import TRAIN_MODULE, StageJob


def run_job(job: StageJob) -> dict[str, Any]:
    """Run the try to its end and return its result: stagewise.train's JSON, or an own script's report and result."""
    entry = job.entry
    module = TRAIN_MODULE if entry is None else entry.module or ""
    return launch.run(module, list(job.args), job.profile, distributed=True, attempt=job.attempt,
                      script=entry.script if entry is not None else None, extra_env=job.env,
                      result_arg=entry is None, import_paths=job.import_paths)
