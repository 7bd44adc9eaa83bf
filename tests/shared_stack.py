"""The shared live stack (a pytest plugin of tests/conftest.py): one LiveAirflow over several pipelines side by side for
the tests that only trigger runs and read them back (SHARED_STACK_FILES, run by one pytest-xdist worker in order), the
gated pipelines of the approval tests with their SMTP receiver, and the stack stopped right after its last test.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import run_cache
from tests.live_airflow import REPO_ROOT, LiveAirflow

# The pipelines of the shared stack, each tests.conftest's small config on a storage root of its own, and each
# suite on its own pipeline, so none reads another's runs or registry: `ml` (its DAGs ml_pipeline, ml_retrain, ...:
# the official client, REST triggers and an ingest, which adds a raw file), `twin` (the browser suite; a sweep
# budget of its own shows in its form; tracked in a real MLflow server, whose UI the suite opens) and `fresh` (an
# asset-triggered retrain from an empty registry, one sweep worker; its cron, Feb 29, last fired before the DAG's
# start, so no scheduled run competes).
SHARED_PIPELINES = {"ml": {}, "twin": {"sweep": {"num_trials": 5}},
                    "fresh": {"retrain": {"schedule": "0 0 29 2 *", "num_trials": 2}, "sweep": {"num_workers": 1}}}
# The test files on the shared stack, in the order they run: tests/conftest.py sends them to one pytest-xdist worker
# together (the browser suite answers the gated pipeline's first request before the approval test asks its own).
SHARED_STACK_FILES = ("tests/dags/test_airflow_client.py", "tests/dags/test_rest_trigger.py",
                      "tests/dags/test_retrain_asset.py", "tests/ui/test_airflow_ui.py", "tests/dags/test_human_approval.py")


@dataclass(frozen=True)
class PipelinesStack:
    """A live stack over the repo's DAG file and a folder of pipeline configs ($STAGEWISE_PIPELINES)."""

    live: LiveAirflow
    roots: dict[str, Path]  # each pipeline's storage root, by pipeline name
    configs: dict[str, Path]  # each pipeline's config file, by pipeline name


@contextlib.contextmanager
def pipelines_airflow(tmp_dir: str | os.PathLike, pipelines: dict[str, dict], env: dict[str, str] | None = None,
                      users: dict[str, str] | None = None) -> Iterator[PipelinesStack]:
    """A LiveAirflow over the repo's DAGs and one config per pipeline (tests.conftest's small config with the given
    top-level keys laid over it, each on its own storage root with the digits written), the pool created."""
    import yaml

    from tests.conftest import base_config

    tmp_dir = Path(tmp_dir)
    folder, roots, configs = tmp_dir / "pipelines", {}, {}
    folder.mkdir(parents=True)
    for name, changes in pipelines.items():
        roots[name] = tmp_dir / f"storage_{name}"
        raw = {**base_config(roots[name]), "name": name}
        for key, value in changes.items():
            raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
        configs[name] = folder / f"{name}.yaml"
        configs[name].write_text(yaml.safe_dump(raw))
        run_cache.demo_data(configs[name])
    with LiveAirflow(tmp_dir / "live_airflow", REPO_ROOT / "dags", {"STAGEWISE_PIPELINES": str(folder), **(env or {})},
                     users=users) as live:
        live.api("POST", "/api/v2/pools", expect=(200, 201), json={"name": "cpu_cores", "slots": 2})
        yield PipelinesStack(live, roots, configs)


# The gated pipelines (tests/dags/test_human_approval.py): every promotion waits for a person. `gated` mails each
# decision to the suite's SMTP receiver and to one that is down; `gated_mlflow` keeps its versions in MLflow's
# registry, only `editor` may answer, and an unanswered request times out within a minute.
def documented_registry() -> dict[str, Any]:
    """The `registry:` block of docs/pipelines.md's "Approval and notifications", as the page gives it."""
    import yaml

    section = (REPO_ROOT / "docs" / "pipelines.md").read_text().split("## Approval and notifications", 1)[1]
    return yaml.safe_load(section.split("```yaml", 1)[1].split("```", 1)[0])["registry"]


