"""MLflow tracking against a real `mlflow server`, read back with MLflow's official client: the parent run, nested
trial runs with their per-epoch objective and final state, and a server killed (SIGKILL) and restarted on its port and
store mid-task: the task finishes with one warning and the gap recorded, the calls made meanwhile reach the server once
it is back, runs begun during the outage are made then, and no run is left RUNNING. The tracking config refuses
credentials. (The buffer's bound, without a server: test_tracking_buffer.py.)"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from stagewise.core.errors import UserError
from stagewise.definitions.loading import load_config
from stagewise.study.studies import create
from stagewise.sweep import run_worker
from stagewise.tracking.runs import (
    TRIAL_STATUS,
    Tracker,
    fail_parent,
    finish_parent,
    gaps,
    links,
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


def _unstarted_server(folder: Path):
    """An MLflow server of the test's own, not started yet (the mlflow_servers fixture starts its servers at once)."""
    from tests.conftest import service_unavailable
    from tests.mlflow_server import MLFLOW_PYTHON, MlflowServer

    if not MLFLOW_PYTHON.exists():
        service_unavailable(f"no MLflow environment at {MLFLOW_PYTHON.parent.parent}: run `make mlflow-env`")
    return MlflowServer(folder)


def _start_or_skip(server) -> None:
    from tests.conftest import service_unavailable

    try:
        server.start()
    except RuntimeError as exc:
        service_unavailable(f"mlflow server did not start: {exc}")


def _warnings(caplog, task: str) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "MLflow tracking" in r.getMessage() and f" {task} " in r.getMessage()]


def _runs(server, experiment: str) -> dict:
    """Every run of ``experiment`` by name: status, tags, params, the end reason, and each metric's (step, value)s."""
    return server.client(f"""
        exp = client.get_experiment_by_name({experiment!r}).experiment_id
        emit({{r.info.run_name: {{"status": r.info.status, "tags": r.data.tags, "params": r.data.params,
               "id": r.info.run_id, "artifacts": [a.path for a in client.list_artifacts(r.info.run_id)],
               "history": {{key: [(m.step, m.value) for m in client.get_metric_history(r.info.run_id, key)]
                            for key in r.data.metrics}}}}
              for r in client.search_runs([exp])}})
    """)


