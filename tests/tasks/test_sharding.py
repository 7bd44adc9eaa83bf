"""Input files become shards: any number of files plans at most MAX_SHARDS shards covering every file once, large
files still spread, a multi-file shard commits each of its files' rows once, and a file changed since its plan fails
the shard naming it (inference and preprocess alike)."""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stagewise import infer, preprocess
from stagewise.core import storage
from stagewise.core.errors import DataError
from stagewise.datasets import sharding
from stagewise.datasets.manifest import read_manifest
from stagewise.datasets.predictions import commit_predictions, plan_inference
from stagewise.definitions.loading import load_config
from tests.conftest import train_digits_s1


def _write_files(folder: Path, num_files: int, rows: int, row_group_rows: int | None = None) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    uris = []
    for i in range(num_files):
        table = pa.table({"row_id": pa.array(np.arange(i * rows, (i + 1) * rows), pa.int64()),
                          "x": pa.array(np.ones(rows), pa.float64())})
        uri = str(folder / f"part-{i:05d}.parquet")
        pq.write_table(table, uri, row_group_size=row_group_rows or rows)
        uris.append(uri)
    return uris


def _coverage(shards: list[dict]) -> Counter:
    """How many times each (file, row group) is planned."""
    return Counter((f["uri"], g) for shard in shards for f in sharding.shard_files(shard) for g in f["row_groups"])


