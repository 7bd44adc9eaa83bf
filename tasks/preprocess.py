"""Sharded preprocessing: plan, per-shard statistics, reduce, per-shard transform, commit.

Run one step alone, e.g.::

    python -m stagewise.preprocess plan --input raw/digits --out runs/demo/r1
    python -m stagewise.preprocess stats --shard raw/digits/part-00000.parquet --index 0 --out runs/demo/r1
    python -m stagewise.preprocess reduce --out runs/demo/r1
    python -m stagewise.preprocess transform --shard raw/digits/part-00000.parquet --index 0 --out runs/demo/r1
    python -m stagewise.preprocess commit --out runs/demo/r1

Every shard is streamed in record batches, so memory is bounded by the batch, not the shard. The
split is a pure function of the row key (and a salt), so any retry or re-run yields the same rows
in the same split. Readers trust only ``preprocess/manifest.json``, written last.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from stagewise.core import storage
from stagewise.core.cli import common_parser, json_arg, parse_overrides, run_subjob
from stagewise.core.errors import DataError
from stagewise.datasets import sharding
from stagewise.datasets.columns import (
    FEATURES_COLUMN,
    SPLITS,
    Columns,
    feature_difference,
    feature_vectors,
    layout_of,
    processed_schema,
    resolve_columns,
    schema_types,
    type_difference,
)
from stagewise.datasets.dirt import all_dirty_message
from stagewise.datasets.keys import KEY_HASHES_SUFFIX, key_hashes, repeated_hashes, split_of
from stagewise.datasets.statistics import (
    CheckedBatch,
    batch_moments,
    empty_moments,
    feature_vectors_of,
    merge_moments,
    normalised_rows,
    std_of,
)
from stagewise.datasets.typed import (
    category_counts,
    fill_categories,
    merge_category_counts,
    records,
    typed_block,
    vocabulary,
)
from stagewise.definitions.config import Dataset, PipelineConfig
from stagewise.definitions.loading import load_config
from stagewise.reuse import cache
from stagewise.reuse.fingerprints import code_identity, content_ids, preprocess_inputs

log = logging.getLogger("stagewise.preprocess")

# Small row groups let ranks split a split finely and keep the loader's memory window small.
PROCESSED_ROW_GROUP_ROWS = 16_384
BATCH_ROWS = 262_144


def _iter_checked(uri: str, dataset: Dataset) -> Iterator[tuple[Columns, CheckedBatch]]:
    """Stream ``uri`` in batches, marking rows with a null key/label, a null/non-finite feature or float target.

    A class label outside [0, num_classes) is not dirt but a wrong schema: it fails naming file and value.
    """
    with storage.open_parquet(uri) as parquet:
        columns = resolve_columns(dataset, parquet.schema_arrow, uri)
        layout = columns.layout
        wanted = [columns.key, columns.label, *columns.raw]
        for batch in storage.iter_batches(parquet, wanted, BATCH_ROWS, uri=uri):
            vectors, keep = feature_vectors_of(batch, columns.dense, columns.shapes, uri)
            typed = typed_block(batch, layout, uri) if columns.typed else None
            if typed is not None:
                keep &= typed.keep
            label_column = batch.column(columns.label)
            key_column = batch.column(columns.key)
            keep &= ~np.asarray(label_column.is_null().to_numpy(zero_copy_only=False))
            keep &= ~np.asarray(key_column.is_null().to_numpy(zero_copy_only=False))
            if columns.num_classes is None:
                labels = label_column.cast(pa.float64()).fill_null(np.nan).to_numpy(zero_copy_only=False)
                keep &= np.isfinite(labels)
            else:
                labels = label_column.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
                bad = keep & ((labels < 0) | (labels >= columns.num_classes))
                if bad.any():
                    raise DataError(f"{uri}: label column '{columns.label}' has value {labels[bad][0]} outside "
                                    f"[0, {columns.num_classes}) (dataset.num_classes) in {int(bad.sum())} row(s)")
            yield columns, CheckedBatch(key_column, labels, vectors, keep, typed)


def _stats_prefix(out: str) -> str:
    return storage.join(out, "preprocess", "stats")


def plan(input_uri: str, root: str | None = None) -> list[str]:
    """The raw Parquet files, in a deterministic order (``root``: the storage root; an error lists what a folder
    under it holds instead of Parquet, never what a folder elsewhere holds)."""
    return storage.list_parquet(input_uri, root)


def plan_shards(input_uri: str, root: str | None = None) -> list[dict[str, Any]]:
    """One shard per raw file, each file pinned; beyond sharding.MAX_SHARDS files, whole files packed by bytes and
    rows into at most that many shards (a file is never split: its statistics and duplicate checks name it)."""
    shards = sharding.plan_files(input_uri, 1, root, split_files=False, bytes_per_shard=1)
    log.info("planned %d shard(s) from %s", len(shards), input_uri)
    return shards


def shard_uris(shard: str | dict[str, Any] | list[Any]) -> list[dict[str, Any]]:
    """A shard's files as ``{"uri", pin...}``: a planned shard, a list of its files, or one file's URI."""
    if isinstance(shard, str):
        return [{"uri": shard}]
    if isinstance(shard, dict):
        return sharding.shard_files(shard)
    return [{"uri": entry} if isinstance(entry, str) else entry for entry in shard]


def _checked_files(shard: str | dict[str, Any] | list[Any]) -> list[str]:
    """The shard's file URIs, after checking each is the version its plan pinned (before a row is read)."""
    files = shard_uris(shard)
    for entry in files:
        sharding.check_pinned(entry)
    return [entry["uri"] for entry in files]


