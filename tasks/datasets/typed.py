"""Typed feature columns of raw rows: int64 ids, categories and variable-length lists, as record slots.

Preprocessing and inference share these steps, so a row is encoded the same way for training and for
scoring: :func:`typed_block` reads a batch's typed columns into int64 and float32 slots (variable-length lists
padded with 0, their lengths beside them) and marks rows with a missing or non-finite value;
:func:`fill_categories` turns categorical values into vocabulary ids; :func:`records` joins them with the
standardised float vector into the processed record.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stagewise.core.errors import DataError
from stagewise.datasets.columns import layout_of
from stagewise.definitions.rows import RowLayout

# id of a category not in the vocabulary (or missing): the vocabulary's ids start at 1
UNKNOWN_CATEGORY = 0


@dataclass
class TypedBlock:
    """The typed slots of a batch's rows (before the row filter)."""

    floats: np.ndarray
    """(rows, float slots after the dense vector) float32: variable-length float lists, padded with 0."""
    ints: np.ndarray
    """(rows, int64 slots): ids, padded lists and list lengths; categorical slots hold 0 until filled."""
    keep: np.ndarray
    """Rows whose typed values are all present (and finite)."""
    categories: dict[str, pa.Array] = field(default_factory=dict)
    """Categorical column -> its raw values (strings or integers; null stays null)."""


def _list_parts(column: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray, pa.Array]:
    """(lengths, present, value_rows, values) of a list column: a null list has length 0 and is not present."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    present = np.asarray(column.is_valid().to_numpy(zero_copy_only=False))
    lengths = pc.list_value_length(column).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    values = pc.list_flatten(column)  # null lists emit nothing
    value_rows = np.repeat(np.arange(len(column)), lengths)
    return lengths, present, value_rows, values


def _numbers(values: pa.Array, dtype: type) -> tuple[np.ndarray, np.ndarray]:
    """(values as ``dtype`` with 0 under a null, which values are null)."""
    null = np.asarray(values.is_null().to_numpy(zero_copy_only=False)) if values.null_count else np.zeros(len(values), bool)
    filled = values.fill_null(0) if values.null_count else values
    return np.asarray(filled.to_numpy(zero_copy_only=False)).astype(dtype, copy=False), null


def typed_block(batch: pa.RecordBatch, layout: RowLayout, uri: str) -> TypedBlock:
    """Read ``batch``'s typed columns into their record slots; a row with a null or non-finite value is not kept.

    A fixed-shape list of another length, or a variable-length row above max_length (without truncate), fails
    naming the file, the column and the count.
    """
    rows = batch.num_rows
    extra = layout.float_slots - layout.dense
    block = TypedBlock(np.zeros((rows, extra), np.float32), np.zeros((rows, layout.int_slots), np.int64), np.ones(rows, bool))
    for column in layout.columns:
        if not column.typed:
            continue
        raw = batch.column(column.name)
        if column.dtype == "categorical":
            if pa.types.is_dictionary(raw.type):
                raw = raw.dictionary_decode()
            block.categories[column.name] = raw
            continue
        dtype = np.float32 if column.is_float else np.int64
        target = block.floats[:, column.offset - layout.dense:] if column.is_float else block.ints[:, column.offset:]
        if not column.shape:
            values, null = _numbers(raw, dtype)
            target[:, 0] = values
            block.keep &= ~null
            continue
        lengths, present, value_rows, values = _list_parts(raw)
        block.keep &= present
        size = column.size
        if not column.variable:
            wrong = np.flatnonzero(present & (lengths != size))
            if len(wrong):
                raise DataError(f"{uri}: feature column '{column.name}' is declared with shape {column.shape} ({size} "
                                f"values a row) but {len(wrong)} row(s) hold another count (found {int(lengths[wrong[0]])})")
        elif not column.truncate and len(lengths) and lengths.max() > size:
            longer = np.flatnonzero(lengths > size)
            raise DataError(f"{uri}: feature column '{column.name}' has {len(longer)} row(s) longer than its max_length "
                            f"{size} (the longest holds {int(lengths.max())} values); raise max_length or set truncate: true")
        numbers, null = _numbers(values, dtype)
        if column.is_float:
            null |= ~np.isfinite(numbers)
        if null.any():
            block.keep[np.unique(value_rows[null])] = False
        starts = np.cumsum(lengths) - lengths
        position = np.arange(len(numbers)) - np.repeat(starts, lengths)
        fits = position < size
        target[value_rows[fits], position[fits]] = numbers[fits]
        if column.variable:
            assert column.length_slot is not None
            block.ints[:, column.length_slot] = np.minimum(lengths, size)
    return block


def category_counts(block: TypedBlock, rows: np.ndarray) -> dict[str, list[list[Any]]]:
    """Per categorical column, [value, count] of its non-null values in ``rows`` (a boolean mask)."""
    counts: dict[str, list[list[Any]]] = {}
    for name, values in block.categories.items():
        chosen = values.filter(pa.array(rows)).drop_null()
        counted = pc.value_counts(chosen)
        counts[name] = [[value, count] for value, count in zip(counted.field("values").to_pylist(),
                                                              counted.field("counts").to_pylist())]
    return counts


def merge_category_counts(parts: list[dict[str, list[list[Any]]]]) -> dict[str, Counter]:
    merged: dict[str, Counter] = {}
    for part in parts:
        for name, pairs in part.items():
            counter = merged.setdefault(name, Counter())
            for value, count in pairs:
                counter[value] += count
    return merged


def vocabulary(counts: Counter, limit: int) -> list[Any]:
    """The ``limit`` most frequent values, ties by value: id i + 1 is the i-th (0 stays for anything else)."""
    return [value for value, _ in sorted(counts.items(), key=lambda pair: (-pair[1], str(pair[0])))[:limit]]


def fill_categories(block: TypedBlock, layout: RowLayout, vocabularies: dict[str, list[Any]]) -> None:
    """Write each categorical value's id (1 + its place in the vocabulary; 0 when absent or null) into its slot."""
    for name, values in block.categories.items():
        column = layout.column(name)
        vocab = pa.array(vocabularies.get(name, []), type=values.type)
        index = pc.index_in(values, value_set=vocab).fill_null(UNKNOWN_CATEGORY - 1)
        block.ints[:, column.offset] = np.asarray(index.to_numpy(zero_copy_only=False), np.int64) + 1


