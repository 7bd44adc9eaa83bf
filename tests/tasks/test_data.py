"""Data sets: the digits demo and the synthetic generator write the raw layout preprocess expects."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stagewise.data import main, write_demo
from stagewise.datasets.demo import synthetic_table, write_diabetes, write_digits, write_digits_images, write_synthetic


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


def test_digits_images_hold_the_same_pixels_in_one_list_column(tmp_path):
    """digits-images: the same rows, with each image's 64 pixels (row-major, as px_00..px_63) in one
    fixed_size_list<double>[64] column ``image`` instead of 64 columns."""
    images = _read_all(write_digits_images(str(tmp_path / "images"), num_shards=2))
    pixels = _read_all(write_digits(str(tmp_path / "digits"), num_shards=2))
    assert images.column_names == ["row_id", "image", "label"]
    assert images.schema.field("image").type == pa.list_(pa.float64(), 64)
    expected = np.column_stack([pixels.column(f"px_{i:02d}").to_numpy() for i in range(64)])
    np.testing.assert_array_equal(np.stack(images.column("image").to_pylist()), expected)
    assert images.column("label").equals(pixels.column("label"))


def test_diabetes_has_442_rows_10_float_features_and_the_raw_float_target(tmp_path):
    """diabetes: 442 rows, 10 float features, and the target at its own scale (about 25..346), not standardised."""
    table = _read_all(write_diabetes(str(tmp_path / "diabetes")))
    assert table.num_rows == 442 and len(np.unique(table.column("row_id").to_numpy())) == 442
    features = [name for name in table.column_names if name not in ("row_id", "target")]
    assert len(features) == 10 and all(pa.types.is_floating(table.schema.field(n).type) for n in features)
    target = table.column("target").to_numpy()
    assert pa.types.is_floating(table.schema.field("target").type) and target.min() == 25 and target.max() == 346


@pytest.mark.parametrize("kind,column", [("digits", "px_00"), ("digits-images", "image"), ("diabetes", "bmi")])
def test_demo_writes_the_data_set_the_config_asks_for(write_config, storage_root, monkeypatch, kind, column):
    """`python -m stagewise.data demo` writes dataset.demo_data into dataset.uri (never guessed from names)."""
    from tests.conftest import base_config

    raw = base_config(storage_root)
    raw["dataset"].update({"uri": "raw/anything", "demo_data": kind})
    monkeypatch.setenv("STAGEWISE_CONFIG", str(write_config(raw)))
    target = write_demo()
    assert column in pq.read_schema(sorted((storage_root / "raw" / "anything").glob("*.parquet"))[0]).names
    assert target.endswith("raw/anything")


def test_demo_num_shards_splits_the_same_rows_into_that_many_files(write_config, storage_root, monkeypatch):
    """`stagewise.data demo --num-shards 2` writes the digits' 1,797 rows in two files (the demo's default is four)."""
    monkeypatch.setenv("STAGEWISE_CONFIG", str(write_config()))
    main(["demo", "--num-shards", "2"])
    files = sorted((storage_root / "raw" / "digits").glob("*.parquet"))
    assert len(files) == 2 and sum(pq.read_metadata(f).num_rows for f in files) == 1797


def test_demo_takes_the_config_as_every_job_does(write_config, storage_root, monkeypatch):
    """`stagewise.data demo --config FILE` writes FILE's data set, whatever $STAGEWISE_CONFIG names."""
    from tests.conftest import base_config

    raw = base_config(storage_root)
    raw["dataset"].update({"uri": "raw/chosen", "demo_data": "diabetes"})
    monkeypatch.setenv("STAGEWISE_CONFIG", str(write_config(name="other.yaml")))
    main(["demo", "--config", str(write_config(raw))])
    assert (storage_root / "raw" / "chosen").is_dir() and not (storage_root / "raw" / "digits").exists()


def test_demo_writes_a_shard_for_each_process_of_the_widest_stage(write_config, storage_root, monkeypatch, capfd):
    """`--num-shards 1` for a pipeline whose stage s2 runs 2 processes (pipeline.yaml's) writes 2 files and says why:
    every rank reads files of its own, so 1 would fail the stage long after the data step (docs/ci.md's recipe)."""
    monkeypatch.setenv("STAGEWISE_CONFIG", str(write_config()))
    main(["demo", "--num-shards", "1"])
    files = sorted((storage_root / "raw" / "digits").glob("*.parquet"))
    assert len(files) == 2 and sum(pq.read_metadata(f).num_rows for f in files) == 1797
    assert "1 shard(s) are fewer than stage s2's 2 processes: writing 2" in capfd.readouterr().out