def plan_run(config: PipelineConfig, input_uri: str, out: str, this_run: str) -> dict[str, Any]:
    """Plan the shards and fingerprint what preprocess reads (the shards' bytes, the data set and split rules, the
    code); ``reused_from`` names the run whose committed manifest stands for these inputs (this run's own after a
    clear with unchanged data, or with ``cache.preprocess`` another run's, copied here), else None: preprocess again."""
    shards = plan_shards(input_uri, config.storage_root)
    fingerprint = preprocess_inputs(config, content_ids(sharding.file_uris(shards)), code_identity(config))
    manifest_uri = storage.join(out, "preprocess", "manifest.json")
    if storage.exists(manifest_uri):
        manifest = storage.read_json(manifest_uri)
        if (why := cache.manifest_problem(manifest_uri, fingerprint)) is None:
            reused = manifest.get("reused_from") or this_run
            log.info("preprocess: inputs unchanged (fingerprint %s): this run's committed %s stands; nothing to redo",
                     fingerprint, manifest_uri)
            return {"shards": shards, "fingerprint": fingerprint, "reused_from": reused}
        log.info("preprocess: the committed %s no longer stands (%s); preprocessing %d shard(s) again under inputs %s",
                 manifest_uri, why, len(shards), fingerprint)
    hit = cache.lookup(config, "preprocess", fingerprint, this_run,
                       lambda result: cache.manifest_problem(result.get("manifest_uri"), fingerprint))
    if hit is not None:
        storage.write_json(manifest_uri, {**storage.read_json(hit["manifest_uri"]), "reused_from": hit["reused_from"]})
        return {"shards": shards, "fingerprint": fingerprint, "reused_from": hit["reused_from"]}
    return {"shards": shards, "fingerprint": fingerprint, "reused_from": None}


def committed_result(manifest_uri: str) -> dict[str, Any]:
    """A committed manifest as commit returns it (what a reused preprocess hands on)."""
    manifest = storage.read_json(manifest_uri)
    return {"manifest_uri": manifest_uri, "rows": manifest["rows"], "rows_dropped": manifest["rows_dropped"],
            "fingerprint": manifest.get("fingerprint"), "reused_from": manifest.get("reused_from")}


