"""Committed preprocess manifests and the splits they list: the only view of processed data readers trust."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow.parquet as pq

from stagewise.core import storage
from stagewise.core.errors import DataError
from stagewise.datasets.columns import FEATURES_COLUMN, feature_matrix, layout_of


def read_manifest(uri: str) -> dict[str, Any]:
    manifest = storage.read_json(uri)
    if manifest.get("kind") != "preprocess":
        raise DataError(f"{uri}: not a preprocess manifest")
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


