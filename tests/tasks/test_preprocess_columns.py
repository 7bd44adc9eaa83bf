"""Float targets and declared tensor-shaped feature columns through preprocessing and inference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from stagewise import infer, preprocess
from stagewise.core import storage
from stagewise.core.errors import DataError
from stagewise.datasets.columns import feature_matrix
from stagewise.datasets.manifest import load_split, read_manifest
from stagewise.datasets.predictions import plan_inference
from stagewise.definitions.loading import load_config
from stagewise.models.building import build, data_info
from stagewise.models.bundle import preprocessing_of, save_bundle
from stagewise.models.mlp import MLPClassifier
from stagewise.spec import SpecRef
from tests.conftest import base_config

NUM_ROWS = 240


def _run_all(config, raw_uri: str, out: str) -> dict:
    shards = preprocess.plan(raw_uri)
    stats = [preprocess.shard_stats(config, uri, i, out)["stats_uri"] for i, uri in enumerate(shards)]
    reduced = preprocess.reduce_stats(config, out, stats)
    results = [preprocess.transform_shard(config, uri, i, out, reduced["stats_uri"]) for i, uri in enumerate(shards)]
    return read_manifest(preprocess.commit(config, out, reduced["stats_uri"], results)["manifest_uri"])


def _write(folder: Path, table: pa.Table, num_shards: int = 2) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, table.num_rows, num_shards + 1).astype(int)
    for index, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:])):
        pq.write_table(table.slice(start, stop - start), folder / f"part-{index:05d}.parquet")
    return str(folder)


def _config(write_config, storage_root: Path, dataset: dict):
    raw = base_config(storage_root)
    raw["dataset"] = {"uri": "raw/t", "key": "row_id", "label": "label", **dataset}
    return load_config(write_config(raw))


def _processed(manifest: dict) -> pa.Table:
    return pa.concat_tables([pq.read_table(f["uri"]) for files in manifest["splits"].values() for f in files])


# --- float targets ----------------------------------------------------------------------------------------------


def _regression_table(rng: np.random.Generator) -> pa.Table:
    target = rng.normal(150.0, 40.0, NUM_ROWS)
    mask = np.zeros(NUM_ROWS, bool)
    mask[[3, 50]] = True  # null targets
    target[[7, 130]] = [np.nan, np.inf]  # non-finite targets
    return pa.table({"row_id": pa.array(np.arange(NUM_ROWS, dtype=np.int64)), "x": pa.array(rng.normal(size=NUM_ROWS)),
                     "y": pa.array(rng.integers(0, 5, NUM_ROWS).astype(np.int32)),
                     "label": pa.array(target, mask=mask)})


def test_float_target_moments_land_in_the_manifest_and_dirty_targets_are_dropped(write_config, storage_root):
    """Without num_classes the label is a float target: null/NaN/inf rows are dropped and counted, the manifest's
    target block holds the exact mean/std/min/max of the kept targets (merged over shards), labels stay float32."""
    table = _regression_table(np.random.default_rng(0))
    config = _config(write_config, storage_root, {"features": ["x", "y"]})
    manifest = _run_all(config, _write(storage_root / "raw" / "t", table), str(storage_root / "runs" / "r"))
    kept = table.column("label").to_numpy(zero_copy_only=False)
    kept = kept[np.isfinite(kept)]
    assert manifest["rows_dropped"] == 4 and sum(manifest["rows"].values()) == NUM_ROWS - 4
    assert manifest["num_classes"] is None
    target = manifest["target"]
    assert target["count"] == len(kept)
    np.testing.assert_allclose([target["mean"], target["std"], target["min"], target["max"]],
                               [kept.mean(), kept.std(ddof=1), kept.min(), kept.max()], rtol=1e-9)
    stats = storage.read_json(str(storage_root / "runs" / "r" / "preprocess" / "stats.json"))
    assert "label_counts" not in stats
    assert _processed(manifest).schema.field("label").type == pa.float32()
    features, labels = load_split(manifest, "train")
    assert labels.dtype == np.float32 and np.isfinite(labels).all() and len(features) == len(labels)
    info = data_info(manifest)
    assert (info.num_classes, info.target_mean, info.target_std) == (None, target["mean"], target["std"])


def test_an_integer_raw_target_is_a_float_target_without_num_classes(write_config, storage_root):
    """An integer label column with no num_classes is processed as a float32 target, not range-checked as classes."""
    table = pa.table({"row_id": pa.array(np.arange(60, dtype=np.int64)), "x": pa.array(np.arange(60.0)),
                      "label": pa.array(np.arange(60, dtype=np.int64) * 1000)})
    config = _config(write_config, storage_root, {"features": ["x"]})
    manifest = _run_all(config, _write(storage_root / "raw" / "t", table), str(storage_root / "runs" / "r"))
    assert manifest["target"]["max"] == 59_000.0
    assert _processed(manifest).schema.field("label").type == pa.float32()


# --- tensor columns ---------------------------------------------------------------------------------------------


def _tensor_table(rng: np.random.Generator, num_rows: int = NUM_ROWS) -> pa.Table:
    image = rng.normal(size=(num_rows, 6)) * 10 + 3
    vector = rng.integers(0, 9, size=(num_rows, 2)).astype(np.int32)
    return pa.table({
        "row_id": pa.array(np.arange(num_rows, dtype=np.int64)),
        "a": pa.array(rng.normal(size=num_rows)),
        "image": pa.FixedSizeListArray.from_arrays(pa.array(image.reshape(-1)), 6),
        "b": pa.array(rng.normal(size=num_rows) * 5),
        "vec": pa.array(list(vector), pa.list_(pa.int32())),
        "label": pa.array(rng.integers(0, 3, num_rows).astype(np.int64)),
    })


TENSOR_FEATURES = ["a", {"column": "image", "shape": [2, 3]}, "b", {"column": "vec", "shape": [2], "normalize": False}]


def _raw_matrix(table: pa.Table) -> np.ndarray:
    """The expected feature vector, built independently of stagewise.preprocess: columns in order, lists row-major."""
    return np.column_stack([table.column("a").to_numpy(),
                            np.stack(table.column("image").to_pylist()),
                            table.column("b").to_numpy(),
                            np.stack(table.column("vec").to_pylist())]).astype(np.float64)


@pytest.fixture
def tensor_run(write_config, storage_root):
    table = _tensor_table(np.random.default_rng(1))
    config = _config(write_config, storage_root, {"features": TENSOR_FEATURES, "num_classes": 3})
    raw_uri = _write(storage_root / "raw" / "t", table)
    out = str(storage_root / "runs" / "r")
    return config, raw_uri, out, table, _run_all(config, raw_uri, out)


def test_tensor_columns_flatten_in_order_with_element_names_and_shapes(tensor_run):
    """A declared column's values join the feature vector in row-major order, named column[i]; the manifest keeps
    the raw columns and the declared shapes, and DataInfo exposes them to specs."""
    _, _, _, table, manifest = tensor_run
    assert manifest["features"] == ["a", *[f"image[{i}]" for i in range(6)], "b", "vec[0]", "vec[1]"]
    assert manifest["columns"] == ["a", "image", "b", "vec"]
    assert manifest["feature_shapes"] == {"image": [2, 3], "vec": [2]}
    assert data_info(manifest).shapes == {"image": [2, 3], "vec": [2]}
    processed = _processed(manifest)
    matrix = _raw_matrix(table)
    rows = processed.column("row_id").to_numpy()
    expected = (matrix[rows] - np.asarray(manifest["mean"])) / np.asarray(manifest["std"])
    np.testing.assert_allclose(feature_matrix(processed), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(manifest["mean"][1:7], matrix[:, 1:7].mean(axis=0), rtol=1e-9)


def test_normalize_false_keeps_a_columns_values(tensor_run):
    """normalize: false stores mean 0 and std 1 for its elements, so the processed values are the raw ones."""
    _, _, _, table, manifest = tensor_run
    assert manifest["mean"][-2:] == [0.0, 0.0] and manifest["std"][-2:] == [1.0, 1.0]
    assert manifest["std"][0] != 1.0, "plain columns are still standardised"
    processed = _processed(manifest)
    raw = np.stack(table.column("vec").to_pylist())[processed.column("row_id").to_numpy()]
    np.testing.assert_array_equal(feature_matrix(processed)[:, -2:], raw)


def test_dataset_level_normalize_false_applies_to_plain_columns(write_config, storage_root):
    """dataset.normalize: false keeps every plain column as it is (a declared column still follows its own flag)."""
    table = _tensor_table(np.random.default_rng(2), 60)
    config = _config(write_config, storage_root, {"features": TENSOR_FEATURES, "num_classes": 3, "normalize": False})
    manifest = _run_all(config, _write(storage_root / "raw" / "t", table), str(storage_root / "runs" / "r"))
    assert manifest["std"][0] == manifest["std"][7] == 1.0 and manifest["mean"][0] == 0.0
    assert manifest["std"][1] != 1.0


def test_null_lists_and_null_or_non_finite_elements_make_a_row_dirty(write_config, storage_root):
    """A null list, a null element or a NaN element drops the row (counted), never fails the shard."""
    table = _tensor_table(np.random.default_rng(3), 40)
    images = table.column("image").to_pylist()
    images[0] = None
    images[1][2] = None
    images[2][5] = float("nan")
    table = table.set_column(2, "image", pa.array(images, pa.list_(pa.float64(), 6)))
    config = _config(write_config, storage_root, {"features": TENSOR_FEATURES, "num_classes": 3})
    manifest = _run_all(config, _write(storage_root / "raw" / "t", table, 1), str(storage_root / "runs" / "r"))
    assert manifest["rows_dropped"] == 3
    assert not {0, 1, 2} & set(_processed(manifest).column("row_id").to_pylist())


def _with_column(table: pa.Table, name: str, array: pa.Array) -> pa.Table:
    return table.set_column(table.schema.get_field_index(name), name, array)


@pytest.mark.parametrize("column,change,found", [
    ("vec", lambda t: _with_column(t, "vec", pa.array([[1, 2]] * (t.num_rows - 1) + [[1, 2, 3]], pa.list_(pa.int32()))),
     "1 row(s) hold another count (found 3 numbers)"),
    ("image", lambda t: _with_column(t, "image", pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(t.num_rows * 4)), 4)),
     "[4]: 4 numbers a row"),
    ("image", lambda t: _with_column(t, "image", pa.array(np.zeros(t.num_rows))), "has type double, not a list"),
    ("vec", lambda t: _with_column(t, "vec", pa.array([["x", "y"]] * t.num_rows, pa.list_(pa.string()))),
     "elements have type string, not numbers"),
])
def test_a_tensor_column_that_does_not_match_its_declaration_names_file_column_expected_and_found(
        write_config, storage_root, column, change, found):
    """Wrong list length, wrong fixed size, a scalar or a list of non-numbers: DataError naming file, column,
    the declared shape and what the file holds."""
    table = change(_tensor_table(np.random.default_rng(4), 20))
    config = _config(write_config, storage_root, {"features": TENSOR_FEATURES, "num_classes": 3})
    raw_uri = _write(storage_root / "raw" / "t", table, 1)
    with pytest.raises(DataError) as caught:
        preprocess.shard_stats(config, preprocess.plan(raw_uri)[0], 0, str(storage_root / "runs" / "r"))
    message = str(caught.value)
    assert "part-00000.parquet" in message and f"'{column}'" in message and found in message
    assert ("shape [2]" if column == "vec" else "shape [2, 3]") in message


def test_an_undeclared_list_column_asks_for_its_shape(write_config, storage_root):
    """A list column named as a plain feature is refused with the declaration to write."""
    config = _config(write_config, storage_root, {"features": ["a", "vec"], "num_classes": 3})
    raw_uri = _write(storage_root / "raw" / "t", _tensor_table(np.random.default_rng(5), 20), 1)
    with pytest.raises(DataError, match=r"'vec' has type list<.*int32>, a list; declare it .*\{column: vec, shape"):
        preprocess.shard_stats(config, preprocess.plan(raw_uri)[0], 0, str(storage_root / "runs" / "r"))


# --- inference --------------------------------------------------------------------------------------------------


def test_inference_flattens_raw_tensor_columns_as_preprocessing_did(tensor_run, storage_root):
    """Scoring raw rows gives, for every key, what the model outputs on that key's processed (preprocessed)
    features: the same flattening order and the bundle's stored normalisation."""
    config, raw_uri, out, _, manifest = tensor_run
    torch.manual_seed(0)
    params = {"hidden": 8, "dropout": 0.0}
    model = build(MLPClassifier(), data_info(manifest), params).eval()
    model_uri = str(storage_root / "model.pt")
    save_bundle(model_uri, model, SpecRef("stagewise.model:MLPClassifier"), data_info(manifest), params,
                preprocessing_of(manifest), {})
    scored = pa.concat_tables([pq.read_table(infer.score_shard(config, model_uri, shard, out)["uri"])
                               for shard in plan_inference(raw_uri, 500)])
    processed = _processed(manifest)
    with torch.no_grad():
        expected = torch.softmax(model(torch.from_numpy(feature_matrix(processed).copy())), dim=1).numpy()
    by_key = dict(zip(processed.column("row_id").to_pylist(), expected))
    got = np.stack(scored.column("probabilities").to_pylist())
    assert scored.num_rows == NUM_ROWS
    np.testing.assert_allclose(got, np.stack([by_key[k] for k in scored.column("row_id").to_pylist()]), atol=1e-5)
