"""Airflow's metadata DB on SQLite (``make up``'s embedded default) under a burst of writers.

``scripts/airflow_env.sh`` sets, for a ``sqlite:///`` database only:
``[database] sql_alchemy_connect_args = stagewise.airflow.sqlite.CONNECT_ARGS`` (and its async twin); the Stagewise
plugin installs :class:`WriteQueue` in the api-server (a no-op on any other database).

SQLite takes one writer at a time; every other connection waits for the lock up to its busy timeout, then fails
with ``database is locked``. Two things turned 30 REST triggers in a few seconds into HTTP 500s and a dead scheduler:

- Airflow's audit-log dependency (``action_logging``) is a coroutine that commits on the api-server's event loop.
  When another request's transaction holds the lock, the loop blocks in that commit, and the other request cannot
  commit either, since its session closes on the same loop: both wait out the busy timeout, one fails. Every
  write request therefore passes :class:`WriteQueue` one at a time; reads are never held.
- Python's default busy timeout is 5 s: the scheduler's heartbeat waited out its 5 s behind such a stall and the
  scheduler exited. CONNECT_ARGS gives every connection BUSY_TIMEOUT_S.

A write request that waits longer than WRITE_WAIT_S for its turn is answered 503 with Retry-After (the task SDK
retries a 5xx); nothing is half-made, since it never reached Airflow. Many writers at once is PostgreSQL's job
(docs/services.md).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

BUSY_TIMEOUT_S = 60.0
"""How long a connection waits for SQLite's write lock before ``database is locked``."""

CONNECT_ARGS = {"timeout": BUSY_TIMEOUT_S}
"""sqlite3.connect's (and aiosqlite's) arguments: the busy timeout."""

WRITE_WAIT_S = 30.0
"""How long a write request waits for the ones before it; then it is answered 503."""

READS = frozenset({"GET", "HEAD", "OPTIONS"})


def uses_sqlite() -> bool:
    """Whether this Airflow's metadata DB is SQLite."""
    from airflow.configuration import conf

    return conf.get("database", "sql_alchemy_conn", fallback="").startswith("sqlite")


class WriteQueue:
    """ASGI middleware of the whole api-server (a root middleware): on SQLite, one write request (any method but
    GET/HEAD/OPTIONS, the execution API's too) runs at a time, from its first dependency to its last byte."""

    def __init__(self, app: Any, wait_s: float = WRITE_WAIT_S, enabled: bool | None = None) -> None:
        self.app = app
        self.wait_s = wait_s
        self.enabled = uses_sqlite() if enabled is None else enabled
        self._turn: asyncio.Lock | None = None  # made in the server's event loop, on the first write

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if not self.enabled or scope["type"] != "http" or scope.get("method") in READS:
            await self.app(scope, receive, send)
            return
        if self._turn is None:
            self._turn = asyncio.Lock()
        turn = self._turn
        try:
            await asyncio.wait_for(turn.acquire(), self.wait_s)
        except TimeoutError:
            await self._busy(send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            turn.release()

    async def _busy(self, send: Any) -> None:
        detail = (f"Airflow's metadata DB is SQLite, which takes one write at a time, and this request waited "
                  f"{self.wait_s:g} s for the writes before it: retry it later. Many writes at once need "
                  f"PostgreSQL (docs/services.md).")
        body = json.dumps({"detail": detail}).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"retry-after", b"5")]})
        await send({"type": "http.response.body", "body": body})
