"""stagewise.airflow.stage_steps.with_cost: a Slurm stage's result from the backend's run_job (its try's cost under
``slurm``) becomes the result with ``cost`` summed over this try and the ones before, the try's entry recorded once."""

from __future__ import annotations

import types

from stagewise.airflow.stage_steps import with_cost
from stagewise.reporting import cost
from tests.plugins.test_slurm_deferrable import slurm_config

SPENT = {"job_id": "9", "elapsed_s": 10.0, "cpu_time_s": 40.0, "nodes": 2, "gpu_hours": 0.0, "restarts": 0,
         "source": "scontrol"}


def test_the_backends_figures_become_the_stages_cost_over_its_attempts(tmp_path):
    _, config = slurm_config(tmp_path)
    out = str(tmp_path / "storage" / "runs" / "d" / "r")
    cost.record(out, "s2", 1, {**SPENT, "job_id": "8", "elapsed_s": 5.0}, job_id="8", state="NODE_FAIL")
    job = types.SimpleNamespace(out=out, stage="s2", attempt=2)
    result = with_cost(config, job, {"global_batch": 64, "slurm": dict(SPENT)})
    assert "slurm" not in result and result["global_batch"] == 64
    assert [(a["attempt"], a["job_id"]) for a in result["cost"]["attempts"]] == [(1, "8"), (2, "9")]
    assert (result["cost"]["elapsed_s"], result["cost"]["nodes"]) == (15.0, 2)
    # A try whose entry the operator already wrote (the deferred path) is not written again.
    again = with_cost(config, job, {"slurm": {**SPENT, "elapsed_s": 99.0}})
    assert again["cost"]["elapsed_s"] == 15.0