@pytest.mark.slow
def test_runs_begun_while_the_server_is_away_are_made_and_completed_when_it_returns(digits_run, tmp_path, request, caplog):
    """The server is down from start_run on (SIGKILL), then restarted on its port and store: start_run's parent run,
    stage s1 (which ends during the outage and leaves its calls for the run's next task) and stage s2 (which starts
    during it) all appear once it answers, every metric logged meanwhile included, each run ended as its task ended it;
    logging never waits, and each task warns once and records its gap."""
    server = _unstarted_server(tmp_path / "mlflow")  # down from the start; started once, mid-task
    request.addfinalizer(server.stop)
    config = _tracked(digits_run[0], server.uri, "outage-test")
    out = digits_run[1]
    caplog.set_level(logging.INFO, logger="stagewise.tracking")
    state = _start(config, out, "outage")
    assert state["parent_run_id"] is None and state["pending_parent"]["run_id"] == "outage"

    first = Tracker.for_run(config, out, "train_s1")
    started = time.monotonic()
    s1 = first.nested("stage-s1", "train s1", {"stagewise.kind": "stage"}, {"lr": 0.1})
    for epoch in range(1, 4):
        first.log(s1, metrics={"loss": 1.0 / epoch}, step=epoch)
    first.end(s1, "FINISHED")
    assert time.monotonic() - started < 0.5, "logging only queues: the training loop never waits on the network"
    first.close(timeout_s=1)  # s1's task ends during the outage: its calls are left for the run's next task

    second = Tracker.for_run(config, out, "train_s2")  # s2 starts during the outage
    s2 = second.nested("stage-s2", "train s2", {"stagewise.kind": "stage"}, {"lr": 0.2})
    second.log(s2, metrics={"loss": 0.5}, step=10)
    _start_or_skip(server)  # on the port and with the store it was given
    second.log(s2, metrics={"loss": 0.25}, step=11)
    second.end(s2, "FINISHED")
    second.close()

    runs = _runs(server, "outage-test")
    assert set(runs) == {"outage", "train s1", "train s2"}
    parent = runs["outage"]
    assert parent["status"] == "RUNNING" and "config.yaml" in parent["artifacts"]  # until the report ends it
    assert (parent["tags"]["stagewise.run_id"], parent["tags"]["stagewise.config_hash"]) == ("outage", "abc123")
    assert runs["train s1"]["status"] == runs["train s2"]["status"] == "FINISHED"
    assert runs["train s1"]["history"]["loss"] == [[1, 1.0], [2, 0.5], [3, pytest.approx(1 / 3)]]
    assert runs["train s2"]["history"]["loss"] == [[10, 0.5], [11, 0.25]]
    assert {runs[name]["tags"]["mlflow.parentRunId"] for name in ("train s1", "train s2")} == {parent["id"]}
    assert runs["train s1"]["params"] == {"lr": "0.1"} and runs["train s2"]["tags"]["stagewise.task"] == "train_s2"
    recorded = parent_state(out)
    assert recorded["parent_run_id"] == parent["id"] and parent["id"] in recorded["run_url"]
    assert "pending_parent" not in recorded and not list(Path(out, "tracking", "pending").glob("*.json"))
    for task in ("start_run", "train_s1", "train_s2"):
        assert len(_warnings(caplog, task)) == 1, task
    by_task = {gap["task"]: gap for gap in gaps(out)}
    assert set(by_task) == {"start_run", "train_s1", "train_s2"}
    assert by_task["train_s1"]["pending_calls"] == 5 and by_task["train_s1"]["dropped_calls"] == 0
    assert by_task["train_s2"]["recovered_after_s"] > 0 and by_task["train_s2"]["dropped_calls"] == 0


@pytest.mark.torchrun
@pytest.mark.slow
def test_a_server_killed_and_restarted_mid_stage_loses_no_epoch_and_leaves_no_run_running(
        digits_run, mlflow_servers, caplog, monkeypatch):
    """SIGKILL of the server after s1's first epoch; s1 ends during the outage, s2 starts during it and the server comes
    back (same port, same store) after s2's second epoch: both stages train every epoch, both runs end FINISHED with
    every epoch's metrics, and once the report's task ends the parent, no run is RUNNING."""
    from stagewise import train
    from stagewise.tracking import runs as tracking

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    server = mlflow_servers()
    config = _tracked(digits_run[0], server.uri, "stage-outage", **{"train.stages": [
        {"name": "s1", "profile": "ddp1", "per_process_batch": 32, "epochs": 4},
        {"name": "s2", "profile": "ddp1", "per_process_batch": 64, "epochs": 4}]})
    out = digits_run[1]
    _start(config, out, "stage-outage")
    log_epoch = Tracker.log

    def log_then_fault(tracker, handle, **values):  # the faults land at a known epoch, in the training thread
        log_epoch(tracker, handle, **values)
        epoch = (values.get("metrics") or {}).get("epoch")
        if (tracker.task, epoch) == ("train_s1", 1):
            assert tracker.flush(60), "the first epoch reaches the server"
            server.stop(crash=True)
        elif (tracker.task, epoch) == ("train_s2", 2):
            server.start()

    monkeypatch.setattr(Tracker, "log", log_then_fault)
    caplog.set_level(logging.WARNING, logger="stagewise.tracking")
    monkeypatch.setattr(tracking, "FLUSH_TIMEOUT_S", 1)  # s1's task ends while the server is down
    first = train.run_stage(config, "s1", out, {"lr": 0.05, "hidden": 32}, None)
    monkeypatch.setattr(tracking, "FLUSH_TIMEOUT_S", 120)  # s2's end waits for the restarted server
    second = train.run_stage(config, "s2", out, {"lr": 0.05, "hidden": 32}, first["checkpoint_uri"])
    assert first["epochs_run"] == second["epochs_run"] == 4 and Path(second["model_uri"]).exists()
    tracking.finish_parent(config, out, {})

    runs = _runs(server, "stage-outage")
    assert {name: run["status"] for name, run in runs.items()} == {
        "stage-outage": "FINISHED", "train s1": "FINISHED", "train s2": "FINISHED"}
    for name in ("train s1", "train s2"):
        assert [value for _, value in runs[name]["history"]["epoch"]] == [1, 2, 3, 4], name
        assert len(runs[name]["history"]["loss"]) == 4 and "stagewise.end_reason" not in runs[name]["tags"]
    assert int(runs["train s2"]["params"]["global_batch"]) == second["global_batch"]
    assert len(_warnings(caplog, "train_s1")) == len(_warnings(caplog, "train_s2")) == 1
    assert [gap["task"] for gap in links(out)["gaps"]] == ["train_s1", "train_s2"]
    assert not list(Path(out, "tracking", "pending").glob("*.json"))


