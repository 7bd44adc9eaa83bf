"""MLflow's REST API, spoken directly: runs, metrics, artifacts, registered models, versions and aliases.

No ``mlflow`` package in the Airflow environment: its client pins (cachetools, importlib-metadata, pyarrow for the
full package) fight Airflow's, and the REST API at ``/api/2.0/mlflow`` is the server's stable, documented contract
that the official client speaks too. Credentials come from MLflow's own variables, read here and sent as headers
only: ``MLFLOW_TRACKING_TOKEN`` (bearer) or ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD`` (basic).

Every request has a short timeout and at most one quick retry: tracking must never hold a stage up, so a server
that is down or slow surfaces as :class:`TrackingUnavailable` and the caller decides (the trackers keep their calls
and retry them with backoff in the background, stagewise.tracking.runs; the MLflow registry, which serving depends on,
fails the task for Airflow to retry).
"""

from __future__ import annotations

import os
import time
import urllib.parse
from typing import Any

from stagewise.core import storage

CREDENTIAL_VARIABLES = ("MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")


class TrackingUnavailable(Exception):
    """The server did not answer in time, refused the connection, or answered 5xx: a transient fault."""


class TrackingError(Exception):
    """The server refused a request (4xx): its error code and message are kept."""

    def __init__(self, code: str, message: str, status: int) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.status = code, status


def credential_headers() -> dict[str, str]:
    """The Authorization header MLflow's variables stand for (none when unset)."""
    import base64

    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    if token:
        return {"Authorization": f"Bearer {token}"}
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if user and password:
        return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}
    return {}