def shard_stats(config: PipelineConfig, shard: str | dict[str, Any] | list[Any], index: int, out: str) -> dict[str, Any]:
    """Validate and clean one shard (one file or several); write its partial statistics and its keys' sorted hashes;
    return their URI."""
    started = time.monotonic()
    files = _checked_files(shard)
    moments: dict[str, Any] | None = None
    first: tuple[Columns, dict[str, Any]] | None = None
    hashes: list[np.ndarray] = []
    typed_parts: list[dict[str, Any]] = []
    for uri in files:
        columns = None
        for columns, batch in _iter_checked(uri, config.dataset):
            part = batch_moments(batch, columns.num_classes)
            moments = merge_moments(moments or empty_moments(len(columns.features), columns.num_classes), part)
            hashes.append(key_hashes(batch.kept_keys))
            if batch.typed is not None:
                typed_parts.append(_typed_stats(config, columns, batch))
        schema = storage.read_schema(uri)  # the footer only; reduce compares every shard's column types
        if columns is None:
            # An empty file still has a schema; validate it so a wrong file fails here, not later.
            columns = resolve_columns(config.dataset, schema, uri)
        types = schema_types(schema, [columns.key, columns.label, *columns.raw])
        if first is None:
            first = columns, types
        elif difference := (feature_difference(uri, columns.features, files[0], first[0].features)
                            or type_difference(uri, types, files[0], first[1])):
            raise DataError(difference)  # files of one shard merge their moments: they must agree as shards do
    assert first is not None
    columns, types = first
    moments = moments or empty_moments(len(columns.features), columns.num_classes)
    moments.update({"shard": files[0], "files": files, "features": columns.features, "columns": columns.raw, "feature_shapes": columns.shapes,
                    "types": types,
                    "normalize": columns.normalize or [True] * len(columns.features),
                    "layout": columns.layout.to_dict(), **_merge_typed_stats(typed_parts),
                    "key_hashes_uri": _write_key_hashes(out, index, hashes)})
    uri = storage.join(_stats_prefix(out), f"shard-{index:05d}.json")
    storage.write_json(uri, moments)  # last: it names this attempt's key hashes
    elapsed = time.monotonic() - started
    log.info("shard %d: %d rows read, %d kept, %.0f rows/s (%s%s)", index, moments["rows_in"], moments["count"],
             moments["rows_in"] / max(elapsed, 1e-9), files[0], f" and {len(files) - 1} more file(s)" if len(files) > 1 else "")
    return {"stats_uri": uri, "rows_in": moments["rows_in"], "rows_kept": moments["count"]}


def _typed_stats(config: PipelineConfig, columns: Columns, batch: CheckedBatch) -> dict[str, Any]:
    """A batch's categorical value counts (training rows: the vocabulary is learnt there) and largest int64 ids."""
    assert batch.typed is not None
    training = batch.keep.copy()
    training[training] = split_of(batch.kept_keys, config.preprocess.split) == SPLITS.index("train")
    kept = batch.typed.ints[batch.keep]
    max_values = {column.name: int(kept[:, column.offset : column.offset + column.size].max())
                  for column in columns.layout.columns if column.dtype == "int64" and len(kept)}
    return {"category_counts": category_counts(batch.typed, training), "max_values": max_values}


def _merge_typed_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    if not parts:
        return {}
    counts = merge_category_counts([part["category_counts"] for part in parts])
    max_values: dict[str, int] = {}
    for part in parts:
        for name, value in part["max_values"].items():
            max_values[name] = max(value, max_values.get(name, value))
    return {"category_counts": {name: [[value, count] for value, count in counter.items()] for name, counter in counts.items()},
            "max_values": max_values}


# --- duplicate keys ---------------------------------------------------------------------------------------------
# Each shard's stats step writes the sorted 64-bit hashes of its kept keys (8 bytes a row: an integer key's own
# bits, a string key's SipHash); reduce merges them k-way in bounded memory, and every hash seen twice is
# confirmed by reading the real key values from the files involved, so a hash collision is never reported
# and a duplicate never missed (the merge is stagewise.datasets.keys.repeated_hashes).

def _write_key_hashes(out: str, index: int, hashes: list[np.ndarray]) -> str:
    """Write one shard's sorted key hashes, attempt-unique (the stats JSON written after it names the file)."""
    # stable: timsort finds the runs of keys that arrive in order (5 ms -> 0.1 ms for 125k sorted ids)
    merged = np.sort(np.concatenate(hashes), kind="stable") if hashes else np.zeros(0, np.uint64)
    uri = storage.join(_stats_prefix(out), f"keys-{index:05d}-{storage.unique_token()}{KEY_HASHES_SUFFIX}")
    storage.write_bytes(uri, merged.astype("<u8", copy=False).tobytes())
    return uri


