"""A Stagewise run in MLflow: one parent run per DAG run, a nested run per sweep trial and per training stage.

``start_parent`` (the run's first task) creates the parent run, or finds it again on a re-run, and keeps its id in
``<run>/tracking/mlflow.json``; every later task and sub-job of the run reads that file (:meth:`Tracker.for_run`).
A :class:`Tracker` hands its calls to one background thread, so a training step never waits on the network.

A server that goes away costs one warning in the task's log and a gap record under ``<run>/tracking/gaps/`` (which
the report names); the work itself never fails or retries for it. Meanwhile the calls wait in a buffer bounded in
count and bytes (stagewise.tracking.calls; what does not fit is dropped and counted in the gap) and are retried with
backoff; once the server answers they are sent in order, runs a task began during the outage (the parent run too,
when start_run could not make it) are created then. What a task still holds when it ends is written under
``<run>/tracking/pending/`` and sent by the run's next task that reaches the server, and the report's task ends any
nested run still RUNNING as KILLED with a reason: no run is left RUNNING once the server answers again.
Only rank 0 tracks: sub-jobs create a Tracker on their master process only.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from stagewise.core import assets, storage
from stagewise.definitions.config import PipelineConfig
from stagewise.tracking.api import MlflowApi, TrackingError, TrackingUnavailable, now_ms, run_url
from stagewise.tracking.calls import (  # RunHandle too: callers find it here, where it lived
    MAX_BYTES,
    MAX_CALLS,
    Call,
    CallBuffer,
    RunHandle,
    claim_pending,
    from_records,
    write_pending,
)

log = logging.getLogger("stagewise.tracking")

TRACKING_FILE = ("tracking", "mlflow.json")
GAPS_FOLDER = ("tracking", "gaps")
FLUSH_TIMEOUT_S = 30.0  # how long a finishing task waits for its calls; beyond it they are left to the run's next task
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.5, 5.0  # retries of a server that is away: 0.5 s, doubling, at most 5 s apart
END_REASON_TAG = "stagewise.end_reason"  # why a run ended FAILED or KILLED other than by its own task
# How each Optuna trial state ends its MLflow run (MLflow has no "pruned": KILLED, with the Optuna state as a tag).
TRIAL_STATUS = {"COMPLETE": "FINISHED", "PRUNED": "KILLED", "FAIL": "FAILED"}


def experiment_name(config: PipelineConfig) -> str:
    return config.tracking.experiment or f"stagewise/{config.name or config.registry.model_name}"


def tracking_file(out: str) -> str:
    return storage.join(out, *TRACKING_FILE)


def record_gap(out: str, task: str, error: str, dropped: int = 0, token: str | None = None, **extra: Any) -> str:
    """Note under the run that ``task`` could not track (the report lists these); returns the token to update it.
    ``extra``: how the outage ended (``recovered_after_s``) or what was left for a later task (``pending_calls``)."""
    token = token or storage.unique_token()
    uri = storage.join(out, *GAPS_FOLDER, f"{storage.safe_name(task)}-{token}.json")
    try:
        storage.write_json(uri, {"task": task, "error": error[:500], "dropped_calls": dropped,
                                 "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **extra})
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
    log.warning("MLflow tracking at %s failed for %s (%s); the task goes on, its calls wait (bounded) and are sent "
                "when the server answers again, and the run's report names the gap", uri, task, exc)


def parent_tags(config: PipelineConfig, dag_id: str) -> dict[str, str]:
    return {"stagewise.pipeline": config.name, "stagewise.kind": "pipeline", "mlflow.source.name": dag_id}


def ensure_parent(api: MlflowApi, config: PipelineConfig, *, dag_id: str, run_id: str,
                  extra_tags: dict[str, str]) -> dict[str, Any]:
    """The DAG run's parent run, found by its dag and run id (a re-run reuses it, RUNNING again) or created."""
    return _ensure_parent(api, experiment_name(config), dag_id, run_id, {**parent_tags(config, dag_id), **extra_tags})


def _ensure_parent(api: MlflowApi, experiment_name: str, dag_id: str, run_id: str, tags: dict[str, str]) -> dict[str, Any]:
    experiment = api.experiment_id(experiment_name)
    keys = {"stagewise.dag_id": dag_id, "stagewise.run_id": run_id}
    run = api.find_run(experiment, keys)
    if run is None:
        created = api.create_run(experiment, run_id, {**keys, **tags})
        # Two tasks that came back from an outage together may both have made one: both keep the older, the other goes.
        found = api.search_runs(experiment, keys, max_results=10) or [created]
        oldest = min(found, key=lambda r: (int(r["info"].get("start_time") or 0), r["info"]["run_id"]))
        if oldest["info"]["run_id"] != created["info"]["run_id"]:
            api.delete_run(created["info"]["run_id"])
        return oldest
    if run["info"]["status"] != "RUNNING":
        api.end_run(run["info"]["run_id"], "RUNNING")
    return run


