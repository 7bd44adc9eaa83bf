"""Evaluation on the test split and sharded batch inference with an idempotent commit."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from stagewise import infer
from stagewise.core import storage
from stagewise.core.errors import UserError
from stagewise.datasets.manifest import load_split, read_manifest
from stagewise.datasets.predictions import commit_predictions, plan_inference
from stagewise.definitions.hyperparams import BUILTIN_SPEC
from stagewise.definitions.loading import load_config
from stagewise.definitions.spec import HookError
from stagewise.evaluate import evaluate
from stagewise.models.building import build, data_info
from stagewise.models.bundle import load_bundle, preprocessing_of, save_bundle
from stagewise.models.mlp import MLPClassifier
from stagewise.models.scoring import SerialWriter, exact_float32, ordered_map, prefetch, read_ahead, scoring_device
from stagewise.models.versions import version_of
from stagewise.spec import DataInfo, SpecRef
from tests.bad_parquet import BAD_KINDS, EXPECTED_WORDING, write_bad_file
from tests.conftest import diabetes_config, preprocess_digits, train_digits_s1


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Once per module: digits preprocessed and stage s1 trained in-process; returns (config path, run prefix, model URI)."""
    return train_digits_s1(tmp_path_factory.mktemp("storage"), "infer", hidden=32)


def _constant_model(out: str, path: Path, label: int) -> str:
    """A bundle that always predicts ``label`` (zero weights, one positive bias): its accuracy is that label's share."""
    manifest = read_manifest(storage.join(out, "preprocess", "manifest.json"))
    params = {"hidden": 8, "dropout": 0.0}
    model = build(MLPClassifier(), data_info(manifest), params)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        model[-1].bias[label] = 1.0
    uri = str(path / "constant.pt")
    save_bundle(uri, model, SpecRef(BUILTIN_SPEC), data_info(manifest), params, preprocessing_of(manifest), {})
    return uri


# --- evaluate ---------------------------------------------------------------------------------------------------


def test_evaluate_reports_the_models_accuracy_on_the_test_rows(trained):
    """Test accuracy lies in [0, 1], equals the bundle's accuracy on the committed test rows, and is written to metrics."""
    config_path, out, model_uri = trained
    result = evaluate(load_config(config_path), model_uri, out)
    assert 0.0 <= result["test_accuracy"] <= 1.0
    features, labels = load_split(read_manifest(storage.join(out, "preprocess", "manifest.json")), "test")
    model = load_bundle(model_uri).module
    with torch.no_grad():
        expected = float((model(torch.from_numpy(features)).argmax(dim=1).numpy() == labels).mean())
    assert result["test_accuracy"] == pytest.approx(expected)
    assert result["test_rows"] == len(labels)
    metrics = storage.read_json(result["metrics_uri"])
    assert metrics["test_accuracy"] == result["test_accuracy"]
    assert set(metrics["per_class_accuracy"]) == {str(c) for c in np.unique(labels)}


def test_evaluate_below_the_gate_is_a_user_error(trained, tmp_path):
    """A model under evaluate.min_test_accuracy fails the run (no retry), naming the setting."""
    config_path, out, _ = trained
    constant = _constant_model(out, tmp_path, label=0)
    labels = load_split(read_manifest(storage.join(out, "preprocess", "manifest.json")), "test")[1]
    share = float((labels == 0).mean())
    config = load_config(config_path, overrides={"evaluate.min_test_accuracy": 0.5})
    with pytest.raises(UserError, match="evaluate.min_test_accuracy"):
        evaluate(config, constant, out)
    assert evaluate(load_config(config_path), constant, out)["test_accuracy"] == pytest.approx(share)


def test_evaluate_refuses_a_model_of_other_features(trained, tmp_path):
    """A bundle trained on other columns is refused rather than scored on the wrong inputs."""
    config_path, out, _ = trained
    data, params = DataInfo(features=["a", "b", "c"], num_classes=10), {"hidden": 8, "dropout": 0.0}
    uri = str(tmp_path / "other.pt")
    save_bundle(uri, build(MLPClassifier(), data, params), SpecRef(BUILTIN_SPEC), data, params,
                {"features": ["a", "b", "c"], "mean": [0] * 3, "std": [1] * 3, "key": "row_id", "label": "label"}, {})
    with pytest.raises(UserError, match="features differ"):
        evaluate(load_config(config_path), uri, out)


def test_evaluate_refuses_a_model_with_nan_weights(trained, tmp_path):
    """A bundle whose weights are NaN (a diverged training) fails evaluation as a user error naming the file, so
    it never reaches the registry; no metrics are written."""
    config_path, out, _ = trained
    uri = _constant_model(out, tmp_path, 0)
    bundle = load_bundle(uri)
    with torch.no_grad():
        bundle.module[0].weight[0, 0] = float("nan")
    save_bundle(uri, bundle.module, bundle.ref, bundle.data, bundle.params, bundle.preprocessing, {})
    metrics = Path(storage.join(out, "evaluate", "metrics.json"))
    before = metrics.read_bytes() if metrics.exists() else None
    with pytest.raises(UserError, match="weights are NaN/inf") as caught:
        evaluate(load_config(config_path), uri, out)
    assert uri in str(caught.value)
    assert (metrics.read_bytes() if metrics.exists() else None) == before


# --- infer: plan ------------------------------------------------------------------------------------------------


def _raw_with_row_groups(path: Path, sizes: list[list[int]]) -> str:
    """Files under ``path`` with the given row-group sizes each (keys unique across files)."""
    key = 0
    for index, groups in enumerate(sizes):
        target = path / f"part-{index:05d}.parquet"
        target.parent.mkdir(parents=True, exist_ok=True)
        with pq.ParquetWriter(target, pa.schema([("row_id", pa.int64()), ("x", pa.float64())])) as writer:
            for size in groups:
                writer.write_table(pa.table({"row_id": np.arange(key, key + size, dtype=np.int64),
                                             "x": np.zeros(size)}))
                key += size
    return str(path)


def test_plan_groups_consecutive_row_groups_deterministically(tmp_path):
    """Shards cover every row group once, in file order; each reaches rows_per_shard except a file's last."""
    uri = _raw_with_row_groups(tmp_path / "raw", [[100] * 7, [40, 300, 10], [25]])
    shards = plan_inference(uri, rows_per_shard=250)
    assert shards == plan_inference(uri, rows_per_shard=250), "the same input plans the same shards"
    assert [s["index"] for s in shards] == list(range(len(shards)))
    covered = [(s["uri"], g) for s in shards for g in s["row_groups"]]
    expected = [(f, g) for f in storage.list_parquet(uri) for g in range(pq.ParquetFile(f).metadata.num_row_groups)]
    assert covered == expected
    for shard, following in zip(shards, shards[1:] + [None]):
        metadata = pq.ParquetFile(shard["uri"]).metadata
        assert shard["rows"] == sum(metadata.row_group(g).num_rows for g in shard["row_groups"])
        last_of_file = following is None or following["uri"] != shard["uri"]
        assert shard["rows"] >= 250 or last_of_file
        assert shard["rows"] - metadata.row_group(shard["row_groups"][-1]).num_rows < 250, "no shard is larger than needed"
    assert sum(s["rows"] for s in shards) == 7 * 100 + 350 + 25