@pytest.fixture(scope="module")
def many_small(tmp_path_factory) -> tuple[str, list[str]]:
    """10,000 Parquet files of 3 rows each (a Spark-style output folder). The planner reads only each file's size,
    mtime and footer, so one file's bytes are encoded once and written 10,000 times (encoding each costs seconds)."""
    folder = tmp_path_factory.mktemp("many") / "raw"
    folder.mkdir()
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"row_id": pa.array(np.arange(3), pa.int64()), "x": pa.array(np.ones(3), pa.float64())}),
                   sink)
    data = sink.getvalue().to_pybytes()
    uris = [str(folder / f"part-{i:05d}.parquet") for i in range(10_000)]
    for uri in uris:  # os.write: a third of Path.write_bytes' time over 10,000 files
        handle = os.open(uri, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        os.write(handle, data)
        os.close(handle)
    return str(folder), uris


def test_ten_thousand_small_files_plan_at_most_max_shards_covering_each_file_once(many_small):
    """10,000 files never plan 10,000 mapped tasks (Airflow's max_map_length is 1,024): small files are packed toward
    rows_per_shard, and even a target of 1 row grows shards until the plan fits under MAX_SHARDS; every file's every
    row group is planned exactly once, in file order."""
    folder, uris = many_small
    expected = Counter({(uri, 0): 1 for uri in uris})
    started = time.monotonic()
    packed = plan_inference(folder, rows_per_shard=500)
    print(f"plan of 10,000 files: {time.monotonic() - started:.2f} s")  # measured, never asserted
    # 166 files of 3 rows a shard (498 rows: a 167th would pass 500), so 10,000 files in 61 shards
    assert len(packed) == 61 and _coverage(packed) == expected
    assert all(shard["rows"] == sum(f["rows"] for f in shard["files"]) <= 500 for shard in packed)
    capped = plan_inference(folder, rows_per_shard=1)
    assert len(capped) <= sharding.MAX_SHARDS and _coverage(capped) == expected
    assert [f["uri"] for shard in capped for f in shard["files"]] == uris, "plan order is file order"
    grouped = preprocess.plan_shards(folder)
    assert len(grouped) <= sharding.MAX_SHARDS
    assert [f["uri"] for shard in grouped for f in shard["files"]] == uris


def test_large_files_still_spread_one_or_more_shards_each(tmp_path):
    """100 files each above rows_per_shard are never packed together: each is cut into shards of its own at row
    groups (inference), or is a shard of its own (preprocess), so they spread over the workers."""
    uris = _write_files(tmp_path / "raw", 100, 300, row_group_rows=100)
    shards = plan_inference(str(tmp_path / "raw"), rows_per_shard=200)
    assert len(shards) == 200 and all(len(shard["files"]) == 1 for shard in shards)
    assert _coverage(shards) == Counter({(uri, g): 1 for uri in uris for g in range(3)})
    assert [shard["uri"] for shard in preprocess.plan_shards(str(tmp_path / "raw"))] == uris


def test_a_plan_pins_each_file_and_a_rewritten_file_is_named(tmp_path):
    """Each planned file records its size, rows and mtime (ETag on S3); after a rewrite with other rows the check
    fails naming the file and both versions, while an untouched file passes."""
    uris = _write_files(tmp_path / "raw", 2, 10)
    shards = plan_inference(str(tmp_path / "raw"), rows_per_shard=5)
    entry = shards[0]["files"][0]
    assert entry["file_rows"] == 10 and entry["size"] == Path(uris[0]).stat().st_size and "mtime" in entry
    pq.write_table(pq.read_table(uris[0]).slice(0, 4), uris[0])
    with pytest.raises(DataError, match=rf"{uris[0]}: changed since the plan \(size .*file_rows 10 -> 4"):
        sharding.check_pinned(entry)
    sharding.check_pinned(shards[-1]["files"][0])


# --- end to end -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return train_digits_s1(tmp_path_factory.mktemp("storage"), "sharding", hidden=16)


def _split_digits(config, folder: Path, num_files: int) -> pa.Table:
    """The digits' raw rows written as ``num_files`` small files in ``folder``; returns the rows in order."""
    table = pa.concat_tables(pq.read_table(uri) for uri in storage.list_parquet(
        storage.resolve(config.storage_root, config.dataset.uri)))
    folder.mkdir(parents=True)
    for i, chunk in enumerate(np.array_split(np.arange(table.num_rows), num_files)):
        pq.write_table(table.take(pa.array(chunk)), folder / f"part-{i:05d}.parquet")
    return table


def test_a_multi_file_shard_commits_every_files_rows_once_in_order(trained, tmp_path):
    """30 small files pack into a few multi-file shards; scoring and committing them gives each input row exactly
    once, in input order, with the predictions of scoring the same rows as one file."""
    config_path, out, model_uri = trained
    config = load_config(config_path)
    table = _split_digits(config, tmp_path / "small", 30)
    shards = plan_inference(str(tmp_path / "small"), rows_per_shard=500)
    assert len(shards) < 30 and max(len(shard["files"]) for shard in shards) > 1
    committed = commit_predictions(out, model_uri, [infer.score_shard(config, model_uri, s, out) for s in shards])
    scored = pa.concat_tables(pq.read_table(e["uri"]) for e in storage.read_json(committed["uri"])["files"])
    assert scored.column("row_id").to_pylist() == table.column("row_id").to_pylist()
    pq.write_table(table, tmp_path / "whole.parquet")
    whole = [infer.score_shard(config, model_uri, s, str(tmp_path / "w"))
             for s in plan_inference(str(tmp_path / "whole.parquet"), rows_per_shard=10_000)]
    alone = pa.concat_tables(pq.read_table(f["uri"]) for r in whole for f in r["files"])
    assert scored.column("prediction").equals(alone.column("prediction"))


def test_an_inference_input_changed_between_plan_and_shard_fails_naming_it(trained, tmp_path):
    """The issue's case: the plan saw one version of a file, the try finds another (other rows): the shard fails as
    a data error naming the file before scoring a row; shards of unchanged files still score."""
    config_path, out, model_uri = trained
    config = load_config(config_path)
    _split_digits(config, tmp_path / "raw", 4)
    shards = plan_inference(str(tmp_path / "raw"), rows_per_shard=400)
    changed = shards[1]["files"][0]["uri"]
    pq.write_table(pq.read_table(changed).slice(0, 224), changed)
    with pytest.raises(DataError, match=rf"{changed}: changed since the plan .*file_rows \d+ -> 224"):
        infer.score_shard(config, model_uri, shards[1], str(tmp_path / "out"))
    assert not list((tmp_path / "out").rglob("*.parquet")), "nothing of the changed file was written"
    assert infer.score_shard(config, model_uri, shards[0], str(tmp_path / "out"))["rows"] == shards[0]["rows"]


def test_a_preprocess_input_changed_after_plan_fails_stats_and_transform_naming_it(trained, tmp_path):
    """Preprocess pins its files too: stats and transform of a shard whose file was rewritten since the plan fail
    naming it; the other shards pass."""
    config_path, out, _ = trained
    config = load_config(config_path)
    _split_digits(config, tmp_path / "raw", 3)
    shards = preprocess.plan_shards(str(tmp_path / "raw"))
    run = str(tmp_path / "run")
    stats = [preprocess.shard_stats(config, shard, shard["index"], run)["stats_uri"] for shard in shards]
    reduced = preprocess.reduce_stats(config, run, stats)
    changed = shards[2]["uri"]
    pq.write_table(pq.read_table(changed).slice(0, 100), changed)
    for step in (lambda: preprocess.shard_stats(config, shards[2], 2, run),
                 lambda: preprocess.transform_shard(config, shards[2], 2, run, reduced["stats_uri"])):
        with pytest.raises(DataError, match=rf"{changed}: changed since the plan"):
            step()
    assert preprocess.transform_shard(config, shards[0], 0, run, reduced["stats_uri"])["files"]


def test_preprocess_over_multi_file_shards_commits_the_same_rows_as_one_file_each(trained, tmp_path, monkeypatch):
    """Past the cap, preprocess packs whole files into shards; stats, reduce, transform and commit over them keep
    every row once with the same statistics as one shard per file, and a key repeated across two files of one
    shard is still refused naming both."""
    config_path, _, _ = trained
    config = load_config(config_path)
    _split_digits(config, tmp_path / "raw", 6)

    def run_all(out: str) -> dict:
        shards = preprocess.plan_shards(str(tmp_path / "raw"))
        stats = [preprocess.shard_stats(config, s, s["index"], out)["stats_uri"] for s in shards]
        reduced = preprocess.reduce_stats(config, out, preprocess.planned_stats(out, shards))
        assert len(stats) == len(shards)
        results = [preprocess.transform_shard(config, s, s["index"], out, reduced["stats_uri"]) for s in shards]
        return read_manifest(preprocess.commit(config, out, reduced["stats_uri"], results)["manifest_uri"])

    alone = run_all(str(tmp_path / "alone"))
    monkeypatch.setattr(sharding, "MAX_SHARDS", 2)
    assert [len(s["files"]) for s in preprocess.plan_shards(str(tmp_path / "raw"))] == [3, 3]
    packed = run_all(str(tmp_path / "packed"))
    assert packed["rows"] == alone["rows"]
    np.testing.assert_allclose(packed["mean"], alone["mean"], rtol=1e-12)  # moments merged in another order
    np.testing.assert_allclose(packed["std"], alone["std"], rtol=1e-12)
    keys = [pq.read_table(f["uri"]).column("row_id").to_pylist() for files in packed["splits"].values() for f in files]
    assert sorted(sum(keys, [])) == sorted(k for ks in [pq.read_table(f["uri"]).column("row_id").to_pylist()
                                                        for files in alone["splits"].values() for f in files] for k in ks)
    first, second = sorted((tmp_path / "raw").iterdir())[:2]
    pq.write_table(pa.concat_tables([pq.read_table(second), pq.read_table(first).slice(0, 1)]), second)
    with pytest.raises(DataError, match=f"occurs in both {first} and {second}"):
        run_all(str(tmp_path / "duplicate"))


@pytest.mark.service
def test_on_s3_the_pin_is_the_etag_and_catches_a_rewrite_of_the_same_size_and_rows(s3_bucket):
    """On S3 a plan pins each object's ETag: a rewrite with the same size and row count but other values is still
    named as changed, and an untouched object passes."""
    uris = [f"{s3_bucket}/raw/part-{i}.parquet" for i in range(2)]
    for i, uri in enumerate(uris):
        sink = pa.BufferOutputStream()
        pq.write_table(pa.table({"row_id": pa.array([10 * i, 10 * i + 1], pa.int64())}), sink)
        storage.write_bytes(uri, sink.getvalue().to_pybytes())
    shards = plan_inference(f"{s3_bucket}/raw", rows_per_shard=2)
    pinned = shards[0]["files"][0]
    assert pinned["etag"] and "mtime" not in pinned and pinned["file_rows"] == 2
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"row_id": pa.array([7, 8], pa.int64())}), sink)
    storage.write_bytes(uris[0], sink.getvalue().to_pybytes())
    with pytest.raises(DataError, match=rf"{uris[0]}: changed since the plan \(etag "):
        sharding.check_pinned(pinned)
    sharding.check_pinned(shards[1]["files"][0])