def start_parent(config: PipelineConfig, *, dag_id: str, run_id: str, out: str, config_text: str, config_hash: str,
                 code_version: str, stagewise_version: str = "") -> dict[str, Any]:
    """The DAG run's parent MLflow run (:func:`ensure_parent`), tagged with the config hash, code version and Stagewise
    version (the run's, from its start: stagewise.reporting.lineage), with the resolved config as an artifact. Never
    raises for the server: a failure leaves ``parent_run_id`` empty, a gap, and in ``pending_parent`` what the run's
    first tracker to reach the server needs to make it."""
    settings = config.tracking
    state: dict[str, Any] = {"uri": settings.mlflow_uri, "parent_run_id": None}
    tags = {"stagewise.config_hash": config_hash, "stagewise.code_version": code_version,
            "mlflow.source.git.commit": code_version,
            **({"stagewise.stagewise_version": stagewise_version} if stagewise_version else {})}
    try:
        api = MlflowApi(settings.mlflow_uri, settings.timeout_s)
        run = ensure_parent(api, config, dag_id=dag_id, run_id=run_id, extra_tags=tags)
        info = run["info"]
        api.upload(info["artifact_uri"], "config.yaml", config_text.encode())
        state.update(experiment_id=info["experiment_id"], parent_run_id=info["run_id"], artifact_uri=info["artifact_uri"],
                     run_url=run_url(settings.mlflow_uri, info["experiment_id"], info["run_id"]))
        log.info("MLflow run of %s/%s: %s", dag_id, run_id, state["run_url"])
    except (TrackingUnavailable, TrackingError) as exc:
        _warn("start_run", settings.mlflow_uri, exc)
        state["error"] = str(exc)[:500]
        state["pending_parent"] = {"experiment": experiment_name(config), "dag_id": dag_id, "run_id": run_id,
                                   "tags": {**parent_tags(config, dag_id), **tags}, "config_text": config_text}
        record_gap(out, "start_run", str(exc))
    storage.write_json(tracking_file(out), state)
    return state


def parent_state(out: str) -> dict[str, Any] | None:
    """What start_parent recorded for the run (None: tracking was off, or the run began before it was on)."""
    uri = tracking_file(out)
    return storage.read_json(uri) if storage.exists(uri) else None


class _Unsendable(Exception):
    """A call whose run was never made (its creation was refused): it is dropped like a refused one."""