# --- infer: score and commit ------------------------------------------------------------------------------------


def _score_all(config, model_uri: str, shards: list[dict], out: str) -> list[dict]:
    return [infer.score_shard(config, model_uri, shard, out) for shard in shards]


def _read(manifest: dict) -> pa.Table:
    return pa.concat_tables([pq.read_table(entry["uri"]) for entry in manifest["files"]])


@pytest.mark.parametrize("batch_size", [1024, 128])
def test_score_and_commit(trained, batch_size):
    """Scored rows carry key, prediction = argmax of probabilities summing to 1, and the model version; the manifest
    counts them; the same whether a shard is one batch or several (batch_size 128 < rows_per_shard)."""
    config_path, out, model_uri = trained
    config = load_config(config_path, {"inference.batch_size": batch_size})
    raw = storage.resolve(config.storage_root, config.dataset.uri)
    shards = plan_inference(raw, rows_per_shard=config.inference.rows_per_shard)
    committed = commit_predictions(out, model_uri, _score_all(config, model_uri, shards, out))
    manifest = storage.read_json(committed["uri"])
    assert manifest["kind"] == "predictions" and manifest["model_uri"] == model_uri
    for entry in manifest["files"]:
        assert pq.ParquetFile(entry["uri"]).metadata.num_rows == entry["rows"]
    table = _read(manifest)
    assert committed["rows"] == manifest["rows"] == table.num_rows == 1797
    assert set(table.column_names) == {"row_id", "prediction", "probabilities", "model_version"}
    keys = table.column("row_id").to_numpy()
    assert len(np.unique(keys)) == len(keys) == 1797
    probabilities = np.stack(table.column("probabilities").to_numpy(zero_copy_only=False))
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, atol=1e-5)
    assert (probabilities >= 0).all()
    assert np.array_equal(probabilities.argmax(axis=1), table.column("prediction").to_numpy())
    assert set(table.column("model_version").to_pylist()) == {version_of(Path(model_uri).read_bytes())}
    listed = {entry["uri"] for entry in manifest["files"]}
    on_disk = {str(p) for p in (Path(out) / "predictions").iterdir() if p.name != "manifest.json"}
    assert on_disk == listed


def test_predictions_match_the_model_on_normalised_inputs(trained):
    """Inference applies the bundle's normalisation: its predictions equal the model on the preprocessed test rows."""
    config_path, out, model_uri = trained
    config = load_config(config_path)
    raw = storage.resolve(config.storage_root, config.dataset.uri)
    shards = plan_inference(raw, rows_per_shard=config.inference.rows_per_shard)
    manifest = storage.read_json(commit_predictions(out, model_uri, _score_all(config, model_uri, shards, out))["uri"])
    scored = _read(manifest).to_pandas().set_index("row_id")["prediction"]
    preprocess_manifest = read_manifest(storage.join(out, "preprocess", "manifest.json"))
    features, _ = load_split(preprocess_manifest, "test")
    keys = np.concatenate([pq.read_table(e["uri"], columns=["row_id"]).column(0).to_numpy()
                           for e in preprocess_manifest["splits"]["test"]])  # same files, same order as load_split
    model = load_bundle(model_uri).module
    with torch.no_grad():
        expected = model(torch.from_numpy(features)).argmax(dim=1).numpy()
    agreement = (scored.loc[keys].to_numpy() == expected).mean()
    assert agreement > 0.99  # float32 vs float64 normalisation may flip a near-tie


def test_rescoring_a_shard_and_committing_again_is_idempotent(trained):
    """A retried shard and a second commit give the same keys and predictions and leave no stale files."""
    config_path, out, model_uri = trained
    config = load_config(config_path)
    raw = storage.resolve(config.storage_root, config.dataset.uri)
    shards = plan_inference(raw, rows_per_shard=config.inference.rows_per_shard)
    first = storage.read_json(commit_predictions(out, model_uri, _score_all(config, model_uri, shards, out))["uri"])
    before = _read(first).sort_by("row_id")
    results = _score_all(config, model_uri, shards, out)
    results[0] = infer.score_shard(config, model_uri, shards[0], out)  # the retry of shard 0 replaces its first attempt
    second = storage.read_json(commit_predictions(out, model_uri, results)["uri"])
    after = _read(second).sort_by("row_id")
    assert after.column("row_id").equals(before.column("row_id"))
    assert after.column("prediction").equals(before.column("prediction"))
    assert second["rows"] == first["rows"]
    listed = {entry["uri"] for entry in second["files"]}
    on_disk = {str(p) for p in (Path(out) / "predictions").iterdir() if p.name != "manifest.json"}
    assert on_disk == listed and not listed & {entry["uri"] for entry in first["files"]}


def _dirty_input(config, tmp_path):
    source = pq.read_table(storage.list_parquet(storage.resolve(config.storage_root, config.dataset.uri))[0])
    column = source.column("px_10").to_numpy().copy()
    column[:5] = np.nan
    dirty = source.set_column(source.column_names.index("px_10"), "px_10", pa.array(column))
    path = tmp_path / "dirty" / "part-00000.parquet"
    path.parent.mkdir(exist_ok=True)
    pq.write_table(dirty, path)
    return path, dirty


def test_rows_with_missing_features_are_quarantined_with_a_reason(trained, tmp_path):
    """Null or non-finite feature rows are not scored; they go to quarantine with a reason and are counted."""
    config_path, out, model_uri = trained
    config = load_config(config_path)
    path, dirty = _dirty_input(config, tmp_path)
    prefix = str(tmp_path / "dirty_run")
    shards = plan_inference(str(path), rows_per_shard=10_000)
    committed = commit_predictions(prefix, model_uri, _score_all(config, model_uri, shards, prefix))
    assert committed["rows_quarantined"] == 5 and committed["rows"] == dirty.num_rows - 5
    manifest = json.loads(Path(committed["uri"]).read_text())
    quarantined = pq.read_table(manifest["quarantine"][0]["uri"])
    assert quarantined.column("source_row").to_pylist() == [0, 1, 2, 3, 4]
    assert set(quarantined.column("reason").to_pylist()) == {"null or non-finite feature 'px_10'"}
    assert set(quarantined.column("row_id").to_pylist()) == set(dirty.column("row_id").to_pylist()[:5])


