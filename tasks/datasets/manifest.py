"""Committed preprocess manifests and the splits they list: the only view of processed data readers trust."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow.parquet as pq

from stagewise.core import storage
from stagewise.core.dropped import refuse_dropped
from stagewise.core.errors import DataError
from stagewise.datasets.columns import FEATURES_COLUMN, feature_matrix, layout_of


def read_manifest(uri: str) -> dict[str, Any]:
    """A committed preprocess manifest; a DataError when it is none, or when its split data was dropped once its run
    succeeded (stagewise.reuse.leftovers: a task cleared alone then)."""
    manifest = storage.read_json(uri)
    if manifest.get("kind") != "preprocess":
        raise DataError(f"{uri}: not a preprocess manifest")
    for files in (manifest.get("splits") or {}).values():
        for entry in files[:1]:
            refuse_dropped(entry["uri"], f"the split data of {uri}, such as")
    return manifest


def label_dtype(manifest: dict[str, Any]) -> type:
    """int64 for class labels, float32 for a float target (a manifest without num_classes)."""
    return np.int64 if manifest.get("num_classes") is not None else np.float32


def load_split(manifest: dict[str, Any], split: str) -> tuple[np.ndarray, np.ndarray]:
    """The records (float32 features; typed slots too, see stagewise.definitions.rows) and labels (int64 classes or
    float32 targets) of a committed split, read from the listed files only."""
    features, labels = [], []
    dtype = label_dtype(manifest)
    for entry in manifest["splits"].get(split, []):
        fs, path = storage.filesystem(entry["uri"])
        with fs.open(path, "rb") as handle:
            table = pq.read_table(handle, columns=[manifest["label"], FEATURES_COLUMN])
        features.append(feature_matrix(table))
        labels.append(table.column(manifest["label"]).to_numpy().astype(dtype))
    if not features:
        return np.zeros((0, layout_of(manifest).words), np.float32), np.zeros(0, dtype)
    return np.concatenate(features), np.concatenate(labels)


