"""A digits stage through the Slurm backend on a real cluster (tests/slurm_cluster.py: slurmctld and two slurmd nodes in
network namespaces, munge, the machine's filesystem shared): two nodes train what one node with two processes does;
a node lost mid-stage fails the try and the retry resumes on the one node left, at the same global batch; a requeue
resumes in the same try; SIGTERM cancels the job; a bad partition is named once; any sub-job
(an inference shard's way) and an own script run as Slurm jobs. Each test gets the suite's cluster (conftest's
``slurm``) reset: every node up and idle, no job left.

Each test runs ``stagewise.airflow.backends.run_job`` (the step's own call) on a StageJob built as the step builds a
local one, so the job runs the stage's own arguments from this install on every node.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from airflow.sdk.exceptions import AirflowFailException

from stagewise.airflow import backends
from stagewise.airflow.backends import slurm as slurm_backend
from stagewise.airflow.backends.remote import Stopped
from stagewise.airflow.stage_job import StageJob, job_name, stage_job
from stagewise.definitions.loading import load_config
from tests import run_cache

pytestmark = [pytest.mark.slurm, pytest.mark.torchrun]



def stage_args(epochs: int) -> tuple[str, ...]:
    """Stage s2 of ``epochs`` epochs of 9 steps, a checkpoint every 5: a fault after its first checkpoint lands
    mid-stage (the equality test uses the reference stage of run_cache instead)."""
    return ("--stage", "s2", "--params", json.dumps({"lr": 0.02, "dropout": 0.1}),
            "--override=train.checkpoint_every_steps=5", f"--override=train.stages.1.epochs={epochs}")


LONG_STAGE = stage_args(12)
LOG = "stagewise.airflow.backends.slurm"


def slurm_job(config_path: Path, out: str, cluster, *, attempt: int = 1, args: tuple[str, ...] = LONG_STAGE,
              env: dict[str, str] | None = None, nodes: int = 2, processes_per_node: int = 1, global_batch: int | None = None,
              **settings) -> StageJob:
    """Stage s2 of the digits run on profile ddp2 made a Slurm profile of this cluster, with the local path's args."""
    raw = yaml.safe_load(config_path.read_text())
    raw["profiles"]["ddp2"].update({"backend": "slurm", "nodes": nodes, "processes_per_node": processes_per_node,
                                    "slurm": {"slurm_conf": str(cluster.conf), "poll_s": 0.5, "join_timeout_s": 120,
                                              **settings}})
    if global_batch is not None:
        raw["train"]["stages"][1].update({"global_batch": global_batch, "per_process_batch": None})
    path = config_path.with_name("slurm.yaml")
    path.write_text(yaml.safe_dump(raw))
    config = load_config(path)
    return stage_job(config, dag_id="test", run_id=Path(out).name, stage="s2", out=out, attempt=attempt, params={},
                     init_from=None, config_file=str(path), env=dict(env or {}),
                     args=("--config", str(path), "--out", out, *args))


def pointer(out: str) -> dict | None:
    path = Path(out, "train", "s2", "checkpoints", "latest.json")
    return json.loads(path.read_text()) if path.exists() else None


def after_first_checkpoint(out: str, action: Callable[[int], None], timeout: float = 240) -> threading.Thread:
    """Run ``action(step)`` in a thread as soon as the stage's first checkpoint is committed."""

    def watch() -> None:
        deadline = time.monotonic() + timeout
        while (committed := pointer(out)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if committed is not None:
            action(committed["step"])

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def live_job(cluster, job: StageJob) -> str:
    """The id of the job this try submitted (it is named after the try)."""
    name = job_name(job.dag_id, job.run_id, job.stage, job.attempt)
    ids = cluster.run("squeue", "-h", "--name", name, "-o", "%i").stdout.split()
    assert ids, f"no job named {name} in the queue"
    return ids[0]


def test_two_slurm_nodes_train_what_one_node_with_two_processes_does(slurm, digits_run, subprocess_env):
    """2 nodes x 1 process through sbatch/srun/node_launch = 1 node x 2 processes under the local launcher: steps,
    validation metric and weights; the result carries the allocation's cost (2 nodes, from scontrol: no accounting)."""
    config_path, out = digits_run
    job = slurm_job(config_path, out, slurm, args=run_cache.REFERENCE_STAGE_ARGS)
    result = backends.run_job(job)
    reference_out, reference = run_cache.reference_stage(subprocess_env)
    assert result["world_size"] == reference["world_size"] == 2
    assert (result["global_batch"], result["steps"]) == (reference["global_batch"], reference["steps"])
    assert result["val_metric"] == pytest.approx(reference["val_metric"], abs=1e-9)
    ours = torch.load(Path(out, "train", "s2", "final.pt"), weights_only=True)["model"]
    theirs = torch.load(Path(reference_out, "train", "s2", "final.pt"), weights_only=True)["model"]
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=1e-5)
    spent = result["slurm"]
    assert (spent["nodes"], spent["source"], spent["restarts"]) == (2, "scontrol", 0)
    assert spent["elapsed_s"] >= 1 and spent["cpu_time_s"] >= 2 * spent["elapsed_s"] and spent["gpu_hours"] == 0