def test_bad_rows_can_be_fatal_naming_file_row_and_reason(trained, tmp_path):
    """With inference.bad_rows=fail the shard fails without retry, naming the file, the row and the reason."""
    config_path, out, model_uri = trained
    config = load_config(config_path, {"inference.bad_rows": "fail"})
    path, _ = _dirty_input(config, tmp_path)
    shard = plan_inference(str(path), rows_per_shard=10_000)[0]
    with pytest.raises(UserError, match=r"5 row\(s\) cannot be scored, first at row 0 .*'px_10'.*bad_rows=fail"):
        infer.score_shard(config, model_uri, shard, str(tmp_path / "fatal_run"))


def test_missing_model_column_names_the_file(trained, tmp_path):
    """Scoring input that lacks a feature the model needs fails naming the file and the column."""
    config_path, out, model_uri = trained
    path = tmp_path / "narrow.parquet"
    pq.write_table(pa.table({"row_id": np.arange(3, dtype=np.int64), "px_00": np.zeros(3)}), path)
    shard = plan_inference(str(path), rows_per_shard=10)[0]
    with pytest.raises(UserError) as caught:
        infer.score_shard(load_config(config_path), model_uri, shard, str(tmp_path / "narrow_run"))
    assert str(path) in str(caught.value) and "px_01" in str(caught.value)


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_a_broken_input_file_is_a_data_error_naming_it(trained, tmp_path, kind):
    """Planning or scoring an empty, non-Parquet, truncated or corrupt input file raises DataError naming the file."""
    from stagewise.core.errors import DataError

    config_path, out, model_uri = trained
    config = load_config(config_path)
    good = storage.list_parquet(storage.resolve(config.storage_root, config.dataset.uri))[0]
    path = str(write_bad_file(kind, tmp_path / "input" / "part-00000.parquet", Path(good).read_bytes()))
    with pytest.raises(DataError) as caught:
        # A file whose footer still reads plans fine; then scoring meets the broken pages.
        for shard in plan_inference(path, rows_per_shard=100):
            infer.score_shard(config, model_uri, shard, str(tmp_path / "broken_run"))
    assert path in str(caught.value) and EXPECTED_WORDING[kind] in str(caught.value)


def test_an_empty_input_file_commits_a_readable_shard(trained, tmp_path):
    """An empty raw file (e.g. an empty Spark partition) scores to a readable, empty prediction file."""
    config_path, out, model_uri = trained
    config = load_config(config_path)
    source = pq.read_table(storage.list_parquet(storage.resolve(config.storage_root, config.dataset.uri))[0])
    path = tmp_path / "raw" / "part-00000.parquet"
    path.parent.mkdir()
    pq.write_table(source.slice(0, 0), path)
    prefix = str(tmp_path / "empty_run")
    shards = plan_inference(str(path.parent), rows_per_shard=100)
    manifest = storage.read_json(commit_predictions(prefix, model_uri, _score_all(config, model_uri, shards, prefix))["uri"])
    assert manifest["rows"] == 0
    for entry in manifest["files"]:
        assert pq.read_table(entry["uri"]).num_rows == 0


def test_rerun_gives_byte_identical_committed_output(trained, tmp_path):
    """Re-running every shard and the commit yields the same bytes in every committed file, and no duplicate row."""
    config_path, out, model_uri = trained
    config = load_config(config_path)
    source = storage.resolve(config.storage_root, config.dataset.uri)
    prefix = str(tmp_path / "rerun")
    shards = plan_inference(source, rows_per_shard=200)
    first = json.loads(Path(commit_predictions(prefix, model_uri, _score_all(config, model_uri, shards, prefix))["uri"]).read_text())
    first_bytes = [Path(entry["uri"]).read_bytes() for entry in first["files"]]
    second = json.loads(Path(commit_predictions(prefix, model_uri, _score_all(config, model_uri, shards, prefix))["uri"]).read_text())
    assert [Path(entry["uri"]).read_bytes() for entry in second["files"]] == first_bytes
    keys = _read(second).column("row_id").to_pylist()
    assert len(keys) == len(set(keys)) == second["rows"]


def test_crash_between_shard_writes_leaves_nothing_half_visible(trained, tmp_path, monkeypatch):
    """Shards written before a crash (and a torn one) are invisible: no manifest; the retry's commit lists only its files."""
    config_path, out, model_uri = trained
    config = load_config(config_path)
    source = storage.resolve(config.storage_root, config.dataset.uri)
    prefix = str(tmp_path / "crashed")
    shards = plan_inference(source, rows_per_shard=200)
    infer.score_shard(config, model_uri, shards[0], prefix)  # one shard done, then the worker dies

    real_prefetch = infer.prefetch

    def dying_after_one_batch(*args, **kwargs):  # the worker is lost (outside the user's code): a fault, retried
        for number, item in enumerate(real_prefetch(*args, **kwargs)):
            if number == 1:
                raise OSError("worker lost mid-shard")
            yield item

    small = load_config(config_path, {"inference.batch_size": 100})
    monkeypatch.setattr(infer, "prefetch", dying_after_one_batch)
    with pytest.raises(OSError):
        infer.score_shard(small, model_uri, shards[1], prefix)  # torn: one batch written, then the crash
    monkeypatch.undo()
    assert not (Path(prefix) / "predictions" / "manifest.json").exists(), "no commit, nothing visible"

    committed = commit_predictions(prefix, model_uri, _score_all(config, model_uri, shards, prefix))
    manifest = json.loads(Path(committed["uri"]).read_text())
    on_disk = {str(p) for p in (Path(prefix) / "predictions").glob("*.parquet")}
    assert on_disk == {entry["uri"] for entry in manifest["files"]}, "leftovers of the crash are gone"
    keys = _read(manifest).column("row_id").to_pylist()
    assert len(keys) == len(set(keys)) == sum(shard["rows"] for shard in shards)


# --- the device path on the CPU ---------------------------------------------------------------------------------


