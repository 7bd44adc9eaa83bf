"""Retention's own record under the storage root: a note per pass, written before anything is removed, and a lock so
that two passes never remove from one pipeline's storage at once.

Run: a library; stagewise.retention takes the lock, writes the pass's note, removes, then marks the note done.

- ``retention/<pipeline>/passes/<pass>.json``: what the pass set out to remove (each removal: what, of which run,
  model or study, why, its files and bytes) with ``state`` "removing" until it is done. A pass that stopped midway
  (a crash, a kill, a full disk) leaves "removing": the next pass plans again (every age only grew), removes what is
  left and marks the old note ``finished_by`` itself. Notes go after ``retention.keep_records_days``, as run records do.
- ``retention/<pipeline>/lock.json``: which pass holds the storage (host, pid, since) and when it last said it was
  alive (each progress line, stagewise.upkeep.progress); a lock silent for LOCK_STALE is a dead pass's, taken over.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import uuid
from typing import Any

from stagewise.core import storage
from stagewise.upkeep.policy import Removal

log = logging.getLogger("stagewise.retention")

LOCK_STALE = dt.timedelta(minutes=10)  # a live pass says it is alive every PROGRESS_S seconds


class NoteNotWritten(OSError):
    """The pass's note (or a run's) could not be written: nothing it would have recorded was removed."""


def folder(storage_root: str, pipeline: str) -> str:
    return storage.join(storage_root, "retention", storage.safe_name(pipeline))


def pass_id(now: dt.datetime) -> str:
    """A pass's name: its time, and a suffix so that two passes judged at one ``--now`` never share a note."""
    return f"{now.strftime('%Y%m%dT%H%M%SZ')}-{uuid.uuid4().hex[:6]}"


class Lock:
    """This pass's hold on ``retention/<pipeline>/lock.json`` (:func:`acquire`)."""

    def __init__(self, uri: str, body: dict[str, Any]) -> None:
        self.uri, self.body = uri, body

    def refresh(self) -> None:
        """Say this pass is alive (a storage hiccup here is logged: the pass goes on)."""
        try:
            found, token = storage.read_versioned(self.uri)
            if not isinstance(found, dict) or found.get("owner") != self.body["owner"]:
                log.warning("retention's lock %s is no longer this pass's (held by %s)", self.uri,
                            found.get("owner") if isinstance(found, dict) else None)
                return
            storage.write_if_unchanged(self.uri, {**self.body, "alive": _now_iso()}, token)
        except Exception as exc:
            log.warning("retention's lock %s not refreshed: %s", self.uri, exc)

    def release(self) -> None:
        try:
            found, _ = storage.read_versioned(self.uri)
            if isinstance(found, dict) and found.get("owner") == self.body["owner"]:
                fs, path = storage.filesystem(self.uri)
                fs.rm_file(path)
        except FileNotFoundError:
            pass
        except Exception as exc:  # a lock left behind goes stale; the next pass takes it over
            log.warning("retention's lock %s not released (%s): it is taken over after %s", self.uri, exc, LOCK_STALE)


def _now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat()


def acquire(storage_root: str, pipeline: str) -> tuple[Lock | None, str]:
    """This pass's lock, or (None, who holds it) while another live pass does."""
    uri = storage.join(folder(storage_root, pipeline), "lock.json")
    body = {"owner": f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}", "since": _now_iso()}
    for _ in range(3):  # a race with another pass taking over the same stale lock: look again
        found, token = storage.read_versioned(uri)
        if isinstance(found, dict):
            alive = _moment(found.get("alive") or found.get("since"))
            if alive is not None and dt.datetime.now(dt.UTC) - alive < LOCK_STALE:
                return None, f"{found.get('owner')} since {found.get('since')}, alive at {alive.isoformat()}"
            log.warning("retention's lock %s was held by %s, silent since %s: taken over", uri, found.get("owner"),
                        alive)
        if storage.write_if_unchanged(uri, {**body, "alive": body["since"]}, token):
            return Lock(uri, body), ""
    found, _ = storage.read_versioned(uri)
    return None, f"{found.get('owner') if isinstance(found, dict) else 'another pass'}"


def _moment(value: Any) -> dt.datetime | None:
    try:
        found = dt.datetime.fromisoformat(str(value))
    except ValueError:
        return None
    return found if found.tzinfo else found.replace(tzinfo=dt.UTC)


def _passes(storage_root: str, pipeline: str) -> list[tuple[str, dict[str, Any]]]:
    fs, path = storage.filesystem(storage.join(folder(storage_root, pipeline), "passes"))
    try:
        names = sorted(fs.glob(path.rstrip("/") + "/*.json"))
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        uri = fs.unstrip_protocol(name) if "://" in storage_root else name
        try:
            note = storage.read_json(uri)
        except Exception as exc:  # a torn note names nothing this pass could finish
            log.warning("retention note %s unreadable, skipped: %s", uri, exc)
            continue
        if isinstance(note, dict):
            found.append((uri, note))
    return found


def unfinished(storage_root: str, pipeline: str) -> list[tuple[str, dict[str, Any]]]:
    """Notes of passes that stopped before they were done; each is logged."""
    stopped = [(uri, note) for uri, note in _passes(storage_root, pipeline) if note.get("state") == "removing"]
    for uri, note in stopped:
        log.info("finishing the pass %s, which stopped after noting %d removal(s) (%s): what is left of them goes "
                 "in this pass", note.get("pass"), len(note.get("removals") or []), uri)
    return stopped


def begin(storage_root: str, pipeline: str, name: str, at: str, plan: list[Removal]) -> str:
    """Write the pass's note (what it will remove) before anything goes; NoteNotWritten when it cannot be."""
    uri = storage.join(folder(storage_root, pipeline), "passes", f"{name}.json")
    note = {"pass": name, "at": at, "pipeline": pipeline, "state": "removing",
            "removals": [{"what": r.what, "target": r.target, "reason": r.reason, "files": len(r.files),
                          "bytes": r.bytes} for r in plan]}
    try:
        storage.write_json(uri, note)
    except OSError as exc:
        raise NoteNotWritten(f"retention's note {uri} could not be written ({exc}): nothing was removed. Free some "
                             f"space there (a few MB) and run the pass again") from None
    return uri


def finish(uri: str, result: dict[str, Any], stopped: list[tuple[str, dict[str, Any]]], name: str) -> None:
    """Mark this pass's note done (with its totals) and the stopped passes it finished."""
    for old_uri, note in stopped:
        _rewrite(old_uri, {**note, "state": "done", "finished_by": name})
    note = storage.read_json(uri)
    _rewrite(uri, {**note, "state": "done", "finished_at": _now_iso(), "total_files": result["total_files"],
                   "total_bytes": result["total_bytes"]})


def _rewrite(uri: str, note: dict[str, Any]) -> None:
    try:
        storage.write_json(uri, note)
    except OSError as exc:  # the removals are noted already; the next pass marks this one again
        log.warning("retention note %s not marked done (%s): the next pass finishes it", uri, exc)


def prune(storage_root: str, pipeline: str, now: dt.datetime, days: int | None) -> int:
    """Remove finished passes' notes older than ``days`` (keep_records_days); returns how many went."""
    if days is None:
        return 0
    gone = 0
    for uri, note in _passes(storage_root, pipeline):
        at = _moment(note.get("at"))
        if note.get("state") == "done" and at is not None and now - at > dt.timedelta(days=days):
            try:
                fs, path = storage.filesystem(uri)
                fs.rm_file(path)
                gone += 1
            except FileNotFoundError:
                pass
    return gone
