"""A root middleware of the api-server: a trigger of a Stagewise DAG whose conf names a key the DAG has no Param for
(a typo such as ``num_trails``), or whose body passes MAX_TRIGGER_BYTES or nests past MAX_TRIGGER_DEPTH, is refused
with HTTP 400 before Airflow stores the run; start_run refuses the same keys again for a run made another way
(``airflow dags trigger``, a test). Triggers of other DAGs, and every other request, pass untouched."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

TRIGGER_PATH = re.compile(r"/api/v2/dags/(?P<dag_id>[^/]+)/dagRuns/?$")
MAX_TRIGGER_BYTES = 1 << 20
"""The largest trigger body a Stagewise DAG takes: its form's values are a few hundred bytes; a conf megabytes long
would sit in the metadata DB (and every task's context) before the run's first task could refuse it."""

MAX_TRIGGER_DEPTH = 16
"""The deepest nesting of objects and arrays a trigger body may have: the body, its conf and a form value such as
``stage_epochs`` are three; Python's JSON decoder recurses per level and raised RecursionError (a 500) at ~1,000."""
# Tokens that change the nesting: a whole JSON string (so brackets inside it do not count), a bracket, ':' or ','.
_NESTING_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}:,]')
# Path segments named in the error before it is cut short.
NAMED_SEGMENTS = 8

Receive = Callable[[], Awaitable[dict[str, Any]]]


def too_deep_path(body: bytes, limit: int = MAX_TRIGGER_DEPTH) -> str | None:
    """The key path of the first object or array of ``body`` nested more than ``limit`` deep, else None; a loop over
    tokens, not a recursive parse, so no depth overflows it. Malformed JSON is left to the decoder to name."""
    kinds: list[bytes] = []  # b"{" or b"[" per open container
    places: list[str | int | None] = []  # per open container: the key (object) or index (array) being read
    last_string = b'""'
    for match in _NESTING_TOKEN.finditer(body):
        token = match.group()
        if token[:1] == b'"':
            last_string = token
        elif token in (b"{", b"["):
            kinds.append(token)
            places.append(None if token == b"{" else 0)
            if len(kinds) > limit:
                return _path_text(places[:-1])
        elif token in (b"}", b"]"):
            if not kinds:
                return None
            kinds.pop()
            places.pop()
        elif kinds and token == b":" and kinds[-1] == b"{":
            try:
                places[-1] = json.loads(last_string)
            except ValueError:
                return None
        elif kinds and token == b"," and kinds[-1] == b"[":
            places[-1] = int(places[-1] or 0) + 1
    return None


def _path_text(places: list[str | int | None]) -> str:
    """``conf.stage_epochs[0]``: keys joined with dots, indices in brackets; cut after NAMED_SEGMENTS segments."""
    text = ""
    for number, place in enumerate(places):
        if number == NAMED_SEGMENTS:
            return text + "…"
        text += f"[{place}]" if isinstance(place, int) else (f".{place}" if text else str(place))
    return text or "the body"


def stagewise_params(dag_id: str) -> set[str] | None:
    """The Param names of ``dag_id``'s latest serialized version where it is a Stagewise DAG (tagged stagewise), else
    None."""
    from airflow.models.serialized_dag import SerializedDagModel

    dag = SerializedDagModel.get_dag(dag_id)
    if dag is None or "stagewise" not in set(dag.tags or ()):
        return None
    return set(dag.params)


def trigger_problem(dag_id: str, body: bytes) -> str | None:
    """Why a trigger of ``dag_id`` with ``body`` is refused (None: Airflow takes it, and answers any other fault)."""
    from stagewise.airflow.params import unknown_trigger_keys  # here: every Airflow process loads the plugin

    known = stagewise_params(dag_id)
    if known is None:
        return None
    if len(body) > MAX_TRIGGER_BYTES:
        return (f"trigger of {dag_id}: the request is {len(body)} bytes, more than a Stagewise run's trigger takes "
                f"({MAX_TRIGGER_BYTES}); its conf holds the trigger form's values only")
    if (path := too_deep_path(body)) is not None:
        return (f"trigger of {dag_id}: {path} nests objects or arrays more than {MAX_TRIGGER_DEPTH} levels deep "
                f"(counting the body itself); a Stagewise run's conf holds the trigger form's values, at most 3 levels")
    try:
        conf = json.loads(body or b"{}").get("conf")
    except (ValueError, AttributeError, RecursionError):
        return None  # not a JSON object: Airflow's own validation names it
    if not isinstance(conf, dict):
        return None
    if unknown := unknown_trigger_keys(conf, known):
        return f"trigger conf: unknown key(s) {unknown}; {dag_id} takes {sorted(known)}"
    return None


class TriggerConfCheck:
    """The ASGI middleware: reads a trigger's body, checks it (in a worker thread: a metadata DB read), then refuses it
    or hands the same body on."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Any) -> None:
        match = TRIGGER_PATH.search(scope.get("path", "")) if scope["type"] == "http" else None
        if match is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        problem = await asyncio.to_thread(trigger_problem, match.group("dag_id"), body)
        if problem is not None:
            payload = json.dumps({"detail": problem}).encode()
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(payload)).encode())]})
            await send({"type": "http.response.body", "body": payload})
            return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