def todays_scores(config, model_uri: str, shard: dict) -> tuple[list, dict[str, np.ndarray]]:
    """The scoring of score_shard before the device path, verbatim: batch by batch, no_grad, float64 normalisation
    rounded to float32; returns (keys, prediction columns) of the scorable rows."""
    from stagewise.datasets.columns import flatten_features
    from stagewise.infer import _row_problems

    bundle = load_bundle(model_uri)
    prep = bundle.preprocessing
    columns, shapes = prep.get("columns") or prep["features"], prep.get("feature_shapes") or {}
    mean, std = np.asarray(prep["mean"]), np.asarray(prep["std"])
    keys, outputs = [], {}
    with storage.open_parquet(shard["uri"]) as parquet:
        for batch in storage.iter_batches(parquet, [prep["key"], *columns], config.inference.batch_size,
                                          shard["row_groups"], uri=shard["uri"]):
            matrix = flatten_features(batch, columns, shapes, shard["uri"])
            valid = _row_problems(batch, prep["key"], prep["features"], matrix) == ""
            with torch.no_grad():
                scaled = torch.from_numpy(((matrix[valid] - mean) / std).astype(np.float32))
                inputs = bundle.spec.batch(scaled, torch.zeros(len(scaled), dtype=torch.int64))[0]
                predicted = bundle.spec.predict(bundle.module(inputs))
            keys += batch.column(prep["key"]).filter(pa.array(valid)).to_pylist()
            for name, tensor in predicted.items():
                outputs.setdefault(name, []).append(tensor.numpy())
    return keys, {name: np.concatenate(parts) for name, parts in outputs.items()}


def test_device_path_on_the_cpu_gives_todays_predictions_exactly(trained, tmp_path):
    """Chunked prefetch with device cpu (several chunks, some rows quarantined) writes bit for bit the keys,
    classes and probabilities that scoring wrote before the device path existed."""
    config_path, _, model_uri = trained
    config = load_config(config_path, {"inference.batch_size": 128})
    path, _ = _dirty_input(config, tmp_path)
    shard = plan_inference(str(path), rows_per_shard=10_000)[0]
    result = infer.score_shard(config, model_uri, shard, str(tmp_path / "device_cpu"))
    assert result["rows_quarantined"] == 5 and result["rows"] > 2 * 128, "several chunks, some rows left out"
    scored = pq.read_table(result["uri"])
    keys, expected = todays_scores(config, model_uri, shard)
    assert scored.column("row_id").to_pylist() == keys
    assert np.array_equal(scored.column("prediction").to_numpy(), expected["prediction"])
    probabilities = np.stack(scored.column("probabilities").to_numpy(zero_copy_only=False))
    assert probabilities.dtype == expected["probabilities"].dtype and np.array_equal(probabilities, expected["probabilities"])


# --- the pipeline: reading, preparation, the model and writing overlap in threads --------------------------------


def _scattered_dirty_input(config, tmp_path) -> str:
    """The digits as one file of 300-row row groups, with unscorable rows in several groups: NaN or inf features
    (the first and last row, across a group boundary) and a null key."""
    source = pa.concat_tables([pq.read_table(uri) for uri in
                               storage.list_parquet(storage.resolve(config.storage_root, config.dataset.uri))])
    px = source.column("px_10").to_numpy().copy()
    px[[0, 299, 300, 301, 950, source.num_rows - 1]] = [np.nan, np.nan, np.inf, np.nan, -np.inf, np.nan]
    keys = source.column("row_id").to_numpy()
    dirty = source.set_column(source.column_names.index("px_10"), "px_10", pa.array(px))
    dirty = dirty.set_column(dirty.column_names.index("row_id"), "row_id",
                             pa.array(keys, mask=np.arange(len(keys)) == 600))
    path = tmp_path / "scattered" / "part-00000.parquet"
    path.parent.mkdir()
    pq.write_table(dirty, path, row_group_size=300)
    return str(path)


def one_chunk_after_another(config, model_uri: str, shard: dict) -> tuple[list, dict[str, np.ndarray], list[dict]]:
    """Straightforward scoring of a shard in one thread, batch after batch (the rows' checks, the bundle's
    normalisation in float64 rounded to float32, the model, its prediction columns); returns (keys, prediction
    columns) of the scorable rows and the quarantine rows {key, reason, source_uri, source_row}."""
    from stagewise.datasets.columns import flatten_features
    from stagewise.infer import _row_problems

    bundle = load_bundle(model_uri)
    prep = bundle.preprocessing
    mean, std = np.asarray(prep["mean"]), np.asarray(prep["std"])
    keys, outputs, quarantined, offset = [], {}, [], 0
    with storage.open_parquet(shard["uri"]) as parquet:
        for batch in storage.iter_batches(parquet, [prep["key"], *prep["features"]], config.inference.batch_size,
                                          shard["row_groups"], uri=shard["uri"]):
            matrix = flatten_features(batch, prep["features"], {}, shard["uri"])
            reasons = _row_problems(batch, prep["key"], prep["features"], matrix)
            batch_keys = batch.column(prep["key"]).to_pylist()
            for row in np.flatnonzero(reasons != ""):
                quarantined.append({"row_id": batch_keys[row], "reason": reasons[row], "source_uri": shard["uri"],
                                    "source_row": offset + int(row)})
            valid = reasons == ""
            with torch.no_grad():
                scaled = torch.from_numpy(((matrix[valid] - mean) / std).astype(np.float32))
                predicted = bundle.spec.predict(bundle.module(scaled))
            keys += [k for k, ok in zip(batch_keys, valid) if ok]
            for name, tensor in predicted.items():
                outputs.setdefault(name, []).append(tensor.numpy())
            offset += batch.num_rows
    return keys, {name: np.concatenate(parts) for name, parts in outputs.items()}, quarantined


def _scored_files(result: dict) -> pa.Table:
    """A shard's predictions: its files read in the order its result lists them."""
    assert [f["uri"] for f in result["files"]][0] == result["uri"]
    return pa.concat_tables([pq.read_table(f["uri"]) for f in result["files"]])


def _quarantined_files(result: dict) -> list[dict]:
    return [row for f in result.get("quarantine_files", []) for row in pq.read_table(f["uri"]).to_pylist()]


@pytest.mark.parametrize("threads,batch_size,group_rows,file_rows,files",
                         [(1, 128, 65_536, 262_144, [1, 1]), (3, 128, 500, 262_144, [1, 1]),
                          (2, 1000, 700, 262_144, [1, 1]),
                          # several output files per shard, written by as many threads (a file per 300 rows at most)
                          (1, 128, 200, 300, [2, 2]), (3, 100, 65_536, 300, [3, 3]), (4, 1000, 250, 300, [4, 3])])
