"""Data sets: the digits demo and the synthetic generator write the raw layout preprocess expects."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tasks.data import synthetic_table, write_digits, write_synthetic


def _read_all(uris: list[str]) -> pa.Table:
    return pa.concat_tables([pq.read_table(uri) for uri in uris])


def test_digits_rows_keys_labels_and_columns(tmp_path):
    """Digits: 1797 rows over the shards, row_id unique, labels cover 0..9, 64 pixel columns."""
    uris = write_digits(str(tmp_path / "digits"), num_shards=3)
    assert len(uris) == 3
    table = _read_all(uris)
    assert table.num_rows == 1797
    keys = table.column("row_id").to_numpy()
    assert len(np.unique(keys)) == len(keys)
    assert set(table.column("label").to_numpy().tolist()) == set(range(10))
    assert len([name for name in table.column_names if name.startswith("px_")]) == 64
    assert pa.types.is_integer(table.schema.field("label").type)


def test_synthetic_rows_shards_and_unique_keys(tmp_path):
    """Synthetic: the requested rows split over the requested shards, keys unique across shards, f_* features."""
    uris = write_synthetic(str(tmp_path / "synth"), 10_001, num_features=6, num_classes=4, num_shards=5, dirty_fraction=0.0)
    assert len(uris) == 5
    tables = [pq.read_table(uri) for uri in uris]
    assert sum(t.num_rows for t in tables) == 10_001
    keys = np.concatenate([t.column("row_id").to_numpy() for t in tables])
    assert len(np.unique(keys)) == len(keys) == 10_001
    assert tables[0].column_names == ["row_id", *[f"f_{i:03d}" for i in range(6)], "label"]
    labels = np.concatenate([t.column("label").to_numpy() for t in tables])
    assert labels.min() >= 0 and labels.max() < 4


def test_synthetic_dirty_fraction(tmp_path):
    """About dirty_fraction of rows carry a null feature; with 0 there are none."""
    dirty = _read_all(write_synthetic(str(tmp_path / "dirty"), 40_000, num_features=4, num_shards=4, dirty_fraction=0.05))
    nulls = sum(dirty.column(name).null_count for name in dirty.column_names if name.startswith("f_"))
    assert nulls / dirty.num_rows == pytest.approx(0.05, abs=0.006)  # binomial sd ~0.0011
    clean = _read_all(write_synthetic(str(tmp_path / "clean"), 5_000, num_features=4, num_shards=2, dirty_fraction=0.0))
    assert sum(clean.column(name).null_count for name in clean.column_names) == 0


def test_synthetic_is_deterministic_per_seed(tmp_path):
    """The same seed writes identical shards; another seed draws different rows."""
    first = _read_all(write_synthetic(str(tmp_path / "a"), 2_000, num_features=4, num_shards=3, seed=7))
    again = _read_all(write_synthetic(str(tmp_path / "b"), 2_000, num_features=4, num_shards=3, seed=7))
    other = _read_all(write_synthetic(str(tmp_path / "c"), 2_000, num_features=4, num_shards=3, seed=8))
    assert first.equals(again)
    assert not first.equals(other)


def test_synthetic_table_first_key_offsets_keys():
    """Keys start at first_key, so chunks generated apart never collide."""
    table = synthetic_table(100, num_features=3, first_key=5_000)
    assert table.column("row_id").to_numpy().tolist() == list(range(5_000, 5_100))


def test_synthetic_classes_are_learnable():
    """The signal is real: a nearest-centroid rule fitted on half the rows beats chance clearly on the rest."""
    table = synthetic_table(4_000, num_features=8, num_classes=4, seed=3)
    features = np.column_stack([table.column(f"f_{i:03d}").to_numpy() for i in range(8)])
    labels = table.column("label").to_numpy()
    features = (features - features.mean(axis=0)) / features.std(axis=0)
    fit, held = slice(0, 2_000), slice(2_000, None)
    centroids = np.stack([features[fit][labels[fit] == c].mean(axis=0) for c in range(4)])
    predicted = np.argmin(((features[held][:, None, :] - centroids[None]) ** 2).sum(axis=2), axis=1)
    assert (predicted == labels[held]).mean() > 0.5  # chance is 0.25