def test_demo_all_skips_an_s3_pipeline_this_shell_cannot_reach(tmp_path, monkeypatch, capfd, no_aws_credentials):
    """`make up` runs `stagewise.data demo --all`: a pipeline on S3 with no credentials in the shell (its workers use
    its storage_conn_id) is named and skipped, and the local pipeline still gets its demo data."""
    import yaml

    from tests.conftest import base_config

    folder = tmp_path / "pipelines"
    folder.mkdir()
    (folder / "local.yaml").write_text(yaml.safe_dump({**base_config(tmp_path / "local_root"), "name": "local"}))
    (folder / "lake.yaml").write_text(yaml.safe_dump({**base_config(tmp_path / "unused"), "name": "lake",
                                                      "storage_root": "s3://stagewise-demo-lake/team",
                                                      "storage_conn_id": "lake_s3"}))
    monkeypatch.setenv("STAGEWISE_PIPELINES", str(folder))
    main(["demo", "--all", "--num-shards", "1"])
    assert len(list((tmp_path / "local_root" / "raw" / "digits").glob("*.parquet"))) == 2  # one per process of s2
    printed = "".join(capfd.readouterr())  # the CLI logs to the console
    assert "pipeline lake: no demo data written to its s3 storage (NoCredentialsError)" in printed, printed


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


# --- ingest: all or nothing, never a file twice ------------------------------------------------------------------


@pytest.fixture
def dataset(write_config, storage_root):
    """A data set of 2 synthetic shards (keys 0..599) and a config over it; returns (config, data set URI)."""
    from stagewise.definitions.loading import load_config
    from tests.conftest import base_config

    target = str(storage_root / "raw" / "synth")
    write_synthetic(target, 600, num_features=4, num_shards=2, dirty_fraction=0.0)
    raw = base_config(storage_root)
    raw["dataset"] = {"uri": "raw/synth", "key": "row_id", "label": "label", "features": "f_*", "num_classes": 10}
    return load_config(write_config(raw)), target


def _new_source(folder, num_files: int = 3, first_key: int = 10_000) -> list[str]:
    """``num_files`` new shards of 100 rows each with keys from ``first_key`` on, sorted by name."""
    folder.mkdir(parents=True, exist_ok=True)
    uris = []
    for index in range(num_files):
        path = folder / f"part-{index:05d}.parquet"
        pq.write_table(synthetic_table(100, num_features=4, seed=index, first_key=first_key + 100 * index), path)
        uris.append(str(path))
    return uris


def _content(uris: list[str]) -> list[bytes]:
    return sorted(open(uri, "rb").read() for uri in uris)


def test_ingest_adds_exactly_the_source_files_and_a_rerun_adds_nothing(dataset, tmp_path):
    """Ingest copies each source file once; running it again (a retry or a re-run) adds nothing."""
    from stagewise.core import storage
    from stagewise.data import ingest

    config, target = dataset
    before = storage.list_parquet(target)
    sources = _new_source(tmp_path / "new")
    first = ingest(config, str(tmp_path / "new"), target)
    assert len(first["added"]) == 3 and first["rows"] == 300
    after = storage.list_parquet(target)
    assert _content(sorted(set(after) - set(before))) == _content(sources)
    again = ingest(config, str(tmp_path / "new"), target)
    assert again["added"] == [] and sorted(again["already_present"]) == sorted(first["added"])
    assert storage.list_parquet(target) == after


@pytest.mark.parametrize("kind", ["empty", "truncated", "corrupt_pages"])
def test_ingest_with_a_broken_file_names_it_and_writes_nothing(dataset, tmp_path, kind):
    """A broken file anywhere in the source fails ingest with a DataError naming it, before any file is copied
    (the good files sorted before it are not left in the data set)."""
    from stagewise.core import storage
    from stagewise.core.errors import DataError
    from stagewise.data import ingest
    from tests.bad_parquet import EXPECTED_WORDING, write_bad_file

    config, target = dataset
    before = storage.list_parquet(target)
    good = _new_source(tmp_path / "new", num_files=2)
    bad = str(write_bad_file(kind, tmp_path / "new" / "part-00009.parquet", open(good[0], "rb").read()))
    with pytest.raises(DataError) as caught:
        ingest(config, str(tmp_path / "new"), target)
    assert bad in str(caught.value) and EXPECTED_WORDING[kind] in str(caught.value)
    assert storage.list_parquet(target) == before
    assert sorted(p.name for p in (tmp_path / "storage" / "raw" / "synth").iterdir()) == ["part-00000.parquet", "part-00001.parquet"]