def test_a_node_lost_mid_stage_fails_the_try_and_with_it_drained_the_retry_resumes_on_one_node_at_the_same_global_batch(
        slurm, digits_run, caplog):
    """n2 is killed (slurmd, its steps and ranks) after the first checkpoint: the try fails retryably as Slurm ends the
    job (NODE_FAIL). n2 comes back drained (an admin took it out); with min_nodes 1 the retry (attempt 2, a new
    allocation) asks for the one usable node, n1, and resumes the 2-process checkpoint resharded onto 1 process at
    global batch 128."""
    config_path, out = digits_run
    options = dict(global_batch=128, min_nodes=1, cpus_per_task=2)
    killed: list[int] = []
    watcher = after_first_checkpoint(out, lambda step: (slurm.kill_node("n2"), killed.append(step)))
    with pytest.raises(RuntimeError, match=r"Slurm job \d+ (NODE_FAIL|ended FAILED|ended NODE_FAIL)") as failed:
        backends.run_job(slurm_job(config_path, out, slurm, **options))
    watcher.join(timeout=10)
    assert killed, "the stage ended before its first checkpoint"
    assert "retrying" in str(failed.value)
    newest = pointer(out)["step"]
    assert newest >= killed[0]
    slurm.start_slurmd("n2")
    slurm.wait_node("n2", {"idle"}, timeout=60)
    slurm.drain("n2", "taken out after its failure")
    with caplog.at_level(logging.INFO):
        result = backends.run_job(slurm_job(config_path, out, slurm, attempt=2, **options))
    assert (result["world_size"], result["global_batch"], result["resumed_from_step"]) == (1, 128, newest)
    assert result["slurm"]["nodes"] == 1
    assert "written by 2 process(es), on 1: global batch 128 either way" in caplog.text


def test_a_requeued_job_restarts_and_resumes_in_the_same_try(slurm, digits_run, caplog):
    """``scontrol requeue`` after the first checkpoint: Slurm restarts the batch script (restart 1, a new rendezvous
    id), the stage resumes from its checkpoint, and run_job succeeds without an Airflow retry."""
    config_path, out = digits_run
    job = slurm_job(config_path, out, slurm)
    requeued: list[int] = []
    watcher = after_first_checkpoint(out, lambda step: (slurm.requeue(live_job(slurm, job)), requeued.append(step)))
    with caplog.at_level(logging.INFO, logger=LOG):
        result = backends.run_job(job)
    watcher.join(timeout=10)
    assert requeued, "the stage ended before its first checkpoint"
    assert result["resumed_from_step"] >= requeued[0] and result["slurm"]["restarts"] == 1
    assert "was requeued (restart 1): it restarts and resumes" in caplog.text
    assert "(restart 1) on n[1-2]" in caplog.text


def test_sigterm_to_the_waiting_task_cancels_the_job(slurm, tmp_path):
    """Airflow's kill (SIGTERM to the task) while its job runs: the wait unwinds and scancel ends the job. A stage's
    wait is this one (run_submitted), so a job that only sleeps shows it without training anything."""
    from stagewise.definitions.config import Profile

    profile = Profile(backend="slurm", slurm={"slurm_conf": str(slurm.conf), "poll_s": 0.5})
    job_ids: list[str] = []

    def kill_once_running() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not job_ids:
            job_ids.extend(slurm.run("squeue", "-h", "--name", "sleeper-t1", "-t", "R", "-o", "%i").stdout.split())
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGTERM)

    watcher = threading.Thread(target=kill_once_running, daemon=True)
    watcher.start()
    with pytest.raises(Stopped, match="the task got SIGTERM"):
        slurm_backend.run_command(["-c", "import time; print('up', flush=True); time.sleep(300)"], profile,
                                  profile.slurm, name="sleeper-t1", log_dir=str(tmp_path))
    watcher.join(timeout=10)
    assert job_ids, "the job never ran"
    record = slurm.wait_state(job_ids[0], {"CANCELLED"}, timeout=30)
    assert record["JobState"] == "CANCELLED"
    assert slurm.run("squeue", "-h", "-j", job_ids[0], "-t", "PD,R,CG", "-o", "%i").stdout.strip() == ""


