"""A Stagewise run in MLflow: one parent run per DAG run, a nested run per sweep trial and per training stage.

``start_parent`` (the run's first task) creates the parent run, or finds it again on a re-run, and keeps its id in
``<run>/tracking/mlflow.json``; every later task and sub-job of the run reads that file (:meth:`Tracker.for_run`).
A :class:`Tracker` hands its calls to one background thread, so a training step never waits on the network. The
first call that fails (server down, slow or refusing) stops tracking for that task with one warning in its log and
a gap record under ``<run>/tracking/gaps/``, which the report names; the work itself never fails or retries for it.
Only rank 0 tracks: sub-jobs create a Tracker on their master process only.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stagewise.core import storage
from stagewise.definitions.config import PipelineConfig
from stagewise.tracking.api import MlflowApi, TrackingError, TrackingUnavailable, now_ms, run_url

log = logging.getLogger("stagewise.tracking")

TRACKING_FILE = ("tracking", "mlflow.json")
GAPS_FOLDER = ("tracking", "gaps")
FLUSH_TIMEOUT_S = 30.0  # how long a finishing task waits for its queued calls; beyond it they are dropped and named
# How each Optuna trial state ends its MLflow run (MLflow has no "pruned": KILLED, with the Optuna state as a tag).
TRIAL_STATUS = {"COMPLETE": "FINISHED", "PRUNED": "KILLED", "FAIL": "FAILED"}


def experiment_name(config: PipelineConfig) -> str:
    return config.tracking.experiment or f"stagewise/{config.name or config.registry.model_name}"


def tracking_file(out: str) -> str:
    return storage.join(out, *TRACKING_FILE)


def record_gap(out: str, task: str, error: str, dropped: int = 0, token: str | None = None) -> str:
    """Note under the run that ``task`` could not track (the report lists these); returns the token to update it."""
    token = token or storage.unique_token()
    uri = storage.join(out, *GAPS_FOLDER, f"{storage.safe_name(task)}-{token}.json")
    try:
        storage.write_json(uri, {"task": task, "error": error[:500], "dropped_calls": dropped,
                                 "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    except Exception as exc:  # the gap note is as optional as tracking itself
        log.warning("could not record the tracking gap of %s: %s", task, exc)
    return token


def gaps(out: str) -> list[dict[str, Any]]:
    """The run's tracking gaps, oldest first."""
    fs, path = storage.filesystem(storage.join(out, *GAPS_FOLDER))
    if not fs.isdir(path):
        return []
    found = [storage.read_json(fs.unstrip_protocol(p) if "://" in out else p) for p in fs.glob(path + "/*.json")]
    return sorted(found, key=lambda gap: gap.get("at", ""))


def _warn(task: str, uri: str, exc: BaseException) -> None:
    log.warning("MLflow tracking at %s failed for %s (%s); the task goes on without tracking and the run's report names "
                "the gap", uri, task, exc)


def ensure_parent(api: MlflowApi, config: PipelineConfig, *, dag_id: str, run_id: str,
                  extra_tags: dict[str, str]) -> dict[str, Any]:
    """The DAG run's parent run, found by its dag and run id (a re-run reuses it, RUNNING again) or created."""
    experiment = api.experiment_id(experiment_name(config))
    keys = {"stagewise.dag_id": dag_id, "stagewise.run_id": run_id}
    run = api.find_run(experiment, keys)
    if run is None:
        return api.create_run(experiment, run_id, {**keys, "stagewise.pipeline": config.name, "stagewise.kind": "pipeline",
                                                   "mlflow.source.name": dag_id, **extra_tags})
    if run["info"]["status"] != "RUNNING":
        api.end_run(run["info"]["run_id"], "RUNNING")
    return run