def test_ingest_with_a_wrong_schema_last_writes_nothing(dataset, tmp_path):
    """A file lacking the label column, sorted last, fails naming file and column; nothing was copied before it."""
    from stagewise.core import storage
    from stagewise.core.errors import DataError
    from stagewise.data import ingest

    config, target = dataset
    before = storage.list_parquet(target)
    _new_source(tmp_path / "new", num_files=2)
    wrong = tmp_path / "new" / "part-00009.parquet"
    pq.write_table(synthetic_table(10, num_features=4, first_key=90_000).drop_columns(["label"]), wrong)
    with pytest.raises(DataError, match=f"{wrong}: label column 'label'"):
        ingest(config, str(tmp_path / "new"), target)
    assert storage.list_parquet(target) == before


def test_ingest_with_an_extra_feature_column_names_it_and_both_files(dataset, tmp_path):
    """A new file with one more prefix-matched feature than the data set is refused naming that column and both files."""
    from stagewise.core import storage
    from stagewise.core.errors import DataError
    from stagewise.data import ingest

    config, target = dataset
    wider = tmp_path / "new" / "part-00000.parquet"
    wider.parent.mkdir()
    pq.write_table(synthetic_table(50, num_features=5, first_key=50_000), wider)
    with pytest.raises(DataError) as caught:
        ingest(config, str(wider.parent), target)
    message = str(caught.value)
    assert str(wider) in message and storage.list_parquet(target)[0] in message
    assert "['f_004']" in message and "f_003" not in message


def test_ingest_of_the_same_bytes_twice_in_one_source_is_refused(dataset, tmp_path):
    """Two source files with identical bytes would duplicate every key: refused naming both, nothing copied."""
    import shutil

    from stagewise.core import storage
    from stagewise.core.errors import DataError
    from stagewise.data import ingest

    config, target = dataset
    before = storage.list_parquet(target)
    first = _new_source(tmp_path / "new", num_files=1)[0]
    twin = str(tmp_path / "new" / "part-00001.parquet")
    shutil.copy(first, twin)
    with pytest.raises(DataError) as caught:
        ingest(config, str(tmp_path / "new"), target)
    assert first in str(caught.value) and twin in str(caught.value)
    assert storage.list_parquet(target) == before


def test_ingest_skips_a_file_already_in_the_data_set_under_another_name(dataset, tmp_path):
    """Re-ingesting one of the data set's own files (a copy under a new name) adds nothing: no duplicated rows."""
    import shutil

    from stagewise.core import storage
    from stagewise.data import ingest

    config, target = dataset
    before = storage.list_parquet(target)
    (tmp_path / "again").mkdir()
    shutil.copy(before[1], tmp_path / "again" / "renamed.parquet")
    result = ingest(config, str(tmp_path / "again"), target)
    assert result["added"] == [] and result["already_present"] == [before[1]]
    assert storage.list_parquet(target) == before


def test_ingest_crashing_mid_copy_leaves_no_partial_file_and_the_retry_adds_the_rest_once(dataset, tmp_path, monkeypatch):
    """A crash while copying the second file leaves only whole files visible; the retry adds exactly the source's files,
    each once."""
    import os

    from stagewise.core import storage
    from stagewise.data import ingest

    config, target = dataset
    before = storage.list_parquet(target)
    sources = _new_source(tmp_path / "new", num_files=3)
    real_replace = os.replace
    calls = []

    def power_cut_on_second(source, destination):
        calls.append(destination)
        if len(calls) == 2:
            raise OSError("power cut before the rename")
        return real_replace(source, destination)

    monkeypatch.setattr(os, "replace", power_cut_on_second)
    with pytest.raises(OSError, match="power cut"):
        ingest(config, str(tmp_path / "new"), target)
    monkeypatch.undo()
    visible = storage.list_parquet(target)
    assert len(visible) == len(before) + 1, "only the first, whole copy is visible"
    for uri in visible:
        pq.read_metadata(uri)  # whole files only
    retry = ingest(config, str(tmp_path / "new"), target)
    assert len(retry["added"]) == 2 and len(retry["already_present"]) == 1
    after = storage.list_parquet(target)
    assert _content(sorted(set(after) - set(before))) == _content(sources)
    assert not [name for name in os.listdir(target) if "partial" in name], "the failed attempt's partial copy was removed"
