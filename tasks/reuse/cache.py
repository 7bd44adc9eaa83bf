"""Step caching across runs: an index of committed sub-job outputs by input fingerprint, one per pipeline and storage
root (``<storage_root>/cache/<pipeline>/<kind>/<fingerprint>.json``).

Nothing to run: the Airflow steps look an entry up before launching a sub-job and remember one after it commits. An
entry points at outputs another run committed, with the content id of every file it serves (stagewise.core.content:
SHA-256, or S3's ETag) taken as it is remembered, right after the commit. A lookup serves it only when its source run
is a run of this pipeline, every file it names lies in that run's folder under this storage root, the outputs still
carry the fingerprint asked for, and every file's content id is the one recorded; else it is a miss, with one warning
naming the file and why, and the work is done again. Two runs that remember the same fingerprint at once write equal
entries (each one whole), so concurrent runs are safe.
"""

from __future__ import annotations

import json
import logging
import posixpath
from collections.abc import Callable
from typing import Any

from stagewise.core import storage
from stagewise.core.content import content_ids, described
from stagewise.core.errors import DataError
from stagewise.definitions.config import PipelineConfig
from stagewise.definitions.pipelines import pipeline_of
from stagewise.reuse.fingerprints import manifest_fingerprint

log = logging.getLogger("stagewise.reuse")

CACHE_FOLDER = "cache"
# The keys of a result that name a file or folder the entry serves (a stage's init_from names its input, not output).
SERVED_KEYS = ("manifest_uri", "uri", "summary_uri", "trials_uri", "metrics_uri", "checkpoint_uri", "model_uri",
               "optimizer_uri")
# The committed record each kind's result is a copy of (its values are served from the entry, so they must agree).
RECORD_KEYS = ("manifest_uri", "uri", "summary_uri", "metrics_uri")


def entry_uri(config: PipelineConfig, kind: str, fingerprint: str) -> str:
    """Where the entry of ``kind`` for ``fingerprint`` lives: under this pipeline's own name and storage root."""
    return storage.join(config.storage_root, CACHE_FOLDER, storage.safe_name(config.name or "pipeline"), kind,
                        f"{fingerprint}.json")


def remember(config: PipelineConfig, kind: str, fingerprint: str, source_run: str, result: dict[str, Any]) -> None:
    """Record ``source_run``'s committed ``result`` of ``kind`` under its fingerprint (with caching on for ``kind``),
    with the content id of every file it serves (one read of each locally, a HEAD on S3)."""
    if not config.cache.enabled(kind) or result.get("reused_from"):
        return  # a reused result already has its entry, naming the run that made it
    try:
        files = served_files(kind, result)
        outputs = dict(zip(files, content_ids(files), strict=True))
    except FileNotFoundError as exc:  # nothing to point at: no entry (the step's own result still stands)
        log.warning("%s: %s's outputs for inputs %s are not cached: %s", kind, source_run, fingerprint, exc)
        return
    storage.write_json(entry_uri(config, kind, fingerprint), {"kind": kind, "fingerprint": fingerprint,
                                                             "source_run": source_run, "result": result,
                                                             "outputs": outputs})


def lookup(config: PipelineConfig, kind: str, fingerprint: str, this_run: str,
           committed: Callable[[dict[str, Any]], str | None]) -> dict[str, Any] | None:
    """An earlier run's result of ``kind`` for ``fingerprint`` with ``reused_from`` naming that run, or None.

    ``committed(result)`` says why the outputs the result names can no longer be served (None: they can); it runs
    after the entry's origin is checked and before the recorded content ids are (the costly part: a read of each
    served file locally, a HEAD on S3).
    """
    if not config.cache.enabled(kind):
        return None
    uri = entry_uri(config, kind, fingerprint)
    if not storage.exists(uri):
        log.info("%s: no earlier run cached for inputs %s", kind, fingerprint)
        return None
    try:
        entry = storage.read_json(uri)
    except DataError as exc:
        log.warning("%s: the cache entry %s is not served: %s; doing the work again", kind, uri, exc)
        return None
    source = str(entry.get("source_run", ""))
    if source == this_run:
        return None  # its own work is not a cache hit (a cleared task finds it by its own fingerprint)
    result = entry.get("result") if isinstance(entry.get("result"), dict) else {}
    why = entry_problem(config, kind, fingerprint, this_run, entry)
    if why is None:
        why = committed(result) or values_problem(result)
    if why is None:
        why = content_problem(entry["outputs"])
    if why is not None:
        log.warning("%s: the cache entry %s (outputs of %s for inputs %s) is not served: %s; doing the work again",
                    kind, uri, source or "no run", fingerprint, why)
        return None
    log.info("%s: reused from %s (inputs %s unchanged; %d file(s) checked against the content ids recorded at "
             "commit)", kind, source, fingerprint, len(entry["outputs"]))
    return {**result, "reused_from": source}