class Tracker:
    """One task's MLflow calls, made in order by one background thread; never blocks and never raises for the server.

    While the server is away the calls wait in a :class:`CallBuffer` (``max_calls``, ``max_bytes``) and the head one
    is retried with backoff; a call the server refuses (4xx) is dropped and counted, the rest go on."""

    def __init__(self, api: MlflowApi, state: dict[str, Any], out: str, task: str, *, max_calls: int = MAX_CALLS,
                 max_bytes: int = MAX_BYTES) -> None:
        self.api, self.state, self.out, self.task = api, state, out, task
        self._parent = RunHandle("parent", state.get("parent_run_id"), state.get("artifact_uri"))
        self.experiment_id: str | None = state.get("experiment_id")
        self.failure: BaseException | None = None  # the last fault met (an outage or a refusal)
        self._buffer = CallBuffer(max_calls, max_bytes)
        self._refused = 0  # calls dropped because the server refused them (the buffer counts those it had no room for)
        self._recorded = 0  # dropped calls already counted in a gap record
        self._outage: dict[str, Any] | None = None  # the outage going on: since when, its gap record's token
        self._open: dict[str, RunHandle] = {}  # nested runs begun and not yet ended, ended FAILED if the process exits
        self._wake = threading.Condition()
        self._gap_lock = threading.Lock()  # taken before _wake: an outage's gap record is written once, then updated
        self._sending = self._closing = self._closed = self._abandoned = self._nudged = False
        if self._parent.run_id is None:  # start_run could not make it: the first call that reaches the server does
            self._buffer.put(Call(kind="parent", handle=self._parent, body=dict(state["pending_parent"])))
        self._buffer.put(Call(kind="replay"))  # what earlier tasks of the run left unsent goes first
        self._thread = threading.Thread(target=self._drain, name=f"mlflow-{task}", daemon=True)
        self._thread.start()
        atexit.register(self._at_exit)

    @classmethod
    def for_run(cls, config: PipelineConfig, out: str, task: str) -> Tracker | None:
        """The run's tracker for ``task``, or None when tracking is off or the run has no tracking state."""
        if not config.tracking.mlflow_uri:
            return None
        try:
            state = parent_state(out)
        except Exception as exc:
            _warn(task, config.tracking.mlflow_uri, exc)
            record_gap(out, task, f"cannot read the run's tracking state: {exc}")
            return None
        if not state or not (state.get("parent_run_id") or state.get("pending_parent")):
            return None
        return cls(MlflowApi(config.tracking.mlflow_uri, config.tracking.timeout_s), state, out, task)

    @property
    def parent_run_id(self) -> str | None:
        return self._parent.run_id

    @property
    def dropped(self) -> int:
        """Calls that will never be sent: no room in the buffer, or refused by the server."""
        return self._buffer.dropped + self._refused

    # --- what the task calls (from its own thread: each only queues) ---

    def submit(self, call: Call) -> None:
        with self._wake:
            if self._closed:
                self._refused += 1
                return
            self._buffer.put(call)
            self._wake.notify_all()

    def nested(self, key: str, name: str, tags: dict[str, Any], params: dict[str, Any]) -> RunHandle:
        """A nested run under the parent with its params, found again by ``key`` on a retry (RUNNING again; MLflow
        params are write-once, so a retry whose params differ keeps the first attempt's, with a note in the log)."""
        handle = RunHandle(key)
        self._open[key] = handle
        self.submit(Call(kind="create", handle=handle,
                         body={"name": name, "tags": {"stagewise.task": self.task, **tags}, "params": dict(params)}))
        return handle

    def parent(self) -> RunHandle:
        return self._parent

    def log(self, handle: RunHandle, *, metrics: dict[str, float] | None = None, step: int = 0,
            params: dict[str, Any] | None = None, tags: dict[str, Any] | None = None) -> None:
        stamp = now_ms()
        values = [{"key": k, "value": float(v), "step": int(step), "timestamp": stamp}
                  for k, v in (metrics or {}).items() if v is not None]
        if values or params or tags:
            self.submit(Call(kind="log", handle=handle, body={"metrics": values, "params": dict(params or {}),
                                                              "tags": dict(tags or {})}))

    def upload(self, handle: RunHandle, path: str, data: bytes) -> None:
        self.submit(Call(kind="upload", handle=handle, body={"path": path, "data": data}, size=len(data) + 64))

    def end(self, handle: RunHandle, status: str, reason: str | None = None) -> None:
        """End the run FINISHED, FAILED or KILLED (``reason``: the tag saying why)."""
        self._open.pop(handle.key, None)
        self.submit(Call(kind="end", handle=handle, body={"status": status, **({"reason": reason} if reason else {})}))

    def end_running(self, status: str, reason: str, task: str | None = None) -> None:
        """End every nested run of the parent still RUNNING (only ``task``'s, when given) with ``status`` and ``reason``."""
        self.submit(Call(kind="sweep", body={"status": status, "reason": reason, "task": task}))

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every call queued so far was sent or dropped; False when ``timeout_s`` passed first."""
        with self._wake:
            return self._wake.wait_for(lambda: not self._buffer and not self._sending, timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        """Wait (at most ``timeout_s``, default FLUSH_TIMEOUT_S) for the calls still queued, retried while the server is
        away; what is left then goes under ``<run>/tracking/pending/`` for the run's next task, and the gap says so."""
        with self._wake:
            if self._closed:
                return
            self._closed = self._closing = self._nudged = True  # nudged: a retry waiting out its backoff goes now
            self._wake.notify_all()
        atexit.unregister(self._at_exit)
        self._thread.join(self._waited(timeout_s))
        with self._wake:
            left = self._buffer.take_all() if self._thread.is_alive() else []
            self._abandoned = True
            self._wake.notify_all()
        kept = 0
        if left:
            if self.failure is None:  # slow, not down: no warning was given yet
                self.failure = TrackingUnavailable(f"the server took more than {self._waited(timeout_s):g}s for "
                                                   f"the task's last calls")
                _warn(self.task, self.api.uri, self.failure)
            kept = self._leave(left)
            if kept:
                log.info("%s: %d MLflow call(s) not sent yet are left under %s for the run's next task that reaches the "
                         "server", self.task, kept, storage.join(self.out, "tracking", "pending"))
        self._close_gap(pending_calls=kept, unsent=len(left))

    @staticmethod
    def _waited(timeout_s: float | None) -> float:
        return FLUSH_TIMEOUT_S if timeout_s is None else timeout_s

    # --- the background thread ---

    def _drain(self) -> None:
        delay = BACKOFF_FIRST_S
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._buffer or self._closing)
                if self._abandoned or not self._buffer:
                    return
                batch = self._next_batch()
                self._sending = True
            follow: list[Call] = []
            try:
                follow = self._send(batch)
            except TrackingUnavailable as exc:
                self._away(exc)
                with self._wake:
                    self._sending = False
                    self._wake.notify_all()
                    self._wake.wait_for(lambda: self._abandoned or self._nudged, delay)
                    self._nudged = False
                delay = min(delay * 2, BACKOFF_MAX_S)
                continue
            except Exception as exc:  # refused, or its run never made: this call is dropped, never the task
                if isinstance(exc, TrackingError):
                    self._back()
                self._refuse(batch, exc)
            else:
                self._back()
            delay = BACKOFF_FIRST_S
            with self._wake:
                self._sending = False
                orphaned = follow if self._abandoned else []
                if not self._abandoned:
                    self._buffer.pop(len(batch))
                    self._buffer.push_front(follow)
                self._wake.notify_all()
            if orphaned:  # claimed from another task while this one was closing: left again, never lost
                self._leave(orphaned)
                return

    def _next_batch(self) -> list[Call]:
        """The head call; consecutive metric logs of one run go as one request (MLflow takes 1000 metrics per batch)."""
        calls = self._buffer.head(64)
        first, count = calls[0], len(calls[0].body.get("metrics", ()))
        batch = [first]
        for call in calls[1:] if first.kind == "log" else ():
            more = len(call.body["metrics"]) if call.kind == "log" else 0
            if call.kind != "log" or call.handle is not first.handle or call.body["params"] or count + more > 1000:
                break
            batch.append(call)
            count += more
        return batch

    def _send(self, batch: list[Call]) -> list[Call]:
        """Make the calls of ``batch``; returns the calls to make next (another task's, claimed by a replay)."""
        call = batch[0]
        if call.kind == "parent":
            self._make_parent(call.body)
        elif call.kind == "replay":
            self.api.request("GET", "health", raw=True)  # only a server that answers is worth claiming others' calls for
            records = claim_pending(self.out, self.task)
            loaded = from_records([entry for record in records for entry in record["calls"]], self._parent)
            if loaded:
                log.info("%s sends %d MLflow call(s) left by %s", self.task, len(loaded),
                         ", ".join(sorted({record["task"] for record in records})))
            return loaded
        elif call.kind == "sweep":
            self._end_running(**call.body)
        elif call.kind == "create":
            self._create(call)
        elif call.handle is None or call.handle.run_id is None:
            raise _Unsendable(f"a {call.kind} call of '{getattr(call.handle, 'key', '?')}', whose run was never made")
        elif call.kind == "log":
            self._log_batch(call.handle.run_id, batch)
        elif call.kind == "upload":
            self.api.upload(call.handle.artifact_uri, call.body["path"], call.body["data"])
        elif call.kind == "end":
            if call.body.get("reason"):
                self.api.log_batch(call.handle.run_id, tags={END_REASON_TAG: call.body["reason"]})
            self.api.end_run(call.handle.run_id, call.body["status"])
        return []

    def _log_batch(self, run_id: str, batch: list[Call]) -> None:
        metrics = [metric for call in batch for metric in call.body["metrics"]]
        tags = {key: value for call in batch for key, value in call.body["tags"].items()}
        params = batch[0].body["params"]
        try:
            self.api.log_batch(run_id, metrics=metrics, params=params, tags=tags)
        except TrackingError as exc:  # params are write-once: an earlier attempt's stay, the metrics still go
            if exc.code != "INVALID_PARAMETER_VALUE" or not params:
                raise
            log.info("%s: MLflow run %s keeps the params of an earlier attempt (%s)", self.task, run_id, exc)
            self.api.log_batch(run_id, metrics=metrics, tags=tags)

    def _make_parent(self, pending: dict[str, Any]) -> None:
        run = _ensure_parent(self.api, pending["experiment"], pending["dag_id"], pending["run_id"], pending["tags"])
        info = run["info"]
        if pending.get("config_text") is not None:
            self.api.upload(info["artifact_uri"], "config.yaml", pending["config_text"].encode())
        self.experiment_id = info["experiment_id"]
        self._parent.run_id, self._parent.artifact_uri = info["run_id"], info["artifact_uri"]
        state = {key: value for key, value in self.state.items() if key != "pending_parent"}
        state.update(parent_run_id=info["run_id"], experiment_id=info["experiment_id"], artifact_uri=info["artifact_uri"],
                     run_url=run_url(self.api.uri, info["experiment_id"], info["run_id"]), made_by=self.task)
        try:
            storage.write_json(tracking_file(self.out), state)
        except Exception as exc:  # later tasks find the run by its tags instead
            log.warning("could not record the MLflow parent run of the run: %s", exc)
        log.info("MLflow run of %s/%s, made by %s once the server answered: %s", pending["dag_id"], pending["run_id"],
                 self.task, state["run_url"])

    def _create(self, call: Call) -> None:
        handle = call.handle
        if self._parent.run_id is None:
            raise _Unsendable(f"the run '{handle.key}' of a parent run that was never made")
        keys = {"mlflow.parentRunId": self._parent.run_id, "stagewise.key": handle.key}
        run = self.api.find_run(self.experiment_id, keys)  # a retried create finds what its first try made
        if run is None:
            run = self.api.create_run(self.experiment_id, call.body["name"], {**keys, **call.body["tags"]})
        elif run["info"]["status"] != "RUNNING":
            self.api.end_run(run["info"]["run_id"], "RUNNING")
        handle.run_id, handle.artifact_uri = run["info"]["run_id"], run["info"]["artifact_uri"]
        try:
            self.api.log_batch(handle.run_id, params=call.body["params"])
        except TrackingError as exc:
            if exc.code != "INVALID_PARAMETER_VALUE":
                raise
            log.info("%s: MLflow run %s keeps the params of an earlier attempt (%s)", self.task, call.body["name"], exc)

    def _end_running(self, status: str, reason: str, task: str | None) -> None:
        if self._parent.run_id is None:
            raise _Unsendable("ending the runs of a parent run that was never made")
        tags = {"mlflow.parentRunId": self._parent.run_id, **({"stagewise.task": task} if task else {})}
        for run in self.api.search_runs(self.experiment_id, tags, status="RUNNING"):
            run_id = run["info"]["run_id"]
            self.api.log_batch(run_id, tags={END_REASON_TAG: reason})
            self.api.end_run(run_id, status)
            log.info("%s: MLflow run %s ended %s: %s", self.task, run_id, status, reason)

    # --- outages, refusals and their gap records ---

    def _away(self, exc: BaseException) -> None:
        with self._wake:
            if self._abandoned:
                return
            if self._outage is not None:  # the same outage: warned and recorded already
                self.failure = exc
                return
            outage = {"since": time.monotonic(), "token": storage.unique_token()}
            self.failure, self._outage = exc, outage
        _warn(self.task, self.api.uri, exc)
        with self._gap_lock:  # close() may have written this outage's record meanwhile: one record per outage
            if self._outage is outage:
                record_gap(self.out, self.task, str(exc), token=outage["token"])

    def _back(self) -> None:
        with self._wake:
            outage = self._outage
            if outage is None or self._abandoned:
                return
            self._outage = None
            dropped, self._recorded = self.dropped - self._recorded, self.dropped
        seconds = time.monotonic() - outage["since"]
        log.info("MLflow tracking at %s answers %s again after %.0fs: the calls held meanwhile are sent (%d dropped)",
                 self.api.uri, self.task, seconds, dropped)
        with self._gap_lock:
            record_gap(self.out, self.task, str(self.failure), dropped, outage["token"],
                       recovered_after_s=round(seconds, 1))

    def _refuse(self, batch: list[Call], exc: BaseException) -> None:
        with self._wake:
            first = self._refused == 0
            self._refused += len(batch)
            self.failure = exc
        if first:
            log.warning("MLflow tracking at %s refused a %s call of %s (%s: %s); the call is dropped, the rest go on, and "
                        "the run's report names the gap", self.api.uri, batch[0].kind, self.task, type(exc).__name__, exc)

    def _leave(self, calls: list[Call]) -> int:
        try:
            return write_pending(self.out, self.task, calls, str(self.failure or "the task ended first"), self.dropped)
        except Exception as exc:
            log.warning("%s: could not keep %d unsent MLflow call(s) for a later task: %s", self.task, len(calls), exc)
            with self._wake:
                self._refused += len(calls)
            return 0

    def _close_gap(self, pending_calls: int, unsent: int) -> None:
        with self._gap_lock:
            with self._wake:
                outage, self._outage = self._outage, None
                dropped, self._recorded = self.dropped - self._recorded, self.dropped
            if outage is not None or dropped or unsent:
                record_gap(self.out, self.task, str(self.failure or "the buffer was full"), dropped,
                           outage["token"] if outage else None, pending_calls=pending_calls)

    def _at_exit(self) -> None:
        """The process exits with runs of this task still open (an error ended it): they end FAILED, saying so."""
        for handle in list(self._open.values()):
            self.end(handle, "FAILED", "the task's process exited before it ended this run")
        self.close()


