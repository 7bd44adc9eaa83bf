"""MLflow tracking against a real `mlflow server`, read back with MLflow's official client: the parent run, nested
trial runs with their per-epoch objective and final state, and a server that stops mid-task (the task finishes, one
warning, the gap recorded). The tracking config refuses credentials."""

from __future__ import annotations

import logging
import time

import pytest

from stagewise.core.errors import UserError
from stagewise.definitions.loading import load_config
from stagewise.study.studies import create
from stagewise.sweep import run_worker
from stagewise.tracking.runs import (
    TRIAL_STATUS,
    Tracker,
    fail_parent,
    gaps,
    log_script_stage,
    parent_state,
    start_parent,
)
from tests.mlflow_server import free_port

pytestmark = pytest.mark.service


def _tracked(config_path, uri: str, experiment: str, **overrides):
    return load_config(config_path, {"tracking.mlflow_uri": uri, "tracking.experiment": experiment, **overrides})


def _start(config, out, run_id: str = "manual__1") -> dict:
    return start_parent(config, dag_id="ml_pipeline", run_id=run_id, out=out, config_text="name: ml\n",
                        config_hash="abc123", code_version="deadbeef")


def test_the_parent_run_is_tagged_holds_the_config_and_a_rerun_reuses_it(digits_run, mlflow_server):
    """One parent run per DAG run: tagged with pipeline, dag, run, config hash and code version, the resolved config as
    an artifact; starting the same DAG run again finds it instead of making a second."""
    config = _tracked(digits_run[0], mlflow_server.uri, "parent-test")
    out = digits_run[1]
    first = _start(config, out)
    assert _start(config, out)["parent_run_id"] == first["parent_run_id"]
    seen = mlflow_server.client(f"""
        run = client.get_run({first['parent_run_id']!r})
        found = client.search_runs([run.info.experiment_id])
        emit({{"tags": run.data.tags, "artifacts": [a.path for a in client.list_artifacts(run.info.run_id)],
              "runs": len(found), "config": open(client.download_artifacts(run.info.run_id, "config.yaml")).read()}})
    """)
    assert seen["runs"] == 1 and "config.yaml" in seen["artifacts"] and seen["config"] == "name: ml\n"
    tags = seen["tags"]
    assert (tags["stagewise.dag_id"], tags["stagewise.run_id"], tags["stagewise.config_hash"],
            tags["stagewise.code_version"]) == ("ml_pipeline", "manual__1", "abc123", "deadbeef")
    assert first["run_url"].startswith(mlflow_server.uri) and first["parent_run_id"] in first["run_url"]


def test_a_task_failing_for_good_ends_the_parent_run_failed_and_names_it(digits_run, mlflow_server):
    """The failure callback's call: the parent run ends FAILED with the task's id; re-running the DAG run resumes it."""
    config = _tracked(digits_run[0], mlflow_server.uri, "failing-test")
    out = digits_run[1]
    parent = _start(config, out, "failing")["parent_run_id"]
    fail_parent(config, out, "train_s2")
    seen = mlflow_server.client(f"""
        run = client.get_run({parent!r})
        emit([run.info.status, run.data.tags.get("stagewise.failed_task")])
    """)
    assert seen == ["FAILED", "train_s2"]
    _start(config, out, "failing")
    assert mlflow_server.client(f"emit(client.get_run({parent!r}).info.status)") == "RUNNING"