def test_a_bad_partition_is_one_user_error_naming_it_and_sbatch_runs_once(slurm, digits_run, monkeypatch):
    config_path, out = digits_run
    calls: list[list[str]] = []
    command = slurm_backend._command

    def counted(settings, argv, **kwargs):
        calls.append(argv)
        return command(settings, argv, **kwargs)

    monkeypatch.setattr(slurm_backend, "_command", counted)
    with pytest.raises(AirflowFailException) as raised:
        backends.run_job(slurm_job(config_path, out, slurm, partition="gpu-nope"))
    message = str(raised.value)
    assert "Invalid partition name specified" in message and "gpu-nope" in message and "slurm.partition" in message
    assert [argv[0] for argv in calls].count("sbatch") == 1


WRITE_RESULT = ("import json, os, socket; json.dump({'host': socket.gethostname(), 'token': os.environ['SHARD_TOKEN']}, "
                "open(os.environ['STAGEWISE_RESULT_FILE'], 'w')); print('shard done')")


def test_any_sub_job_runs_as_one_node_job_and_its_end_maps_like_a_stages(slurm, tmp_path, caplog):
    """run_command (an inference shard's way): the command runs on a node with the given environment, its result file
    and cost come back, its output reaches the task log; exit USER_ERROR_EXIT is the user's (no retry), exit 1 retried."""
    from stagewise.core.errors import USER_ERROR_EXIT
    from stagewise.definitions.config import Profile

    profile = Profile(backend="slurm", slurm={"slurm_conf": str(slurm.conf), "poll_s": 0.5})
    folder = str(tmp_path / "shards")
    with caplog.at_level(logging.INFO, logger=LOG):
        result = slurm_backend.run_command(["-c", WRITE_RESULT], profile, profile.slurm, name="infer-0-t1", log_dir=folder,
                                           env={"SHARD_TOKEN": "t0k"})
    assert result["token"] == "t0k" and result["host"] in ("n1", "n2")
    assert (result["slurm"]["state"], result["slurm"]["exit_code"], result["slurm"]["nodes"]) == ("COMPLETED", 0, 1)
    assert "[node 0] shard done" in caplog.text
    with pytest.raises(AirflowFailException, match="ended FAILED"):
        slurm_backend.run_command(["-c", f"raise SystemExit({USER_ERROR_EXIT})"], profile, profile.slurm,
                                  name="infer-1-t1", log_dir=folder)
    with pytest.raises(RuntimeError, match="ended FAILED .exit 1.*retrying"):
        slurm_backend.run_command(["-c", "raise SystemExit(1)"], profile, profile.slurm, name="infer-2-t1", log_dir=folder)


def test_an_own_script_stage_runs_on_two_slurm_nodes_with_the_stage_contract(slurm, digits_run):
    """examples/byo_train.py as stage s2's entrypoint on 2 nodes x 1 process: torchrun's variables and the STAGEWISE_*
    contract reach it on every node, its result comes back, and it leaves the outputs a later stage needs."""
    from stagewise.airflow.stage_job import build
    from stagewise.scripting.stage_contract import check_byo_outputs
    from tests.conftest import REPO_ROOT

    config_path, out = digits_run
    raw = yaml.safe_load(config_path.read_text())
    raw["train"]["stages"][1]["entrypoint"] = {"script": str(REPO_ROOT / "examples" / "byo_train.py"),
                                               "args": ["--hidden", "{hidden}"]}
    raw["profiles"]["ddp2"].update({"backend": "slurm", "nodes": 2, "processes_per_node": 1,
                                    "slurm": {"slurm_conf": str(slurm.conf), "poll_s": 0.5, "join_timeout_s": 120}})
    path = config_path.with_name("byo-slurm.yaml")
    path.write_text(yaml.safe_dump(raw))
    config = load_config(path)
    run = {"dag_id": "test", "run_id": Path(out).name, "config": str(path), "overrides": {}, "out": out}
    result = backends.run_job(build(config, run, "s2", {"lr": 0.02, "hidden": 32}, None, 1))
    assert result["world_size"] == 2 and result["args"] == {"hidden": 32}
    assert result["torchrun_env"]["WORLD_SIZE"] == "2" and result["slurm"]["nodes"] == 2
    assert set(check_byo_outputs(config, "s2", out)) == {"final.pt", "model.pt"}
