"""Column roles of a data set and its feature vector: what preprocessing checks and writes, and inference reads.

A raw row's float features are plain numeric columns and declared tensor columns (flattened row-major, element
``name[i]``); typed columns (int64, categorical, variable-length lists) are declared with their dtype. A processed
row holds them all as one fixed-size record in the ``features`` column, laid out as
:class:`stagewise.definitions.rows.RowLayout` says (float-only data: the float32 feature vector).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stagewise.core.errors import DataError
from stagewise.definitions.config import Dataset, FeatureColumn
from stagewise.definitions.rows import InputColumn, RowLayout, float_only_layout

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
    typed: dict[str, FeatureColumn] = field(default_factory=dict)
    """Typed columns (int64, categorical, variable-length) by name; the rest of ``columns`` make the float vector."""

    @property
    def raw(self) -> list[str]:
        """The raw columns the record is read from."""
        return self.columns or self.features

    @property
    def dense(self) -> list[str]:
        """The raw columns of the float32 feature vector (plain and tensor float columns)."""
        return [name for name in self.raw if name not in self.typed]

    @functools.cached_property
    def layout(self) -> RowLayout:
        """Where each column sits in a processed record (the data's vocabulary sizes and largest ids: RowLayout.sized)."""
        inputs: list[InputColumn] = []
        dense = len(self.features)
        floats, ints = dense, 0
        element = 0
        for name in self.raw:
            item = self.typed.get(name)
            if item is None:
                shape = self.shapes.get(name, [])
                size = math.prod(shape)
                inputs.append(InputColumn(name=name, dtype="float32", shape=list(shape), offset=element,
                                          normalize=bool(self.normalize[element]) if self.normalize else True))
                element += size
                continue
            variable = item.max_length is not None
            shape = [item.max_length] if variable else list(item.shape or [])
            size = math.prod(shape)
            if item.dtype == "float32":
                offset, floats = floats, floats + size
            else:
                offset, ints = ints, ints + size
            length_slot = None
            if variable:
                length_slot, ints = ints, ints + 1
            inputs.append(InputColumn(name=name, dtype=item.dtype, shape=shape, variable=variable, offset=offset,
                                      length_slot=length_slot, truncate=item.truncate))
        return RowLayout(columns=inputs, float_slots=floats, int_slots=ints)


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
        listlike = _is_list(kind)
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


def check_unique_columns(schema: pa.Schema, wanted: list[str], uri: str) -> None:
    """A column the data set reads must occur once in the file: with two of one name neither can be chosen."""
    repeated = [name for name in dict.fromkeys(wanted) if schema.get_all_field_indices(name)[1:]]
    if repeated:
        counts = ", ".join(f"'{name}' {len(schema.get_all_field_indices(name))} times" for name in repeated)
        raise DataError(f"{uri}: column name(s) repeat in this file ({counts}); a column the data set reads must "
                        f"occur once: rename or drop the copies where the file is written")


def resolve_columns(dataset: Dataset, schema: pa.Schema, uri: str) -> Columns:
    """Check ``schema`` against the declared data set; the error names the file and the column."""
    names = set(schema.names)
    declared_features = ([name for name in schema.names if name.startswith(dataset.features[:-1])]
                         if isinstance(dataset.features, str) else
                         [item if isinstance(item, str) else item.column for item in dataset.features])
    check_unique_columns(schema, [dataset.key, dataset.label, *declared_features], uri)
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
    typed = {name: item for name, item in dataset.declared.items() if item.typed}
    dense = [name for name in columns if name not in typed]
    check_feature_types(schema, dense, shapes, uri)
    label_type = schema.field(dataset.label).type
    if dataset.num_classes is not None and not pa.types.is_integer(label_type):
        raise DataError(f"{uri}: label column '{dataset.label}' has type {label_type}; it must be an integer "
                        f"(dataset.num_classes={dataset.num_classes}; leave num_classes out for a float target)")
    if not (pa.types.is_integer(label_type) or pa.types.is_floating(label_type)):
        raise DataError(f"{uri}: label column '{dataset.label}' has type {label_type}; a float target must be a number")
    key_type = schema.field(dataset.key).type
    if not (pa.types.is_integer(key_type) or pa.types.is_string(key_type) or pa.types.is_large_string(key_type)):
        raise DataError(f"{uri}: key column '{dataset.key}' has type {key_type}; it must be an integer or a string")
    declared = dataset.declared
    normalize = []
    for name in dense:
        item = declared.get(name)
        flag = item.normalize if item is not None and item.normalize is not None else (
            name in shapes or dataset.normalize)  # a tensor column is standardised unless it says otherwise
        normalize += [flag] * (math.prod(shapes[name]) if name in shapes else 1)
    resolved = Columns(key=dataset.key, label=dataset.label, features=element_names(dense, shapes),
                       num_classes=dataset.num_classes, columns=columns, shapes=shapes, normalize=normalize, typed=typed)
    if typed:
        check_typed_types(schema, resolved.layout, uri)
    return resolved


def _is_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)