def trial_tags(study: str, number: int, worker: int) -> dict[str, Any]:
    return {"stagewise.kind": "trial", "stagewise.study": study, "stagewise.trial": number, "stagewise.worker": worker}


def finish_trial(tracker: Tracker, handle: RunHandle, state: str, value: float | None, metric: str,
                 error: str | None) -> None:
    """A trial's final objective and Optuna state on its nested run, which ends FINISHED, KILLED (pruned) or FAILED."""
    tags = {"stagewise.state": state, **({"stagewise.error": error} if error else {})}
    final = {f"final_val_{metric}": value} if value is not None and value == value else {}
    tracker.log(handle, metrics=final, tags=tags)
    tracker.end(handle, TRIAL_STATUS[state])


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


def _bookkeeping(config: PipelineConfig, out: str, task: str, work: Callable[[Tracker], None]) -> None:
    """``work(tracker)`` in a bookkeeping task (not training): its calls, and those earlier tasks left, get
    FLUSH_TIMEOUT_S to reach the server; an outage warns once and records the gap instead of failing the task."""
    tracker = Tracker.for_run(config, out, task)
    if tracker is None:
        return
    try:
        work(tracker)
    finally:
        tracker.close()


def log_gate(config: PipelineConfig, out: str, registered: dict[str, Any], decision: dict[str, Any]) -> None:
    """The candidate's test metrics and the gate's decision on the parent run."""

    def work(tracker: Tracker) -> None:
        metrics = {key: float(value) for key, value in registered.items()
                   if key.startswith("test_") and isinstance(value, (int, float))}
        tags = {"stagewise.gate": "promoted" if decision.get("promoted") else "refused",
                "stagewise.gate_reason": decision.get("reason", ""), "stagewise.model_name": registered.get("model_name", ""),
                "stagewise.model_version": registered.get("mlflow_version") or registered.get("version", ""),
                "stagewise.current_version": decision.get("current_mlflow_version") or decision.get("current", "")}
        if registered.get("model_version_url"):
            tags["stagewise.model_version_url"] = registered["model_version_url"]
        tracker.log(tracker.parent(), metrics=metrics, tags=tags)

    _bookkeeping(config, out, "gate_model", work)


