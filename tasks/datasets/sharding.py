"""How input files become shards, and the pin that ties a shard to the files its plan saw.

Nothing to run: stagewise.infer and stagewise.preprocess plan with these, and each shard job checks its files.

A shard is a list of files (inference: each with a range of its row groups). Files at least a shard's size are cut
into shards of their own; smaller ones are packed together while a shard stays within the target rows and bytes, so 10,000
small files plan a few shards while 100 large ones still spread over 100 or more. However many files an input has,
a plan never exceeds :data:`MAX_SHARDS`: when it would, the targets double until it fits (shards grow).

Every file is pinned at plan: its size, its row count (the Parquet footer), and its S3 ETag, or elsewhere its
modification time. A batch inference plan also pins each file's content (stagewise.core.content: the S3 ETag, else
the SHA-256, which the plan reads anyway for its fingerprint): a file rewritten in place with its size and mtime kept
is another file. Locally that costs each try a read of its files' bytes (of a file cut into several shards, only its
own row groups' and the footer's: stagewise.datasets.spans); preprocess, whose raw bytes its fingerprint hashes at
plan too, keeps the cheap pin in its tries. A try that finds a file other than pinned fails as a DataError
naming it, before reading any row: nothing committed mixes two versions.
"""

from __future__ import annotations

import functools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from stagewise.core import storage
from stagewise.core.content import HASH_THREADS, content_id
from stagewise.core.errors import DataError
from stagewise.datasets import spans

log = logging.getLogger("stagewise.sharding")

# Airflow's [core] max_map_length defaults to 1,024 mapped tasks: half of it leaves room for a lowered setting.
MAX_SHARDS = 512
# Small files are packed until a shard holds this many Parquet bytes (or its target rows): per-file overhead amortised.
SHARD_BYTES = 256 * 2**20
PIN_KEYS = ("size", "file_rows", "etag", "mtime", "content")
# What a plan keeps of a file cut into several shards: each shard's row groups' digests and the footer's.
SPAN_KEYS = ("group_digests", "footer_digest")


def pin(uri: str, fresh: bool = False, content: bool = False) -> dict[str, Any]:
    """What identifies a file's current version: its size, its rows, and its ETag (S3) or mtime (``fresh``: asked
    of the store itself, never of a listing this process cached); with ``content`` its content id too."""
    fs, path = storage.filesystem(uri)
    if fresh:
        fs.invalidate_cache(path)
    info = fs.info(path)
    with storage.open_parquet(uri) as parquet:
        metadata = parquet.metadata
    found: dict[str, Any] = {"uri": uri, "size": info.get("size"), "file_rows": metadata.num_rows,
                             "group_rows": [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]}
    if etag := str(info.get("ETag") or info.get("etag") or "").strip('"'):
        found["etag"] = etag
    elif (mtime := info.get("mtime")) is not None:
        found["mtime"] = mtime.timestamp() if hasattr(mtime, "timestamp") else float(mtime)
    if content and not found.get("etag"):
        found.update(spans.pinned_digests(uri, info["size"], metadata))
    elif content:
        found["content"] = content_id(uri, info)
    return found


def check_pinned(entry: dict[str, Any]) -> None:
    """Raise DataError naming the file when it is no longer the version its plan pinned (a shard from before pins,
    without them, is not checked)."""
    pinned = {key: entry[key] for key in PIN_KEYS if key in entry}
    if not pinned:
        return
    by_spans = all(key in entry for key in SPAN_KEYS) and entry.get("row_groups") is not None
    if by_spans:  # a part of the file: its own row groups and the footer are hashed below, not the whole file
        pinned.pop("content", None)
    now = pin(entry["uri"], fresh=True, content="content" in pinned)
    found = {key: now.get(key) for key in pinned}
    if by_spans and found == pinned and (what := spans.changed_spans(entry["uri"], entry["row_groups"],
                                                                     entry["group_digests"], entry["footer_digest"])):
        raise DataError(f"{entry['uri']}: changed since the plan (content of {what} differs from the bytes the plan "
                        f"hashed; size and mtime kept): a shard reads only the version its plan pinned, so no output "
                        f"mixes two versions of an input: clear the plan task to plan the input as it is now")
    if found != pinned:
        changed = ", ".join(f"{key} {pinned[key]!r} -> {found[key]!r}" for key in pinned if pinned[key] != found[key])
        raise DataError(f"{entry['uri']}: changed since the plan ({changed}): planned {pinned}, found {found}; a shard "
                        f"reads only the version its plan pinned, so no output mixes two versions of an input: clear "
                        f"the plan task to plan the input as it is now")