def test_pipelined_scoring_writes_what_one_chunk_after_another_writes(trained, tmp_path, monkeypatch, threads,
                                                                      batch_size, group_rows, file_rows, files):
    """The pipeline (reader thread, `threads` preparing threads, writer thread; output row groups coalesced; a shard
    of at least 2 x OUTPUT_FILE_ROWS rows cut into contiguous parts, each with its own threads and file) writes the
    same rows in the same order (read file after file as the result lists them), bit for bit the same classes and
    probabilities, the same version and the same quarantine (rows, reasons, shard rows) as straightforward scoring
    in one thread, for a whole file and for a shard of some of its row groups; a re-run writes the same bytes."""
    config_path, _, model_uri = trained
    config = load_config(config_path, {"inference.batch_size": batch_size, "profiles.small.threads_per_process": threads})
    monkeypatch.setattr(infer, "OUTPUT_ROW_GROUP_ROWS", group_rows)
    monkeypatch.setattr(infer, "OUTPUT_FILE_ROWS", file_rows)
    path = _scattered_dirty_input(config, tmp_path)
    whole = plan_inference(path, rows_per_shard=10_000)[0]
    assert len(whole["row_groups"]) == 6
    for shard, count in zip((whole, {"index": 1, "uri": path, "row_groups": [1, 2, 3]}), files):
        result = infer.score_shard(config, model_uri, shard, str(tmp_path / "scored"))
        keys, expected, quarantined = one_chunk_after_another(config, model_uri, shard)
        assert len(result["files"]) == count
        scored = _scored_files(result)
        assert result["rows"] == scored.num_rows == sum(f["rows"] for f in result["files"]) == len(keys) > 0
        assert scored.column("row_id").to_pylist() == keys
        assert np.array_equal(scored.column("prediction").to_numpy(), expected["prediction"])
        probabilities = np.stack(scored.column("probabilities").to_numpy(zero_copy_only=False))
        assert probabilities.dtype == np.float32 and np.array_equal(probabilities, expected["probabilities"])
        assert set(scored.column("model_version").to_pylist()) == {load_bundle(model_uri).version}
        assert result["rows_quarantined"] == len(quarantined) > 0
        assert result["quarantine_uri"] == result["quarantine_files"][0]["uri"]
        assert sum(f["rows"] for f in result["quarantine_files"]) == result["rows_quarantined"]
        assert _quarantined_files(result) == quarantined
        for entry in result["files"]:
            metadata = pq.ParquetFile(entry["uri"]).metadata
            groups = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
            assert sum(groups) == entry["rows"] > 0 and all(rows >= group_rows for rows in groups[:-1]), groups
        again = infer.score_shard(config, model_uri, shard, str(tmp_path / "again"))
        assert [Path(f["uri"]).read_bytes() for f in again["files"]] == [Path(f["uri"]).read_bytes() for f in result["files"]]
        assert [Path(f["uri"]).read_bytes() for f in again["quarantine_files"]] == [
            Path(f["uri"]).read_bytes() for f in result["quarantine_files"]]
        assert not {f["uri"] for f in again["files"]} & {f["uri"] for f in result["files"]}, "attempt-unique files"
    reasons = {row["reason"] for row in one_chunk_after_another(config, model_uri, whole)[2]}
    assert reasons == {"null key", "null or non-finite feature 'px_10'"}


def test_output_parts_split_only_large_shards_into_contiguous_parts_of_about_equal_rows():
    """One part (one file) below 2 x OUTPUT_FILE_ROWS rows; above, at most `writers` contiguous runs of whole row
    groups covering each group once in order, none empty, no more than leaves OUTPUT_FILE_ROWS rows each."""
    file_rows = infer.OUTPUT_FILE_ROWS
    assert infer.output_parts([], 4) == [range(0)]
    assert infer.output_parts([65_536] * 7, 4) == [range(7)], "458,752 rows < 2 x 262,144: one file"
    assert infer.output_parts([2 * file_rows], 4) == [range(1)], "a row group is never split"
    assert infer.output_parts([65_536] * 8, 4) == [range(0, 4), range(4, 8)]
    assert infer.output_parts([65_536] * 31, 4) == [range(0, 8), range(8, 16), range(16, 24), range(24, 31)]
    assert infer.output_parts([65_536] * 31, 2) == [range(0, 16), range(16, 31)]
    for sizes in ([65_536] * 31, [300_000, 10, 10, 600_000, 5, 400_000], [1_000_000, 1, 1], [131_072] * 9 + [7]):
        for writers in (2, 3, 4, 8):
            parts = infer.output_parts(sizes, writers)
            assert parts == infer.output_parts(sizes, writers)
            assert [g for part in parts for g in part] == list(range(len(sizes))) and all(len(part) for part in parts)
            assert len(parts) <= min(writers, sum(sizes) // file_rows)


def test_a_multi_file_shard_commits_all_its_files_in_order_and_a_retry_leaves_no_duplicate(trained, tmp_path,
                                                                                          monkeypatch):
    """Shards written as several files: the manifest lists every file (and quarantine file) of every shard, by shard
    then part, so reading them in the listed order gives the rows of the single-file scoring in the same order; a
    retried shard's commit lists only the retry's files, none of the first attempt's stay, no row twice."""
    config_path, _, model_uri = trained
    config = load_config(config_path, {"inference.batch_size": 128, "profiles.small.threads_per_process": 3})
    path = _scattered_dirty_input(config, tmp_path)
    shards = [{"index": 0, "uri": path, "row_groups": [0, 1, 2]}, {"index": 1, "uri": path, "row_groups": [3, 4, 5]}]
    single = _read(storage.read_json(commit_predictions(str(tmp_path / "single"), model_uri, _score_all(
        config, model_uri, shards, str(tmp_path / "single")))["uri"]))
    monkeypatch.setattr(infer, "OUTPUT_FILE_ROWS", 300)
    prefix = str(tmp_path / "multi")
    results = _score_all(config, model_uri, shards, prefix)
    assert [len(r["files"]) for r in results] == [3, 2], "900 rows: 3 files of 300; 897 rows: 2 files"
    first = storage.read_json(commit_predictions(prefix, model_uri, results)["uri"])
    assert [(f["uri"], f["rows"]) for f in first["files"]] == [(f["uri"], f["rows"]) for r in results for f in r["files"]]
    assert [f["shard"] for f in first["files"]] == [0, 0, 0, 1, 1]
    assert [q["uri"] for q in first["quarantine"]] == [q["uri"] for r in results for q in r["quarantine_files"]]
    assert sum(q["rows"] for q in first["quarantine"]) == first["rows_quarantined"] == 7
    assert _read(first).equals(single)
    results[1] = infer.score_shard(config, model_uri, shards[1], prefix)  # the retry of shard 1
    second = storage.read_json(commit_predictions(prefix, model_uri, results)["uri"])
    assert _read(second).equals(single) and second["rows"] == first["rows"] == single.num_rows
    listed = {f["uri"] for f in second["files"]} | {q["uri"] for q in second["quarantine"]}
    on_disk = {str(p) for p in (Path(prefix) / "predictions").rglob("*.parquet")}
    assert on_disk == listed and len(listed) == len(second["files"]) + len(second["quarantine"])


def test_commit_takes_a_shard_result_from_before_multi_file_shards():
    """A shard result with only `uri` (and `quarantine_uri`) commits as one file, as before."""
    old = {"index": 0, "uri": "/x/predictions/part-00000-a.parquet", "rows": 5, "rows_quarantined": 1,
           "quarantine_uri": "/x/predictions/quarantine/part-00000-a.parquet"}
    from stagewise.datasets.predictions import shard_files, shard_quarantine

    assert shard_files(old) == [{"uri": old["uri"], "rows": 5}]
    assert shard_quarantine(old) == [{"uri": old["quarantine_uri"], "rows": 1}]
    assert shard_quarantine({"index": 1, "uri": "u", "rows": 2, "rows_quarantined": 0}) == []


def _pipeline_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("infer-")]


