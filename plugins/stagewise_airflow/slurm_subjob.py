"""A step's sub-job on a Slurm profile (an inference shard, a sweep worker) as one one-node Slurm job of its own.

``stagewise.airflow.steps.launch_subjob`` comes here when the step's profile has ``backend: slurm``: the sub-job's
command (``python -m <module> <args> --config <snapshot>``, plus ``--result-file`` in a folder the nodes share) runs
through ``stagewise.airflow.backends.slurm.run_command``, its output in the task log, cancelled if the task ends
first. A sweep worker whose trials run DDP gets the profile's processes under torchrun on its node.
"""

from __future__ import annotations

import time
from typing import Any

from airflow.sdk.exceptions import AirflowFailException

from stagewise.core.errors import UserError
from stagewise.definitions.config import PipelineConfig


def run(config: PipelineConfig, run: dict[str, Any], module: str, args: list[str], profile: str, *, attempt: int,
        label: str, distributed: bool = False) -> dict[str, Any]:
    """Run the sub-job and return its result with ``duration_s``, ``attempt`` and, under ``slurm``, the job's cost,
    id and end. The job is named by the run, ``label`` and the try (a retry is a new one); its files go to
    ``slurm.log_dir``, else ``<run>/slurm/`` under a local storage root. A setting Slurm refuses, or the sub-job's
    own user error, fails the task without retry."""
    from stagewise.airflow import credentials
    from stagewise.airflow.backends import slurm
    from stagewise.airflow.stage_job import job_name
    from stagewise.core import storage

    chosen = config.profile(profile)
    settings = chosen.slurm
    folder = settings.log_dir or storage.join(run["out"], "slurm")
    if "://" in folder and not folder.startswith("file://"):
        raise AirflowFailException(f"profiles.{profile}.slurm.log_dir: a Slurm job's files go to a folder the nodes "
                                   f"share, not {folder}; give slurm.log_dir")
    folder = folder.removeprefix("file://")
    name = job_name(run["dag_id"], run["run_id"], label, attempt)
    argv = ["-m", module, *args, "--result-file", slurm.JobFiles.of(folder, name).result]
    started = time.monotonic()
    try:
        result = slurm.run_command(argv, chosen, settings, name=name, log_dir=folder, distributed=distributed,
                                   env=credentials.task_environment(config), import_paths=config.model.import_paths or ())
    except UserError as exc:
        raise AirflowFailException(str(exc)) from None
    return {"duration_s": round(time.monotonic() - started, 3), **result, "attempt": attempt}
