"""A succeeded run drops what only a resume reads (stagewise.reuse.leftovers): each finished stage's checkpoints/, best/
and hand-off (final.pt, the optimizer DCP), preprocess's per-shard stats and split copy; model.pt, metrics.json, the
manifest and stats.json stay, and the report says what went and how many bytes. Step caching keeps what it serves (one
gone is a clean miss), retention can keep everything, and a task cleared alone afterwards says what went, not crashes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from stagewise import report
from stagewise.core import dropped as drop_records
from stagewise.core import storage
from stagewise.core.errors import DataError
from stagewise.datasets.manifest import read_manifest
from stagewise.definitions.loading import load_config
from stagewise.reporting import html as report_html
from stagewise.reuse import leftovers
from stagewise.reuse.cache import stage_problem
from tests.conftest import base_config, preprocess_digits, train_digits_s1

STAGE_KEPT = {"model.pt", "metrics.json", drop_records.RECORD}
PREPROCESS_KEPT = {"manifest.json", "stats.json", drop_records.RECORD}


@pytest.fixture
def run(tmp_path) -> tuple[Path, str, Path, dict]:
    """The digits preprocessed and stage s1 trained in-process (its files name their own absolute paths, so each test
    trains its own): (config path, run prefix, stage folder, the stage's result as the cache keeps it)."""
    config_path, out, _ = train_digits_s1(tmp_path, "r1", hidden=16)
    folder = Path(out, "train", "s1")
    (hand_off,) = folder.glob("final-optimizer-*.dcp")
    result = {**storage.read_json(str(folder / "metrics.json")), "checkpoint_uri": str(folder / "final.pt"),
              "model_uri": str(folder / "model.pt"), "optimizer_uri": str(hand_off)}
    return config_path, out, folder, result


def _config(config_path: Path, **sections):
    raw = yaml.safe_load(config_path.read_text())
    raw.update(sections)
    config_path.write_text(yaml.safe_dump(raw))
    return load_config(config_path)


def _bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def test_a_succeeded_run_drops_what_only_a_resume_reads_and_keeps_the_model(run):
    """checkpoints/, best/, final.pt, the optimizer DCP, preprocess/stats/ and the split files go; model.pt,
    metrics.json, manifest.json and stats.json stay; the result lists each entry with its bytes, summing to what the
    run folder shrank by (less the records)."""
    config_path, out, folder, _ = run
    assert (folder / "checkpoints").is_dir() and (folder / "best").is_dir() and list(folder.glob("final-optimizer-*.dcp"))
    before = _bytes(Path(out))
    dropped = leftovers.drop_finished(_config(config_path), out, ["s1"])
    assert {path.name for path in folder.iterdir()} == STAGE_KEPT
    assert {path.name for path in Path(out, "preprocess").iterdir()} == PREPROCESS_KEPT
    names = {entry["file"] for entry in dropped["files"]}
    assert {"train/s1/final.pt"} <= names and any(name.startswith("train/s1/final-optimizer-") for name in names)
    assert {name.split("/")[2] for name in names if name.startswith("train/")} >= {"checkpoints", "best"}
    assert {name.split("/")[1] for name in names if name.startswith("preprocess/")} >= {"stats", "train", "test"}
    records = sum(path.stat().st_size for path in Path(out).rglob(drop_records.RECORD))
    assert dropped["bytes"] == sum(entry["bytes"] for entry in dropped["files"]) == before - _bytes(Path(out)) + records
    assert "kept" not in dropped


def test_the_report_says_which_files_went_and_how_many_bytes(run):
    """report.json carries the dropped files and bytes, its summary says so in a line, and report.html lists them."""
    config_path, out, _, _ = run
    dropped = leftovers.drop_finished(_config(config_path), out, ["s1"])
    written = report.build_report(
        dag_id="ml_pipeline", run_id="r1", out=out, stage_results={}, preprocess={"rows": {"train": 1}, "rows_dropped": 0},
        sweep={"n_trials": 1, "n_complete": 1, "n_pruned": 0, "n_failed": 0, "best_value": 0.9},
        training=[{"stage": "s1", "world_size": 1, "global_batch": 32, "lr": 0.05, "epochs": 2, "val_metric": 0.9}],
        evaluation={"objective": "accuracy", "test_objective": 0.9, "test_accuracy": 0.9}, predictions={"rows": 1},
        registry={}, dropped=dropped)
    saved = storage.read_json(written["report_uri"])
    assert saved["dropped"] == dropped
    (line,) = [line for line in report.summary_lines(saved) if "dropped after success" in line]
    assert f"{len(dropped['files'])} file(s)" in line and f"{dropped['bytes']:,} bytes" in line
    page = Path(written["html_uri"]).read_text()
    assert f"{dropped['bytes']:,} bytes" in page and all(entry["file"] in page for entry in dropped["files"])
    assert report_html.dropped_line({}) == "", "a report made before the drop existed shows nothing"


def test_a_retried_drop_finishes_and_reports_the_same_files(run):
    """Each record is written before anything goes: a report step retried after a drop cut short removes what is left
    and reports the whole list again; one retried after a whole drop reports the same list."""
    config_path, out, folder, _ = run
    config = _config(config_path)
    found = leftovers.stage_leftovers(str(folder))
    storage.write_json(str(folder / drop_records.RECORD), {"files": found, "bytes": 1})  # the earlier attempt died here
    first = leftovers.drop_finished(config, out, ["s1"])
    assert {path.name for path in folder.iterdir()} == STAGE_KEPT
    assert leftovers.drop_finished(config, out, ["s1"]) == first
    assert {entry["uri"] for entry in found} <= {str(Path(out, entry["file"])) for entry in first["files"]}


def test_with_caching_on_what_the_cache_serves_stays_and_it_still_serves(run):
    """cache.stage and cache.preprocess on: checkpoints/, best/ and the per-shard stats go, but final.pt, its optimizer
    hand-off and the split files stay, so the cache's check still serves the stage; the report says why they stayed."""
    config_path, out, folder, result = run
    dropped = leftovers.drop_finished(_config(config_path, cache={"stage": True, "preprocess": True}), out, ["s1"])
    assert (folder / "final.pt").is_file() and Path(result["optimizer_uri"]).is_dir()
    assert not (folder / "checkpoints").exists() and not (folder / "best").exists()
    assert not Path(out, "preprocess", "stats").exists() and Path(out, "preprocess", "train").is_dir()
    assert "cache.stage is on" in dropped["kept"] and "cache.preprocess is on" in dropped["kept"]
    assert stage_problem(result, result["fingerprint"]) is None
    read_manifest(storage.join(out, "preprocess", "manifest.json"))


def test_a_dropped_hand_off_is_a_clean_cache_miss(run):
    """A stage whose hand-off went (caching turned on later, or retention) is not served: the cache's check names what
    is gone (the stage is trained again), no crash."""
    config_path, out, _, result = run
    leftovers.drop_finished(_config(config_path), out, ["s1"])
    assert "is gone" in stage_problem(result, result["fingerprint"])


def test_retention_can_keep_everything(run):
    """retention.drop_after_success: false drops nothing and the report says why."""
    config_path, out, _, _ = run
    before = sorted(path.relative_to(out) for path in Path(out).rglob("*"))
    dropped = leftovers.drop_finished(_config(config_path, retention={"drop_after_success": False}), out, ["s1"])
    assert dropped["files"] == [] and dropped["bytes"] == 0 and "drop_after_success is false" in dropped["kept"]
    assert sorted(path.relative_to(out) for path in Path(out).rglob("*")) == before


def test_a_task_cleared_alone_after_the_drop_says_what_went(run):
    """A stage cleared after the run succeeded reads the stage before's final.pt, and evaluate the split data: both
    went on purpose, so each is a DataError that names the file and says to clear from preprocess on; a file lost
    without a record stays an ordinary missing file."""
    from stagewise.training.distributed import DistEnv
    from stagewise.training.handoff import read_hand_off

    config_path, out, folder, _ = run
    leftovers.drop_finished(_config(config_path), out, ["s1"])
    env = DistEnv(rank=0, local_rank=0, world_size=1, device="cpu")
    with pytest.raises(DataError, match="was dropped once its run succeeded.*clear the run's tasks from preprocess on"):
        read_hand_off(str(folder / "final.pt"), env, rank_zero_reads=False)
    with pytest.raises(DataError, match="split data.*was dropped once its run succeeded"):
        read_manifest(storage.join(out, "preprocess", "manifest.json"))
    (folder / drop_records.RECORD).unlink()
    assert not drop_records.was_dropped(str(folder / "final.pt"))


def test_a_stage_started_from_a_dropped_optimizer_starts_it_fresh(run, caplog):
    """An optimizer hand-off that went on purpose (final.pt kept by hand, the DCP dropped) loads as a fresh optimizer
    with a warning; one lost without a record still fails loudly."""
    import torch

    from stagewise.training.strategy import load_sharded_optimizer

    config_path, out, folder, result = run
    uri = result["optimizer_uri"]
    module = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    leftovers.drop_finished(_config(config_path), out, ["s1"])
    load_sharded_optimizer(module, optimizer, uri)
    assert optimizer.state_dict()["state"] == {}
    assert "was dropped once its run succeeded" in caplog.text
    (folder / drop_records.RECORD).unlink()  # now gone without a word of why
    with pytest.raises(BaseException):  # noqa: B017 - lost, not dropped: DCP's CheckpointException (a BaseException)
        load_sharded_optimizer(module, optimizer, uri)


@pytest.mark.service
def test_the_drop_works_on_an_s3_root(s3_bucket, tmp_path):
    """On s3:// (moto) the same entries go (a DCP folder is a key prefix there), the record lists s3:// URIs and the
    report's paths are relative to the run, with their bytes."""
    out = storage.run_prefix(s3_bucket, "ml_pipeline", "r1")
    stage = storage.stage_prefix(out, "s1")
    for name, size in {"checkpoints/step-000000010.pt": 300, "checkpoints/latest.json": 20, "best/step-000000001.pt": 200,
                       "final.pt": 100, "final-optimizer-ab12.dcp/__0_0.distcp": 400, "final-optimizer-ab12.dcp/.metadata": 10,
                       "model.pt": 90, "metrics.json": 5}.items():
        storage.write_bytes(storage.join(stage, name), b"x" * size)
    split = storage.join(out, "preprocess", "train", "part-0.parquet")
    storage.write_bytes(split, b"p" * 70)
    storage.write_bytes(storage.join(out, "preprocess", "stats", "shard-00000.json"), b"{}")
    storage.write_json(storage.join(out, "preprocess", "manifest.json"), {"kind": "preprocess", "splits": {"train": [{"uri": split}]}})
    config_path = tmp_path / "pipeline.yaml"
    config_path.write_text(yaml.safe_dump({**base_config(tmp_path), "storage_root": s3_bucket}))
    dropped = leftovers.drop_finished(load_config(config_path), out, ["s1"])
    assert {entry["file"]: entry["bytes"] for entry in dropped["files"]} == {
        "preprocess/stats/shard-00000.json": 2, "preprocess/train/part-0.parquet": 70,
        "train/s1/best/step-000000001.pt": 200, "train/s1/checkpoints/latest.json": 20,
        "train/s1/checkpoints/step-000000010.pt": 300, "train/s1/final-optimizer-ab12.dcp": 410, "train/s1/final.pt": 100}
    fs, path = storage.filesystem(stage)
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(path)) == sorted(["model.pt", "metrics.json", drop_records.RECORD])
    assert drop_records.was_dropped(storage.join(stage, "final.pt"))
    assert all(entry["uri"].startswith("s3://") for entry in storage.read_json(storage.join(stage, drop_records.RECORD))["files"])


