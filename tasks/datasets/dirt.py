"""Which columns left no clean row: read only when preprocessing kept no row at all, so the error can name them.

``python -m stagewise.preprocess reduce`` reaches it through ``reduce_stats``; the hot path never calls it.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stagewise.core import storage
from stagewise.datasets.columns import resolve_columns
from stagewise.definitions.config import Dataset

# Files named in one message: enough to find them, short enough to read.
NAMED_FILES = 5
BATCH_ROWS = 262_144


def clean_rows(column: pa.Array) -> np.ndarray:
    """Rows whose value is present, and finite where it is a float (every element of a list)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    clean = np.asarray(column.is_valid().to_numpy(zero_copy_only=False), bool)
    kind = column.type
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        values = pc.list_flatten(column)
        lengths = pc.list_value_length(column).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        bad = ~clean_rows(values)
        if bad.any():
            clean[np.unique(np.repeat(np.arange(len(column)), lengths)[bad])] = False
        return clean
    if pa.types.is_floating(kind):
        with np.errstate(invalid="ignore"):
            clean &= np.isfinite(np.asarray(column.fill_null(0).to_numpy(zero_copy_only=False), np.float64))
    return clean


def unusable_columns(uri: str, dataset: Dataset) -> tuple[list[str], int]:
    """(the columns of ``uri`` the data set reads that are null or non-finite in every row, the file's rows)."""
    with storage.open_parquet(uri) as parquet:
        columns = resolve_columns(dataset, parquet.schema_arrow, uri)
        wanted = list(dict.fromkeys([columns.key, columns.label, *columns.raw]))
        usable = dict.fromkeys(wanted, False)
        rows = 0
        for batch in storage.iter_batches(parquet, wanted, BATCH_ROWS, uri=uri):
            rows += batch.num_rows
            for name in [name for name, seen in usable.items() if not seen]:
                usable[name] = bool(clean_rows(batch.column(name)).any())
            if all(usable.values()):
                break
    return [name for name, seen in usable.items() if not seen], rows


def all_dirty_message(dataset: Dataset, files: list[str]) -> str:
    """Why no row survived cleaning: each column null (or NaN/inf) in every row, with the files it is so in."""
    where: dict[str, list[str]] = {}
    for uri in files:
        names, rows = unusable_columns(uri, dataset)
        for name in names if rows else []:
            where.setdefault(name, []).append(uri)
    head = f"{dataset.uri}: every row was dropped as dirty (nulls or non-finite features or target)"
    if not where:
        return (f"{head}; no column is null in every row, but each row has a null or non-finite value in some "
                f"column (dataset.key, dataset.label, dataset.features)")
    parts = []
    for name, uris in where.items():
        named = ", ".join(uris[:NAMED_FILES]) + (f" and {len(uris) - NAMED_FILES} more" if len(uris) > NAMED_FILES else "")
        parts.append(f"column '{name}' is null or NaN/inf in every row of {named}")
    return (f"{head}: " + "; ".join(parts) + ". Fill the column where the files are written, or leave it out of "
            "dataset.features (a key or label column must hold a value in every row)")