def records(dense: np.ndarray, block: TypedBlock | None, layout: RowLayout, rows: np.ndarray | None) -> np.ndarray:
    """The (len(dense), words) float32 records: ``dense`` (the rows' standardised float vectors) then ``block``'s
    slots of ``rows`` (None: all); ``dense`` itself for a float-only layout."""
    if block is None or not layout.typed:
        return dense
    out = np.zeros((len(dense), layout.words), np.float32)
    out[:, : layout.dense] = dense
    write_typed_slots(out, block, layout, rows)
    return out


def write_typed_slots(out: np.ndarray, block: TypedBlock, layout: RowLayout, rows: np.ndarray | None) -> None:
    """Fill the typed part of (len(rows), words) float32 records ``out`` with ``block``'s slots of ``rows`` (None: all)."""
    out[:, layout.dense : layout.float_slots] = block.floats if rows is None else block.floats[rows]
    if layout.int_slots:
        out[:, layout.int_offset :].view(np.int64)[:] = block.ints if rows is None else block.ints[rows]


def standardised_whole_columns(manifest: dict[str, Any], records: np.ndarray) -> list[str]:
    """Standardised float32 columns whose values in ``records`` undo to whole numbers: ids that the normalisation
    turned into fractions, which an embedding then reads as (out of range) indices."""
    layout = layout_of(manifest)
    mean, std = np.asarray(manifest["mean"], np.float64), np.asarray(manifest["std"], np.float64)
    original = np.asarray(records, np.float64)[:, : layout.dense] * std + mean
    whole = np.abs(original - np.round(original)) <= 1e-3 * np.maximum(1.0, np.abs(original))
    names = []
    for column in layout.columns:
        if column.typed:
            continue
        elements = slice(column.offset, column.offset + column.size)
        standardised = bool(np.any((mean[elements] != 0.0) | (std[elements] != 1.0)))
        if standardised and len(original) and bool(whole[:, elements].all()):
            names.append(column.name)
    return names


def index_error_hint(manifest: dict[str, Any], records: np.ndarray) -> str:
    """What to say when a model indexes with a batch of ``records`` out of range: the standardised id columns, if any."""
    names = standardised_whole_columns(manifest, records)
    if not names:
        return ""
    declare = ", ".join(f"{{column: {name}, dtype: int64}}" for name in names)
    return (f"; feature column(s) {names} hold whole numbers but were standardised with the data's mean and std "
            f"(dataset.normalize / normalize: true), so as indices they are fractions or negative: declare them in "
            f"dataset.features as {declare} to reach the spec as exact int64 ids, never normalised")