@pytest.mark.parametrize("file_rows", [262_144, 300])
def test_a_failing_write_fails_the_shard_and_stops_every_pipeline_thread(trained, tmp_path, monkeypatch, file_rows):
    """An error in a writer thread (a full disk) is raised by score_shard as it was; the reader, preparing and
    writer threads (of every part, where the shard is written as several files) are gone afterwards, and the shard
    is not committed."""
    config_path, _, model_uri = trained
    config = load_config(config_path, {"inference.batch_size": 64, "profiles.small.threads_per_process": 2})
    monkeypatch.setattr(infer, "OUTPUT_ROW_GROUP_ROWS", 128)
    monkeypatch.setattr(infer, "OUTPUT_FILE_ROWS", file_rows)
    real_write = pq.ParquetWriter.write_table
    calls = {"n": 0}

    def full_disk(self, table, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 2:
            raise OSError(28, "No space left on device")
        return real_write(self, table, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetWriter, "write_table", full_disk)
    shard = plan_inference(storage.resolve(config.storage_root, config.dataset.uri), rows_per_shard=10_000)[0]
    with pytest.raises(OSError, match="No space left"):
        infer.score_shard(config, model_uri, shard, str(tmp_path / "full"))
    assert _pipeline_threads() == []
    assert not (tmp_path / "full" / "predictions" / "manifest.json").exists()


def test_a_failing_model_stops_every_pipeline_thread(trained, tmp_path, monkeypatch):
    """An error of the model (in the calling thread: the spec's predict, so a user error naming it) mid-shard leaves
    no reader, preparing or writer thread behind, also when the reader is far ahead (small batches, many row groups)."""
    config_path, _, model_uri = trained
    config = load_config(config_path, {"inference.batch_size": 16, "profiles.small.threads_per_process": 2})
    real_softmax, calls = torch.softmax, {"n": 0}

    def dying_softmax(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 3:
            raise RuntimeError("the model broke")
        return real_softmax(*args, **kwargs)

    monkeypatch.setattr(torch, "softmax", dying_softmax)
    shard = plan_inference(storage.resolve(config.storage_root, config.dataset.uri), rows_per_shard=10_000)[0]
    with pytest.raises(HookError, match=r"MLPClassifier\.predict .*RuntimeError: the model broke"):
        infer.score_shard(config, model_uri, shard, str(tmp_path / "broken_model"))
    assert _pipeline_threads() == []


@pytest.mark.parametrize("file_rows", [262_144, 300])
def test_bad_rows_fail_names_the_first_bad_row_of_the_shard_with_several_preparing_threads(trained, tmp_path,
                                                                                          monkeypatch, file_rows):
    """With inference.bad_rows=fail and chunks prepared in parallel (in one part, or in four parts of the shard
    with their own threads), the error names the shard's first bad row even when a later chunk with bad rows is
    prepared first (the order decides, not the threads' timing), and no pipeline thread is left."""
    config_path, _, model_uri = trained
    config = load_config(config_path, {"inference.bad_rows": "fail", "inference.batch_size": 100,
                                       "profiles.small.threads_per_process": 4})
    monkeypatch.setattr(infer, "OUTPUT_FILE_ROWS", file_rows)
    path = _scattered_dirty_input(config, tmp_path)
    real_flatten = infer.flatten_features

    def slow_first_chunk(batch, *args):
        if batch.column("row_id")[0].as_py() == 300:
            time.sleep(0.3)  # the chunks after it, the null key at shard row 300 among them, finish first
        return real_flatten(batch, *args)

    monkeypatch.setattr(infer, "flatten_features", slow_first_chunk)
    shard = {"index": 0, "uri": path, "row_groups": [1, 2, 3, 4, 5]}
    with pytest.raises(UserError, match=r"2 row\(s\) cannot be scored, first at row 0 \(key 300\): null or "
                                        r"non-finite feature 'px_10' \(inference.bad_rows=fail\)"):
        infer.score_shard(config, model_uri, shard, str(tmp_path / "fatal"))
    assert _pipeline_threads() == []


def test_read_ahead_keeps_order_reads_at_most_depth_ahead_raises_in_place_and_stops_on_close():
    """Items come in order; the thread is never more than depth (+ the one it holds) ahead of the consumer; an
    error of the source comes after the items before it; closing early stops and joins the thread."""
    import threading

    pulled = []

    def source(n, fail_at=None):
        for index in range(n):
            if index == fail_at:
                raise ValueError(f"bad item {index}")
            pulled.append(index)
            yield index

    seen = []
    for item in read_ahead(source(20), depth=2):
        time.sleep(0.002)
        assert pulled[-1] - item <= 3
        seen.append(item)
    assert seen == list(range(20))
    got = []
    with pytest.raises(ValueError, match="bad item 5"):
        for item in read_ahead(source(10, fail_at=5), depth=2):
            got.append(item)
    assert got == [0, 1, 2, 3, 4]
    before = threading.active_count()
    reader = read_ahead(source(1000), depth=2, name="test-read")
    assert next(reader) == 0
    reader.close()
    assert threading.active_count() <= before and not [t for t in threading.enumerate() if t.name == "test-read"]


def test_interleave_takes_each_stream_in_turn_and_raises_the_first_streams_error_whatever_fails_first():
    """Items of each stream in order, one of each stream in turn; when a later stream fails before an earlier one,
    the earlier streams are drained (nothing more yielded) and the earliest stream's error is raised, as one stream
    over the same items in order would; a stream after the failed one is not read further."""
    from stagewise.models.scoring import interleave

    streams = [iter([1, 2, 3]), iter([10]), iter([]), iter([20, 21])]
    assert list(interleave(streams)) == [(0, 1), (1, 10), (3, 20), (0, 2), (3, 21), (0, 3)]

    pulled = []

    def stream(name, values, fail_at=None):
        for index, value in enumerate(values):
            if index == fail_at:
                raise ValueError(name)
            pulled.append((name, value))
            yield value

    seen = []
    with pytest.raises(ValueError, match="^first$"):
        for item in interleave([stream("first", [1, 2, 3], fail_at=2), stream("second", [4, 5], fail_at=0),
                                stream("third", [6, 7, 8])]):
            seen.append(item)
    assert seen == [(0, 1)], "nothing after the second stream failed"
    assert ("first", 2) in pulled and ("third", 7) not in pulled
    with pytest.raises(ValueError, match="^second$"):
        list(interleave([stream("first", [1]), stream("second", [2, 3], fail_at=1), stream("third", [4], fail_at=0)]))


def test_ordered_map_yields_in_input_order_whatever_finishes_first_and_raises_in_place():
    """Results follow the input order though later items finish first; at most depth items are in flight; an
    error is raised at its item, after the results before it; the threads are joined."""
    import random
    import threading

    rng = random.Random(0)
    delays = [rng.uniform(0, 0.004) for _ in range(40)]
    running, most = [0], [0]
    lock = threading.Lock()

    def work(index):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(delays[index])
        with lock:
            running[0] -= 1
        if index == 33:
            raise KeyError("item 33")
        return index * index

    got = []
    with pytest.raises(KeyError, match="item 33"):
        for value in ordered_map(work, range(40), workers=4, depth=6, name="test-map"):
            got.append(value)
    assert got == [i * i for i in range(33)]
    assert most[0] <= 4
    assert not [t for t in threading.enumerate() if t.name.startswith("test-map")]


def test_serial_writer_runs_calls_in_order_bounds_what_waits_and_surfaces_an_error():
    """Calls run one at a time in submission order; submit blocks beyond depth outstanding; a failed call's error
    is raised by a later submit or by finish; close joins the thread."""
    import threading

    done, outstanding = [], []
    writer = SerialWriter(depth=2, name="test-write")
    try:
        for index in range(10):
            writer.submit(lambda i=index: (time.sleep(0.001), done.append(i)))
            outstanding.append(len(writer._pending))
        writer.finish()
    finally:
        writer.close()
    assert done == list(range(10)) and max(outstanding) <= 2
    failing = SerialWriter(depth=2, name="test-write")

    def boom():
        raise OSError("disk full")

    try:
        failing.submit(boom)
        with pytest.raises(OSError, match="disk full"):
            for _ in range(5):
                failing.submit(lambda: None)
            failing.finish()
    finally:
        failing.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("test-write")]


def test_prefetch_on_the_cpu_hands_over_every_chunk_in_order_and_reads_ahead_by_at_most_one():
    """prefetch keeps order and content (tensors and tuples of them) and pulls a chunk only when it is asked for."""
    pulled = []

    def chunks():
        for index in range(4):
            pulled.append(index)
            yield index, (torch.full((3, 2), float(index)), torch.arange(3) + index)

    seen = []
    for meta, (features, labels) in prefetch(chunks(), torch.device("cpu")):
        assert pulled[-1] == meta, "no chunk is read before the previous one was handed over"
        seen.append(meta)
        assert torch.equal(features, torch.full((3, 2), float(meta))) and torch.equal(labels, torch.arange(3) + meta)
    assert seen == [0, 1, 2, 3]


def test_prefetch_on_cuda_pins_copies_on_a_side_stream_and_hands_over_safely(monkeypatch):
    """The CUDA branch with CPU tensors standing in (fake streams record what happens): each chunk is pinned and copied
    non_blocking inside the side stream; the consumer's stream waits for that stream and record_stream()s each tensor
    before the chunk is handed over; a chunk is read and copied only after the previous one was handed over (so its
    copy overlaps the consumer's work on it); order and content are kept."""
    events = []

    class FakeStream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            events.append(("wait", self.name, other.name))

    side, current, active = FakeStream("side"), FakeStream("current"), []

    class Entered:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            active.append(self.stream.name)

        def __exit__(self, *exc):
            active.pop()

    real_to = torch.Tensor.to

    def fake_to(self, *args, **kwargs):
        if args and isinstance(args[0], torch.device) and args[0].type == "cuda":
            events.append(("copy", active[-1] if active else None, kwargs.get("non_blocking", False)))
            return self.clone()
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: side)
    monkeypatch.setattr(torch.cuda, "stream", Entered)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: False)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: events.append(("pin",)) or self.clone())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: events.append(("record", stream.name)))
    monkeypatch.setattr(torch.Tensor, "to", fake_to)

    def chunks():
        for index in range(3):
            events.append(("read", index))
            yield index, (torch.full((2, 2), float(index)), torch.arange(2) + index)

    for meta, (features, labels) in prefetch(chunks(), torch.device("cuda")):
        events.append(("got", meta))
        assert torch.equal(features, torch.full((2, 2), float(meta))) and torch.equal(labels, torch.arange(2) + meta)
    one_chunk = [("pin",), ("copy", "side", True), ("pin",), ("copy", "side", True), ("wait", "current", "side"),
                 ("record", "current"), ("record", "current")]
    assert events == [e for i in range(3) for e in [("read", i), *one_chunk, ("got", i)]]


