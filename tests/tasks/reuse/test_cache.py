"""The cross-run cache serves only committed outputs that still carry the fingerprint asked for, per pipeline."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from stagewise import preprocess
from stagewise.core import storage
from stagewise.definitions.loading import load_config
from stagewise.reuse import cache
from tests.conftest import base_config, preprocess_digits


def _config(write_config, storage_root, on=True, name="ml"):
    raw = base_config(storage_root)
    raw.update({"cache": on, "name": name})
    return load_config(write_config(raw, f"{name}.yaml"))


def test_cache_is_off_by_default_and_on_per_kind(write_config, storage_root):
    """No cache: key means nothing is remembered; a mapping turns on only the kinds it names."""
    raw = base_config(storage_root)
    config = load_config(write_config(raw))
    assert not any(config.cache.enabled(kind) for kind in ("preprocess", "sweep", "stage", "evaluate", "inference"))
    cache.remember(config, "sweep", "f1", "ml_pipeline/r1", {"summary_uri": "x"})
    assert not storage.exists(cache.entry_uri(config, "sweep", "f1"))
    raw["cache"] = {"sweep": True}
    config = load_config(write_config(raw))
    assert config.cache.enabled("sweep") and not config.cache.enabled("stage")


def test_a_hit_is_served_only_while_its_record_still_carries_the_fingerprint(write_config, storage_root):
    """An entry is served to another run with reused_from; never to the run that made it; never once its record is
    gone or re-made from other inputs; never across pipelines."""
    config = _config(write_config, storage_root)
    record = storage.join(str(storage_root), "runs", "ml_pipeline", "r1", "sweep", "summary.json")
    storage.write_json(record, {"fingerprint": "f1"})
    cache.remember(config, "sweep", "f1", "ml_pipeline/r1", {"summary_uri": record, "best_value": 0.9})

    def check(result):
        return cache.record_problem(result.get("summary_uri"), "f1")

    hit = cache.lookup(config, "sweep", "f1", "ml_pipeline/r2", check)
    assert hit == {"summary_uri": record, "best_value": 0.9, "reused_from": "ml_pipeline/r1"}
    assert cache.lookup(config, "sweep", "f1", "ml_pipeline/r1", check) is None  # its own work is not a cache hit
    assert cache.lookup(config, "sweep", "f2", "ml_pipeline/r2", check) is None
    other = _config(write_config, storage_root, name="other")
    assert cache.lookup(other, "sweep", "f1", "ml_pipeline/r2", check) is None
    storage.write_json(record, {"fingerprint": "f9"})  # the source run was cleared and re-made from new data
    assert cache.lookup(config, "sweep", "f1", "ml_pipeline/r2", check) is None


def test_preprocess_reuses_its_own_commit_only_for_the_same_bytes(write_config, storage_root):
    """A cleared preprocess whose raw bytes are unchanged keeps its committed manifest (same fingerprint, nothing
    redone); one shard's bytes changing means preprocess runs again."""
    config_path = write_config()
    out = str(storage_root / "runs" / "test" / "r1")
    committed = preprocess_digits(config_path, out)
    config = load_config(config_path)
    raw = storage.resolve(config.storage_root, config.dataset.uri)
    planned = preprocess.plan_run(config, raw, out, "test/r1")
    assert planned["reused_from"] is None  # committed by hand without a fingerprint: nothing stands for it
    results = [preprocess.transform_shard(config, uri, i, out, committed["manifest_uri"].replace("manifest", "stats"))
               for i, uri in enumerate(planned["shards"])]
    recommitted = preprocess.commit(config, out, storage.join(out, "preprocess", "stats.json"), results,
                                    planned["fingerprint"])
    again = preprocess.plan_run(config, raw, out, "test/r1")
    assert again == {**planned, "reused_from": "test/r1"}
    assert preprocess.committed_result(recommitted["manifest_uri"])["fingerprint"] == planned["fingerprint"]
    first = planned["shards"][0]["uri"]
    pq.write_table(pq.read_table(first).slice(1), first)  # other bytes: one row fewer
    assert preprocess.plan_run(config, raw, out, "test/r1")["reused_from"] is None


@pytest.mark.parametrize("kind", ["preprocess", "inference"])
def test_a_manifest_naming_a_lost_file_is_not_served(tmp_path, kind):
    """manifest_problem names a listed file that is gone, whatever kind of manifest lists it."""
    part = tmp_path / "part.parquet"
    part.write_bytes(b"x")
    listed = {"splits": {"train": [{"uri": str(part)}]}} if kind == "preprocess" else {"files": [{"uri": str(part)}]}
    manifest = tmp_path / "manifest.json"
    storage.write_json(str(manifest), {**listed, "fingerprint": "f1"})
    assert cache.manifest_problem(str(manifest), "f1") is None
    assert "other inputs" in cache.manifest_problem(str(manifest), "f2")
    part.unlink()
    assert "is gone" in cache.manifest_problem(str(manifest), "f1")


def test_a_cached_stage_is_not_served_once_its_hand_off_or_the_optimizer_checkpoint_it_names_is_gone(tmp_path):
    """stage_problem: a finished stage stands for its fingerprint while final.pt, model.pt, metrics.json and the sharded
    optimizer checkpoint final.pt names are all there; with any gone it names that one."""
    stage = tmp_path / "train" / "s1"
    optimizer = stage / "final-optimizer-abc.dcp"
    optimizer.mkdir(parents=True)
    (optimizer / ".metadata").write_bytes(b"m")
    for name in ("final.pt", "model.pt"):
        (stage / name).write_bytes(b"x")
    storage.write_json(str(stage / "metrics.json"), {"complete": True, "fingerprint": "f1"})
    result = {"checkpoint_uri": str(stage / "final.pt"), "model_uri": str(stage / "model.pt"),
              "optimizer_uri": str(optimizer)}
    assert cache.stage_problem(result, "f1") is None
    assert "other inputs" in cache.stage_problem(result, "f2")
    (optimizer / ".metadata").unlink()
    assert cache.stage_problem(result, "f1") == f"{optimizer} (the optimizer state final.pt hands on) is gone"
    (stage / "model.pt").unlink()
    assert "(model_uri) is gone" in cache.stage_problem(result, "f1")