def finish_parent(config: PipelineConfig, out: str, report: dict[str, Any], status: str = "FINISHED") -> None:
    """The run's report (report.html and report.json) on the parent run, which then ends; a nested run still RUNNING
    (its task was killed, or ended while the server was away and left nothing to send) ends KILLED with the reason."""

    def work(tracker: Tracker) -> None:
        for key in ("html_uri", "report_uri"):
            if report.get(key):
                data = storage.read_bytes(report[key])
                if key == "html_uri":  # MLflow shows the page alone: the root's plotly.js it links goes back inline
                    data = assets.inline(data, out)
                tracker.upload(tracker.parent(), report[key].rsplit("/", 1)[-1], data)
        tracker.end_running("KILLED", "still RUNNING when the run's report was written: its task ended without "
                                      "ending it (killed, or the tracking server was away until after it ended)")
        tracker.end(tracker.parent(), status)

    _bookkeeping(config, out, "report", work)


def fail_parent(config: PipelineConfig, out: str, task: str) -> None:
    """A task of the run failed for good: its nested runs still RUNNING end FAILED, and so does the parent run, naming
    it (a later successful re-run of the DAG run sets it RUNNING again)."""

    def work(tracker: Tracker) -> None:
        tracker.end_running("FAILED", f"task {task} failed", task=task)
        tracker.log(tracker.parent(), tags={"stagewise.failed_task": task})
        tracker.end(tracker.parent(), "FAILED")

    _bookkeeping(config, out, task, work)


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