def _confirm_duplicates(config: PipelineConfig, shards: list[list[str]], hashes: np.ndarray, owners: np.ndarray) -> None:
    """Read the kept keys behind ``hashes`` from the shards involved; a real repeat raises DataError naming it.

    Every row of an involved file whose hash matches is read, and the first merge round reaching a hash
    holds an entry of every sidecar that has it, so a batch never misses one of a hash's files.
    """
    wanted = np.unique(hashes)
    key = config.dataset.key
    first_file: dict[Any, str] = {}
    for uri in [uri for position in np.unique(owners).tolist() for uri in shards[position]]:
        in_this_file: set[Any] = set()
        for _, batch in _iter_checked(uri, config.dataset):
            keys = batch.kept_keys
            matches = np.isin(key_hashes(keys), wanted)
            if not matches.any():
                continue
            for value in keys.filter(pa.array(matches)).to_pylist():
                if value in in_this_file:
                    raise DataError(f"{uri}: dataset.key '{key}' value {value!r} occurs more than once in this file; "
                                    f"the key must be unique (every such row would be trained on and predicted twice)")
                if value in first_file:
                    raise DataError(f"dataset.key '{key}' value {value!r} occurs in both {first_file[value]} and {uri}; "
                                    f"the key must be unique across the data set (is one file a copy of the other?)")
                in_this_file.add(value)
        for value in in_this_file:
            first_file[value] = uri


def check_unique_keys(config: PipelineConfig, parts: list[dict[str, Any]]) -> int:
    """Refuse a data set whose kept rows repeat a key (within a file or across files); returns the hashes merged."""
    shards = [_part_files(part) for part in parts]
    sidecars = [part["key_hashes_uri"] for part in parts]
    checked = 0
    for hashes, owners in repeated_hashes(sidecars):
        checked += len(hashes)
        _confirm_duplicates(config, shards, hashes, owners)
    if checked:
        log.info("checked %d key hash match(es) against the key values: hash collisions, no duplicate key", checked)
    return sum(part["count"] for part in parts)


def _part_files(part: dict[str, Any]) -> list[str]:
    """The files a shard's statistics were computed over (statistics from before multi-file shards name one)."""
    return list(part.get("files") or [part["shard"]])


def planned_stats(out: str, shards: list[Any]) -> list[str]:
    """The stats of every planned shard, in plan order; refuses a missing shard and stats computed for other files."""
    uris, missing = [], []
    for index, shard in enumerate(shards):
        planned = [entry["uri"] for entry in shard_uris(shard)]
        uri = storage.join(_stats_prefix(out), f"shard-{index:05d}.json")
        if not storage.exists(uri):
            missing.append(f"{index} ({planned[0]}{f' and {len(planned) - 1} more' if len(planned) > 1 else ''})")
            continue
        recorded = _part_files({"shard": "", **storage.read_json(uri)})
        if len(recorded) != len(planned) or not all(map(_same_file, recorded, planned)):
            shown, wanted = " + ".join(recorded), " + ".join(planned)
            raise DataError(f"{uri}: statistics of {shown}, but planned shard {index} is {wanted}: stale statistics "
                            f"from another input; run `python -m stagewise.preprocess stats --index {index}` for it again")
        uris.append(uri)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise DataError(f"no statistics for planned shard(s) {shown} under {_stats_prefix(out)}: run "
                        f"`python -m stagewise.preprocess stats` for each first; reduce merges every planned shard or none")
    fs, path = storage.filesystem(_stats_prefix(out))
    extra = [p for p in fs.glob(path + "/shard-*.json") if int(p.rsplit("-", 1)[1].split(".")[0]) >= len(shards)]
    if extra:
        log.warning("ignoring %d statistics file(s) beyond the %d planned shard(s), e.g. %s", len(extra), len(shards), extra[0])
    return uris


def _file_identity(uri: str) -> tuple[str, str]:
    """One spelling per file: ``x``, ``file://x`` and a symlink to it name the same local file."""
    fs, path = storage.filesystem(uri)
    if isinstance(fs, LocalFileSystem):
        return "file", os.path.realpath(path)
    return type(fs).__name__, path