def start_parent(config: PipelineConfig, *, dag_id: str, run_id: str, out: str, config_text: str, config_hash: str,
                 code_version: str) -> dict[str, Any]:
    """The DAG run's parent MLflow run (:func:`ensure_parent`), tagged with the config hash and code version, with the
    resolved config as an artifact. Never raises for the server: a failure leaves ``parent_run_id`` empty and a gap."""
    settings = config.tracking
    state: dict[str, Any] = {"uri": settings.mlflow_uri, "parent_run_id": None}
    try:
        api = MlflowApi(settings.mlflow_uri, settings.timeout_s)
        run = ensure_parent(api, config, dag_id=dag_id, run_id=run_id, extra_tags={
            "stagewise.config_hash": config_hash, "stagewise.code_version": code_version,
            "mlflow.source.git.commit": code_version})
        info = run["info"]
        api.upload(info["artifact_uri"], "config.yaml", config_text.encode())
        state.update(experiment_id=info["experiment_id"], parent_run_id=info["run_id"], artifact_uri=info["artifact_uri"],
                     run_url=run_url(settings.mlflow_uri, info["experiment_id"], info["run_id"]))
        log.info("MLflow run of %s/%s: %s", dag_id, run_id, state["run_url"])
    except (TrackingUnavailable, TrackingError) as exc:
        _warn("start_run", settings.mlflow_uri, exc)
        state["error"] = str(exc)[:500]
        record_gap(out, "start_run", str(exc))
    storage.write_json(tracking_file(out), state)
    return state


def parent_state(out: str) -> dict[str, Any] | None:
    """What start_parent recorded for the run (None: tracking was off, or the run began before it was on)."""
    uri = tracking_file(out)
    return storage.read_json(uri) if storage.exists(uri) else None


@dataclass
class RunHandle:
    """A nested run being created in the background: its id is filled in once the server answers."""

    key: str
    run_id: str | None = None
    artifact_uri: str | None = None
    closed: bool = field(default=False)


