"""On SQLite the api-server's writes pass one at a time: a burst waits its turn or is answered 503, never a 500."""

from __future__ import annotations

import asyncio

import pytest

from stagewise.airflow.sqlite import CONNECT_ARGS, WriteQueue


class SlowApp:
    """An ASGI app whose requests take ``seconds``; it records how many ran at once."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.running, self.most = seconds, 0, 0

    async def __call__(self, scope, receive, send) -> None:
        self.running += 1
        self.most = max(self.most, self.running)
        await asyncio.sleep(self.seconds)
        self.running -= 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


async def _call(app, method: str) -> tuple[int, bytes, dict]:
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    await app({"type": "http", "method": method, "path": "/api/v2/dags/x/dagRuns", "headers": []}, receive, send)
    headers = dict(sent[0].get("headers", []))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:]), headers


def test_writes_pass_one_at_a_time_and_reads_are_never_held():
    """Concurrent POSTs run one after another (no two transactions interleave on the event loop); GETs run at once."""
    inner = SlowApp(0.02)
    queue = WriteQueue(inner, wait_s=5, enabled=True)

    async def burst():
        return await asyncio.gather(*(_call(queue, "POST") for _ in range(10)))

    assert [status for status, _, _ in asyncio.run(burst())] == [200] * 10
    assert inner.most == 1
    inner.most = 0

    async def reads():
        return await asyncio.gather(*(_call(queue, "GET") for _ in range(10)))

    asyncio.run(reads())
    assert inner.most == 10


def test_a_write_that_waits_too_long_is_answered_503_saying_why():
    """Past the wait, a write is refused before it reaches Airflow (nothing half-made), with Retry-After and a message
    naming SQLite and PostgreSQL; a retry later succeeds."""
    queue = WriteQueue(SlowApp(0.5), wait_s=0.1, enabled=True)

    async def burst():
        return await asyncio.gather(_call(queue, "POST"), _call(queue, "PATCH"))

    (first, _, _), (second, body, headers) = asyncio.run(burst())
    assert (first, second) == (200, 503)
    assert headers[b"retry-after"] == b"5"
    assert b"SQLite" in body and b"PostgreSQL (docs/services.md)" in body


@pytest.mark.parametrize("url,enabled", [("sqlite:////tmp/airflow.db", True), ("postgresql://a@b/c", False)])
def test_the_queue_acts_on_sqlite_only(monkeypatch, url, enabled):
    """PostgreSQL takes many writers: there the middleware passes every request straight through."""
    monkeypatch.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", url)
    assert WriteQueue(SlowApp(0)).enabled is enabled
    assert CONNECT_ARGS["timeout"] >= 30  # every connection waits for the lock well past Python's 5 s


def test_the_plugin_installs_the_queue_on_the_whole_api_server():
    """A root middleware: it wraps the execution API and the public API alike."""
    from stagewise.airflow.plugin import StagewiseUIPlugin

    assert WriteQueue in [entry["middleware"] for entry in StagewiseUIPlugin.fastapi_root_middlewares]
