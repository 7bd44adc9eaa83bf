"""The MLflow calls a task still has to make: a buffer bounded in count and bytes that holds them while the server is
away, and the records a task leaves under ``<run>/tracking/pending/`` when it ends before the server is back, for the
next task of its run that reaches the server to send. Imported by stagewise.tracking.runs; no entry point.

A call is data (kind, the run it belongs to, its body), never a closure, so what a task could not send can be written
down and sent by another process. Creating and ending a run always fit the buffer (one of each per run): a run is
never left RUNNING for want of room. Metrics, tags and artifacts that do not fit are dropped and counted.
"""

from __future__ import annotations

import base64
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from stagewise.core import storage

PENDING_FOLDER = ("tracking", "pending")
MAX_CALLS = 10_000  # calls held while the server is away (an epoch's metrics are one call)
MAX_BYTES = 16 * 2**20  # their size, artifacts included
CLAIM_EXPIRY_S = 600.0  # a claim on a pending record older than this was left by a process that died: taken over
ESSENTIAL = frozenset({"parent", "create", "end", "replay", "sweep"})  # kept whatever the bound


@dataclass
class RunHandle:
    """A run being created in the background: its id is filled in once the server answers."""

    key: str
    run_id: str | None = None
    artifact_uri: str | None = None
    closed: bool = field(default=False)


@dataclass(kw_only=True)
class Call:
    """One call to make: ``kind`` is parent, create, log, upload, end, replay or sweep; ``body`` its arguments."""

    kind: str
    handle: RunHandle | None = None
    body: dict[str, Any] = field(default_factory=dict)
    size: int = 0

    def __post_init__(self) -> None:
        if not self.size:
            self.size = estimated_size(self.body)

    @property
    def essential(self) -> bool:
        return self.kind in ESSENTIAL


def estimated_size(body: dict[str, Any]) -> int:
    """Roughly the bytes a call holds (its JSON), cheap enough for the training thread."""
    size = 64
    for value in body.values():
        if isinstance(value, (bytes, str)):
            size += len(value)
        elif isinstance(value, dict):
            size += sum(len(str(k)) + len(str(v)) + 8 for k, v in value.items())
        elif isinstance(value, list):
            size += 96 * len(value)
    return size


class CallBuffer:
    """First in, first out, bounded by ``max_calls`` and ``max_bytes``: a call that does not fit is dropped and
    counted in ``dropped``; essential calls (creating and ending runs) always fit. Not thread-safe: the Tracker locks."""

    def __init__(self, max_calls: int = MAX_CALLS, max_bytes: int = MAX_BYTES) -> None:
        self.max_calls, self.max_bytes = max_calls, max_bytes
        self._calls: deque[Call] = deque()
        self.bytes = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._calls)

    def put(self, call: Call) -> bool:
        if not call.essential and (len(self._calls) >= self.max_calls or self.bytes + call.size > self.max_bytes):
            self.dropped += 1
            return False
        self._calls.append(call)
        self.bytes += call.size
        return True

    def head(self, count: int = 1) -> list[Call]:
        return [self._calls[index] for index in range(min(count, len(self._calls)))]

    def pop(self, count: int = 1) -> None:
        for _ in range(min(count, len(self._calls))):
            self.bytes -= self._calls.popleft().size

    def push_front(self, calls: Iterable[Call]) -> None:
        """Calls another task left: ahead of this task's own, outside the bound (they were bounded where they began)."""
        for call in reversed(list(calls)):
            self._calls.appendleft(call)
            self.bytes += call.size

    def take_all(self) -> list[Call]:
        calls = list(self._calls)
        self._calls.clear()
        self.bytes = 0
        return calls


# --- pending records: what a task ended without sending ---

def pending_folder(out: str) -> str:
    return storage.join(out, *PENDING_FOLDER)


def to_record(call: Call) -> dict[str, Any] | None:
    """A call as JSON (None for those only a live tracker makes: finding the parent, replaying, sweeping)."""
    if call.kind not in ("create", "log", "upload", "end") or call.handle is None:
        return None
    body = dict(call.body)
    if call.kind == "upload":
        body["data"] = base64.b64encode(body["data"]).decode()
    return {"kind": call.kind, "key": call.handle.key, "run_id": call.handle.run_id,
            "artifact_uri": call.handle.artifact_uri, "body": body}


def from_records(records: Iterable[dict[str, Any]], parent: RunHandle) -> list[Call]:
    """Calls again, the records of one run sharing one handle (``parent`` stands for the DAG run's parent run)."""
    handles: dict[str, RunHandle] = {"parent": parent}
    calls = []
    for record in records:
        handle = handles.setdefault(record["key"], RunHandle(record["key"]))
        handle.run_id = handle.run_id or record.get("run_id")
        handle.artifact_uri = handle.artifact_uri or record.get("artifact_uri")
        body = dict(record.get("body") or {})
        if record["kind"] == "upload":
            body["data"] = base64.b64decode(body["data"])
        calls.append(Call(kind=record["kind"], handle=handle, body=body))
    return calls


def write_pending(out: str, task: str, calls: list[Call], error: str, dropped: int) -> int:
    """Write the calls ``task`` could not send under the run; returns how many were written (0: none to keep)."""
    records = [record for record in map(to_record, calls) if record is not None]
    if records:
        name = f"{storage.safe_name(task)}-{storage.unique_token()}.json"
        storage.write_json(storage.join(pending_folder(out), name),
                           {"task": task, "error": error[:500], "dropped_calls": dropped, "calls": records,
                            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return len(records)


def claim_pending(out: str, claimer: str) -> list[dict[str, Any]]:
    """Every pending record of the run that this process wins the claim on, removed from storage once read: two tasks
    reaching the server at once never both send a record."""
    folder = pending_folder(out)
    fs, path = storage.filesystem(folder)
    if not fs.isdir(path):
        return []
    claimed = []
    for found in sorted(fs.glob(path + "/*.json")):
        uri = fs.unstrip_protocol(found) if "://" in out else found
        claim = uri[: -len(".json")] + ".claim"
        if not _claim(claim, claimer):
            continue
        try:
            try:
                record = storage.read_json(uri)
            except FileNotFoundError:  # another process sent and removed it after we listed it
                continue
            _remove(uri)
            claimed.append(record)
        finally:
            _remove(claim)
    return claimed


def _claim(uri: str, claimer: str) -> bool:
    mine = {"by": claimer, "at": time.time()}
    if storage.write_if_unchanged(uri, mine, None):
        return True
    held, token = storage.read_versioned(uri)
    if held is None or time.time() - float(held.get("at", 0)) < CLAIM_EXPIRY_S:
        return False
    return storage.write_if_unchanged(uri, mine, token)


def _remove(uri: str) -> None:
    fs, path = storage.filesystem(uri)
    for target in (path, path + ".lock"):
        try:
            fs.rm(target)
        except FileNotFoundError:
            pass