class Tracker:
    """One task's MLflow calls, made in order by one background thread; never blocks and never raises for the server."""

    def __init__(self, api: MlflowApi, state: dict[str, Any], out: str, task: str) -> None:
        self.api, self.state, self.out, self.task = api, state, out, task
        self.parent_run_id: str = state["parent_run_id"]
        self.experiment_id: str = state["experiment_id"]
        self.failure: BaseException | None = None
        self.dropped = 0
        self._gap_token: str | None = None
        self._calls: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._drain, name=f"mlflow-{task}", daemon=True)
        self._thread.start()

    @classmethod
    def for_run(cls, config: PipelineConfig, out: str, task: str) -> Tracker | None:
        """The run's tracker for ``task``, or None when tracking is off or its parent run could not be made (that gap
        is already recorded by start_run)."""
        if not config.tracking.mlflow_uri:
            return None
        try:
            state = parent_state(out)
        except Exception as exc:
            _warn(task, config.tracking.mlflow_uri, exc)
            record_gap(out, task, f"cannot read the run's tracking state: {exc}")
            return None
        if not state or not state.get("parent_run_id"):
            return None
        return cls(MlflowApi(config.tracking.mlflow_uri, config.tracking.timeout_s), state, out, task)

    def _drain(self) -> None:
        while (call := self._calls.get()) is not None:
            try:
                if self.failure is None:
                    call()
                else:
                    self.dropped += 1
            except Exception as exc:  # any fault of the server or the network ends tracking for this task, never the task
                self.failure = exc
                _warn(self.task, self.api.uri, exc)
                self._gap_token = record_gap(self.out, self.task, str(exc))
            finally:
                self._calls.task_done()

    def submit(self, call: Callable[[], None]) -> None:
        if self.failure is None:
            self._calls.put(call)
        else:
            self.dropped += 1

    def nested(self, key: str, name: str, tags: dict[str, Any], params: dict[str, Any]) -> RunHandle:
        """A nested run under the parent with its params, found again by ``key`` on a retry (RUNNING again; MLflow
        params are write-once, so a retry whose params differ keeps the first attempt's, with a note in the log)."""
        handle = RunHandle(key)

        def create() -> None:
            keys = {"mlflow.parentRunId": self.parent_run_id, "stagewise.key": key}
            run = self.api.find_run(self.experiment_id, keys)
            if run is None:
                run = self.api.create_run(self.experiment_id, name, {**keys, **tags})
            elif run["info"]["status"] != "RUNNING":
                self.api.end_run(run["info"]["run_id"], "RUNNING")
            handle.run_id, handle.artifact_uri = run["info"]["run_id"], run["info"]["artifact_uri"]
            try:
                self.api.log_batch(handle.run_id, params=params)
            except TrackingError as exc:
                if exc.code != "INVALID_PARAMETER_VALUE":
                    raise
                log.info("%s: MLflow run %s keeps the params of an earlier attempt (%s)", self.task, name, exc)

        self.submit(create)
        return handle

    def parent(self) -> RunHandle:
        return RunHandle("parent", self.parent_run_id, self.state.get("artifact_uri"))

    def log(self, handle: RunHandle, *, metrics: dict[str, float] | None = None, step: int = 0,
            params: dict[str, Any] | None = None, tags: dict[str, Any] | None = None) -> None:
        stamp = now_ms()
        values = [{"key": k, "value": float(v), "step": int(step), "timestamp": stamp}
                  for k, v in (metrics or {}).items() if v is not None]
        self.submit(lambda: self.api.log_batch(handle.run_id, metrics=values, params=params, tags=tags))

    def upload(self, handle: RunHandle, path: str, data: bytes) -> None:
        self.submit(lambda: self.api.upload(handle.artifact_uri, path, data))

    def end(self, handle: RunHandle, status: str) -> None:
        self.submit(lambda: self.api.end_run(handle.run_id, status))

    def flush(self) -> None:
        """Wait until every call queued so far was made or dropped."""
        self._calls.join()

    def close(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Wait (at most ``timeout_s``) for the queued calls; what is left is dropped and recorded as a gap."""
        self._calls.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            waiting = self._calls.qsize()
            exc = TrackingUnavailable(f"the server took more than {timeout_s:g}s for the task's last calls")
            if self.failure is None:
                self.failure = exc
                _warn(self.task, self.api.uri, exc)
            self.dropped += waiting
        if self.failure is not None:
            record_gap(self.out, self.task, str(self.failure), self.dropped, self._gap_token)


def trial_tags(study: str, number: int, worker: int) -> dict[str, Any]:
    return {"stagewise.kind": "trial", "stagewise.study": study, "stagewise.trial": number, "stagewise.worker": worker}


def finish_trial(tracker: Tracker, handle: RunHandle, state: str, value: float | None, metric: str,
                 error: str | None) -> None:
    """A trial's final objective and Optuna state on its nested run, which ends FINISHED, KILLED (pruned) or FAILED."""
    tags = {"stagewise.state": state, **({"stagewise.error": error} if error else {})}
    final = {f"final_val_{metric}": value} if value is not None and value == value else {}
    tracker.log(handle, metrics=final, tags=tags)
    tracker.end(handle, TRIAL_STATUS[state])


def task_call(config: PipelineConfig, out: str, task: str, work: Callable[[MlflowApi, dict[str, Any]], Any]) -> Any:
    """``work(api, parent state)`` now, in the task's own thread (bookkeeping tasks, not training): None when tracking
    is off or has no parent run; a failure warns once and records the gap instead of failing the task."""
    settings = config.tracking
    if not settings.mlflow_uri:
        return None
    state = parent_state(out)
    if not state or not state.get("parent_run_id"):
        return None
    try:
        return work(MlflowApi(settings.mlflow_uri, settings.timeout_s), state)
    except (TrackingUnavailable, TrackingError) as exc:
        _warn(task, settings.mlflow_uri, exc)
        record_gap(out, task, str(exc))
        return None


def log_script_stage(config: PipelineConfig, out: str, contract: dict[str, Any], result: dict[str, Any]) -> None:
    """A stage run by the user's own script, as a nested run: the stage's contract (world size, global batch, rescaled
    lr) and params, and the objective it last reported (its per-epoch curve stays in the script's own hands)."""
    tracker = Tracker.for_run(config, out, f"train_{result['stage']}")
    if tracker is None:
        return
    params = {**(result.get("params") or contract["params"]), "world_size": result["world_size"],
              "global_batch": contract["global_batch"], "per_process_batch": contract["per_process_batch"],
              "grad_accum_steps": contract["grad_accum_steps"], "stage_lr": contract["lr"], "epochs": contract["epochs"]}
    tracked = tracker.nested(f"stage-{result['stage']}", f"train {result['stage']}",
                             {"stagewise.kind": "stage", "stagewise.stage": result["stage"], "stagewise.script": "true"}, params)
    if result.get("val_metric") is not None:
        tracker.log(tracked, metrics={f"val_{config.objective.metric}": result["val_metric"]})
    tracker.end(tracked, "FINISHED")
    tracker.close()


def log_gate(config: PipelineConfig, out: str, registered: dict[str, Any], decision: dict[str, Any]) -> None:
    """The candidate's test metrics and the gate's decision on the parent run."""

    def work(api: MlflowApi, state: dict[str, Any]) -> None:
        stamp = now_ms()
        metrics = [{"key": key, "value": float(value), "step": 0, "timestamp": stamp} for key, value in registered.items()
                   if key.startswith("test_") and isinstance(value, (int, float))]
        tags = {"stagewise.gate": "promoted" if decision.get("promoted") else "refused",
                "stagewise.gate_reason": decision.get("reason", ""), "stagewise.model_name": registered.get("model_name", ""),
                "stagewise.model_version": registered.get("mlflow_version") or registered.get("version", ""),
                "stagewise.current_version": decision.get("current_mlflow_version") or decision.get("current", "")}
        if registered.get("model_version_url"):
            tags["stagewise.model_version_url"] = registered["model_version_url"]
        api.log_batch(state["parent_run_id"], metrics=metrics, tags=tags)

    task_call(config, out, "gate_model", work)


def finish_parent(config: PipelineConfig, out: str, report: dict[str, Any], status: str = "FINISHED") -> None:
    """The run's report (report.html and report.json) on the parent run, which then ends."""

    def work(api: MlflowApi, state: dict[str, Any]) -> None:
        for key in ("html_uri", "report_uri"):
            if report.get(key):
                api.upload(state["artifact_uri"], report[key].rsplit("/", 1)[-1], storage.read_bytes(report[key]))
        api.end_run(state["parent_run_id"], status)

    task_call(config, out, "report", work)


def fail_parent(config: PipelineConfig, out: str, task: str) -> None:
    """A task of the run failed for good: the parent run ends FAILED, naming it (a later successful re-run of the DAG
    run sets it RUNNING again)."""

    def work(api: MlflowApi, state: dict[str, Any]) -> None:
        api.log_batch(state["parent_run_id"], tags={"stagewise.failed_task": task})
        api.end_run(state["parent_run_id"], "FAILED")

    task_call(config, out, task, work)


def links(out: str, model: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The report's view of tracking: the parent run's page, the MLflow model version (``model``: a registered or
    resolved version) and every gap; None when the run was neither tracked nor served from MLflow."""
    state = parent_state(out)
    version_url = (model or {}).get("model_version_url")
    if state is None and not version_url:
        return None
    found = {"mlflow_uri": (state or {}).get("uri"), "run_url": (state or {}).get("run_url"),
             "run_id": (state or {}).get("parent_run_id"), "gaps": gaps(out)}
    if version_url:
        found.update(model_version_url=version_url,
                     model_version_label=f"{model.get('model_name', '')} v{model.get('mlflow_version')}".strip())
    return found
