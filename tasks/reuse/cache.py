"""Step caching across runs: an index of committed sub-job outputs by input fingerprint, one per pipeline and storage
root (``<storage_root>/cache/<pipeline>/<kind>/<fingerprint>.json``).

Nothing to run: the Airflow steps look an entry up before launching a sub-job and remember one after it commits. An
entry only points at outputs another run committed; a lookup serves it only after checking that those outputs are
still there and still carry the same fingerprint, so a deleted or re-made output is never served. Two runs that
remember the same fingerprint at once write equal entries (each one whole), so concurrent runs are safe.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from stagewise.core import storage
from stagewise.definitions.config import PipelineConfig
from stagewise.reuse.fingerprints import manifest_fingerprint

log = logging.getLogger("stagewise.reuse")

CACHE_FOLDER = "cache"


def entry_uri(config: PipelineConfig, kind: str, fingerprint: str) -> str:
    """Where the entry of ``kind`` for ``fingerprint`` lives: under this pipeline's own name and storage root."""
    return storage.join(config.storage_root, CACHE_FOLDER, storage.safe_name(config.name or "pipeline"), kind,
                        f"{fingerprint}.json")


def remember(config: PipelineConfig, kind: str, fingerprint: str, source_run: str, result: dict[str, Any]) -> None:
    """Record ``source_run``'s committed ``result`` of ``kind`` under its fingerprint (with caching on for ``kind``)."""
    if not config.cache.enabled(kind) or result.get("reused_from"):
        return  # a reused result already has its entry, naming the run that made it
    storage.write_json(entry_uri(config, kind, fingerprint),
                       {"kind": kind, "fingerprint": fingerprint, "source_run": source_run, "result": result})


def lookup(config: PipelineConfig, kind: str, fingerprint: str, this_run: str,
           committed: Callable[[dict[str, Any]], str | None]) -> dict[str, Any] | None:
    """An earlier run's result of ``kind`` for ``fingerprint`` with ``reused_from`` naming that run, or None.

    ``committed(result)`` says why the outputs the result names can no longer be served (None: they can).
    """
    if not config.cache.enabled(kind):
        return None
    uri = entry_uri(config, kind, fingerprint)
    if not storage.exists(uri):
        log.info("%s: no earlier run cached for inputs %s", kind, fingerprint)
        return None
    entry = storage.read_json(uri)
    source = str(entry.get("source_run", ""))
    if entry.get("fingerprint") != fingerprint or entry.get("kind") != kind or source == this_run:
        return None
    if (why := committed(entry.get("result") or {})) is not None:
        log.warning("%s: the cached outputs of %s for inputs %s are not served: %s", kind, source, fingerprint, why)
        return None
    log.info("%s: reused from %s (inputs %s unchanged)", kind, source, fingerprint)
    return {**entry["result"], "reused_from": source}


def manifest_problem(uri: str | None, fingerprint: str) -> str | None:
    """Why the committed manifest at ``uri`` cannot stand for ``fingerprint`` (None: it can): gone, made from other
    inputs, or naming a file that is gone."""
    if not uri or not storage.exists(uri):
        return f"{uri} is gone"
    manifest = storage.read_json(uri)
    if (found := manifest_fingerprint(manifest)) != fingerprint:
        return f"{uri} was re-made from other inputs ({found})"
    for part in listed_files(manifest):
        if not storage.exists(part):
            return f"{part}, listed by {uri}, is gone"
    return None


def listed_files(manifest: dict[str, Any]) -> list[str]:
    """Every file URI a preprocess or predictions manifest lists."""
    found: list[str] = []
    for files in (manifest.get("splits") or {}).values():
        found.extend(entry["uri"] for entry in files if isinstance(entry, dict) and "uri" in entry)
    for entry in [*(manifest.get("files") or []), *(manifest.get("quarantine") or [])]:
        if isinstance(entry, dict) and "uri" in entry:
            found.append(entry["uri"])
    return found


def record_problem(uri: str | None, fingerprint: str) -> str | None:
    """Why the JSON record at ``uri`` (a sweep summary, test metrics) cannot stand for ``fingerprint`` (None: it can):
    gone, or re-made from other inputs."""
    if not uri or not storage.exists(uri):
        return f"{uri} is gone"
    found = storage.read_json(uri).get("fingerprint")
    return None if found == fingerprint else f"{uri} was re-made from other inputs ({found})"


def stage_problem(result: dict[str, Any], fingerprint: str) -> str | None:
    """Why a cached stage result cannot stand for ``fingerprint`` (None: it can): its hand-off (with the optimizer
    checkpoint it names) or model is gone, or
    its stage's record (metrics.json, written last) is unfinished or was re-made from other inputs."""
    for key in ("checkpoint_uri", "model_uri"):
        if not result.get(key) or not storage.exists(result[key]):
            return f"{result.get(key)} ({key}) is gone"
    if result.get("optimizer_uri") and not storage.exists(storage.join(result["optimizer_uri"], ".metadata")):
        return f"{result['optimizer_uri']} (the optimizer state final.pt hands on) is gone"
    record_uri = storage.join(result["checkpoint_uri"].rsplit("/", 1)[0], "metrics.json")
    if not storage.exists(record_uri):
        return f"{record_uri} is gone"
    record = storage.read_json(record_uri)
    if not record.get("complete") or record.get("fingerprint") != fingerprint:
        return f"{record_uri} is unfinished or was re-made from other inputs ({record.get('fingerprint')})"
    return None