def _same_file(a: str, b: str) -> bool:
    return _file_identity(a) == _file_identity(b)


def reduce_stats(config: PipelineConfig, out: str, stats_uris: list[str]) -> dict[str, Any]:
    """Merge the shards' statistics into the normalisation stats of the whole data set; refuse duplicate keys."""
    parts = [storage.read_json(uri) for uri in stats_uris]
    if not parts:
        raise DataError("no shard statistics to reduce: the input held no Parquet shards")
    listed: dict[tuple[str, str], tuple[int, str]] = {}
    for position, part in enumerate(parts):
        for name in _part_files(part):
            twin = listed.setdefault(_file_identity(name), (position, name))
            if twin != (position, name):
                raise DataError(f"{name} is listed twice (shards {twin[0]} and {position}): every row would be duplicated")
    features = parts[0]["features"]
    for part in parts[1:]:
        difference = feature_difference(part["shard"], part["features"], parts[0]["shard"], features)
        if difference:
            raise DataError(difference)
    # before any split is written: a key stored as strings in one file and integers in another would hash apart
    # and slip past the duplicate-key check; a feature's type changing between files is as wrong
    typed_parts = [part for part in parts if "types" in part]
    for part in typed_parts[1:]:
        difference = type_difference(part["shard"], part["types"], typed_parts[0]["shard"], typed_parts[0]["types"])
        if difference:
            raise DataError(difference)
    total = empty_moments(len(features), config.dataset.num_classes)
    for part in parts:
        total = merge_moments(total, part)
    if total["rows_in"] == 0:
        names = ", ".join(part["shard"] for part in parts[:5]) + (f" and {len(parts) - 5} more" if len(parts) > 5 else "")
        raise DataError(f"{config.dataset.uri} (dataset.uri) has no rows: all {len(parts)} file(s) are empty ({names})")
    if total["count"] == 0:
        raise DataError(all_dirty_message(config.dataset, [uri for part in parts for uri in _part_files(part)]))
    dropped = total["rows_in"] - total["count"]
    if dropped > config.preprocess.max_null_fraction * total["rows_in"]:
        raise DataError(f"{config.dataset.uri}: {dropped} of {total['rows_in']} rows are dirty, above "
                        f"preprocess.max_null_fraction={config.preprocess.max_null_fraction}")
    check_unique_keys(config, parts)
    normalize = np.asarray(parts[0]["normalize"], bool)
    typed = _merge_typed_stats([part for part in parts if "category_counts" in part])
    declared = config.dataset.declared
    vocabularies = {name: vocabulary(Counter(dict(pairs)), declared[name].max_categories)
                    for name, pairs in typed.get("category_counts", {}).items()}
    layout = layout_of(parts[0]).sized({name: len(vocab) for name, vocab in vocabularies.items()},
                                       typed.get("max_values", {}))
    for name, vocab in vocabularies.items():
        log.info("categorical column '%s': %d value(s) in the training split, %d in the vocabulary (id 0: any other)",
                 name, len(typed["category_counts"][name]), len(vocab))
    stats = {"features": features, "features_from": parts[0]["shard"], "columns": parts[0]["columns"],
             "feature_shapes": parts[0]["feature_shapes"], "layout": layout.to_dict(), "vocabularies": vocabularies,
             "mean": np.where(normalize, total["mean"], 0.0).tolist(), "std": np.where(normalize, std_of(total), 1.0).tolist(),
             "rows_in": total["rows_in"], "rows_kept": total["count"], "rows_dropped": dropped,
             "min": total["min"], "max": total["max"], "key_hashes": [part["key_hashes_uri"] for part in parts]}
    if "target" in total:
        target = total["target"]
        stats["target"] = {"mean": target["mean"][0], "std": float(std_of(target)[0]), "min": target["min"][0],
                           "max": target["max"][0], "count": target["count"]}
    else:
        stats["label_counts"] = total["label_counts"]
    uri = storage.join(out, "preprocess", "stats.json")
    storage.write_json(uri, stats)
    log.info("reduced %d shard(s): %d rows kept, %d dropped as dirty, keys unique", len(parts), total["count"], dropped)
    return {"stats_uri": uri, "rows_kept": total["count"], "rows_dropped": dropped}


