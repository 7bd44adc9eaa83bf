"""One whole `airflow dags test` of the digits pipeline whose second stage runs on two Slurm nodes of the suite's
cluster (tests/slurm_cluster.py): the stage's task submits its job and defers (SlurmStageOperator: the trigger runs
inline in a test run, logging the job's state and both nodes' output), resumes when the job ends, and the run
succeeds with report.json naming the stage's world size, node count and cost. Its inference shard runs as a
one-node Slurm job of its own (shard_steps.slurm_subjob: backends.slurm.run_command). The storage root is this test's
tmp folder: the nodes are network namespaces of this machine, so they share its filesystem."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.dags.conftest import REPO_ROOT, airflow, make_airflow_env
from tests.dags.test_operations import small_config

pytestmark = [pytest.mark.airflow, pytest.mark.slurm, pytest.mark.torchrun, pytest.mark.slow,
              pytest.mark.timeout(1800)]


def recipe(conf: str) -> dict:
    """docs/scale-out.md's Slurm recipe, as written but for its slurm_conf: this cluster's."""
    page = (REPO_ROOT / "docs" / "scale-out.md").read_text()
    block = re.search(r"### Slurm\n.*?```yaml\n(.*?)```", page, re.DOTALL)
    assert block, "docs/scale-out.md's Slurm section has a yaml recipe"
    text = block.group(1).replace("/etc/slurm/slurm.conf", conf)
    assert conf in text, "the recipe names the cluster's slurm.conf"
    return yaml.safe_load(text)


def test_a_pipeline_whose_second_stage_runs_on_two_slurm_nodes_defers_succeeds_and_reports_its_cost(
        tmp_path, slurm):
    raw, documented = yaml.safe_load((REPO_ROOT / "pipeline.yaml").read_text()), recipe(str(slurm.conf))
    config = small_config(profiles={**raw["profiles"], **documented["profiles"]},
                          retention={"drop_after_success": False})
    config["train"]["stages"] = documented["train"]["stages"]
    config["inference"].update(documented["inference"])
    storage, home = tmp_path / "storage", tmp_path / "home"
    home.mkdir()
    env = make_airflow_env(home, str(storage), storage, config=config)

    done = airflow(env, "dags", "test", "ml_pipeline", timeout=1500)
    log = done.stdout + done.stderr

    # The stage's task deferred to the Slurm trigger, which logged the job and both nodes' output while it waited.
    submitted = re.search(r"Slurm job (\d+) \(sw-s2-[0-9a-f]+-t1\) submitted: 2 node\(s\)", log)
    assert submitted, log[-6000:]
    job_id = submitted.group(1)
    assert "Pausing task as DEFERRED" in log and "[DAG TEST] running trigger in line" in log
    assert f"waiting for Slurm job {job_id}" in log and re.search(rf"Slurm job {job_id}: RUNNING on \S+", log)
    assert f"Slurm job {job_id}: COMPLETED" in log
    assert "[node 0]" in log and "[node 1]" in log  # both nodes' output reached the task's log

    (report_path,) = storage.glob("runs/ml_pipeline/*/report.json")
    report = json.loads(report_path.read_text())
    (s2,) = [entry for entry in report["training"] if entry["stage"] == "s2"]
    assert s2["world_size"] == 2 and s2["samples_per_s"] > 0
    spent = s2["cost"]
    assert spent["nodes"] == 2 and spent["source"] in ("scontrol", "sacct", "jobcomp")
    assert spent["elapsed_s"] > 0 and spent["cpu_time_s"] >= 2 * spent["elapsed_s"] and spent["gpu_hours"] == 0
    assert [(a["attempt"], a["job_id"], a["state"]) for a in spent["attempts"]] == [(1, job_id, "COMPLETED")]
    assert report["stages"]["train_s2"]["cost"] == spent and "cost" not in report["stages"]["train_s1"]
    page = (report_path.parent / "report.html").read_text()
    assert "<th>nodes</th>" in page and "<tr data-stage='s2'" in page

    # The inference shard was a Slurm job of its own, and scored the rows.
    shard = re.search(r"submitted Slurm job (\d+) \((sw-infer-0-[0-9a-f]+-t1)\)", log)
    assert shard and shard.group(1) != job_id, log[-6000:]
    assert report["predictions"]["rows"] > 0 and (report_path.parent / "slurm" / f"{shard.group(2)}.out").exists()
