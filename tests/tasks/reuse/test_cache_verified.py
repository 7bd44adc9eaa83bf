"""The cross-run cache serves an output only while its bytes are those recorded when it committed, and only from a
run of this pipeline under this storage root: a tampered output or a forged entry is a miss with one warning naming
the file and why, and the work is done again."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stagewise import preprocess
from stagewise.core import storage
from stagewise.definitions.loading import load_config
from stagewise.reuse import cache
from tests.conftest import base_config, preprocess_digits

SOURCE = "ml_pipeline/r1"


def _config(write_config, storage_root):
    raw = base_config(storage_root)
    raw.update({"cache": True, "name": "ml"})
    path = write_config(raw, "ml.yaml")
    return path, load_config(path)


def _out(storage_root: Path, run: str) -> str:
    return storage.run_prefix(str(storage_root), "ml_pipeline", run)


@pytest.fixture
def committed(write_config, storage_root):
    """The digits preprocessed by run r1 under its inputs' fingerprint and remembered: (config, raw URI, result)."""
    path, config = _config(write_config, storage_root)
    out = _out(storage_root, "r1")
    stats_uri = preprocess_digits(path, out)["manifest_uri"].replace("manifest", "stats")
    raw = storage.resolve(config.storage_root, config.dataset.uri)
    planned = preprocess.plan_run(config, raw, out, SOURCE)
    results = [preprocess.transform_shard(config, shard, i, out, stats_uri) for i, shard in enumerate(planned["shards"])]
    result = preprocess.commit(config, out, stats_uri, results, planned["fingerprint"])
    cache.remember(config, "preprocess", result["fingerprint"], SOURCE, result)
    return config, raw, result


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "stagewise.reuse" and r.levelno >= logging.WARNING]


def test_preprocess_cache_tampered_output_misses(committed, storage_root, caplog):
    """The issue's case: a cached split copy whose train labels were shuffled after it committed (valid Parquet, same
    rows and schema) is not served; one warning names the file and says its content changed; preprocess runs again."""
    config, raw, result = committed
    assert preprocess.plan_run(config, raw, _out(storage_root, "r2"), "ml_pipeline/r2")["reused_from"] == SOURCE
    train = storage.read_json(result["manifest_uri"])["splits"]["train"][0]["uri"]
    table = pq.read_table(train)
    label = config.dataset.label
    shuffled = np.random.default_rng(0).permutation(table.column(label).to_numpy())
    pq.write_table(table.set_column(table.schema.get_field_index(label), table.schema.field(label),
                                    pa.array(shuffled, table.schema.field(label).type)), train)
    assert pq.read_table(train).schema == table.schema and pq.read_table(train).num_rows == table.num_rows
    caplog.set_level(logging.INFO, logger="stagewise.reuse")
    caplog.clear()  # r2's reuse above is not this lookup's
    planned = preprocess.plan_run(config, raw, _out(storage_root, "r3"), "ml_pipeline/r3")
    assert planned["reused_from"] is None
    assert not storage.exists(storage.join(_out(storage_root, "r3"), "preprocess", "manifest.json"))
    warned = _warnings(caplog)
    assert len(warned) == 1 and train in warned[0] and "content changed since it committed" in warned[0], warned
    assert not any("reused from" in r.getMessage() for r in caplog.records)


def _stage_outputs(stage: Path, fingerprint: str) -> dict:
    optimizer = stage / "final-optimizer-abc.dcp"
    optimizer.mkdir(parents=True)
    (optimizer / ".metadata").write_bytes(b"metadata")
    (optimizer / "__0_0.distcp").write_bytes(b"shard")
    for name in ("final.pt", "model.pt"):
        (stage / name).write_bytes(b"weights" * 100)
    storage.write_json(str(stage / "metrics.json"), {"complete": True, "fingerprint": fingerprint})
    return {"checkpoint_uri": str(stage / "final.pt"), "model_uri": str(stage / "model.pt"),
            "optimizer_uri": str(optimizer)}


def _outputs(kind: str, run: Path, fingerprint: str) -> tuple[dict, object, Path]:
    """A small committed output of ``kind`` in ``run``'s folder: (its result, the lookup's check, the file to alter)."""
    if kind == "stage":
        result = _stage_outputs(run / "train" / "s1", fingerprint)
        return result, lambda r: cache.stage_problem(r, fingerprint), run / "train" / "s1" / "model.pt"
    if kind == "inference":
        part = run / "predictions" / "part-00000-abc.parquet"
        part.parent.mkdir(parents=True)
        pq.write_table(pa.table({"row_id": [1, 2], "prediction": [0, 1]}), part)
        manifest = run / "predictions" / "manifest.json"
        storage.write_json(str(manifest), {"kind": "predictions", "files": [{"uri": str(part), "rows": 2}],
                                           "quarantine": [], "rows": 2, "rows_quarantined": 0, "fingerprint": fingerprint})
        return {"uri": str(manifest), "rows": 2}, lambda r: cache.manifest_problem(r.get("uri"), fingerprint), part
    record = run / ("sweep/summary.json" if kind == "sweep" else "test/metrics.json")
    key = "summary_uri" if kind == "sweep" else "metrics_uri"
    storage.write_json(str(record), {"fingerprint": fingerprint, "best_value": 0.9, "test_accuracy": 0.9})
    return {key: str(record)}, lambda r: cache.record_problem(r.get(key), fingerprint), record