def _pack(pins: list[dict[str, Any]], rows_target: int, bytes_target: int, split_files: bool) -> list[list[dict[str, Any]]]:
    """Shards as lists of ``{pin..., "row_groups", "rows"}``: a file at a target or above cut into its own (at row
    groups when ``split_files``), smaller ones packed in order while the shard stays within both targets."""
    shards: list[list[dict[str, Any]]] = []
    packed: list[dict[str, Any]] = []
    packed_rows = packed_bytes = 0
    for entry in pins:
        groups, size = entry["group_rows"], entry["size"] or 0
        base = {key: value for key, value in entry.items() if key != "group_rows" and key not in SPAN_KEYS}
        if entry["file_rows"] >= rows_target or size >= bytes_target:
            if not split_files:
                shards.append([{**base, "row_groups": list(range(len(groups))), "rows": entry["file_rows"]}])
                continue
            per_row = size / max(entry["file_rows"], 1)
            chosen: list[int] = []
            rows = 0
            cut: list[dict[str, Any]] = []
            for index, count in enumerate(groups):
                chosen.append(index)
                rows += count
                if rows >= rows_target or rows * per_row >= bytes_target:
                    cut.append({**base, "row_groups": chosen, "rows": rows})
                    chosen, rows = [], 0
            if chosen:
                cut.append({**base, "row_groups": chosen, "rows": rows})
            if len(cut) > 1 and all(key in entry for key in SPAN_KEYS):  # each shard checks only its own bytes
                cut = [{**part, "group_digests": [entry["group_digests"][g] for g in part["row_groups"]],
                        "footer_digest": entry["footer_digest"]} for part in cut]
            shards.extend([part] for part in cut)
            continue
        if packed and (packed_rows + entry["file_rows"] > rows_target or packed_bytes + size > bytes_target):
            shards.append(packed)  # this file would carry the shard past a target: it starts the next one
            packed, packed_rows, packed_bytes = [], 0, 0
        packed.append({**base, "row_groups": list(range(len(groups))), "rows": entry["file_rows"]})
        packed_rows += entry["file_rows"]
        packed_bytes += size
        if packed_rows >= rows_target or packed_bytes >= bytes_target:
            shards.append(packed)
            packed, packed_rows, packed_bytes = [], 0, 0
    if packed:
        shards.append(packed)
    return shards


def plan_files(input_uri: str, rows_per_shard: int, root: str | None = None, *, split_files: bool = True,
               bytes_per_shard: int = SHARD_BYTES, max_shards: int | None = None,
               content: bool = False) -> list[dict[str, Any]]:
    """Deterministic shards ``{"index", "rows", "files": [{"uri", "row_groups", "rows", pin...}]}`` covering every
    row group of every file once, in file order; at most ``max_shards`` (default MAX_SHARDS; targets doubled until
    they fit); ``content``: each file pinned by its content id too. A shard
    of one file also carries that file's ``uri`` and ``row_groups`` at the top, its shape before multi-file shards."""
    max_shards = max_shards or MAX_SHARDS
    uris = storage.list_parquet(input_uri, root)
    pin_file = functools.partial(pin, content=content)
    if content and len(uris) > 1:  # each file is read whole: several at once
        with ThreadPoolExecutor(min(HASH_THREADS, len(uris))) as pool:
            pins = list(pool.map(pin_file, uris))
    else:
        pins = [pin_file(uri) for uri in uris]
    rows_target, bytes_target = rows_per_shard, bytes_per_shard
    while len(packed := _pack(pins, rows_target, bytes_target, split_files)) > max_shards:
        rows_target, bytes_target = max(rows_target * 2, 1), max(bytes_target * 2, 1)
    if rows_target != rows_per_shard:
        log.info("%d file(s) would plan over %d shards: targets grown to %d rows / %d bytes per shard", len(pins),
                 max_shards, rows_target, bytes_target)
    shards = []
    for index, files in enumerate(packed):
        shard: dict[str, Any] = {"index": index, "rows": sum(f["rows"] for f in files), "files": files}
        if len(files) == 1:
            shard.update(uri=files[0]["uri"], row_groups=files[0]["row_groups"])
        shards.append(shard)
    return shards


def shard_files(shard: dict[str, Any]) -> list[dict[str, Any]]:
    """A shard's files as ``{"uri", "row_groups", pin...}``; a shard from before multi-file shards is its one file."""
    if shard.get("files"):
        return list(shard["files"])
    return [{"uri": shard["uri"], "row_groups": shard.get("row_groups")}]


def file_uris(shards: list[dict[str, Any]]) -> list[str]:
    """Every file of ``shards`` once, in plan order."""
    return list(dict.fromkeys(f["uri"] for shard in shards for f in shard_files(shard)))


def file_contents(shards: list[dict[str, Any]]) -> list[str]:
    """The content id each file of ``shards`` was pinned by, once per file in plan order (a plan with content pins)."""
    return list({f["uri"]: f["content"] for shard in shards for f in shard_files(shard)}.values())
