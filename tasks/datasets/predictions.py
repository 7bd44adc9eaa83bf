"""Batch inference's data: the raw input cut into shards of whole row groups, and the committed predictions
manifest that lists exactly the shards' files (leftovers of failed attempts removed).
"""

from __future__ import annotations

import logging
from typing import Any

from stagewise.core import storage
from stagewise.datasets import sharding

log = logging.getLogger("stagewise.infer")


def plan_inference(input_uri: str, rows_per_shard: int, root: str | None = None) -> list[dict[str, Any]]:
    """Deterministic shards of about ``rows_per_shard`` rows: consecutive row groups of a large file, or several small
    files together, each file pinned by its content too (stagewise.datasets.sharding); ``root``: the storage root,
    under which alone an error lists what a folder holds instead of Parquet."""
    shards = sharding.plan_files(input_uri, rows_per_shard, root, content=True)
    log.info("planned %d inference shard(s) over %s", len(shards), input_uri)
    return shards


def committed_result(uri: str) -> dict[str, Any]:
    """A committed predictions manifest as commit_predictions returns it."""
    manifest = storage.read_json(uri)
    return {"uri": uri, "rows": manifest["rows"], "rows_quarantined": manifest["rows_quarantined"],
            "fingerprint": manifest.get("fingerprint")}


def shard_files(result: dict[str, Any]) -> list[dict[str, Any]]:
    """A shard result's prediction files in order, as ``{"uri", "rows"}``: its ``files`` (a large shard is written as
    several, in parallel), or the one ``uri`` of a result from before them."""
    return [{"uri": f["uri"], "rows": f["rows"]} for f in result["files"]] if result.get("files") else [
        {"uri": result["uri"], "rows": result["rows"]}]


def shard_quarantine(result: dict[str, Any]) -> list[dict[str, Any]]:
    """A shard result's quarantine files in order (none when no row was quarantined), as ``{"uri", "rows"}``."""
    if result.get("quarantine_files"):
        return [{"uri": f["uri"], "rows": f["rows"]} for f in result["quarantine_files"]]
    return [{"uri": result["quarantine_uri"], "rows": result["rows_quarantined"]}] if result.get("quarantine_uri") else []


def commit_predictions(out: str, model_uri: str, results: list[dict[str, Any]], fingerprint: str | None = None) -> dict[str, Any]:
    """Write ``predictions/manifest.json`` listing exactly the shards' files; drop unlisted leftovers.

    ``files`` (and ``quarantine``) list every file of every shard, by shard index, then in each shard's own order, so
    reading them in the listed order gives the rows in input order; each entry names its ``shard``. One manifest,
    written last, commits all of a shard's files together."""
    ordered = sorted(results, key=lambda r: r["index"])
    files = [{**f, "shard": r["index"]} for r in ordered for f in shard_files(r)]
    quarantine = [{**q, "shard": r["index"]} for r in ordered for q in shard_quarantine(r)]
    manifest = {"kind": "predictions", "model_uri": model_uri, "files": files, "quarantine": quarantine,
                "rows": sum(r["rows"] for r in ordered), "rows_quarantined": sum(r.get("rows_quarantined", 0) for r in ordered),
                "fingerprint": fingerprint}
    prefix = storage.join(out, "predictions")
    uri = storage.join(prefix, "manifest.json")
    storage.write_json(uri, manifest)
    listed = {f["uri"] for f in files} | {q["uri"] for q in quarantine}
    removed = storage.remove_unlisted(prefix, listed)
    log.info("committed %s: %d rows in %d file(s) of %d shard(s), %d quarantined, %d stale file(s) removed", uri,
             manifest["rows"], len(files), len(ordered), manifest["rows_quarantined"], removed)
    return {"uri": uri, "rows": manifest["rows"], "rows_quarantined": manifest["rows_quarantined"], "fingerprint": fingerprint}
