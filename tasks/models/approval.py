"""Approval records of one model name: the open request and every decision taken on each version.

Layout under ``models/<name>/approvals/``: ``pending.json`` holds the one open request (the version waiting, the run
whose gate asked, the current version it was compared with); ``<version>.json`` lists every decision on that version
(waiting, approved, rejected, timed_out, superseded), each with who, when and the note they gave. Both are replaced by
compare-and-swap (storage.write_if_unchanged), so two gates asking at once, or an answer racing a new request, each
decide against what the other wrote. One request is open per model name: a newer gate's request supersedes the older
one, which then moves nothing when it is answered (docs/pipelines.md, "Approval and notifications").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from stagewise.core import storage
from stagewise.core.errors import UserError
from stagewise.definitions.sections.approval import Approval

SWAP_ATTEMPTS = 20  # each lost attempt means another writer moved the record in between


def now_text() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def folder(models_prefix: str) -> str:
    return storage.join(models_prefix, "approvals")


def pending_uri(models_prefix: str) -> str:
    return storage.join(folder(models_prefix), "pending.json")


def history_uri(models_prefix: str, version: str) -> str:
    return storage.child(folder(models_prefix), f"{version}.json", "model version")


def waits_because(approval: Approval, candidate: dict[str, Any], incumbent: dict[str, Any] | None) -> str | None:
    """Why a promotion the gate would make waits for a person (None: it need not)."""
    if approval.mode == "none":
        return None
    if approval.mode == "required":
        return "registry.approval is required: every promotion waits for a person"
    metric = approval.metric
    assert metric is not None  # the config refuses when_worse_on without a metric
    if metric not in candidate:
        raise UserError(f"registry.approval.metric '{metric}' is not in the candidate's card (its test metrics: "
                        f"{sorted(key for key in candidate if key.startswith('test_'))})")
    if incumbent is None:
        return None  # nothing current to be worse than
    if metric not in incumbent:
        return f"the current model has no {metric} to compare with: a person decides"
    loss = incumbent[metric] - candidate[metric] if approval.direction == "maximize" else candidate[metric] - incumbent[metric]
    if loss <= approval.margin:
        return None
    return (f"{metric} {candidate[metric]:.4f} is worse than the current model's {incumbent[metric]:.4f} by "
            f"{loss:.4f}, more than registry.approval.margin {approval.margin}")


def _swap(uri: str, change: Callable[[Any], tuple[Any, Any]]) -> Any:
    """Replace the JSON at ``uri`` by compare-and-swap: ``change`` gets what is there (None: nothing) and gives
    (what to write, or None to leave it; its answer). Returns the answer."""
    for _ in range(SWAP_ATTEMPTS):
        state, token = storage.read_versioned(uri)
        written, answer = change(state)
        if written is None or storage.write_if_unchanged(uri, written, token):
            return answer
    raise RuntimeError(f"{uri}: other writers changed it {SWAP_ATTEMPTS} times in a row; a retry decides again")


def record(models_prefix: str, version: str, entry: dict[str, Any]) -> dict[str, Any]:
    """Append ``entry`` (decision, by, at, note, run ...) to ``version``'s decisions; a retry's repeat is kept once."""
    entry = {"at": now_text(), **entry}
    key = (entry["decision"], entry.get("run"))

    def change(entries: list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]] | None, dict[str, Any]]:
        entries = entries or []
        if any((old["decision"], old.get("run")) == key for old in entries):
            return None, entry
        return [*entries, entry], entry

    return _swap(history_uri(models_prefix, version), change)


def history(models_prefix: str, version: str) -> list[dict[str, Any]]:
    """Every decision on ``version``, oldest first."""
    uri = history_uri(models_prefix, version)
    return storage.read_json(uri) if storage.exists(uri) else []


def ask(models_prefix: str, request: dict[str, Any]) -> dict[str, Any] | None:
    """Open ``request`` (version, run, compared, reason, ...) as this name's one pending request; returns the request
    it superseded (another run's, still open), else None. A retry of the same run's gate asks once."""
    request = {"asked_at": now_text(), **request}

    def change(state: dict[str, Any] | None) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        still_open = state if state and state.get("run") else None
        if still_open is not None and still_open["run"] == request["run"]:
            return None, None
        return request, still_open

    superseded = _swap(pending_uri(models_prefix), change)
    if superseded is not None:
        record(models_prefix, superseded["version"], {
            "decision": "superseded", "run": superseded["run"], "by": request["run"],
            "note": f"a newer request from {request['run']} (version {request['version']}) replaced it"})
    record(models_prefix, request["version"], {"decision": "waiting", "run": request["run"], "reason": request["reason"],
                                               "compared": request.get("compared")})
    return superseded


def close(models_prefix: str, run: str) -> dict[str, Any] | None:
    """Close ``run``'s request; returns it, or None when it is no longer open (superseded or closed before). The
    closed request stays readable in the file until the next one."""

    def change(state: dict[str, Any] | None) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        if state is None or state.get("run") != run:
            return None, None
        return {"run": None, "closed": state, "closed_at": now_text()}, state

    return _swap(pending_uri(models_prefix), change)


def last_closed(models_prefix: str) -> dict[str, Any] | None:
    """The request closed last (by its answer), while no newer one is open; None otherwise."""
    state = storage.read_versioned(pending_uri(models_prefix))[0]
    return state.get("closed") if state and not state.get("run") else None


def open_request(models_prefix: str) -> dict[str, Any] | None:
    """The request waiting for an answer now, or None."""
    state = storage.read_versioned(pending_uri(models_prefix))[0]
    return state if state and state.get("run") else None