def check_typed_types(schema: pa.Schema, layout: RowLayout, uri: str) -> None:
    """An int64 column holds integers (a list of them with shape/max_length); a categorical one strings or integers."""
    for column in layout.columns:
        if not column.typed:
            continue
        name, declared = column.name, column.describe()
        kind = schema.field(name).type
        if column.dtype == "categorical":
            if pa.types.is_dictionary(kind):
                kind = kind.value_type
            if not (pa.types.is_integer(kind) or pa.types.is_string(kind) or pa.types.is_large_string(kind)):
                raise DataError(f"{uri}: feature column '{name}' is {declared} (dataset.features) but has type {kind}; "
                                f"categories must be strings or integers")
            continue
        listed = bool(column.shape)
        if listed != _is_list(kind):
            raise DataError(f"{uri}: feature column '{name}' is {declared} (dataset.features) but has type {kind}"
                            + (", not a list" if listed else ", a list; give it shape: [...] or max_length"))
        element = kind.value_type if listed else kind
        number = pa.types.is_integer(element) or (column.is_float and pa.types.is_floating(element))
        if not number:
            raise DataError(f"{uri}: feature column '{name}' is {declared} (dataset.features) but "
                            f"{'its elements have' if listed else 'it has'} type {element}"
                            + ("; int64 ids must be stored as integers (float32 would lose ids above 2^24; cast the "
                               "column in the data, or declare it float32)" if column.dtype == "int64" else ""))
        if not column.variable and listed and pa.types.is_fixed_size_list(kind) and kind.list_size != column.size:
            raise DataError(f"{uri}: feature column '{name}' is {declared} but has type {kind}: {kind.list_size} values a row")


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


def type_name(kind: pa.DataType) -> str:
    """A column's logical type, spelled alike whatever the writer chose for its encoding: dictionary-encoded,
    large_ and plain strings/lists are one type, and a list's element field name does not count."""
    if pa.types.is_dictionary(kind):
        return type_name(kind.value_type)
    if pa.types.is_large_string(kind):
        return "string"
    if pa.types.is_large_binary(kind):
        return "binary"
    if pa.types.is_fixed_size_list(kind):
        return f"fixed_size_list<{type_name(kind.value_type)}>[{kind.list_size}]"
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return f"list<{type_name(kind.value_type)}>"
    return str(kind)


def schema_types(schema: pa.Schema, names: list[str]) -> dict[str, str]:
    """``{column: type_name}`` of the named columns of ``schema``, for comparing shards' schemas."""
    return {name: type_name(schema.field(name).type) for name in names}


def type_difference(uri: str, types: dict[str, str], reference_uri: str, reference: dict[str, str]) -> str | None:
    """None when every column both files hold has one type; else a message naming the file, the column and both types."""
    for name, kind in types.items():
        other = reference.get(name)
        if other is not None and other != kind:
            return (f"{uri}: column '{name}' has type {kind} here but {other} in {reference_uri}; every file of the "
                    f"data set must store each column with one type (cast the column where the files are written)")
    return None


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


def layout_of(manifest: dict) -> RowLayout:
    """The record layout of a preprocess manifest (or its stats, or a bundle's preprocessing); a manifest from before
    typed columns holds float32 features only."""
    if manifest.get("layout"):
        return RowLayout(**manifest["layout"])
    return float_only_layout(manifest["features"], manifest.get("feature_shapes"), manifest.get("columns"))


def processed_schema(columns: Columns, key_type: pa.DataType, words: int | None = None) -> pa.Schema:
    """Key, label (int64 classes or a float32 target) and each row's record of ``words`` 4-byte words (default: the
    float32 feature vector; layout in the manifest).

    A fixed-size binary column decodes about as fast as raw bytes (a Parquet list column is ~5x
    slower) and maps onto a (rows, features) matrix without a copy, so a training batch is one
    contiguous row gather. ``feature_matrix`` reads it back.
    """
    label_type = pa.float32() if columns.num_classes is None else pa.int64()
    return pa.schema([pa.field(columns.key, key_type), pa.field(columns.label, label_type),
                      pa.field(FEATURES_COLUMN, pa.binary(4 * (len(columns.features) if words is None else words)))])


def feature_vectors(matrix: np.ndarray) -> pa.Array:
    """The processed vector column for a (rows, features) matrix."""
    block = np.ascontiguousarray(matrix, dtype="<f4")
    return pa.FixedSizeBinaryArray.from_buffers(pa.binary(4 * block.shape[1]), block.shape[0], [None, pa.py_buffer(block)])
