"""What a run's folder no longer needs once the run succeeded: the files only a resume, or a lone re-run of one of
its tasks, would read.

Nothing to run: the training DAG's report step calls :func:`drop_finished` (before report.json, which lists what went);
a stage that starts from a hand-off, its optimizer loader and a manifest's reader ask
stagewise.core.dropped.was_dropped first. Plain storage calls, no
torch.

Dropped from each ``train/<stage>/``: ``checkpoints/`` (``step-*.pt`` / ``step-*.dcp``, their checksum records, the
pointer) and ``best/`` (the best epoch's model and optimizer), which carry optimizer state, and the hand-off to the
next stage -- ``final.pt`` (the weights again, as model.pt holds them) and its optimizer ``final-optimizer-<id>.dcp``
(about 2x the model with Adam). From ``preprocess/``: each shard's partial statistics (``stats/``, reduced into
stats.json) and the split data the manifest lists (the parquet copy of the input). Kept: ``model.pt`` (evaluation, the
registry, inference, the model card), ``metrics.json``, ``manifest.json``, ``stats.json``, predictions and the run's
record (report, config snapshot, lineage, timeline): a re-run from the snapshot (``stagewise.config --rerun``) reads
the raw data again, never these files.

With step caching on, what the cache serves stays: a stage's hand-off (``cache.stage``:
stagewise.reuse.cache.stage_problem serves a stage only while final.pt and its optimizer are there, so one removed
later by retention is a clean cache miss) and the split data (``cache.preprocess``). ``retention.drop_after_success:
false`` keeps everything (the maintenance DAG's ``checkpoints_days`` then applies).

Each folder's ``dropped.json`` lists what went, written before anything goes: a retried report step finishes the job
and reports the same list, and a task cleared after the run succeeded that reads a dropped file says so and what to
clear instead, rather than failing on a file that went on purpose.
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Iterable
from typing import Any

from stagewise.core import storage
from stagewise.core.dropped import RECORD
from stagewise.definitions.config import PipelineConfig
from stagewise.reuse.cache import listed_files

log = logging.getLogger("stagewise.train")

STAGE_FOLDERS = ("checkpoints", "best")  # every file in them carries optimizer state or points at a file that does
HAND_OFF = ("final.pt", "final-optimizer-*.dcp")


def _uri(scheme: str, path: str) -> str:
    return scheme + path if scheme and not path.startswith(scheme) else path


def _sized(prefix: str, paths: Iterable[str]) -> list[dict[str, Any]]:
    """``{"uri", "bytes"}`` of each path (a file or a folder) under ``prefix``'s storage."""
    fs, _ = storage.filesystem(prefix)
    scheme = prefix.split("://", 1)[0] + "://" if "://" in prefix else ""
    return [{"uri": _uri(scheme, path), "bytes": int(fs.du(path, total=True))} for path in paths]


def stage_leftovers(stage_prefix: str, keep_hand_off: bool = False) -> list[dict[str, Any]]:
    """A finished stage's checkpoints/ and best/ entries and (unless ``keep_hand_off``) its hand-off to the next stage."""
    fs, path = storage.filesystem(stage_prefix)
    if not fs.isdir(path):
        return []  # a stage reused from another run: its files are that run's
    found = [p for folder in STAGE_FOLDERS if fs.isdir(f"{path}/{folder}") for p in sorted(fs.ls(f"{path}/{folder}", detail=False))]
    if not keep_hand_off:
        found += [p for pattern in HAND_OFF for p in sorted(fs.glob(f"{path}/{pattern}"))]
    return _sized(stage_prefix, found)


def preprocess_leftovers(preprocess_prefix: str, keep_splits: bool = False) -> list[dict[str, Any]]:
    """A committed preprocess's per-shard statistics and (unless ``keep_splits``) the split files its manifest lists."""
    fs, path = storage.filesystem(preprocess_prefix)
    if not fs.isdir(path) or not fs.exists(f"{path}/manifest.json"):
        return []  # reused from another run, or never committed
    found = sorted(fs.ls(f"{path}/stats", detail=False)) if fs.isdir(f"{path}/stats") else []
    if not keep_splits:
        manifest = storage.read_json(storage.join(preprocess_prefix, "manifest.json"))
        # Only this run's own copy: a manifest's files outside its folder are another run's.
        own = path.rstrip("/") + "/"
        found += sorted(p for p in (storage.filesystem(uri)[1] for uri in listed_files(manifest))
                        if p.startswith(own) and fs.exists(p))
    return _sized(preprocess_prefix, found)


def drop_listed(prefix: str, found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Remove ``found`` (entries under ``prefix``); returns every entry ``prefix``'s record lists as dropped (an earlier
    attempt's too). The record is written first, so a drop cut short is finished by the next call."""
    record_uri = storage.join(prefix, RECORD)
    earlier = storage.read_json(record_uri)["files"] if storage.exists(record_uri) else []
    if not found:
        return earlier
    by_uri = {entry["uri"]: entry for entry in earlier}
    by_uri.update({entry["uri"]: entry for entry in found if entry["uri"] not in by_uri})
    files = sorted(by_uri.values(), key=lambda entry: entry["uri"])
    storage.write_json(record_uri, {"files": files, "bytes": sum(entry["bytes"] for entry in files)})
    fs, path = storage.filesystem(prefix)
    parents = set()
    for entry in found:
        target = storage.filesystem(entry["uri"])[1]
        fs.rm(target, recursive=True)
        parents.add(posixpath.dirname(target.rstrip("/")))
    for parent in sorted(parents, reverse=True):  # emptied folders go too (a local file system keeps them)
        if parent.rstrip("/") != path.rstrip("/") and fs.isdir(parent) and not fs.ls(parent):
            fs.rm(parent, recursive=True)
    return files


def drop_finished(config: PipelineConfig, out: str, stages: Iterable[str]) -> dict[str, Any]:
    """At the end of the succeeded run under ``out``: drop what only a resume reads, as the config allows; returns what
    the report says of it (``files`` relative to ``out`` with their ``bytes``, the total, and ``kept``: what stayed
    and why)."""
    if not config.retention.drop_after_success:
        return {"files": [], "bytes": 0, "kept": "retention.drop_after_success is false: checkpoints and hand-offs stay"}
    keep_hand_off, keep_splits = config.cache.enabled("stage"), config.cache.enabled("preprocess")
    files = drop_listed(storage.join(out, "preprocess"), preprocess_leftovers(storage.join(out, "preprocess"), keep_splits))
    for stage in stages:
        prefix = storage.stage_prefix(out, stage)
        files += drop_listed(prefix, stage_leftovers(prefix, keep_hand_off))
    base = storage.filesystem(out)[1].rstrip("/") + "/"
    listed = [{"file": storage.filesystem(entry["uri"])[1].removeprefix(base), "bytes": entry["bytes"]} for entry in files]
    total = sum(entry["bytes"] for entry in files)
    log.info("dropped %d file(s) only a resume reads, %d bytes", len(listed), total)
    kept = [*(["each stage's hand-off (final.pt, final-optimizer-*.dcp): cache.stage is on"] if keep_hand_off else []),
            *(["the split data (preprocess/): cache.preprocess is on"] if keep_splits else [])]
    return {"files": listed, "bytes": total, **({"kept": "; ".join(kept)} if kept else {})}