def transform_shard(config: PipelineConfig, shard: str | dict[str, Any] | list[Any], index: int, out: str,
                    stats_uri: str) -> dict[str, Any]:
    """Clean, normalise and split one shard (one file or several, in order) into attempt-unique train/validation/test
    files."""
    started = time.monotonic()
    files = _checked_files(shard)
    stats = storage.read_json(stats_uri)
    mean, std = np.asarray(stats["mean"]), np.asarray(stats["std"])
    layout = layout_of(stats)
    token = storage.unique_token()
    writers: dict[str, pq.ParquetWriter] = {}
    handles = []
    rows = dict.fromkeys(SPLITS, 0)
    uris = {name: storage.join(out, "preprocess", name, f"part-{index:05d}-{token}.parquet") for name in SPLITS}
    rows_in = 0
    try:
        for source, (columns, batch) in ((name, item) for name in files for item in _iter_checked(name, config.dataset)):
            difference = feature_difference(source, columns.features, stats.get("features_from", stats_uri), stats["features"])
            if difference:
                raise DataError(difference)
            rows_in += len(batch.keep)
            kept, keys, labels = batch.kept, batch.kept_keys, batch.kept_labels
            schema = processed_schema(columns, keys.type, layout.words)
            if batch.typed is not None:
                fill_categories(batch.typed, layout, stats.get("vocabularies", {}))
            assignment = split_of(keys, config.preprocess.split)
            # each split's rows together, in their order in the file: one contiguous block of the matrix per split
            order = np.argsort(assignment, kind="stable")
            bounds = np.concatenate([[0], np.cumsum(np.bincount(assignment, minlength=len(SPLITS)))])
            rows_in_order = order if kept is None else kept[order]
            normalised = records(normalised_rows(batch.vectors, rows_in_order, mean, std), batch.typed, layout, rows_in_order)
            for code, name in enumerate(SPLITS):
                start, stop = int(bounds[code]), int(bounds[code + 1])
                count = stop - start
                if not count:
                    continue
                chosen = order[start:stop]
                arrays = [keys.take(pa.array(chosen)), pa.array(labels[chosen], schema.field(columns.label).type),
                          feature_vectors(normalised[start:stop])]
                with storage.writing(uris[name]):  # a full disk names the split file, not nothing
                    if name not in writers:
                        fs, path = storage.filesystem(uris[name])
                        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
                        handle = fs.open(path, "wb")
                        handles.append((name, handle))
                        # Float bytes neither dictionary-encode nor compress well; skipping both reads faster.
                        dictionary = [columns.label] if columns.num_classes is not None else False
                        # min/max of the feature bytes would tell a reader nothing: no statistics for that column
                        writers[name] = pq.ParquetWriter(handle, schema, use_dictionary=dictionary,
                                                         write_statistics=[columns.key, columns.label],
                                                         compression={columns.key: "snappy", columns.label: "snappy",
                                                                      FEATURES_COLUMN: "none"})
                    writers[name].write_batch(pa.record_batch(arrays, schema=schema),
                                              row_group_size=PROCESSED_ROW_GROUP_ROWS)
                rows[name] += count
    finally:
        for name, writer in writers.items():
            with storage.writing(uris[name]):
                writer.close()
        for name, handle in handles:
            with storage.writing(uris[name]):
                handle.close()
    elapsed = time.monotonic() - started
    log.info("shard %d: %d rows -> train %d, validation %d, test %d; %.0f rows/s", index, rows_in,
             rows["train"], rows["validation"], rows["test"], rows_in / max(elapsed, 1e-9))
    return {"index": index, "files": {name: {"uri": uris[name], "rows": rows[name]} for name in SPLITS if rows[name]}}