def _write_plain(table: pa.Table, uri: str) -> None:
    """Fixed-width bytes for fixed-width values (no compression, dictionary or statistics): other values, same size."""
    pq.write_table(table, uri, compression="none", use_dictionary=False, write_statistics=False)


def test_an_inference_input_rewritten_with_size_and_mtime_kept_is_refused_and_rescored(trained, tmp_path):
    """The issue's case: a file rewritten in place with its size and mtime kept (23 rows' pixels changed). The plan
    pins each file by its content (SHA-256; S3: ETag), so the shard planned before fails naming the file, before
    scoring a row; planned again, the file has another identity and its new values are scored."""
    config_path, _, model_uri = trained
    config = load_config(config_path)
    table = _split_digits(config, tmp_path / "split", 1)
    (tmp_path / "raw").mkdir()
    uri = str(tmp_path / "raw" / "part-00000.parquet")
    _write_plain(table, uri)
    shards = plan_inference(str(tmp_path / "raw"), rows_per_shard=10_000)
    scored = infer.score_shard(config, model_uri, shards[0], str(tmp_path / "first"))
    first = pa.concat_tables(pq.read_table(f["uri"]) for f in scored["files"])
    kept = os.stat(uri)
    pixels = [name for name in table.column_names if name.startswith("px_")]
    inverted = {name: pa.array(np.concatenate([16.0 - table.column(name).to_numpy()[:23],
                                               table.column(name).to_numpy()[23:]])) for name in pixels}
    _write_plain(pa.table({name: inverted.get(name, table.column(name)) for name in table.column_names}), uri)
    os.utime(uri, ns=(kept.st_atime_ns, kept.st_mtime_ns))
    assert (os.stat(uri).st_size, os.stat(uri).st_mtime_ns) == (kept.st_size, kept.st_mtime_ns)
    with pytest.raises(DataError, match=rf"{uri}: changed since the plan \(content 'sha256:"):
        infer.score_shard(config, model_uri, shards[0], str(tmp_path / "stale"))
    assert not list((tmp_path / "stale").rglob("*.parquet")), "nothing of the rewritten file was scored"
    again = plan_inference(str(tmp_path / "raw"), rows_per_shard=10_000)
    assert again[0]["files"][0]["content"] != shards[0]["files"][0]["content"]
    rescored = infer.score_shard(config, model_uri, again[0], str(tmp_path / "again"))
    second = pa.concat_tables(pq.read_table(f["uri"]) for f in rescored["files"])
    assert second.num_rows == first.num_rows and not second.equals(first), "the new values were scored"


