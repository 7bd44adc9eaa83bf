"""Feature statistics, a column at a time: the clean rows of a batch, count/mean/M2/min/max per feature and their
stable merge across batches and shards (Chan et al.), and normalisation of the kept rows to float32.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from stagewise.datasets.columns import tensor_block


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


def float64_values(column: pa.Array) -> np.ndarray:
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
            block = tensor_block(column, name, shapes[name], uri)  # NaN where a list or element is null
            vectors.extend(block[:, i] for i in range(block.shape[1]))
            continue
        if column.null_count:
            keep &= np.asarray(column.is_valid().to_numpy(zero_copy_only=False))
        vectors.append(float64_values(column))
    with np.errstate(invalid="ignore"):
        for vector in vectors:
            keep &= np.isfinite(vector, out=finite)
    return vectors, keep


@dataclass
class CheckedBatch:
    """One record batch before the row filter: every row's key and label, the feature vectors, and which rows are clean."""

    keys: pa.Array
    labels: np.ndarray
    vectors: list[np.ndarray]
    keep: np.ndarray
    typed: Any = None
    """The typed columns' slots (stagewise.datasets.typed.TypedBlock), when the data set declares any."""

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


def merge_column_moments(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
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


def merge_moments(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Feature moments, rows read, and the label's class counts or the float target's moments, merged."""
    merged = {**merge_column_moments(a, b), "rows_in": a["rows_in"] + b["rows_in"]}
    if "target" in a:
        merged["target"] = merge_column_moments(a["target"], b["target"])
    else:
        merged["label_counts"] = (np.asarray(a["label_counts"]) + np.asarray(b["label_counts"])).tolist()
    return merged


def column_moments(vectors: list[np.ndarray], kept: np.ndarray | None) -> dict[str, Any]:
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


def empty_moments(num_features: int, num_classes: int | None) -> dict[str, Any]:
    moments = {**column_moments([np.zeros(0)] * num_features, None), "rows_in": 0}
    if num_classes is None:
        moments["target"] = column_moments([np.zeros(0)], None)
    else:
        moments["label_counts"] = [0] * num_classes
    return moments


def batch_moments(batch: CheckedBatch, num_classes: int | None) -> dict[str, Any]:
    """The moments of one batch's clean rows, and the rows it read."""
    moments = {**column_moments(batch.vectors, batch.kept), "rows_in": len(batch.keep)}
    moments["count"] = int(batch.keep.sum())  # also when every feature is typed (no float vector)
    labels = batch.kept_labels
    if num_classes is None:
        moments["target"] = column_moments([labels.astype(np.float64)], None)
    else:
        moments["label_counts"] = np.bincount(labels.astype(np.int64), minlength=num_classes).tolist()
    return moments


def std_of(moments: dict[str, Any]) -> np.ndarray:
    """Sample standard deviation; 1 where a column is constant (e.g. blank pixels), so it passes through centred."""
    std = np.sqrt(np.asarray(moments["m2"]) / max(moments["count"] - 1, 1))
    return np.where(std > 1e-12, std, 1.0)


def normalised_rows(vectors: list[np.ndarray], rows: np.ndarray, mean: np.ndarray, std: np.ndarray) -> np.ndarray:
    """The C-ordered float32 (len(rows), features) matrix of ``(vector[rows] - mean) / std``, one column per vector.

    Every row is normalised in float64 and rounded to float32 (what training consumes) in row blocks that stay
    in cache, reading each vector in order; then ``rows`` are gathered whole. The result is scratch memory,
    overwritten by the next call.
    """
    if not vectors:
        return np.zeros((len(rows), 0), np.float32)
    num_rows = len(vectors[0])
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
