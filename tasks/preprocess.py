"""Sharded preprocessing: plan, per-shard statistics, reduce, per-shard transform, commit.

Run one step alone, e.g.::

    python -m tasks.preprocess plan --input raw/digits --out runs/demo/r1
    python -m tasks.preprocess stats --shard raw/digits/part-00000.parquet --index 0 --out runs/demo/r1
    python -m tasks.preprocess reduce --out runs/demo/r1
    python -m tasks.preprocess transform --shard raw/digits/part-00000.parquet --index 0 --out runs/demo/r1
    python -m tasks.preprocess commit --out runs/demo/r1

Every shard is streamed in record batches, so memory is bounded by the batch, not the shard. The
split is a pure function of the row key (and a salt), so any retry or re-run yields the same rows
in the same split. Readers trust only ``preprocess/manifest.json``, written last.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import logging
import math
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from tasks import storage
from tasks.cli import common_parser, json_arg, parse_overrides, run_subjob
from tasks.config import Dataset, PipelineConfig, Split, load_config
from tasks.errors import DataError

log = logging.getLogger("stagewise.preprocess")

SPLITS = ("train", "validation", "test")
FEATURES_COLUMN = "features"
# Small row groups let ranks split a split finely and keep the loader's memory window small.
PROCESSED_ROW_GROUP_ROWS = 16_384
BATCH_ROWS = 262_144
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclass(frozen=True, kw_only=True)
class Columns:
    """The resolved column roles of one data set."""

    key: str
    """Row key column."""
    label: str
    """Label column: integer classes, or a float target when ``num_classes`` is None."""
    features: list[str]
    """Feature vector element names, in model input order (a tensor column's elements are ``name[i]``)."""
    num_classes: int | None
    """Labels lie in [0, num_classes); None: the label is a float target."""
    columns: list[str] = field(default_factory=list)
    """Raw feature columns, in order (empty: ``features`` themselves)."""
    shapes: dict[str, list[int]] = field(default_factory=dict)
    """Declared tensor columns -> their per-row shape."""
    normalize: list[bool] = field(default_factory=list)
    """Per element of ``features``: standardise it (empty: all)."""

    @property
    def raw(self) -> list[str]:
        """The raw columns the feature vector is read from."""
        return self.columns or self.features


def element_names(columns: list[str], shapes: dict[str, list[int]]) -> list[str]:
    """The feature vector's element names: a plain column's own name, ``name[i]`` for a tensor column's i-th value."""
    names: list[str] = []
    for name in columns:
        names.extend([f"{name}[{i}]" for i in range(math.prod(shapes[name]))] if name in shapes else [name])
    return names


def check_feature_types(schema: pa.Schema, columns: list[str], shapes: dict[str, list[int]], uri: str) -> None:
    """A plain feature must be a number; a declared tensor column a list of numbers (of prod(shape) values if fixed-size)."""
    for name in columns:
        kind = schema.field(name).type
        listlike = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
        if name not in shapes:
            if listlike:
                raise DataError(f"{uri}: feature column '{name}' has type {kind}, a list; declare it in dataset.features "
                                f"as {{column: {name}, shape: [...]}}")
            if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
                raise DataError(f"{uri}: feature column '{name}' has type {kind}; features must be numeric")
            continue
        shape = shapes[name]
        expected = f"shape {shape} ({math.prod(shape)} numbers a row)"
        if not listlike:
            raise DataError(f"{uri}: feature column '{name}' is declared with {expected} (dataset.features) but has "
                            f"type {kind}, not a list")
        if not (pa.types.is_integer(kind.value_type) or pa.types.is_floating(kind.value_type)):
            raise DataError(f"{uri}: feature column '{name}' is declared with {expected} but its elements have type "
                            f"{kind.value_type}, not numbers")
        if pa.types.is_fixed_size_list(kind) and kind.list_size != math.prod(shape):
            raise DataError(f"{uri}: feature column '{name}' is declared with {expected} but has type {kind}: "
                            f"{kind.list_size} numbers a row")


def resolve_columns(dataset: Dataset, schema: pa.Schema, uri: str) -> Columns:
    """Check ``schema`` against the declared data set; the error names the file and the column."""
    names = set(schema.names)
    for role, column in (("key", dataset.key), ("label", dataset.label)):
        if column == FEATURES_COLUMN:
            raise DataError(f"dataset.{role} '{column}' clashes with the processed '{FEATURES_COLUMN}' vector column; rename it")
        if column not in names:
            raise DataError(f"{uri}: {role} column '{column}' (dataset.{role}) is missing; columns are {schema.names}")
    shapes = dataset.shapes
    if isinstance(dataset.features, str):
        prefix = dataset.features[:-1]
        columns = [name for name in schema.names if name.startswith(prefix) and name not in (dataset.key, dataset.label)]
        if not columns:
            raise DataError(f"{uri}: no column matches dataset.features '{dataset.features}'")
    else:
        columns = [item if isinstance(item, str) else item.column for item in dataset.features]
        missing = [name for name in columns if name not in names]
        if missing:
            raise DataError(f"{uri}: feature column(s) {missing} (dataset.features) are missing")
    check_feature_types(schema, columns, shapes, uri)
    label_type = schema.field(dataset.label).type
    if dataset.num_classes is not None and not pa.types.is_integer(label_type):
        raise DataError(f"{uri}: label column '{dataset.label}' has type {label_type}; it must be an integer "
                        f"(dataset.num_classes={dataset.num_classes}; leave num_classes out for a float target)")
    if not (pa.types.is_integer(label_type) or pa.types.is_floating(label_type)):
        raise DataError(f"{uri}: label column '{dataset.label}' has type {label_type}; a float target must be a number")
    key_type = schema.field(dataset.key).type
    if not (pa.types.is_integer(key_type) or pa.types.is_string(key_type) or pa.types.is_large_string(key_type)):
        raise DataError(f"{uri}: key column '{dataset.key}' has type {key_type}; it must be an integer or a string")
    declared = {} if isinstance(dataset.features, str) else {
        item.column: item.normalize for item in dataset.features if not isinstance(item, str)}
    normalize = [flag for name in columns
                 for flag in [declared.get(name, dataset.normalize)] * (math.prod(shapes[name]) if name in shapes else 1)]
    return Columns(key=dataset.key, label=dataset.label, features=element_names(columns, shapes),
                   num_classes=dataset.num_classes, columns=columns, shapes=shapes, normalize=normalize)


def feature_difference(uri: str, features: list[str], reference_uri: str, reference: list[str]) -> str | None:
    """None when ``features`` equal ``reference``; else a message naming only the columns that differ and both files."""
    if features == reference:
        return None
    missing = [name for name in reference if name not in features]
    extra = [name for name in features if name not in reference]
    parts = []
    if missing:
        parts.append(f"lacks feature column(s) {missing} that {reference_uri} has")
    if extra:
        parts.append(f"has extra feature column(s) {extra} that {reference_uri} lacks")
    if not parts:
        position = next(i for i, (a, b) in enumerate(zip(features, reference)) if a != b)
        parts.append(f"orders its feature columns differently from {reference_uri}: column {position} is "
                     f"'{features[position]}' here and '{reference[position]}' there")
    return f"{uri}: " + "; ".join(parts) + " (every file must have the same dataset.features columns)"


def _mix64(values: np.ndarray) -> np.ndarray:
    # splitmix64 finaliser: a fast, well-spread, platform-independent integer hash.
    z = values.astype(np.uint64, copy=True)
    z += _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _key_bits(keys: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """64 bits per key: an integer key's own bits, a string key's stable SipHash."""
    if pa.types.is_integer(keys.type):
        return np.asarray(keys.to_numpy(zero_copy_only=False)).astype(np.int64).view(np.uint64)
    from pandas.util import hash_array  # stable SipHash of strings with a fixed key

    return hash_array(np.asarray(keys.to_numpy(zero_copy_only=False), dtype=object))


def key_hashes(keys: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A 64-bit hash per key for the duplicate check: an integer key's own bits (never collide, and ids that
    arrive in order sort in linear time), a string key's SipHash (may collide)."""
    return _key_bits(keys)


def split_of(keys: pa.Array | pa.ChunkedArray, split: Split) -> np.ndarray:
    """0 = train, 1 = validation, 2 = test, decided by a salted hash of each key alone."""
    salt = np.uint64(int.from_bytes(hashlib.sha256(split.salt.encode()).digest()[:8], "little"))
    unit = (_mix64(_key_bits(keys) ^ salt) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    return np.where(unit < split.test, 2, np.where(unit < split.test + split.validation, 1, 0)).astype(np.int8)


def _tensor_block(column: pa.Array, name: str, shape: list[int], uri: str) -> np.ndarray:
    """(rows, prod(shape)) float64 from a list column; a null list or element is NaN (a dirty row), a wrong length fails."""
    size = math.prod(shape)
    lengths = pc.list_value_length(column).fill_null(size).to_numpy(zero_copy_only=False)
    wrong = np.flatnonzero(lengths != size)
    if len(wrong):
        raise DataError(f"{uri}: feature column '{name}' is declared with shape {shape} ({size} numbers a row) but "
                        f"{len(wrong)} row(s) hold another count (found {int(lengths[wrong[0]])} numbers)")
    block = np.full((len(column), size), np.nan)
    present = ~np.asarray(column.is_null().to_numpy(zero_copy_only=False))
    values = pc.list_flatten(column.filter(pa.array(present)) if not present.all() else column)
    if values.null_count:
        values = values.cast(pa.float64()).fill_null(np.nan)
    block[present] = np.asarray(values.to_numpy(zero_copy_only=False), dtype=np.float64).reshape(-1, size)
    return block


def flatten_features(batch: pa.RecordBatch, columns: list[str], shapes: dict[str, list[int]], uri: str) -> np.ndarray:
    """The (rows, features) float64 matrix of raw rows, as inference scores them: plain columns as they are, tensor
    columns flattened in row-major order; a null or non-finite value stays NaN/inf (the row is unscorable).
    """
    width = sum(math.prod(shapes[name]) if name in shapes else 1 for name in columns)
    # Fortran order: column copies stay contiguous
    matrix = np.empty((batch.num_rows, width), dtype=np.float64, order="F")
    index = 0
    for name in columns:
        column = batch.column(name)
        if name in shapes:
            block = _tensor_block(column, name, shapes[name], uri)
            matrix[:, index : index + block.shape[1]] = block
            index += block.shape[1]
            continue
        if column.null_count:
            column = column.cast(pa.float64()).fill_null(np.nan)
        matrix[:, index] = column.to_numpy(zero_copy_only=False)
        index += 1
    return matrix


class _Scratch(threading.local):
    """Arrays reused from batch to batch and shard to shard in one thread: a fresh large array page-faults
    in anew each time (in a fresh task process about 40 % of our CPU time was the kernel zeroing such pages)."""

    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}

    def array(self, name: str, shape: tuple[int, ...], dtype: type = np.float64) -> np.ndarray:
        """An uninitialised C-contiguous array of ``shape``, on the memory of the last one named ``name`` when it fits."""
        size = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.dtype != dtype or buffer.size < size:
            buffer = self._buffers[name] = np.empty(size, dtype)
        return buffer[:size].reshape(shape)


_SCRATCH = _Scratch()
# Rows normalised per block: a block's float32 rows and float64 column stay in a core's L2 cache.
NORMALISE_BLOCK_ROWS = 4_096


def _float64_values(column: pa.Array) -> np.ndarray:
    """A plain numeric column as float64: a float64 column's own buffer (no copy), other types converted.

    The value under a null is arbitrary: callers use only rows the validity bitmap marks valid.
    """
    if pa.types.is_float64(column.type):
        return np.frombuffer(column.buffers()[1], np.float64, count=len(column), offset=column.offset * 8)
    return np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.float64)


def feature_vectors_of(batch: pa.RecordBatch, columns: list[str], shapes: dict[str, list[int]],
                       uri: str) -> tuple[list[np.ndarray], np.ndarray]:
    """Each feature element of ``batch`` as a float64 vector, and the rows whose every feature is present and finite.

    Column at a time, so each step works on one cache-sized vector, and a float64 column is read in place.
    A vector's value in a row not kept is arbitrary. Tensor columns give one (strided) vector per element.
    """
    keep = np.ones(batch.num_rows, bool)
    finite = np.empty(batch.num_rows, bool)
    vectors: list[np.ndarray] = []
    for name in columns:
        column = batch.column(name)
        if name in shapes:
            block = _tensor_block(column, name, shapes[name], uri)  # NaN where a list or element is null
            vectors.extend(block[:, i] for i in range(block.shape[1]))
            continue
        if column.null_count:
            keep &= np.asarray(column.is_valid().to_numpy(zero_copy_only=False))
        vectors.append(_float64_values(column))
    with np.errstate(invalid="ignore"):
        for vector in vectors:
            keep &= np.isfinite(vector, out=finite)
    return vectors, keep


@dataclass
class _CheckedBatch:
    """One record batch before the row filter: every row's key and label, the feature vectors, and which rows are clean."""

    keys: pa.Array
    labels: np.ndarray
    vectors: list[np.ndarray]
    keep: np.ndarray

    @functools.cached_property
    def kept(self) -> np.ndarray | None:
        """Indices of the clean rows; None when every row is clean."""
        return None if self.keep.all() else np.flatnonzero(self.keep)

    @property
    def kept_keys(self) -> pa.Array:
        return self.keys if self.kept is None else self.keys.take(pa.array(self.kept))

    @property
    def kept_labels(self) -> np.ndarray:
        return self.labels if self.kept is None else self.labels[self.kept]


def _iter_checked(uri: str, dataset: Dataset) -> Iterator[tuple[Columns, _CheckedBatch]]:
    """Stream ``uri`` in batches, marking rows with a null key/label, a null/non-finite feature or float target.

    A class label outside [0, num_classes) is not dirt but a wrong schema: it fails naming file and value.
    """
    with storage.open_parquet(uri) as parquet:
        columns = resolve_columns(dataset, parquet.schema_arrow, uri)
        wanted = [columns.key, columns.label, *columns.raw]
        for batch in storage.iter_batches(parquet, wanted, BATCH_ROWS, uri=uri):
            vectors, keep = feature_vectors_of(batch, columns.raw, columns.shapes, uri)
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
            yield columns, _CheckedBatch(key_column, labels, vectors, keep)


def _merge_core(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    # Chan et al.'s pairwise update of count, mean, m2, min, max: stable where sum-of-squares would cancel.
    if a["count"] == 0:
        return {**a, **{k: b[k] for k in ("count", "mean", "m2", "min", "max")}}
    if b["count"] == 0:
        return a
    count = a["count"] + b["count"]
    mean_a, mean_b = np.asarray(a["mean"]), np.asarray(b["mean"])
    delta = mean_b - mean_a
    mean = mean_a + delta * (b["count"] / count)
    m2 = np.asarray(a["m2"]) + np.asarray(b["m2"]) + delta**2 * (a["count"] * b["count"] / count)
    return {**a, "count": count, "mean": mean.tolist(), "m2": m2.tolist(),
            "min": np.minimum(a["min"], b["min"]).tolist(), "max": np.maximum(a["max"], b["max"]).tolist()}


def _merge_moments(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Feature moments, rows read, and the label's class counts or the float target's moments, merged."""
    merged = {**_merge_core(a, b), "rows_in": a["rows_in"] + b["rows_in"]}
    if "target" in a:
        merged["target"] = _merge_core(a["target"], b["target"])
    else:
        merged["label_counts"] = (np.asarray(a["label_counts"]) + np.asarray(b["label_counts"])).tolist()
    return merged


def _core(vectors: list[np.ndarray], kept: np.ndarray | None) -> dict[str, Any]:
    """count, mean, m2, min, max of each vector over the rows ``kept`` (None: all), a vector at a time."""
    count = (len(vectors[0]) if kept is None else len(kept)) if vectors else 0
    if count == 0:
        width = len(vectors)
        return {"count": 0, "mean": [0.0] * width, "m2": [0.0] * width, "min": [float("inf")] * width,
                "max": [float("-inf")] * width}
    core: dict[str, Any] = {"count": count, "mean": [], "m2": [], "min": [], "max": []}
    for vector in vectors:
        values = vector if kept is None else np.take(vector, kept, out=_SCRATCH.array("kept", (count,)), mode="clip")
        mean = values.mean()
        centred = np.subtract(values, mean, out=_SCRATCH.array("centred", (count,)))
        np.square(centred, out=centred)
        core["mean"].append(float(mean))
        core["m2"].append(float(centred.sum()))
        core["min"].append(float(values.min()))
        core["max"].append(float(values.max()))
    return core


def _empty_moments(num_features: int, num_classes: int | None) -> dict[str, Any]:
    moments = {**_core([np.zeros(0)] * num_features, None), "rows_in": 0}
    if num_classes is None:
        moments["target"] = _core([np.zeros(0)], None)
    else:
        moments["label_counts"] = [0] * num_classes
    return moments


def _batch_moments(batch: _CheckedBatch, num_classes: int | None) -> dict[str, Any]:
    """The moments of one batch's clean rows, and the rows it read."""
    moments = {**_core(batch.vectors, batch.kept), "rows_in": len(batch.keep)}
    labels = batch.kept_labels
    if num_classes is None:
        moments["target"] = _core([labels.astype(np.float64)], None)
    else:
        moments["label_counts"] = np.bincount(labels.astype(np.int64), minlength=num_classes).tolist()
    return moments


def _std(moments: dict[str, Any]) -> np.ndarray:
    """Sample standard deviation; 1 where a column is constant (e.g. blank pixels), so it passes through centred."""
    std = np.sqrt(np.asarray(moments["m2"]) / max(moments["count"] - 1, 1))
    return np.where(std > 1e-12, std, 1.0)


def _stats_prefix(out: str) -> str:
    return storage.join(out, "preprocess", "stats")


def plan(input_uri: str) -> list[str]:
    """One shard per raw Parquet file, in a deterministic order."""
    shards = storage.list_parquet(input_uri)
    log.info("planned %d shard(s) from %s", len(shards), input_uri)
    return shards


def shard_stats(config: PipelineConfig, shard: str, index: int, out: str) -> dict[str, Any]:
    """Validate and clean one shard; write its partial statistics and its keys' sorted hashes; return their URI."""
    started = time.monotonic()
    moments: dict[str, Any] | None = None
    columns: Columns | None = None
    hashes: list[np.ndarray] = []
    for columns, batch in _iter_checked(shard, config.dataset):
        part = _batch_moments(batch, columns.num_classes)
        moments = _merge_moments(moments or _empty_moments(len(columns.features), columns.num_classes), part)
        hashes.append(key_hashes(batch.kept_keys))
    if columns is None:
        # An empty file still has a schema; validate it so a wrong file fails here, not later.
        columns = resolve_columns(config.dataset, storage.read_schema(shard), shard)
        moments = _empty_moments(len(columns.features), columns.num_classes)
    assert moments is not None
    moments.update({"shard": shard, "features": columns.features, "columns": columns.raw, "feature_shapes": columns.shapes,
                    "normalize": columns.normalize or [True] * len(columns.features),
                    "key_hashes_uri": _write_key_hashes(out, index, hashes)})
    uri = storage.join(_stats_prefix(out), f"shard-{index:05d}.json")
    storage.write_json(uri, moments)  # last: it names this attempt's key hashes
    elapsed = time.monotonic() - started
    log.info("shard %d: %d rows read, %d kept, %.0f rows/s (%s)", index, moments["rows_in"], moments["count"],
             moments["rows_in"] / max(elapsed, 1e-9), shard)
    return {"stats_uri": uri, "rows_in": moments["rows_in"], "rows_kept": moments["count"]}


# --- duplicate keys ---------------------------------------------------------------------------------------------
# Each shard's stats step writes the sorted 64-bit hashes of its kept keys (8 bytes a row: an integer key's own
# bits, a string key's SipHash); reduce merges them k-way in bounded memory, and every hash seen twice is
# confirmed by reading the real key values from the files involved, so a hash collision is never reported
# and a duplicate never missed.

KEY_HASHES_SUFFIX = ".u64"
MERGE_BUDGET_HASHES = 8 << 20  # hashes buffered across all shards while merging: 64 MiB
MAX_CANDIDATES = 1 << 20  # hash matches gathered before they are confirmed against the files


def _write_key_hashes(out: str, index: int, hashes: list[np.ndarray]) -> str:
    """Write one shard's sorted key hashes, attempt-unique (the stats JSON written after it names the file)."""
    # stable: timsort finds the runs of keys that arrive in order (5 ms -> 0.1 ms for 125k sorted ids)
    merged = np.sort(np.concatenate(hashes), kind="stable") if hashes else np.zeros(0, np.uint64)
    uri = storage.join(_stats_prefix(out), f"keys-{index:05d}-{storage.unique_token()}{KEY_HASHES_SUFFIX}")
    storage.write_bytes(uri, merged.astype("<u8", copy=False).tobytes())
    return uri


def _iter_hash_chunks(uri: str, num_hashes: int) -> Iterator[np.ndarray]:
    """A sidecar's hashes, ``num_hashes`` at a time."""
    leftover = b""
    for chunk in storage.iter_chunks(uri, num_hashes * 8):
        chunk = leftover + chunk
        whole = len(chunk) - len(chunk) % 8
        leftover = chunk[whole:]
        if whole:
            yield np.frombuffer(chunk[:whole], dtype="<u8")
    if leftover:
        raise DataError(f"{uri}: key hash file is cut off ({len(leftover)} stray bytes); run the shard's stats again")


def _repeated_hashes(sidecars: list[str]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(hash, sidecar position) pairs of every hash found more than once over the sorted sidecars, in batches.

    A k-way merge by rounds: each round takes, from every buffer, the hashes up to the smallest of the
    buffers' last hashes, so at least one buffer empties per round and at most MERGE_BUDGET_HASHES are held.
    """
    chunk_hashes = max(1024, MERGE_BUDGET_HASHES // max(len(sidecars), 1))
    streams = [_iter_hash_chunks(uri, chunk_hashes) for uri in sidecars]
    buffers: list[np.ndarray | None] = [next(stream, None) for stream in streams]
    carried_hash, carried_owner = np.zeros(0, np.uint64), np.zeros(0, np.int32)  # the last hash of the previous round
    found_hashes: list[np.ndarray] = []
    found_owners: list[np.ndarray] = []
    found = 0
    while True:
        active = [i for i, buffer in enumerate(buffers) if buffer is not None]
        if not active:
            break
        threshold = min(buffers[i][-1] for i in active)
        values, owners = [carried_hash], [carried_owner]
        for i in active:
            cut = int(np.searchsorted(buffers[i], threshold, side="right"))
            values.append(buffers[i][:cut])
            owners.append(np.full(cut, i, np.int32))
            rest = buffers[i][cut:]
            buffers[i] = rest if len(rest) else next(streams[i], None)
        merged = np.concatenate(values)
        owner = np.concatenate(owners)
        order = np.argsort(merged, kind="stable")
        merged, owner = merged[order], owner[order]
        repeated = np.zeros(len(merged), bool)
        same = merged[1:] == merged[:-1]
        repeated[1:] |= same
        repeated[:-1] |= same
        if repeated.any():
            found_hashes.append(merged[repeated])
            found_owners.append(owner[repeated])
            found += int(repeated.sum())
        carried_hash, carried_owner = merged[-1:], owner[-1:]
        if found >= MAX_CANDIDATES:
            yield np.concatenate(found_hashes), np.concatenate(found_owners)
            found_hashes, found_owners, found = [], [], 0
    if found:
        yield np.concatenate(found_hashes), np.concatenate(found_owners)


def _confirm_duplicates(config: PipelineConfig, shards: list[str], hashes: np.ndarray, owners: np.ndarray) -> None:
    """Read the kept keys behind ``hashes`` from the shards involved; a real repeat raises DataError naming it.

    Every row of an involved file whose hash matches is read, and the first merge round reaching a hash
    holds an entry of every sidecar that has it, so a batch never misses one of a hash's files.
    """
    wanted = np.unique(hashes)
    key = config.dataset.key
    first_file: dict[Any, str] = {}
    for position in np.unique(owners).tolist():
        uri = shards[position]
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
    shards = [part["shard"] for part in parts]
    sidecars = [part["key_hashes_uri"] for part in parts]
    checked = 0
    for hashes, owners in _repeated_hashes(sidecars):
        checked += len(hashes)
        _confirm_duplicates(config, shards, hashes, owners)
    if checked:
        log.info("checked %d key hash match(es) against the key values: hash collisions, no duplicate key", checked)
    return sum(part["count"] for part in parts)


def planned_stats(out: str, shards: list[str]) -> list[str]:
    """The stats of every planned shard, in plan order; refuses a missing shard and stats computed for another file."""
    uris, missing = [], []
    for index, shard in enumerate(shards):
        uri = storage.join(_stats_prefix(out), f"shard-{index:05d}.json")
        if not storage.exists(uri):
            missing.append(f"{index} ({shard})")
            continue
        recorded = storage.read_json(uri).get("shard", "")
        if not _same_file(recorded, shard):
            raise DataError(f"{uri}: statistics of {recorded}, but planned shard {index} is {shard}: stale statistics "
                            f"from another input; run `python -m tasks.preprocess stats --index {index}` for it again")
        uris.append(uri)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise DataError(f"no statistics for planned shard(s) {shown} under {_stats_prefix(out)}: run "
                        f"`python -m tasks.preprocess stats` for each first; reduce merges every planned shard or none")
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
    listed: dict[tuple[str, str], int] = {}
    for position, part in enumerate(parts):
        twin = listed.setdefault(_file_identity(part["shard"]), position)
        if twin != position:
            raise DataError(f"{part['shard']} is listed twice (shards {twin} and {position}): every row would be duplicated")
    features = parts[0]["features"]
    for part in parts[1:]:
        difference = feature_difference(part["shard"], part["features"], parts[0]["shard"], features)
        if difference:
            raise DataError(difference)
    total = _empty_moments(len(features), config.dataset.num_classes)
    for part in parts:
        total = _merge_moments(total, part)
    if total["rows_in"] == 0:
        names = ", ".join(part["shard"] for part in parts[:5]) + (f" and {len(parts) - 5} more" if len(parts) > 5 else "")
        raise DataError(f"{config.dataset.uri} (dataset.uri) has no rows: all {len(parts)} file(s) are empty ({names})")
    if total["count"] == 0:
        raise DataError(f"{config.dataset.uri}: every row was dropped as dirty (nulls or non-finite features or target)")
    dropped = total["rows_in"] - total["count"]
    if dropped > config.preprocess.max_null_fraction * total["rows_in"]:
        raise DataError(f"{config.dataset.uri}: {dropped} of {total['rows_in']} rows are dirty, above "
                        f"preprocess.max_null_fraction={config.preprocess.max_null_fraction}")
    check_unique_keys(config, parts)
    normalize = np.asarray(parts[0]["normalize"], bool)
    stats = {"features": features, "features_from": parts[0]["shard"], "columns": parts[0]["columns"],
             "feature_shapes": parts[0]["feature_shapes"],
             "mean": np.where(normalize, total["mean"], 0.0).tolist(), "std": np.where(normalize, _std(total), 1.0).tolist(),
             "rows_in": total["rows_in"], "rows_kept": total["count"], "rows_dropped": dropped,
             "min": total["min"], "max": total["max"], "key_hashes": [part["key_hashes_uri"] for part in parts]}
    if "target" in total:
        target = total["target"]
        stats["target"] = {"mean": target["mean"][0], "std": float(_std(target)[0]), "min": target["min"][0],
                           "max": target["max"][0], "count": target["count"]}
    else:
        stats["label_counts"] = total["label_counts"]
    uri = storage.join(out, "preprocess", "stats.json")
    storage.write_json(uri, stats)
    log.info("reduced %d shard(s): %d rows kept, %d dropped as dirty, keys unique", len(parts), total["count"], dropped)
    return {"stats_uri": uri, "rows_kept": total["count"], "rows_dropped": dropped}


def processed_schema(columns: Columns, key_type: pa.DataType) -> pa.Schema:
    """Key, label (int64 classes or a float32 target) and each row's features as one little-endian float32 vector
    (names in the manifest).

    A fixed-size binary column decodes about as fast as raw bytes (a Parquet list column is ~5x
    slower) and maps onto a (rows, features) matrix without a copy, so a training batch is one
    contiguous row gather. ``feature_matrix`` reads it back.
    """
    label_type = pa.float32() if columns.num_classes is None else pa.int64()
    return pa.schema([pa.field(columns.key, key_type), pa.field(columns.label, label_type),
                      pa.field(FEATURES_COLUMN, pa.binary(4 * len(columns.features)))])


def feature_vectors(matrix: np.ndarray) -> pa.Array:
    """The processed vector column for a (rows, features) matrix."""
    block = np.ascontiguousarray(matrix, dtype="<f4")
    return pa.FixedSizeBinaryArray.from_buffers(pa.binary(4 * block.shape[1]), block.shape[0], [None, pa.py_buffer(block)])


def feature_matrix(table: pa.Table | pa.RecordBatch) -> np.ndarray:
    """The (rows, features) float32 matrix of processed rows; zero-copy for a single chunk."""
    column = table.column(FEATURES_COLUMN)
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    width = column.type.byte_width // 4
    parts = [np.frombuffer(chunk.buffers()[1], dtype="<f4", count=len(chunk) * width,
                           offset=chunk.offset * width * 4).reshape(-1, width) for chunk in chunks]
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.zeros((0, width), np.float32)


def normalised_rows(vectors: list[np.ndarray], rows: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """The C-ordered float32 (len(rows), features) matrix of ``(vector[rows] - mean) / std``, one column per vector.

    Every row is normalised in float64 and rounded to float32 (what training consumes) in row blocks that stay
    in cache, reading each vector in order; then ``rows`` are gathered whole. The result is scratch memory,
    overwritten by the next call.
    """
    num_rows = len(vectors[0]) if vectors else 0
    every_row = _SCRATCH.array("every_row", (num_rows, len(vectors)), np.float32)
    for start in range(0, num_rows, NORMALISE_BLOCK_ROWS):
        stop = min(start + NORMALISE_BLOCK_ROWS, num_rows)
        work = _SCRATCH.array("work", (stop - start,))
        target = every_row[start:stop]
        for column, vector in enumerate(vectors):
            np.subtract(vector[start:stop], mean[column], out=work)
            np.divide(work, std[column], out=target[:, column])
    result = _SCRATCH.array("normalised", (len(rows), len(vectors)), np.float32)
    return np.take(every_row, rows, axis=0, out=result, mode="clip")  # the rows are in range; clip skips a buffered check


def transform_shard(config: PipelineConfig, shard: str, index: int, out: str, stats_uri: str) -> dict[str, Any]:
    """Clean, normalise and split one shard into attempt-unique train/validation/test files."""
    started = time.monotonic()
    stats = storage.read_json(stats_uri)
    mean, std = np.asarray(stats["mean"]), np.asarray(stats["std"])
    token = storage.unique_token()
    writers: dict[str, pq.ParquetWriter] = {}
    handles = []
    rows = dict.fromkeys(SPLITS, 0)
    uris = {name: storage.join(out, "preprocess", name, f"part-{index:05d}-{token}.parquet") for name in SPLITS}
    rows_in = 0
    try:
        for columns, batch in _iter_checked(shard, config.dataset):
            difference = feature_difference(shard, columns.features, stats.get("features_from", stats_uri), stats["features"])
            if difference:
                raise DataError(difference)
            rows_in += len(batch.keep)
            kept, keys, labels = batch.kept, batch.kept_keys, batch.kept_labels
            schema = processed_schema(columns, keys.type)
            assignment = split_of(keys, config.preprocess.split)
            # each split's rows together, in their order in the file: one contiguous block of the matrix per split
            order = np.argsort(assignment, kind="stable")
            bounds = np.concatenate([[0], np.cumsum(np.bincount(assignment, minlength=len(SPLITS)))])
            normalised = normalised_rows(batch.vectors, order if kept is None else kept[order], mean, std)
            for code, name in enumerate(SPLITS):
                start, stop = int(bounds[code]), int(bounds[code + 1])
                count = stop - start
                if not count:
                    continue
                chosen = order[start:stop]
                arrays = [keys.take(pa.array(chosen)), pa.array(labels[chosen], schema.field(columns.label).type),
                          feature_vectors(normalised[start:stop])]
                if name not in writers:
                    fs, path = storage.filesystem(uris[name])
                    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
                    handle = fs.open(path, "wb")
                    handles.append(handle)
                    # Float bytes neither dictionary-encode nor compress well; skipping both reads faster.
                    dictionary = [columns.label] if columns.num_classes is not None else False
                    # min/max of the feature bytes would tell a reader nothing: no statistics for that column
                    writers[name] = pq.ParquetWriter(handle, schema, use_dictionary=dictionary,
                                                     write_statistics=[columns.key, columns.label],
                                                     compression={columns.key: "snappy", columns.label: "snappy",
                                                                  FEATURES_COLUMN: "none"})
                writers[name].write_batch(pa.record_batch(arrays, schema=schema), row_group_size=PROCESSED_ROW_GROUP_ROWS)
                rows[name] += count
    finally:
        for writer in writers.values():
            writer.close()
        for handle in handles:
            handle.close()
    elapsed = time.monotonic() - started
    log.info("shard %d: %d rows -> train %d, validation %d, test %d; %.0f rows/s", index, rows_in,
             rows["train"], rows["validation"], rows["test"], rows_in / max(elapsed, 1e-9))
    return {"index": index, "files": {name: {"uri": uris[name], "rows": rows[name]} for name in SPLITS if rows[name]}}


def commit(config: PipelineConfig, out: str, stats_uri: str, shard_results: list[dict[str, Any]]) -> dict[str, Any]:
    """Publish the manifest (the commit point) and delete files of attempts it does not list."""
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
        **({"target": stats["target"]} if "target" in stats else {}),
        "mean": stats["mean"],
        "std": stats["std"],
        "splits": splits,
        "rows": {name: sum(f["rows"] for f in files) for name, files in splits.items()},
        "rows_dropped": stats["rows_dropped"],
    }
    uri = storage.join(out, "preprocess", "manifest.json")
    storage.write_json(uri, manifest)
    listed = {f["uri"] for files in splits.values() for f in files}
    removed = sum(storage.remove_unlisted(storage.join(out, "preprocess", name), listed) for name in SPLITS)
    removed += storage.remove_unlisted(_stats_prefix(out), set(stats.get("key_hashes", [])))
    log.info("committed %s: rows %s, %d stale file(s) removed", uri, manifest["rows"], removed)
    return {"manifest_uri": uri, "rows": manifest["rows"], "rows_dropped": stats["rows_dropped"]}


def read_manifest(uri: str) -> dict[str, Any]:
    manifest = storage.read_json(uri)
    if manifest.get("kind") != "preprocess":
        raise DataError(f"{uri}: not a preprocess manifest")
    return manifest


def label_dtype(manifest: dict[str, Any]) -> type:
    """int64 for class labels, float32 for a float target (a manifest without num_classes)."""
    return np.int64 if manifest.get("num_classes") is not None else np.float32


def load_split(manifest: dict[str, Any], split: str) -> tuple[np.ndarray, np.ndarray]:
    """The features (float32) and labels (int64 classes or float32 targets) of a committed split, read from the listed files only."""
    features, labels = [], []
    dtype = label_dtype(manifest)
    for entry in manifest["splits"].get(split, []):
        fs, path = storage.filesystem(entry["uri"])
        with fs.open(path, "rb") as handle:
            table = pq.read_table(handle, columns=[manifest["label"], FEATURES_COLUMN])
        features.append(feature_matrix(table))
        labels.append(table.column(manifest["label"]).to_numpy().astype(dtype))
    if not features:
        return np.zeros((0, len(manifest["features"])), np.float32), np.zeros(0, dtype)
    return np.concatenate(features), np.concatenate(labels)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Sharded preprocessing steps.")
    common = common_parser()
    sub = parser.add_subparsers(dest="step", required=True)
    p_plan = sub.add_parser("plan", parents=[common], help="list the raw shards")
    p_plan.add_argument("--input", default=None, help="raw data URI (default: dataset.uri)")
    for name in ("stats", "transform"):
        step = sub.add_parser(name, parents=[common], help=f"{name} of one shard")
        step.add_argument("--shard", required=True, help="raw shard URI")
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
            return {"shards": plan(source)}
        out = storage.resolve(config.storage_root, args.out)
        if args.step == "stats":
            return shard_stats(config, args.shard, args.index, out)
        if args.step == "reduce":
            shards = plan(storage.resolve(config.storage_root, args.input or config.dataset.uri))
            return reduce_stats(config, out, planned_stats(out, shards))
        if args.step == "transform":
            return transform_shard(config, args.shard, args.index, out, args.stats or storage.join(out, "preprocess", "stats.json"))
        return commit(config, out, storage.join(out, "preprocess", "stats.json"), args.results)

    run_subjob(f"preprocess {args.step}", work, args.result_file)


if __name__ == "__main__":
    main()
