"""Column roles of a data set and its feature vector: what preprocessing checks and writes, and inference reads.

A raw row's features are plain numeric columns and declared tensor columns (flattened row-major, element
``name[i]``); a processed row holds them as one fixed-size float32 vector in the ``features`` column.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stagewise.core.errors import DataError
from stagewise.definitions.config import Dataset

SPLITS = ("train", "validation", "test")


FEATURES_COLUMN = "features"


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


def tensor_block(column: pa.Array, name: str, shape: list[int], uri: str) -> np.ndarray:
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
            block = tensor_block(column, name, shapes[name], uri)
            matrix[:, index : index + block.shape[1]] = block
            index += block.shape[1]
            continue
        if column.null_count:
            column = column.cast(pa.float64()).fill_null(np.nan)
        matrix[:, index] = column.to_numpy(zero_copy_only=False)
        index += 1
    return matrix


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