def test_a_run_still_running_when_the_report_ends_the_parent_is_killed_with_the_reason(digits_run, mlflow_server):
    """A stage whose process was killed never ended its run: the report's task ends it KILLED, saying why, and a task
    failing for good ends its own runs FAILED; nothing stays RUNNING."""
    config = _tracked(digits_run[0], mlflow_server.uri, "orphans")
    out = digits_run[1]
    _start(config, out, "orphans")
    for task in ("train_s1", "train_s2"):
        tracker = Tracker.for_run(config, out, task)
        tracker.nested(f"stage-{task[-2:]}", f"train {task[-2:]}", {"stagewise.kind": "stage"}, {})
        tracker.flush(60)
        tracker._open.clear()  # as if its process died: nothing ends the run
        tracker.close()
    fail_parent(config, out, "train_s2")
    finish_parent(config, out, {})
    runs = _runs(mlflow_server, "orphans")
    assert runs["train s2"]["status"] == "FAILED" and runs["train s2"]["tags"]["stagewise.end_reason"] == "task train_s2 failed"
    assert runs["train s1"]["status"] == "KILLED" and "report" in runs["train s1"]["tags"]["stagewise.end_reason"]
    assert runs["orphans"]["status"] == "FINISHED"


def test_a_script_stage_is_a_nested_run_with_its_contract_and_its_last_objective(digits_run, mlflow_server):
    """A stage run by the user's own script: its nested run holds the contract it was given (global batch, rescaled lr)
    and the objective it last reported."""
    from stagewise.scripting.stage_contract import byo_contract

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


def test_an_unreachable_server_at_the_start_leaves_the_parent_to_the_first_task_that_reaches_it(digits_run):
    """Nothing listens at the tracking URI: start_run goes on, the state says why and keeps what the parent run needs,
    and a later task's tracker is there to make it (its calls wait, then are left for the next task)."""
    config = _tracked(digits_run[0], f"http://127.0.0.1:{free_port()}", "down", **{"tracking.timeout_s": 1})
    out = digits_run[1]
    state = _start(config, out, "down")
    assert state["parent_run_id"] is None and "ConnectionError" in state["error"]
    assert parent_state(out)["pending_parent"]["tags"]["stagewise.code_version"] == "deadbeef"
    tracker = Tracker.for_run(config, out, "train_s1")
    assert tracker is not None and tracker.parent_run_id is None
    tracker.close(timeout_s=0.2)
    assert [gap["task"] for gap in gaps(out)] == ["start_run", "train_s1"]


@pytest.mark.parametrize(("overrides", "message"), [
    ({"tracking.mlflow_uri": "http://user:secret@mlflow.example:5000"}, "holds credentials"),
    ({"tracking.mlflow_uri": "mlflow.example:5000"}, "not an http"),
    ({"registry.backend": "mlflow"}, "set tracking.mlflow_uri"),
])
def test_the_tracking_config_refuses_credentials_and_a_registry_without_a_server(write_config, overrides, message):
    """Credentials belong in the Airflow connection or the environment, never in the config (or the config snapshot)."""
    with pytest.raises(UserError, match=message):
        load_config(write_config(), overrides)