def test_scoring_device_follows_the_profile(monkeypatch):
    """cpu stays cpu, auto is cuda only where CUDA is present, and cuda without a GPU is a user error saying so."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert scoring_device("cpu").type == "cpu" and scoring_device("auto").type == "cpu"
    with pytest.raises(UserError, match="device 'cuda' but no CUDA device is visible"):
        scoring_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert scoring_device("auto").type == "cuda" and scoring_device("cpu").type == "cpu"


def test_scoring_on_cuda_turns_tf32_off_and_restores_the_switches_after():
    """Inside exact_float32 on a cuda device, matmul/conv use full float32 (the stated CPU/GPU tolerance depends on it);
    the previous settings come back afterwards, even after an error; on the CPU nothing changes."""
    switches = [torch.backends.cuda.matmul, torch.backends.cudnn.conv]
    before = [s.fp32_precision for s in switches]
    with pytest.raises(RuntimeError, match="inside"):
        with exact_float32(torch.device("cuda")):
            assert [s.fp32_precision for s in switches] == ["ieee", "ieee"]
            raise RuntimeError("inside")
    assert [s.fp32_precision for s in switches] == before
    with exact_float32(torch.device("cpu")):
        assert [s.fp32_precision for s in switches] == before


def test_a_cuda_inference_profile_without_a_gpu_fails_naming_the_device(trained, tmp_path, monkeypatch):
    """A shard on a cuda profile where no GPU is visible fails as a user error, and writes nothing."""
    config_path, _, model_uri = trained
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = load_config(config_path, {"profiles.small.device": "cuda"})
    shard = plan_inference(storage.resolve(config.storage_root, config.dataset.uri), rows_per_shard=500)[0]
    with pytest.raises(UserError, match="no CUDA device"):
        infer.score_shard(config, model_uri, shard, str(tmp_path / "no_gpu"))
    assert not (tmp_path / "no_gpu").exists()


# --- a float target ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def diabetes(tmp_path_factory):
    """The diabetes data preprocessed under a Regressor config (rmse, minimised); returns (config path, run prefix)."""
    root = tmp_path_factory.mktemp("diabetes")
    config_path = root / "pipeline.yaml"
    config_path.write_text(yaml.safe_dump(diabetes_config(root)))
    out = str(root / "runs" / "test" / "diabetes")
    preprocess_digits(config_path, out)  # writes the config's demo_data: here the diabetes
    return config_path, out


def _mean_regressor(config_path: Path, out: str, path: Path) -> str:
    """A DiabetesMLP bundle whose output is always 0: it predicts the data set's mean target for every row."""
    from stagewise.examples.diabetes import DiabetesMLP

    manifest = read_manifest(storage.join(out, "preprocess", "manifest.json"))
    params = {"hidden": 4, "dropout": 0.0}
    model = build(DiabetesMLP(), data_info(manifest), params)
    with torch.no_grad():
        model[-1].weight.zero_()
        model[-1].bias.zero_()
    uri = str(path / "mean.pt")
    save_bundle(uri, model, SpecRef("stagewise.examples.diabetes:DiabetesMLP"), data_info(manifest), params, preprocessing_of(manifest), {})
    return uri