def test_a_run_cleared_whole_after_the_drop_makes_it_all_again(run):
    """Clearing the succeeded run from its first task: preprocess finds its manifest's split files gone and plans the
    shards again (no 'inputs unchanged'), and the stage, its checkpoints gone, trains from the start to a whole new
    hand-off and model; the drop after that success removes them again."""
    from stagewise import preprocess, train

    config_path, out, folder, _ = run
    config = _config(config_path)
    leftovers.drop_finished(config, out, ["s1"])
    raw = storage.resolve(config.storage_root, config.dataset.uri)
    assert preprocess.plan_run(config, raw, out, "test/r1")["reused_from"] is None
    preprocess_digits(config_path, out)
    read_manifest(storage.join(out, "preprocess", "manifest.json"))
    with pytest.MonkeyPatch.context() as patch:
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            patch.delenv(name, raising=False)
        result = train.run_stage(config, "s1", out, {"lr": 0.05, "hidden": 16}, None)
    assert result["resumed_from_step"] in (None, 0) and Path(result["checkpoint_uri"]).is_file()
    assert not drop_records.was_dropped(result["checkpoint_uri"])
    again = leftovers.drop_finished(config, out, ["s1"])
    assert {path.name for path in folder.iterdir()} == STAGE_KEPT and again["files"]