def _gated_registry() -> dict[str, Any]:
    """The documented block, plus the same notifier pointed at a receiver that is down (gate_mail_down)."""
    documented = documented_registry()
    mail = documented["notify"][0]
    return {**documented, "notify": [*documented["notify"],
                                     {**mail, "args": {**mail["args"], "smtp_conn_id": "gate_mail_down"}}]}


# The gate needs a model, not a good one: a one-trial sweep and one one-epoch stage (the gated runs are the suite's
# costliest test: six of them).
SMALLEST_RUN = {"sweep": {"num_trials": 1, "num_workers": 1, "epochs": 1},
                "train": {"stages": [{"name": "s1", "profile": "ddp1", "per_process_batch": 32, "epochs": 1}]}}
GATED_PIPELINES = {
    "gated": {**SMALLEST_RUN, "registry": _gated_registry()},
    "gated_mlflow": {**SMALLEST_RUN, "registry": {"backend": "mlflow", "approval": {
        "mode": "required", "timeout_minutes": 1.0, "respondents": ["editor"]}}}}
STACK_USERS = {"viewer": "viewer", "editor": "user", "operator": "op"}  # beside admin; "user" may act on DAGs


@pytest.fixture(scope="session")
def smtp_receiver() -> Iterator[Any]:
    """The suite's mail server on loopback (tests/smtp_receiver.py): what the gated pipeline's notifier sends."""
    from tests.smtp_receiver import SmtpReceiver

    with SmtpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="session")
def shared_airflow(tmp_path_factory, mlflow_server, smtp_receiver) -> Iterator[PipelinesStack]:
    """One live stack for the tests that only trigger runs and read them back (the browser suite, the official
    client, REST triggers, the asset-triggered retrain): SHARED_PIPELINES side by side, every DAG paused until a
    test unpauses it. Their files are SHARED_STACK_FILES, which one pytest-xdist worker runs, on one stack.

    Each test triggers its own runs and finds them by run id; none moves another pipeline's data or registry.
    """
    from tests.smtp_receiver import closed_port, smtp_connection

    tracked = {"tracking": {"mlflow_uri": mlflow_server.uri, "experiment": "twin"}}
    gated = {**GATED_PIPELINES, "gated_mlflow": {
        **GATED_PIPELINES["gated_mlflow"], "tracking": {"mlflow_uri": mlflow_server.uri, "experiment": "gated_mlflow"}}}
    pipelines = {**SHARED_PIPELINES, "twin": {**SHARED_PIPELINES["twin"], **tracked}, **gated}
    mail = {"AIRFLOW_CONN_GATE_MAIL": smtp_receiver.connection_uri(),
            "AIRFLOW_CONN_GATE_MAIL_DOWN": smtp_connection(closed_port())}
    with contextlib.ExitStack() as running:
        stack = running.enter_context(pipelines_airflow(tmp_path_factory.mktemp("shared_airflow"), pipelines, mail,
                                                        STACK_USERS))
        _shared_stack.update(stop=running, stopped=False)
        yield stack


# The shared stack's exit, so its last test can stop it (pytest_runtest_teardown below); "stopped" once it has been.
_shared_stack: dict[str, Any] = {}


def pytest_runtest_setup(item):
    if "shared_airflow" in item.fixturenames and _shared_stack.get("stopped"):
        pytest.fail("the shared live stack was stopped after the last test before this one that used it: its tests "
                    "must run one after another (tests/conftest.py sorts SHARED_STACK_FILES together)", pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Stop the shared stack right after the last test in a row that uses it, not at the worker's end: idle, its
    scheduler, api-server and dag-processor kept spending CPU while the worker ran the rest of its files."""
    result = yield
    if ("shared_airflow" in item.fixturenames and not _shared_stack.get("stopped") and "stop" in _shared_stack
            and (nextitem is None or "shared_airflow" not in nextitem.fixturenames)):
        _shared_stack["stopped"] = True
        _shared_stack.pop("stop").close()
    return result
