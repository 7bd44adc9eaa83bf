"""The api-server's trigger check: a Stagewise DAG's trigger whose conf names an unknown key, or that is too large, is
refused with 400 before Airflow stores anything; everything else reaches Airflow with its body whole."""

from __future__ import annotations

import asyncio
import json

import pytest

from stagewise.airflow import trigger_check

PARAMS = {"num_trials": 5, "input_uri": "raw/digits"}


def _call(path: str, body: bytes, method: str = "POST", chunk: int = 7) -> tuple[list[dict], list[bytes]]:
    """The middleware over an app that records the body it received; returns what was sent back and what the app got."""
    got: list[bytes] = []

    async def app(scope, receive, send):
        parts, more = [], True
        while more:
            message = await receive()
            parts.append(message.get("body", b""))
            more = message.get("more_body", False)
        got.append(b"".join(parts))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    pieces = [body[i:i + chunk] for i in range(0, len(body), chunk)] or [b""]
    messages = [{"type": "http.request", "body": piece, "more_body": i < len(pieces) - 1} for i, piece in enumerate(pieces)]
    sent: list[dict] = []

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path}
    asyncio.run(trigger_check.TriggerConfCheck(app)(scope, receive, send))
    return sent, got


@pytest.fixture(autouse=True)
def dags(monkeypatch):
    """ml_pipeline is a Stagewise DAG with PARAMS; any other DAG is not."""
    monkeypatch.setattr(trigger_check, "stagewise_params", lambda dag_id: set(PARAMS) if dag_id == "ml_pipeline" else None)


def test_an_unknown_conf_key_is_refused_naming_it_and_nothing_reaches_airflow():
    body = json.dumps({"logical_date": None, "conf": {"num_trails": 3}}).encode()
    sent, got = _call("/api/v2/dags/ml_pipeline/dagRuns", body)
    assert sent[0]["status"] == 400 and not got
    detail = json.loads(sent[1]["body"])["detail"]
    assert detail == "trigger conf: unknown key(s) ['num_trails']; ml_pipeline takes ['input_uri', 'num_trials']"


def test_a_trigger_larger_than_a_form_is_refused():
    body = json.dumps({"conf": {"num_trials": 3, "notes": "x" * trigger_check.MAX_TRIGGER_BYTES}}).encode()
    sent, got = _call("/api/v2/dags/ml_pipeline/dagRuns", body, chunk=65536)
    assert sent[0]["status"] == 400 and not got and "more than a Stagewise run's trigger takes" in sent[1]["body"].decode()


@pytest.mark.parametrize(("path", "body"), [
    ("/api/v2/dags/ml_pipeline/dagRuns", {"logical_date": None, "conf": {"num_trials": 3}}),  # known keys
    ("/api/v2/dags/other_dag/dagRuns", {"conf": {"anything": 1}}),  # not a Stagewise DAG
    ("/airflow/api/v2/dags/ml_pipeline/dagRuns", {"conf": {}}),  # under a base_url path
])
def test_a_valid_trigger_or_another_dags_reaches_airflow_with_its_body_whole(path, body):
    raw = json.dumps(body).encode()
    sent, got = _call(path, raw)
    assert sent[0]["status"] == 200 and got == [raw]


def test_other_requests_pass_untouched():
    raw = b'{"conf": {"num_trails": 3}}'
    assert _call("/api/v2/dags/ml_pipeline/dagRuns", raw, method="GET")[1] == [raw]
    assert _call("/api/v2/dags/ml_pipeline/dagRuns/r1/clear", raw)[1] == [raw]


def test_the_plugin_installs_the_check_on_the_whole_api_server():
    """A root middleware, so it sees the public API's trigger route (the UI's and the official client's)."""
    from stagewise.airflow.plugin import StagewiseUIPlugin

    assert trigger_check.TriggerConfCheck in [entry["middleware"] for entry in StagewiseUIPlugin.fastapi_root_middlewares]


@pytest.mark.parametrize("depth", [trigger_check.MAX_TRIGGER_DEPTH + 1, 5_000, 200_000])
def test_a_conf_nested_past_the_limit_is_a_400_naming_its_key_path(depth):
    """A 5,000-deep conf made the check's json.loads raise RecursionError (a 500); the nesting is now counted without
    recursion, at any depth, and refused naming where it goes too deep (the first levels of the path)."""
    inner = depth - 3  # the body, its conf and the object under "stage_epochs" are the first three levels
    body = b'{"logical_date": null, "conf": {"stage_epochs": {"s1": ' + b"[1, " * inner + b"2" + b"]" * inner + b"}}}"
    sent, got = _call("/api/v2/dags/ml_pipeline/dagRuns", body, chunk=1 << 20)
    assert sent[0]["status"] == 400 and not got
    detail = json.loads(sent[1]["body"])["detail"]
    assert detail.startswith("trigger of ml_pipeline: conf.stage_epochs.s1[1][1][1][1]")
    assert f"more than {trigger_check.MAX_TRIGGER_DEPTH} levels deep" in detail


def test_nesting_up_to_the_limit_and_brackets_inside_strings_reach_airflow():
    """Exactly MAX_TRIGGER_DEPTH levels pass (Airflow then answers for the keys); brackets in a string are text."""
    body = ('{"conf": ' + "[" * (trigger_check.MAX_TRIGGER_DEPTH - 1) + "]" * (trigger_check.MAX_TRIGGER_DEPTH - 1)
            + "}").encode()
    assert trigger_check.too_deep_path(body) is None
    text = json.dumps({"conf": {"input_uri": "[[[{{{\\\"" * 1000}}).encode()
    sent, got = _call("/api/v2/dags/ml_pipeline/dagRuns", text, chunk=1 << 20)
    assert sent[0]["status"] == 200 and got == [text]


def test_too_deep_path_names_keys_and_indices_and_cuts_a_long_path():
    assert trigger_check.too_deep_path(b'{"a": [0, {"b": [[]]}]}', limit=4) == "a[1].b[0]"
    deep = b'{"a": ' + b"[" * 40 + b"]" * 40 + b"}"
    assert trigger_check.too_deep_path(deep, limit=16) == "a[0][0][0][0][0][0][0]…"
