"""Columns that cannot be read as one: a name stored twice in a file, a column null in every row (issue 53, Low).

Each fails once as a DataError (no retry) naming the file and the column, never as a raw KeyError or a message
that leaves the user to guess which column made every row dirty.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stagewise import preprocess
from stagewise.core.errors import DataError, UserError
from stagewise.datasets.columns import check_unique_columns, resolve_columns
from stagewise.datasets.dirt import clean_rows
from stagewise.definitions.loading import load_config
from tests.bad_parquet import write_repeated_column
from tests.conftest import base_config

NUM_ROWS = 20


def _columns() -> dict:
    rng = np.random.default_rng(0)
    return {"row_id": pa.array(np.arange(NUM_ROWS, dtype=np.int64)),
            "f_000": pa.array(rng.normal(size=NUM_ROWS)), "f_001": pa.array(rng.normal(size=NUM_ROWS)),
            "label": pa.array(np.arange(NUM_ROWS, dtype=np.int64) % 10)}


@pytest.fixture
def config(write_config, storage_root):
    raw = base_config(storage_root)
    raw["dataset"] = {"uri": "raw/bad", "key": "row_id", "label": "label", "features": "f_*", "num_classes": 10}
    return load_config(write_config(raw))


def _write(storage_root: Path, name: str, columns: dict) -> str:
    path = storage_root / "raw" / "bad" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return str(path)


def _stats_and_reduce(config, uris: list[str], out: str) -> dict:
    stats = [preprocess.shard_stats(config, uri, i, out)["stats_uri"] for i, uri in enumerate(uris)]
    return preprocess.reduce_stats(config, out, stats)


@pytest.mark.parametrize("repeated", ["f_000", "label", "row_id"])
def test_a_repeated_column_name_fails_stats_and_transform_naming_the_file_and_the_column(config, storage_root, repeated):
    """Two columns of one name (a feature, the label, the key): pyarrow cannot pick one and raised a bare KeyError
    ('Column f_000 does not exist in schema'), which was retried; now it is a DataError naming both."""
    good = _write(storage_root, "part-00000.parquet", _columns())
    out = str(storage_root / "runs" / "t" / "repeated")
    reduced = _stats_and_reduce(config, [good], out)
    bad = str(write_repeated_column(storage_root / "raw" / "bad" / "part-00001.parquet", _columns(), repeated))
    for step in (lambda: preprocess.shard_stats(config, bad, 1, out),
                 lambda: preprocess.transform_shard(config, bad, 1, out, reduced["stats_uri"])):
        with pytest.raises(DataError) as caught:
            step()
        assert isinstance(caught.value, UserError)
        message = str(caught.value)
        assert bad in message and f"'{repeated}' 2 times" in message


def test_a_repeated_column_the_data_set_does_not_read_is_no_error(config, storage_root):
    """Only the columns the data set reads must be unique: a repeated unrelated column is left alone."""
    columns = _columns()
    columns["comment"] = pa.array(["x"] * NUM_ROWS)
    table = pa.Table.from_arrays([*columns.values(), columns["comment"]], names=[*columns, "comment"])
    resolved = resolve_columns(config.dataset, table.schema, "mem://file")
    assert resolved.features == ["f_000", "f_001"]


@pytest.mark.parametrize("column,values", [
    ("f_001", pa.nulls(NUM_ROWS, pa.float64())),
    ("f_001", pa.array(np.full(NUM_ROWS, np.nan))),
    ("label", pa.nulls(NUM_ROWS, pa.int64())),
], ids=["null-feature", "nan-feature", "null-label"])
def test_a_column_null_in_every_row_is_named_with_its_files_when_every_row_is_dropped(
        config, storage_root, column, values):
    """Every row dropped because one column holds no value: the error names that column and each file, not only
    'every row was dropped as dirty'; the other columns, which have values, are not named."""
    uris = []
    for index in range(2):
        columns = _columns()
        columns[column] = values
        uris.append(_write(storage_root, f"part-{index:05d}.parquet", columns))
    with pytest.raises(DataError) as caught:
        _stats_and_reduce(config, uris, str(storage_root / "runs" / "t" / "null"))
    message = str(caught.value)
    assert "every row was dropped as dirty" in message
    assert f"column '{column}' is null or NaN/inf in every row of {uris[0]}, {uris[1]}" in message
    assert all(f"'{other}'" not in message for other in ("row_id", "f_000", "label", "f_001") if other != column)


def test_rows_dirty_in_different_columns_say_no_single_column_is_to_blame(config, storage_root):
    """Each row dirty, but every column has a value somewhere: no column is named, and the message says so."""
    columns = _columns()
    half = np.arange(NUM_ROWS) < NUM_ROWS // 2
    columns["f_000"] = pa.array(columns["f_000"].to_numpy(), mask=half)
    columns["f_001"] = pa.array(columns["f_001"].to_numpy(), mask=~half)
    uri = _write(storage_root, "part-00000.parquet", columns)
    with pytest.raises(DataError, match="no column is null in every row"):
        _stats_and_reduce(config, [uri], str(storage_root / "runs" / "t" / "mixed"))


def test_clean_rows_marks_nulls_non_finite_floats_and_lists_with_a_bad_element():
    assert clean_rows(pa.array([1.0, None, np.nan, np.inf, 2.0])).tolist() == [True, False, False, False, True]
    assert clean_rows(pa.array([1, None, 3])).tolist() == [True, False, True]
    assert clean_rows(pa.array(["a", None])).tolist() == [True, False]
    lists = pa.array([[1.0, 2.0], None, [1.0, np.nan], [3.0, 4.0]], pa.list_(pa.float64()))
    assert clean_rows(lists).tolist() == [True, False, False, True]


def test_write_repeated_column_really_repeats_the_name(tmp_path: Path):
    """The helper's file holds the name twice (else the tests above would test nothing)."""
    path = write_repeated_column(tmp_path / "x.parquet", _columns(), "f_000")
    assert pq.read_schema(path).names.count("f_000") == 2


def test_check_unique_columns_names_every_repeated_column_inference_reads():
    """Inference checks the key and the model's columns the same way (score_shard calls it before reading a row)."""
    schema = pa.schema([("k", pa.int64()), ("a", pa.float64()), ("a", pa.float64()), ("b", pa.float64()),
                        ("k", pa.int64())])
    with pytest.raises(DataError, match=r"f\.parquet: column name\(s\) repeat in this file \('k' 2 times, 'a' 2 times\)"):
        check_unique_columns(schema, ["k", "a", "b"], "f.parquet")
    check_unique_columns(schema, ["b"], "f.parquet")