def entry_problem(config: PipelineConfig, kind: str, fingerprint: str, this_run: str, entry: dict[str, Any]) -> str | None:
    """Why ``entry`` cannot be served by its own account (None: it can): another kind or fingerprint, no recorded
    content ids, a source run of another pipeline, or a URI outside its source run's folder under the storage root."""
    if entry.get("kind") != kind or entry.get("fingerprint") != fingerprint:
        return f"it records kind {entry.get('kind')!r} and fingerprint {entry.get('fingerprint')!r}"
    outputs, result = entry.get("outputs"), entry.get("result")
    if not isinstance(outputs, dict) or not outputs or not isinstance(result, dict):
        return "it records no content fingerprint of its outputs (written before Stagewise recorded them)"
    root, named = config.storage_root, [*(str(result[key]) for key in SERVED_KEYS if result.get(key)), *outputs]
    if outside := next((uri for uri in named if not storage.under(uri, root)), None):
        return f"{outside} lies outside the storage root {root}"
    source = str(entry.get("source_run", ""))
    dag_id, _, run_id = source.partition("/")
    pipeline = config.name or pipeline_of(this_run.partition("/")[0])
    if not run_id or "/" in run_id or pipeline is None or pipeline_of(dag_id) != pipeline:
        return f"its source run {source!r} is not a run of pipeline '{pipeline}'"
    folder = storage.run_prefix(root, dag_id, run_id)
    if outside := next((uri for uri in named if not storage.under(uri, folder)), None):
        return f"{outside} lies outside the folder of its source run {source} ({folder})"
    return None


def content_problem(outputs: dict[str, str]) -> str | None:
    """Why the files of ``outputs`` (URI: the content id recorded at commit) cannot be served (None: each still has
    its recorded content)."""
    uris = list(outputs)
    try:
        found = content_ids(uris)
    except FileNotFoundError as exc:
        return f"{exc.filename or exc} is gone"
    for uri, now in zip(uris, found, strict=True):
        if now != outputs[uri]:
            return f"{uri}: its content changed since it committed ({described(outputs[uri])} then, {described(now)} now)"
    return None


def served_files(kind: str, result: dict[str, Any]) -> list[str]:
    """Every file a result of ``kind`` serves, as its content ids are recorded: a manifest and the files it lists
    (preprocess, inference), a record (sweep summary, test metrics), or a stage's hand-off, model, record and the
    files of the optimizer checkpoint its hand-off names."""
    found = []
    for key in SERVED_KEYS:
        if not result.get(key):
            continue
        uri = str(result[key])
        if key == "optimizer_uri":
            fs, path = storage.filesystem(uri)
            found.extend(storage.join(uri, posixpath.relpath(name, path)) for name in sorted(fs.find(path)))
            continue
        found.append(uri)
        if key in ("manifest_uri", "uri"):
            found.extend(listed_files(storage.read_json(uri)))
        if key == "checkpoint_uri":
            found.append(_stage_record(result))
    if not found:
        raise FileNotFoundError(f"the {kind} result names no output file ({sorted(result)})")
    return list(dict.fromkeys(found))


def _stage_record(result: dict[str, Any]) -> str:
    """A stage's metrics.json, beside its final.pt and written last."""
    return storage.join(result["checkpoint_uri"].rsplit("/", 1)[0], "metrics.json")


def values_problem(result: dict[str, Any]) -> str | None:
    """Which value a cached result holds other than the committed record it copies (a manifest, a summary, test
    metrics, a stage's metrics.json) does (None: they agree)."""
    keys = [key for key in RECORD_KEYS if result.get(key)]
    uri = str(result[keys[0]]) if keys else _stage_record(result) if result.get("checkpoint_uri") else None
    if uri is None:
        return None
    record = storage.read_json(uri)
    for key in sorted((set(result) & set(record)) - set(SERVED_KEYS)):
        if json.dumps(result[key], sort_keys=True, default=str) != json.dumps(record[key], sort_keys=True, default=str):
            return f"the entry's {key} is not the one {uri} records"
    return None


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
    checkpoint it names) or model is gone, or its stage's record (metrics.json, written last) is unfinished or was
    re-made from other inputs."""
    for key in ("checkpoint_uri", "model_uri"):
        if not result.get(key) or not storage.exists(result[key]):
            return f"{result.get(key)} ({key}) is gone"
    if result.get("optimizer_uri") and not storage.exists(storage.join(result["optimizer_uri"], ".metadata")):
        return f"{result['optimizer_uri']} (the optimizer state final.pt hands on) is gone"
    record_uri = _stage_record(result)
    if not storage.exists(record_uri):
        return f"{record_uri} is gone"
    record = storage.read_json(record_uri)
    if not record.get("complete") or record.get("fingerprint") != fingerprint:
        return f"{record_uri} is unfinished or was re-made from other inputs ({record.get('fingerprint')})"
    return None