def test_evaluate_a_regressor_reports_rmse_mae_and_the_mean_baseline(diabetes, tmp_path):
    """For a float target: test_rmse/test_mae in the target's units, no per-class accuracy, and test_baseline_rmse,
    the RMSE of predicting the manifest's mean target, which a model predicting that mean matches exactly."""
    config_path, out = diabetes
    metrics = evaluate(load_config(config_path), _mean_regressor(config_path, out, tmp_path), out)
    manifest = read_manifest(storage.join(out, "preprocess", "manifest.json"))
    _, labels = load_split(manifest, "test")
    expected = float(np.sqrt(np.mean((labels.astype(np.float64) - manifest["target"]["mean"]) ** 2)))
    assert metrics["test_baseline_rmse"] == pytest.approx(expected, rel=1e-9)
    assert metrics["test_rmse"] == pytest.approx(expected, rel=1e-5) == metrics["test_objective"]
    assert 20 < metrics["test_mae"] < metrics["test_rmse"]
    written = storage.read_json(metrics["metrics_uri"])
    assert "per_class_accuracy" not in written and "test_accuracy" not in written


@pytest.mark.parametrize("limit,fails", [(10.0, True), (500.0, False)])
def test_objective_limit_fails_a_minimised_objective_above_it(diabetes, tmp_path, limit, fails):
    """evaluate.objective_limit is read in objective.direction: with rmse minimised, a test RMSE above it fails."""
    config_path, out = diabetes
    config = load_config(config_path, {"evaluate.objective_limit": limit})
    model_uri = _mean_regressor(config_path, out, tmp_path)
    if fails:
        with pytest.raises(UserError, match=r"test_rmse .* is worse than evaluate.objective_limit=10.0 .*minimize"):
            evaluate(config, model_uri, out)
    else:
        assert evaluate(config, model_uri, out)["test_rmse"] < limit


def test_objective_limit_of_a_maximised_accuracy(trained, tmp_path):
    """With accuracy maximised, a test accuracy below objective_limit fails; min_test_accuracy keeps working too."""
    config_path, out, model_uri = trained
    with pytest.raises(UserError, match=r"test_accuracy .* is worse than evaluate.objective_limit=1.0"):
        evaluate(load_config(config_path, {"evaluate.objective_limit": 1.0}), model_uri, out)  # 2 epochs: not perfect
    assert evaluate(load_config(config_path, {"evaluate.objective_limit": 0.1}), model_uri, out)["test_accuracy"] > 0.1


def test_inference_of_a_regressor_writes_float_predictions(diabetes, tmp_path):
    """Scoring raw diabetes rows with a Regressor bundle writes one float32 prediction per row, in the target's units."""
    config_path, out = diabetes
    config = load_config(config_path)
    model_uri = _mean_regressor(config_path, out, tmp_path)
    shard = plan_inference(storage.resolve(config.storage_root, config.dataset.uri), 10_000)[0]
    table = pq.read_table(infer.score_shard(config, model_uri, shard, str(tmp_path / "scored"))["uri"])
    manifest = read_manifest(storage.join(out, "preprocess", "manifest.json"))
    assert table.schema.field("prediction").type == pa.float32() and table.num_rows == shard["rows"]
    np.testing.assert_allclose(table.column("prediction").to_numpy(), manifest["target"]["mean"], rtol=1e-6)


def test_a_predict_hook_that_raises_while_scoring_is_a_user_error_naming_it(trained, tmp_path, monkeypatch):
    """A user's predict() raising on a real batch (the one-row probe passed) ends the shard sub-job with the user-error
    exit (no retry), its error file naming the spec, the hook, the file and line; nothing is committed (the attempt's
    own part file is listed by no manifest, and the next commit removes it)."""
    from stagewise.core import contract
    from stagewise.core.errors import USER_ERROR_EXIT

    config_path, out, model_uri = trained
    bundle = load_bundle(model_uri)
    failing = str(tmp_path / "predict-fails.pt")
    save_bundle(failing, bundle.module, SpecRef("tests.specs:PredictFailsOnBatches"), bundle.data, bundle.params,
                bundle.preprocessing, {})
    config = load_config(config_path)
    [shard, *_] = plan_inference(storage.resolve(config.storage_root, config.dataset.uri),
                                 rows_per_shard=config.inference.rows_per_shard)
    scored_out = str(tmp_path / "run")
    error_file = tmp_path / "user_error.txt"
    monkeypatch.setenv(contract.ERROR_FILE, str(error_file))
    with pytest.raises(SystemExit) as exited:
        infer.main(["shard", "--config", str(config_path), "--model", failing, "--out", scored_out,
                    "--shard", json.dumps(shard)])
    assert exited.value.code == USER_ERROR_EXIT
    written = error_file.read_text()
    assert "PredictFailsOnBatches.predict (" in written and "tests/specs.py:" in written
    assert "KeyError: 'calibration'" in written
    assert not list(Path(scored_out).rglob("manifest.json"))