class MlflowApi:
    """One tracking server: ``uri`` is its base URL (http or https), ``timeout_s`` bounds every request."""

    def __init__(self, uri: str, timeout_s: float = 10.0) -> None:
        import requests

        self.uri, self.timeout_s = uri.rstrip("/"), timeout_s
        self._session = requests.Session()
        self._session.headers.update(credential_headers())
        self._session.verify = os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() != "true"

    def request(self, method: str, path: str, *, json: Any = None, params: Any = None, data: bytes | None = None,
                raw: bool = False) -> Any:
        """``method`` on ``path`` (below the server's base URL); the decoded JSON answer, or the bytes with ``raw``."""
        import requests

        url = f"{self.uri}/{path.lstrip('/')}"
        for attempt in (1, 2):
            try:
                answer = self._session.request(method, url, json=json, params=params, data=data, timeout=self.timeout_s)
            except requests.RequestException as exc:
                failure: Exception = TrackingUnavailable(f"{method} {url}: {type(exc).__name__}: {exc}")
            else:
                if answer.status_code < 400:
                    return answer.content if raw else (answer.json() if answer.content else {})
                if answer.status_code < 500 and answer.status_code != 429:
                    try:
                        body = answer.json()
                    except ValueError:
                        body = {}
                    raise TrackingError(body.get("error_code", f"HTTP {answer.status_code}"),
                                        body.get("message", answer.text[:300]), answer.status_code)
                failure = TrackingUnavailable(f"{method} {url}: HTTP {answer.status_code}")
            if attempt == 1:
                time.sleep(0.2)
        raise failure

    def call(self, method: str, endpoint: str, body: dict[str, Any] | None = None) -> Any:
        """An ``/api/2.0/mlflow/<endpoint>`` call: a JSON body for POST/PATCH/DELETE, query parameters for GET."""
        path = f"api/2.0/mlflow/{endpoint}"
        if method == "GET":
            return self.request(method, path, params=body)
        return self.request(method, path, json=body or {})

    # --- experiments and runs ---

    def experiment_id(self, name: str) -> str:
        """The id of experiment ``name``, created when missing (a race with another creator is settled by re-reading)."""
        try:
            return self.call("GET", "experiments/get-by-name", {"experiment_name": name})["experiment"]["experiment_id"]
        except TrackingError as exc:
            if exc.code != "RESOURCE_DOES_NOT_EXIST":
                raise
        # The kind opens the experiment in MLflow's model-training view rather than its GenAI one.
        kind = [{"key": "mlflow.experimentKind", "value": "custom_model_development"}]
        try:
            return self.call("POST", "experiments/create", {"name": name, "tags": kind})["experiment_id"]
        except TrackingError as exc:
            if exc.code != "RESOURCE_ALREADY_EXISTS":
                raise
            return self.call("GET", "experiments/get-by-name", {"experiment_name": name})["experiment"]["experiment_id"]

    def create_run(self, experiment_id: str, name: str, tags: dict[str, str]) -> dict[str, Any]:
        body = {"experiment_id": experiment_id, "run_name": name, "start_time": now_ms(),
                "tags": [{"key": key, "value": str(value)} for key, value in tags.items()]}
        return self.call("POST", "runs/create", body)["run"]

    def get_run(self, run_id: str) -> dict[str, Any]:
        return self.call("GET", "runs/get", {"run_id": run_id})["run"]

    def find_run(self, experiment_id: str, tags: dict[str, str]) -> dict[str, Any] | None:
        """The newest run of the experiment carrying every one of ``tags``, or None."""
        runs = self.search_runs(experiment_id, tags, max_results=1)
        return runs[0] if runs else None

    def search_runs(self, experiment_id: str, tags: dict[str, str], *, status: str | None = None,
                    max_results: int = 1000) -> list[dict[str, Any]]:
        """The experiment's runs carrying every one of ``tags`` (and ``status``, when given), newest first."""
        clauses = [f"tags.`{key}` = '{_quoted(value)}'" for key, value in tags.items()]
        clauses += [f"attributes.status = '{_quoted(status)}'"] if status else []
        found = self.call("POST", "runs/search", {"experiment_ids": [experiment_id], "filter": " and ".join(clauses),
                                                  "max_results": max_results, "order_by": ["attributes.start_time DESC"]})
        return found.get("runs") or []

    def delete_run(self, run_id: str) -> None:
        self.call("POST", "runs/delete", {"run_id": run_id})

    def log_batch(self, run_id: str, *, metrics: list[dict[str, Any]] = (), params: dict[str, Any] | None = None,
                  tags: dict[str, Any] | None = None) -> None:
        """Metrics (``{key, value, step, timestamp}``), params and tags in one request, at MLflow's per-request limits."""
        metrics = list(metrics)
        param_list = [{"key": k, "value": str(v)[:6000]} for k, v in (params or {}).items()]
        tag_list = [{"key": k, "value": str(v)[:8000]} for k, v in (tags or {}).items()]
        while metrics or param_list or tag_list:
            body = {"run_id": run_id, "metrics": metrics[:1000], "params": param_list[:100], "tags": tag_list[:100]}
            metrics, param_list, tag_list = metrics[1000:], param_list[100:], tag_list[100:]
            self.call("POST", "runs/log-batch", body)

    def end_run(self, run_id: str, status: str) -> None:
        """Mark the run FINISHED, FAILED or KILLED (or RUNNING again, on a retry)."""
        body: dict[str, Any] = {"run_id": run_id, "status": status}
        if status != "RUNNING":
            body["end_time"] = now_ms()
        self.call("POST", "runs/update", body)

    # --- artifacts ---

    def upload(self, artifact_uri: str, path: str, data: bytes) -> None:
        """``data`` as ``path`` under a run's artifact root: through the server's proxy (``mlflow-artifacts:``) or
        straight into the store it names (``s3://``, ``file://``, a local path) with fsspec."""
        proxied = _proxied_path(artifact_uri)
        if proxied is None:
            storage.write_bytes(storage.join(artifact_uri, path), data)
            return
        self.request("PUT", f"api/2.0/mlflow-artifacts/artifacts/{proxied}/{path}", data=data)

    def download(self, artifact_uri: str, path: str) -> bytes:
        proxied = _proxied_path(artifact_uri)
        if proxied is None:
            return storage.read_bytes(storage.join(artifact_uri, path))
        return self.request("GET", f"api/2.0/mlflow-artifacts/artifacts/{proxied}/{path}", raw=True)

    # --- the model registry ---

    def ensure_registered_model(self, name: str, description: str, tags: dict[str, str] | None = None) -> None:
        """Create model ``name`` with ``tags`` unless it exists (an existing model's tags are left as they are)."""
        body = {"name": name, "description": description, "tags": [{"key": k, "value": v} for k, v in (tags or {}).items()]}
        try:
            self.call("POST", "registered-models/create", body)
        except TrackingError as exc:
            if exc.code != "RESOURCE_ALREADY_EXISTS":
                raise

    def registered_model(self, name: str) -> dict[str, Any] | None:
        try:
            return self.call("GET", "registered-models/get", {"name": name})["registered_model"]
        except TrackingError as exc:
            if exc.code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise

    def model_versions(self, name: str, run_id: str | None = None) -> list[dict[str, Any]]:
        """Every version of model ``name`` (of one run only, with ``run_id``), newest first."""
        query = f"name = '{_quoted(name)}'" + (f" and run_id = '{_quoted(run_id)}'" if run_id else "")
        found, token = [], None
        while True:
            body = {"filter": query, "max_results": 200, **({"page_token": token} if token else {})}
            page = self.call("GET", "model-versions/search", body)
            found += page.get("model_versions") or []
            token = page.get("next_page_token")
            if not token:
                return sorted(found, key=lambda v: int(v["version"]), reverse=True)

    def create_model_version(self, name: str, source: str, run_id: str, tags: dict[str, Any], description: str) -> dict[str, Any]:
        body = {"name": name, "source": source, "run_id": run_id, "description": description,
                "tags": [{"key": k, "value": str(v)} for k, v in tags.items()]}
        return self.call("POST", "model-versions/create", body)["model_version"]

    def model_version(self, name: str, version: str) -> dict[str, Any]:
        return self.call("GET", "model-versions/get", {"name": name, "version": version})["model_version"]

    def set_version_tags(self, name: str, version: str, tags: dict[str, Any]) -> None:
        for key, value in tags.items():
            self.call("POST", "model-versions/set-tag", {"name": name, "version": version, "key": key, "value": str(value)})

    def set_model_tag(self, name: str, key: str, value: str) -> None:
        self.call("POST", "registered-models/set-tag", {"name": name, "key": key, "value": value})

    def alias_version(self, name: str, alias: str) -> dict[str, Any] | None:
        """The version ``alias`` points at, or None when the alias is not set."""
        try:
            return self.call("GET", "registered-models/alias", {"name": name, "alias": alias})["model_version"]
        except TrackingError as exc:
            if exc.code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                return None
            raise

    def set_alias(self, name: str, alias: str, version: str) -> None:
        self.call("POST", "registered-models/alias", {"name": name, "alias": alias, "version": version})


def now_ms() -> int:
    return int(time.time() * 1000)


def _quoted(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("'", "\\'")


def _proxied_path(artifact_uri: str) -> str | None:
    """``1/<run>/artifacts`` of ``mlflow-artifacts:/1/<run>/artifacts`` (or ``mlflow-artifacts://host/...``); None
    for an artifact root the client writes itself."""
    parsed = urllib.parse.urlparse(artifact_uri)
    if parsed.scheme != "mlflow-artifacts":
        return None
    return parsed.path.strip("/")


def run_url(uri: str, experiment_id: str, run_id: str) -> str:
    """The run's page in the MLflow UI."""
    return f"{uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def model_version_url(uri: str, name: str, version: str) -> str:
    return f"{uri.rstrip('/')}/#/models/{urllib.parse.quote(name)}/versions/{version}"