@pytest.mark.torchrun
def test_each_trial_is_a_nested_run_with_its_curve_and_its_optuna_state(digits_run, mlflow_server, monkeypatch):
    """Every trial of a sweep worker gets a nested run: its params, the objective per epoch at that epoch's step, and a
    status from its Optuna state (complete: FINISHED, pruned: KILLED, failed: FAILED), the state itself as a tag."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    config = _tracked(digits_run[0], mlflow_server.uri, "trials-test", **{
        "sweep.epochs": 3, "sweep.num_trials": 6, "sweep.num_workers": 1, "sweep.batch_size": 64, "sweep.seed": 3,
        "sweep.pruner": {"type": "median", "n_startup_trials": 1, "n_warmup_steps": 0},
        "sweep.search_space": {"lr": {"type": "categorical", "choices": [0.05, 1e-7]},
                               "hidden": {"type": "categorical", "choices": [32]}}})
    out = digits_run[1]
    parent = _start(config, out, "trials")["parent_run_id"]
    create(config, "tracked")
    run_worker(config, "tracked", 0, out)
    import optuna

    from stagewise.study.studies import open_storage

    trials = optuna.load_study(study_name="tracked", storage=open_storage(config.sweep.storage)).trials
    runs = mlflow_server.client(f"""
        exp = client.get_experiment_by_name("trials-test").experiment_id
        runs = client.search_runs([exp], filter_string="tags.`mlflow.parentRunId` = '{parent}'")
        emit([{{"trial": int(r.data.tags["stagewise.trial"]), "status": r.info.status, "state": r.data.tags["stagewise.state"],
               "params": r.data.params,
               "curve": [(m.step, m.value) for m in client.get_metric_history(r.info.run_id, "val_accuracy")]}}
              for r in runs])
    """)
    by_trial = {run["trial"]: run for run in runs}
    assert sorted(by_trial) == [t.number for t in trials]
    assert {t.state.name for t in trials} >= {"COMPLETE", "PRUNED"}, "the seed gives both outcomes"
    for trial in trials:
        run = by_trial[trial.number]
        assert (run["state"], run["status"]) == (trial.state.name, TRIAL_STATUS[trial.state.name])
        assert float(run["params"]["lr"]) == trial.params["lr"]
        assert [tuple(point) for point in run["curve"]] == sorted(trial.intermediate_values.items())


def test_a_server_that_stops_mid_task_costs_one_warning_and_a_recorded_gap(digits_run, mlflow_servers, caplog):
    """The server goes away while a task tracks: its calls never raise or block the task, the log has one warning,
    and the gap (with the calls dropped) is recorded for the report."""
    server = mlflow_servers()
    config = _tracked(digits_run[0], server.uri, "stops-test")  # a crashed server refuses at once: no timeout waited
    out = digits_run[1]
    _start(config, out, "stops")
    tracker = Tracker.for_run(config, out, "train_s1")
    stage = tracker.nested("stage-s1", "train s1", {"stagewise.kind": "stage"}, {"world_size": 1})
    tracker.log(stage, metrics={"loss": 1.0}, step=1)
    tracker.flush()  # the first epoch reached the server
    server.stop(crash=True)
    caplog.set_level(logging.WARNING, logger="stagewise.tracking")
    started = time.monotonic()
    for epoch in range(2, 12):
        tracker.log(stage, metrics={"loss": 1.0 / epoch}, step=epoch)
    assert time.monotonic() - started < 0.5, "logging only queues: the training loop never waits on the network"
    tracker.end(stage, "FINISHED")
    tracker.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "MLflow tracking" in r.getMessage()]
    assert len(warnings) == 1 and "train_s1" in warnings[0].getMessage()
    (gap,) = gaps(out)
    assert gap["task"] == "train_s1" and gap["dropped_calls"] == 10  # 9 epochs and the end; the first failed


@pytest.mark.torchrun
def test_a_stage_whose_server_stops_after_its_first_epoch_finishes_with_one_warning(digits_run, mlflow_servers, caplog,
                                                                                    monkeypatch):
    """The server stops while stage s1 trains: the stage trains every epoch and hands on its model, its log has one
    warning naming the task, and the report's tracking section names the gap."""
    import threading
    from pathlib import Path

    from stagewise import train
    from stagewise.tracking.runs import links

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    server = mlflow_servers()
    config = _tracked(digits_run[0], server.uri, "stage-stops", **{"train.stages": [
        {"name": "s1", "profile": "ddp1", "per_process_batch": 32, "epochs": 4}]})
    out = digits_run[1]
    _start(config, out, "stage-stops")
    first_epoch = Path(out, "train", "s1", "metrics.json")

    def stop_after_the_first_epoch() -> None:
        while not first_epoch.exists():
            time.sleep(0.01)
        server.stop(crash=True)

    stopper = threading.Thread(target=stop_after_the_first_epoch)
    stopper.start()
    caplog.set_level(logging.WARNING, logger="stagewise.tracking")
    result = train.run_stage(config, "s1", out, {"lr": 0.05, "hidden": 32}, None)
    stopper.join()
    assert result["epochs_run"] == 4 and Path(result["model_uri"]).exists()
    warnings = [r.getMessage() for r in caplog.records if "MLflow tracking" in r.getMessage()]
    assert len(warnings) == 1 and "train_s1" in warnings[0]
    assert [gap["task"] for gap in links(out)["gaps"]] == ["train_s1"]


def test_a_script_stage_is_a_nested_run_with_its_contract_and_its_last_objective(digits_run, mlflow_server):
    """A stage run by the user's own script: its nested run holds the contract it was given (global batch, rescaled lr)
    and the objective it last reported."""
    from stagewise.train import byo_contract

    config = _tracked(digits_run[0], mlflow_server.uri, "script-stage")
    out = digits_run[1]
    parent = _start(config, out, "script")["parent_run_id"]
    contract = byo_contract(config, str(digits_run[0]), "s2", out, {"lr": 0.05}, None)
    log_script_stage(config, out, contract, {"stage": "s2", "world_size": 2, "val_metric": 0.91, "params": None})
    (run,) = mlflow_server.client(f"""
        exp = client.get_experiment_by_name("script-stage").experiment_id
        emit([{{"params": r.data.params, "metrics": r.data.metrics, "tags": r.data.tags, "status": r.info.status}}
              for r in client.search_runs([exp], filter_string="tags.`mlflow.parentRunId` = '{parent}'")])
    """)
    assert run["tags"]["stagewise.script"] == "true" and run["status"] == "FINISHED"
    assert int(run["params"]["global_batch"]) == contract["global_batch"] and run["params"]["world_size"] == "2"
    assert float(run["params"]["stage_lr"]) == pytest.approx(contract["lr"])
    assert run["metrics"]["val_accuracy"] == pytest.approx(0.91)


def test_an_unreachable_server_at_the_start_leaves_the_run_untracked_with_the_gap_named(digits_run):
    """Nothing listens at the tracking URI: start_run goes on, the state says why, later tasks do not try again."""
    config = _tracked(digits_run[0], f"http://127.0.0.1:{free_port()}", "down", **{"tracking.timeout_s": 1})
    out = digits_run[1]
    state = _start(config, out, "down")
    assert state["parent_run_id"] is None and "ConnectionError" in state["error"]
    assert parent_state(out)["parent_run_id"] is None
    assert Tracker.for_run(config, out, "train_s1") is None
    assert [gap["task"] for gap in gaps(out)] == ["start_run"]


@pytest.mark.parametrize(("overrides", "message"), [
    ({"tracking.mlflow_uri": "http://user:secret@mlflow.example:5000"}, "holds credentials"),
    ({"tracking.mlflow_uri": "mlflow.example:5000"}, "not an http"),
    ({"registry.backend": "mlflow"}, "set tracking.mlflow_uri"),
])
def test_the_tracking_config_refuses_credentials_and_a_registry_without_a_server(write_config, overrides, message):
    """Credentials belong in the Airflow connection or the environment, never in the config (or the config snapshot)."""
    with pytest.raises(UserError, match=message):
        load_config(write_config(), overrides)