def test_a_file_cut_into_shards_is_checked_by_each_shards_own_row_groups(tmp_path):
    """A file cut into several shards is pinned by each row group's bytes and its footer's: a value changed in place
    (size and mtime kept) fails the shard that reads it, naming its row group, while the other shards, whose bytes
    are unchanged, pass without hashing the whole file."""
    uri = str(tmp_path / "raw" / "big.parquet")
    (tmp_path / "raw").mkdir()
    table = pa.table({"row_id": pa.array(np.arange(400), pa.int64()), "x": pa.array(np.ones(400), pa.float64())})
    pq.write_table(table, uri, row_group_size=100, compression="none", use_dictionary=False, write_statistics=False)
    shards = plan_inference(str(tmp_path / "raw"), rows_per_shard=100)
    assert [f["row_groups"] for shard in shards for f in shard["files"]] == [[0], [1], [2], [3]]
    assert all(len(shard["files"][0]["group_digests"]) == 1 for shard in shards)
    kept = os.stat(uri)
    x = np.ones(400)
    x[250] = 2.0  # row group 2
    pq.write_table(table.set_column(1, "x", pa.array(x)), uri, row_group_size=100, compression="none",
                   use_dictionary=False, write_statistics=False)
    os.utime(uri, ns=(kept.st_atime_ns, kept.st_mtime_ns))
    assert os.stat(uri).st_size == kept.st_size
    with pytest.raises(DataError, match=rf"{uri}: changed since the plan \(content of row group\(s\) \[2\]"):
        sharding.check_pinned(shards[2]["files"][0])
    for shard in (shards[0], shards[1], shards[3]):
        sharding.check_pinned(shard["files"][0])
