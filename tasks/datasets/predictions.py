"""Batch inference's data: the raw input cut into shards of whole row groups, and the committed predictions
manifest that lists exactly the shards' files (leftovers of failed attempts removed).
"""

from __future__ import annotations

import logging
from typing import Any

from stagewise.core import storage

log = logging.getLogger("stagewise.infer")


def plan_inference(input_uri: str, rows_per_shard: int, root: str | None = None) -> list[dict[str, Any]]:
    """Deterministic shards: consecutive row groups of each file, about ``rows_per_shard`` rows each (``root``: the
    storage root, under which alone an error lists what a folder holds instead of Parquet)."""
    shards: list[dict[str, Any]] = []
    for uri in storage.list_parquet(input_uri, root):
        with storage.open_parquet(uri) as parquet:
            metadata = parquet.metadata
        group, rows = [], 0
        for index in range(metadata.num_row_groups):
            group.append(index)
            rows += metadata.row_group(index).num_rows
            if rows >= rows_per_shard:
                shards.append({"index": len(shards), "uri": uri, "row_groups": group, "rows": rows})
                group, rows = [], 0
        if group:
            shards.append({"index": len(shards), "uri": uri, "row_groups": group, "rows": rows})
    log.info("planned %d inference shard(s) over %s", len(shards), input_uri)
    return shards


def commit_predictions(out: str, model_uri: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    """Write ``predictions/manifest.json`` listing exactly the shards' files; drop unlisted leftovers."""
    ordered = sorted(results, key=lambda r: r["index"])
    manifest = {"kind": "predictions", "model_uri": model_uri,
                "files": [{"uri": r["uri"], "rows": r["rows"]} for r in ordered],
                "quarantine": [{"uri": r["quarantine_uri"], "rows": r["rows_quarantined"]} for r in ordered if r.get("quarantine_uri")],
                "rows": sum(r["rows"] for r in ordered), "rows_quarantined": sum(r.get("rows_quarantined", 0) for r in ordered)}
    prefix = storage.join(out, "predictions")
    uri = storage.join(prefix, "manifest.json")
    storage.write_json(uri, manifest)
    listed = {r["uri"] for r in ordered} | {q["uri"] for q in manifest["quarantine"]}
    removed = storage.remove_unlisted(prefix, listed)
    log.info("committed %s: %d rows in %d file(s), %d quarantined, %d stale file(s) removed", uri, manifest["rows"],
             len(ordered), manifest["rows_quarantined"], removed)
    return {"uri": uri, "rows": manifest["rows"], "rows_quarantined": manifest["rows_quarantined"]}