def commit(config: PipelineConfig, out: str, stats_uri: str, shard_results: list[dict[str, Any]],
           fingerprint: str | None = None) -> dict[str, Any]:
    """Publish the manifest (the commit point), recording the inputs' ``fingerprint`` (stagewise.reuse.fingerprints)
    that every later reuse and the model card's data fingerprint are keyed by, and delete files of attempts it does
    not list."""
    stats = storage.read_json(stats_uri)
    ordered = sorted(shard_results, key=lambda result: result["index"])
    splits = {name: [r["files"][name] for r in ordered if name in r["files"]] for name in SPLITS}
    manifest = {
        "kind": "preprocess",
        "dataset": config.dataset.uri,
        "key": config.dataset.key,
        "label": config.dataset.label,
        "features": stats["features"],
        "num_classes": config.dataset.num_classes,
        "columns": stats["columns"],
        "feature_shapes": stats["feature_shapes"],
        "layout": stats["layout"],
        "vocabularies": stats.get("vocabularies", {}),
        **({"target": stats["target"]} if "target" in stats else {}),
        **({"class_counts": stats["label_counts"]} if "label_counts" in stats else {}),
        "mean": stats["mean"],
        "std": stats["std"],
        "splits": splits,
        "rows": {name: sum(f["rows"] for f in files) for name, files in splits.items()},
        "rows_dropped": stats["rows_dropped"],
        "fingerprint": fingerprint,
    }
    uri = storage.join(out, "preprocess", "manifest.json")
    storage.write_json(uri, manifest)
    listed = {f["uri"] for files in splits.values() for f in files}
    removed = sum(storage.remove_unlisted(storage.join(out, "preprocess", name), listed) for name in SPLITS)
    removed += storage.remove_unlisted(_stats_prefix(out), set(stats.get("key_hashes", [])))
    log.info("committed %s: rows %s, %d stale file(s) removed", uri, manifest["rows"], removed)
    return {"manifest_uri": uri, "rows": manifest["rows"], "rows_dropped": stats["rows_dropped"], "fingerprint": fingerprint}


def _shard_arg(text: str) -> Any:
    """One file's URI, or a shard's files as JSON (inline or @file) as plan returns them."""
    return json_arg(text) if text[:1] in "[{@" else text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Sharded preprocessing steps.")
    common = common_parser()
    sub = parser.add_subparsers(dest="step", required=True)
    p_plan = sub.add_parser("plan", parents=[common], help="list the raw shards")
    p_plan.add_argument("--input", default=None, help="raw data URI (default: dataset.uri)")
    for name in ("stats", "transform"):
        step = sub.add_parser(name, parents=[common], help=f"{name} of one shard")
        step.add_argument("--shard", required=True, type=_shard_arg,
                          help="raw file URI, or a planned shard's files as JSON (or @file)")
        step.add_argument("--index", type=int, required=True, help="shard number (names outputs)")
        step.add_argument("--out", required=True, help="the run prefix")
    sub.choices["transform"].add_argument("--stats", default=None, help="reduced stats URI (default: under --out)")
    p_reduce = sub.add_parser("reduce", parents=[common], help="merge shard statistics")
    p_reduce.add_argument("--out", required=True)
    p_reduce.add_argument("--input", default=None, help="raw data URI the stats were planned from (default: dataset.uri)")
    p_commit = sub.add_parser("commit", parents=[common], help="write the manifest from transform results")
    p_commit.add_argument("--out", required=True)
    p_commit.add_argument("--results", required=True, type=json_arg, help="JSON list of transform results, or @file")
    args = parser.parse_args(argv)

    def work() -> dict[str, Any]:
        config = load_config(args.config, parse_overrides(args.override))
        storage.require_bucket(config.storage_root, "storage_root")
        if args.step == "plan":
            source = storage.resolve(config.storage_root, args.input or config.dataset.uri)
            storage.require_bucket(source, "--input" if args.input else "dataset.uri")
            return {"shards": plan_shards(source, config.storage_root)}
        out = storage.resolve(config.storage_root, args.out)
        if args.step == "stats":
            return shard_stats(config, args.shard, args.index, out)
        if args.step == "reduce":
            shards = plan_shards(storage.resolve(config.storage_root, args.input or config.dataset.uri), config.storage_root)
            return reduce_stats(config, out, planned_stats(out, shards))
        if args.step == "transform":
            return transform_shard(config, args.shard, args.index, out, args.stats or storage.join(out, "preprocess", "stats.json"))
        return commit(config, out, storage.join(out, "preprocess", "stats.json"), args.results)

    run_subjob(f"preprocess {args.step}", work, args.result_file)


if __name__ == "__main__":
    main()