@pytest.mark.parametrize("kind", ["sweep", "stage", "evaluate", "inference"])
def test_every_kind_cache_tampered_output_misses(write_config, storage_root, caplog, kind):
    """Whatever the kind, an output altered after it committed (its own fingerprint kept where it records one) is not
    served, with one warning naming it; the untouched entry was served before."""
    _, config = _config(write_config, storage_root)
    result, check, altered = _outputs(kind, Path(_out(storage_root, "r1")), "f1")
    cache.remember(config, kind, "f1", SOURCE, result)
    assert cache.lookup(config, kind, "f1", "ml_pipeline/r2", check)["reused_from"] == SOURCE
    if altered.suffix == ".json":
        storage.write_json(str(altered), {**storage.read_json(str(altered)), "best_value": 0.1, "test_accuracy": 0.1})
    elif altered.suffix == ".parquet":
        pq.write_table(pa.table({"row_id": [1, 2], "prediction": [1, 0]}), altered)
    else:
        altered.write_bytes(b"WEIGHTS" * 100)  # same size, other bytes
    caplog.set_level(logging.INFO, logger="stagewise.reuse")
    assert cache.lookup(config, kind, "f1", "ml_pipeline/r2", check) is None
    warned = _warnings(caplog)
    assert len(warned) == 1 and str(altered) in warned[0] and "content changed" in warned[0], warned


def _copy_preprocess(result: dict, folder: Path) -> str:
    """The committed preprocess folder of ``result`` copied to ``folder``, its manifest naming the copies."""
    source = Path(result["manifest_uri"]).parent
    shutil.copytree(source, folder)
    manifest = storage.read_json(str(folder / "manifest.json"))
    for files in manifest["splits"].values():
        for entry in files:
            entry["uri"] = str(folder / Path(entry["uri"]).relative_to(source))
    storage.write_json(str(folder / "manifest.json"), manifest)
    return str(folder / "manifest.json")


@pytest.mark.parametrize("forged", ["outside_root_other_pipeline", "inside_root_other_pipeline", "outside_root_own_run"])
def test_cache_entry_outside_root_misses(committed, storage_root, tmp_path, caplog, forged):
    """The issue's case: an entry whose manifest_uri names a folder outside the storage root, from a run of another
    pipeline, is not served, nor one from another pipeline's run inside the root, nor one naming files outside the
    root as this pipeline's run: one warning each names the URI or run and why; preprocess runs again."""
    config, raw, result = committed
    source = {"outside_root_own_run": "ml_pipeline/forged"}.get(forged, "other_pipeline/forged")
    folder = (storage_root / "runs" / "other_pipeline" / "forged" if forged.startswith("inside")
              else tmp_path / "elsewhere" / "runs" / "other_pipeline" / "forged") / "preprocess"
    manifest_uri = _copy_preprocess(result, folder)
    cache.remember(config, "preprocess", result["fingerprint"], source, {**result, "manifest_uri": manifest_uri})
    caplog.set_level(logging.INFO, logger="stagewise.reuse")
    out = _out(storage_root, "r2")
    planned = preprocess.plan_run(config, raw, out, "ml_pipeline/r2")
    assert planned["reused_from"] is None
    assert not storage.exists(storage.join(out, "preprocess", "manifest.json"))
    warned = _warnings(caplog)
    inside = forged.startswith("inside")
    assert len(warned) == 1 and (source if inside else manifest_uri) in warned[0], warned
    assert ("not a run of pipeline 'ml'" if inside else "outside the storage root") in warned[0], warned


def test_an_entry_without_recorded_content_is_a_miss(committed, storage_root, caplog):
    """An entry that records no content fingerprints (written before they were recorded) is never served."""
    config, raw, result = committed
    uri = cache.entry_uri(config, "preprocess", result["fingerprint"])
    storage.write_json(uri, {key: value for key, value in storage.read_json(uri).items() if key != "outputs"})
    caplog.set_level(logging.INFO, logger="stagewise.reuse")
    assert preprocess.plan_run(config, raw, _out(storage_root, "r2"), "ml_pipeline/r2")["reused_from"] is None
    warned = _warnings(caplog)
    assert len(warned) == 1 and "records no content fingerprint" in warned[0], warned


def test_an_entry_whose_served_values_were_edited_is_a_miss(write_config, storage_root, caplog):
    """The values a hit hands on come from the entry (a sweep's best params, test metrics): an entry edited to hold
    others than its committed record is not served, naming the value and the record."""
    _, config = _config(write_config, storage_root)
    record = storage.join(_out(storage_root, "r1"), "evaluate", "metrics.json")
    storage.write_json(record, {"fingerprint": "f1", "test_accuracy": 0.5})
    cache.remember(config, "evaluate", "f1", SOURCE, {"metrics_uri": record, "test_accuracy": 0.5, "fingerprint": "f1"})
    def check(result):
        return cache.record_problem(result["metrics_uri"], "f1")

    assert cache.lookup(config, "evaluate", "f1", "ml_pipeline/r2", check)["test_accuracy"] == 0.5
    uri = cache.entry_uri(config, "evaluate", "f1")
    entry = storage.read_json(uri)
    storage.write_json(uri, {**entry, "result": {**entry["result"], "test_accuracy": 0.99}})
    caplog.set_level(logging.INFO, logger="stagewise.reuse")
    assert cache.lookup(config, "evaluate", "f1", "ml_pipeline/r2", check) is None
    warned = _warnings(caplog)
    assert len(warned) == 1 and f"the entry's test_accuracy is not the one {record} records" in warned[0], warned
