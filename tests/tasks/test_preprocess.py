"""Sharded preprocessing: a key-only split, exact statistics, schema errors that name file and column, idempotent commit."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stagewise import preprocess
from stagewise.core import storage
from stagewise.core.errors import DataError
from stagewise.datasets import keys as key_module
from stagewise.datasets.columns import SPLITS
from stagewise.datasets.demo import write_synthetic
from stagewise.datasets.keys import key_bits, repeated_hashes, split_of
from stagewise.datasets.manifest import load_split, read_manifest
from stagewise.datasets.statistics import column_moments, feature_vectors_of, normalised_rows
from stagewise.definitions.config import Split
from stagewise.definitions.loading import load_config
from tests.bad_parquet import BAD_KINDS, EXPECTED_WORDING, write_bad_file
from tests.conftest import REPO_ROOT, base_config

NUM_FEATURES = 5
SPLIT = Split(validation=0.15, test=0.2, salt="stagewise")


@pytest.fixture
def synthetic(write_config, storage_root):
    """Write synthetic raw shards under the storage root; return (config, raw URI) for a dataset over them."""

    def make(num_rows: int = 3_000, num_shards: int = 3, dirty_fraction: float = 0.02, overrides: dict | None = None,
             dataset: dict | None = None):
        raw_uri = str(storage_root / "raw" / "synth")
        write_synthetic(raw_uri, num_rows, num_features=NUM_FEATURES, num_classes=10, num_shards=num_shards,
                        dirty_fraction=dirty_fraction)
        raw = base_config(storage_root)
        raw["dataset"] = {"uri": "raw/synth", "key": "row_id", "label": "label", "features": "f_*", "num_classes": 10,
                          **(dataset or {})}
        return load_config(write_config(raw), overrides=overrides), raw_uri

    return make


def _stats_and_reduce(config, shards: list[str], out: str) -> dict:
    uris = [preprocess.shard_stats(config, uri, i, out)["stats_uri"] for i, uri in enumerate(shards)]
    return preprocess.reduce_stats(config, out, uris)


def _run_all(config, raw_uri: str, out: str) -> tuple[dict, list[str]]:
    shards = preprocess.plan(raw_uri)
    reduced = _stats_and_reduce(config, shards, out)
    results = [preprocess.transform_shard(config, uri, i, out, reduced["stats_uri"]) for i, uri in enumerate(shards)]
    committed = preprocess.commit(config, out, reduced["stats_uri"], results)
    return read_manifest(committed["manifest_uri"]), shards


def _clean_raw(shards: list[str]) -> pa.Table:
    """The raw rows with no null feature: what cleaning must keep."""
    table = pa.concat_tables([pq.read_table(uri) for uri in shards])
    features = [name for name in table.column_names if name.startswith("f_")]
    keep = np.ones(table.num_rows, bool)
    for name in features:
        keep &= ~table.column(name).is_null().to_numpy(zero_copy_only=False)
    return table.filter(pa.array(keep))


def _keys_by_split(manifest: dict) -> dict[str, set]:
    return {name: set(np.concatenate([pq.read_table(f["uri"], columns=[manifest["key"]]).column(0).to_numpy()
                                      for f in files]).tolist()) if files else set()
            for name, files in manifest["splits"].items()}


# --- split_of ---------------------------------------------------------------------------------------------------


def test_split_is_deterministic():
    """The same keys always land in the same splits."""
    keys = pa.array(np.arange(5_000, dtype=np.int64))
    assert np.array_equal(split_of(keys, SPLIT), split_of(keys, SPLIT))


def test_split_depends_only_on_the_key():
    """A key's split is the same whatever batch it arrives in and in whatever order (retries re-batch freely)."""
    keys = np.arange(10_000, dtype=np.int64)
    whole = split_of(pa.array(keys), SPLIT)
    order = np.random.default_rng(1).permutation(len(keys))
    shuffled = split_of(pa.array(keys[order]), SPLIT)
    assert np.array_equal(shuffled, whole[order])
    chunks = np.concatenate([split_of(pa.array(chunk), SPLIT) for chunk in np.array_split(keys, 7)])
    assert np.array_equal(chunks, whole)
    assert split_of(pa.array(keys[1234:1235]), SPLIT)[0] == whole[1234]


def test_split_fractions_match_the_config_on_20k_keys():
    """Validation and test fractions are close to the configured ones (binomial sd ~0.003 at 20k)."""
    codes = split_of(pa.array(np.arange(20_000, dtype=np.int64)), SPLIT)
    assert set(np.unique(codes).tolist()) == {0, 1, 2}
    assert (codes == 1).mean() == pytest.approx(SPLIT.validation, abs=0.015)
    assert (codes == 2).mean() == pytest.approx(SPLIT.test, abs=0.015)


def test_split_salt_changes_the_draw():
    """Another salt draws another split with the same fractions."""
    keys = pa.array(np.arange(20_000, dtype=np.int64))
    other = Split(validation=0.15, test=0.2, salt="another")
    first, second = split_of(keys, SPLIT), split_of(keys, other)
    assert not np.array_equal(first, second)
    assert (second == 2).mean() == pytest.approx(0.2, abs=0.015)


def test_string_keys_split_deterministically_with_the_right_fractions():
    """String keys work: per-key determinism and configured fractions, in any batch."""
    keys = [f"user-{i:06d}" for i in range(20_000)]
    codes = split_of(pa.array(keys), SPLIT)
    assert np.array_equal(split_of(pa.array(keys[::-1]), SPLIT), codes[::-1])
    assert np.array_equal(split_of(pa.array(keys, pa.large_string()), SPLIT), codes)
    assert (codes == 1).mean() == pytest.approx(0.15, abs=0.015)
    assert (codes == 2).mean() == pytest.approx(0.2, abs=0.015)


# --- statistics -------------------------------------------------------------------------------------------------


def test_reduced_stats_equal_numpy_on_the_cleaned_rows(synthetic, storage_root, monkeypatch):
    """Mean and std merged over shards and small batches equal numpy's over all clean rows (nulls dropped)."""
    monkeypatch.setattr(preprocess, "BATCH_ROWS", 97)  # many batches per shard: exercises the pairwise merge
    config, raw_uri = synthetic(num_rows=4_000, num_shards=3, dirty_fraction=0.03)
    shards = preprocess.plan(raw_uri)
    out = str(storage_root / "runs" / "t" / "stats")
    reduced = _stats_and_reduce(config, shards, out)
    stats = storage.read_json(reduced["stats_uri"])
    clean = _clean_raw(shards)
    matrix = np.column_stack([clean.column(name).to_numpy() for name in stats["features"]])
    assert stats["features"] == [f"f_{i:03d}" for i in range(NUM_FEATURES)]
    assert reduced["rows_kept"] == clean.num_rows
    assert reduced["rows_dropped"] == 4_000 - clean.num_rows > 0
    np.testing.assert_allclose(stats["mean"], matrix.mean(axis=0), rtol=1e-9)
    np.testing.assert_allclose(stats["std"], matrix.std(axis=0, ddof=1), rtol=1e-9)
    labels = clean.column("label").to_numpy()
    assert stats["label_counts"] == np.bincount(labels, minlength=10).tolist()


def test_too_many_dirty_rows_is_a_data_error(synthetic, storage_root):
    """Dropping more than max_null_fraction of the rows fails, naming the setting."""
    config, raw_uri = synthetic(num_rows=2_000, num_shards=2, dirty_fraction=0.3,
                                overrides={"preprocess.max_null_fraction": 0.1})
    with pytest.raises(DataError, match="max_null_fraction"):
        _stats_and_reduce(config, preprocess.plan(raw_uri), str(storage_root / "runs" / "t" / "dirty"))


def test_reduce_with_no_shards_is_a_data_error(synthetic, storage_root):
    """An empty list of shard statistics is bad input, not an empty success."""
    config, _ = synthetic(num_rows=100, num_shards=1)
    with pytest.raises(DataError):
        preprocess.reduce_stats(config, str(storage_root / "runs" / "t" / "none"), [])


# --- schema errors ----------------------------------------------------------------------------------------------


def _write_bad(storage_root: Path, columns: dict) -> str:
    path = storage_root / "raw" / "bad" / "part-00000.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return str(path)


def _good_columns(num_rows: int = 20) -> dict:
    rng = np.random.default_rng(0)
    return {"row_id": pa.array(np.arange(num_rows, dtype=np.int64)),
            "f_000": pa.array(rng.normal(size=num_rows)), "f_001": pa.array(rng.normal(size=num_rows)),
            "label": pa.array(np.arange(num_rows, dtype=np.int64) % 10)}


@pytest.mark.parametrize("change,column,dataset", [
    (lambda c: c.pop("f_001"), "f_001", {"features": ["f_000", "f_001"]}),
    (lambda c: c.pop("row_id"), "row_id", None),
    (lambda c: c.pop("label"), "label", None),
    (lambda c: c.update(f_001=pa.array([str(i) for i in range(20)])), "f_001", None),
    (lambda c: c.update(label=pa.array(np.arange(20, dtype=np.float64) % 10)), "label", None),
    (lambda c: c.update(label=pa.array(np.arange(20, dtype=np.int64))), "label", None),  # values up to 19 >= 10
], ids=["missing-feature", "missing-key", "missing-label", "string-feature", "float-label", "label-out-of-range"])
def test_schema_errors_name_the_file_and_the_column(synthetic, storage_root, change, column, dataset):
    """A wrong column (missing, non-numeric, float label, label outside [0, num_classes)) names file and column."""
    config, _ = synthetic(num_rows=100, num_shards=1, dataset=dataset)
    columns = _good_columns()
    change(columns)
    uri = _write_bad(storage_root, columns)
    with pytest.raises(DataError) as caught:
        preprocess.shard_stats(config, uri, 0, str(storage_root / "runs" / "t" / "bad"))
    assert uri in str(caught.value) and f"'{column}'" in str(caught.value).replace('"', "'")


def test_label_out_of_range_names_the_value(synthetic, storage_root):
    """A negative label is a schema error naming the offending value and num_classes."""
    config, _ = synthetic(num_rows=100, num_shards=1)
    columns = _good_columns()
    columns["label"] = pa.array(np.full(20, -1, dtype=np.int64))
    uri = _write_bad(storage_root, columns)
    with pytest.raises(DataError, match=r"value -1 outside \[0, 10\)"):
        preprocess.shard_stats(config, uri, 0, str(storage_root / "runs" / "t" / "bad"))


def test_rows_with_null_label_or_key_are_dropped_not_fatal(synthetic, storage_root):
    """Null keys, null labels and non-finite features are dirt: dropped and counted, not an error."""
    config, _ = synthetic(num_rows=100, num_shards=1)
    columns = _good_columns()
    columns["row_id"] = pa.array([None] + list(range(1, 20)), pa.int64())
    columns["label"] = pa.array([0, None] + [i % 10 for i in range(2, 20)], pa.int64())
    f0 = columns["f_000"].to_numpy().copy()
    f0[2], f0[3] = np.inf, np.nan
    columns["f_000"] = pa.array(f0)
    uri = _write_bad(storage_root, columns)
    result = preprocess.shard_stats(config, uri, 0, str(storage_root / "runs" / "t" / "dirt"))
    assert (result["rows_in"], result["rows_kept"]) == (20, 16)


@pytest.mark.parametrize("num_features,difference", [(NUM_FEATURES - 1, "lacks feature column(s) ['f_004']"),
                                                     (NUM_FEATURES + 1, "has extra feature column(s) ['f_005']")],
                         ids=["missing", "extra"])
def test_a_shard_with_a_missing_or_extra_prefixed_feature_names_the_column_and_both_files(
        synthetic, storage_root, num_features, difference):
    """With dataset.features 'f_*', a shard lacking one column or having one more fails naming only that column and
    the two files (not two full column lists), in reduce and in transform."""
    from stagewise.datasets.demo import synthetic_table

    config, raw_uri = synthetic(num_rows=1_000, num_shards=2, dirty_fraction=0.0)
    out = str(storage_root / "runs" / "t" / "columns")
    shards = preprocess.plan(raw_uri)
    reduced = _stats_and_reduce(config, shards, out)
    odd = str(Path(raw_uri) / "part-00002.parquet")
    pq.write_table(synthetic_table(50, num_features=num_features, first_key=90_000), odd)
    with pytest.raises(DataError) as in_reduce:
        _stats_and_reduce(config, preprocess.plan(raw_uri), out)
    with pytest.raises(DataError) as in_transform:
        preprocess.transform_shard(config, odd, 2, out, reduced["stats_uri"])
    for caught in (in_reduce, in_transform):
        message = str(caught.value)
        assert message.startswith(f"{odd}: {difference} that {shards[0]}")
        assert "f_001" not in message


# --- duplicate keys ---------------------------------------------------------------------------------------------


def _write_table(folder: Path, name: str, table: pa.Table) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, folder / name)
    return str(folder / name)


def test_the_same_keys_in_two_shards_fail_naming_the_key_and_both_files(synthetic, storage_root):
    """Two shards sharing one key fail reduce with a DataError naming the key value and both files."""
    from stagewise.datasets.demo import synthetic_table

    config, raw_uri = synthetic(num_rows=3_000, num_shards=3, dirty_fraction=0.0)
    clash = _write_table(Path(raw_uri), "part-00003.parquet", synthetic_table(500, num_features=NUM_FEATURES, first_key=2_999))
    with pytest.raises(DataError) as caught:
        _stats_and_reduce(config, preprocess.plan(raw_uri), str(storage_root / "runs" / "t" / "dup"))
    message = str(caught.value)
    assert "'row_id' value 2999 occurs in both" in message
    assert str(Path(raw_uri) / "part-00002.parquet") in message and clash in message


def test_a_copy_of_a_shard_under_another_name_fails(synthetic, storage_root):
    """The same file twice in the data set (a copy under another name) is caught: every key is duplicated."""
    import shutil

    config, raw_uri = synthetic(num_rows=2_000, num_shards=2, dirty_fraction=0.0)
    shutil.copy(Path(raw_uri) / "part-00001.parquet", Path(raw_uri) / "part-00001-copy.parquet")
    with pytest.raises(DataError, match="occurs in both") as caught:
        _stats_and_reduce(config, preprocess.plan(raw_uri), str(storage_root / "runs" / "t" / "copy"))
    assert f"{raw_uri}/part-00001.parquet" in str(caught.value) and f"{raw_uri}/part-00001-copy.parquet" in str(caught.value)


@pytest.mark.parametrize("column,change,types", [
    ("row_id", lambda t: t.set_column(0, "row_id", pa.array([str(k) for k in t.column("row_id").to_pylist()])),
     ("string", "int64")),
    ("f_002", lambda t: t.set_column(3, "f_002", pa.array(np.round(t.column("f_002").to_numpy()).astype(np.int64))),
     ("int64", "double")),
], ids=["string-key-among-int-keys", "int-feature-among-float"])
def test_a_column_typed_differently_in_one_shard_fails_reduce_naming_file_column_and_both_types(
        synthetic, storage_root, column, change, types):
    """A copy of a shard with its keys stored as strings hashes apart from the int keys and would slip past the
    duplicate check (training rows among the test rows): reduce refuses any column whose type differs between files,
    naming the file, the column and both types, before a split is written."""
    config, raw_uri = synthetic(num_rows=1_000, num_shards=2, dirty_fraction=0.0)
    odd = str(Path(raw_uri) / "part-00002.parquet")  # a copy of part-00000, sorted after it
    pq.write_table(change(pq.read_table(Path(raw_uri) / "part-00000.parquet")), odd)
    out = str(storage_root / "runs" / "t" / "types")
    with pytest.raises(DataError) as caught:
        _stats_and_reduce(config, preprocess.plan(raw_uri), out)
    message = str(caught.value)
    assert message.startswith(f"{odd}: column '{column}' has type {types[0]} here but {types[1]} in {raw_uri}/part-00000.parquet")
    assert not storage.exists(str(Path(out) / "preprocess" / "stats.json"))


def test_encodings_of_one_type_are_not_a_type_difference(synthetic, storage_root):
    """Dictionary-encoded, large and plain strings, and a list's element field name, are one type to the comparison."""
    from stagewise.datasets.columns import type_name

    assert type_name(pa.dictionary(pa.int32(), pa.string())) == type_name(pa.large_string()) == "string"
    assert type_name(pa.list_(pa.field("element", pa.int64()))) == type_name(pa.large_list(pa.int64()))
    config, raw_uri = synthetic(num_rows=1_000, num_shards=2, dirty_fraction=0.0, dataset={"uri": "raw/strkeys"})
    folder = storage_root / "raw" / "strkeys"
    for index, shard in enumerate(preprocess.plan(raw_uri)):
        table = pq.read_table(shard)
        keys = pa.array([f"k{k}" for k in table.column("row_id").to_pylist()], pa.large_string() if index else pa.string())
        _write_table(folder, f"part-{index:05d}.parquet", table.set_column(0, "row_id", keys))
    reduced = _stats_and_reduce(config, preprocess.plan(str(folder)), str(storage_root / "runs" / "t" / "encodings"))
    assert reduced["rows_kept"] == 1_000


def test_the_same_shard_listed_twice_fails(synthetic, storage_root):
    """One file listed as two shards, spelled the same or once as a file:// URI, is refused naming it."""
    config, raw_uri = synthetic(num_rows=1_000, num_shards=1, dirty_fraction=0.0)
    shard = preprocess.plan(raw_uri)[0]
    for second in (shard, f"file://{shard}"):
        with pytest.raises(DataError, match=r"is listed twice \(shards 0 and 1\)"):
            _stats_and_reduce(config, [shard, second], str(storage_root / "runs" / "t" / "twice"))


def test_a_key_repeated_inside_one_file_fails_naming_the_file(synthetic, storage_root):
    """A string key that occurs twice in one file fails naming that file and the value."""
    config, _ = synthetic(num_rows=100, num_shards=1, dataset={"uri": "raw/strings"})
    columns = _good_columns()
    columns["row_id"] = pa.array([f"user-{i:03d}" for i in range(19)] + ["user-007"])
    uri = _write_table(storage_root / "raw" / "strings", "part-00000.parquet", pa.table(columns))
    with pytest.raises(DataError) as caught:
        _stats_and_reduce(config, preprocess.plan(uri), str(storage_root / "runs" / "t" / "in_file"))
    assert str(caught.value).startswith(f"{uri}: dataset.key 'row_id' value 'user-007' occurs more than once in this file")


def test_hash_collisions_are_confirmed_against_the_keys_not_reported(synthetic, storage_root, monkeypatch):
    """With a deliberately coarse key hash (every key collides with hundreds of others) unique keys still pass and a
    real duplicate among the collisions is the one reported: the check is exact, the hash only narrows it."""
    from stagewise.datasets.demo import synthetic_table

    monkeypatch.setattr(preprocess, "key_hashes", lambda keys: key_bits(keys) % np.uint64(7))
    config, raw_uri = synthetic(num_rows=3_000, num_shards=3, dirty_fraction=0.0)
    out = str(storage_root / "runs" / "t" / "collide")
    reduced = _stats_and_reduce(config, preprocess.plan(raw_uri), out)
    assert reduced["rows_kept"] == 3_000
    clash = _write_table(Path(raw_uri), "part-00003.parquet", synthetic_table(1, num_features=NUM_FEATURES, first_key=1_234))
    with pytest.raises(DataError, match=f"value 1234 occurs in both .*part-00001.parquet and {clash}"):
        _stats_and_reduce(config, preprocess.plan(raw_uri), out)


@pytest.mark.parametrize("clash_key", [4_321, 17_777, 25_002])
def test_a_colliding_hash_spread_over_many_merge_rounds_is_confirmed_as_one_group(synthetic, storage_root, monkeypatch,
                                                                                  clash_key):
    """With a 3-value key hash, tiny merge buffers and tiny candidate batches, each hash's matches span many merge
    rounds; they are still confirmed together, so a duplicate whose two rows fall in different rounds is found."""
    from stagewise.datasets.demo import synthetic_table

    monkeypatch.setattr(preprocess, "key_hashes", lambda keys: key_bits(keys) % np.uint64(3))
    monkeypatch.setattr(key_module, "MERGE_BUDGET_HASHES", 1)  # 1024-hash chunks
    monkeypatch.setattr(key_module, "MAX_CANDIDATES", 100)
    config, raw_uri = synthetic(num_rows=30_000, num_shards=3, dirty_fraction=0.0)
    clash = _write_table(Path(raw_uri), "part-00003.parquet",
                         synthetic_table(1, num_features=NUM_FEATURES, first_key=clash_key))
    with pytest.raises(DataError, match=f"value {clash_key} occurs in both .*part-0000{clash_key // 10_000}.parquet and {clash}"):
        _stats_and_reduce(config, preprocess.plan(raw_uri), str(storage_root / "runs" / "t" / "rounds"))


def test_the_bounded_merge_finds_exactly_the_repeated_hashes(tmp_path, monkeypatch):
    """The k-way merge over sorted sidecars, in chunks far smaller than the data, reports exactly the hashes that occur
    more than once overall (within one sidecar, across sidecars, across chunk boundaries) and the sidecars holding them."""
    monkeypatch.setattr(key_module, "MERGE_BUDGET_HASHES", 1)  # 1024-hash chunks: many rounds
    monkeypatch.setattr(key_module, "MAX_CANDIDATES", 500)  # several confirmation batches
    rng = np.random.default_rng(4)
    arrays = [np.sort(rng.integers(0, 40_000, size=size).astype(np.uint64)) for size in (5_000, 3_100, 0, 7_777)]
    sidecars = []
    for index, array in enumerate(arrays):
        uri = str(tmp_path / f"keys-{index}.u64")
        storage.write_bytes(uri, array.astype("<u8").tobytes())
        sidecars.append(uri)
    found = list(repeated_hashes(sidecars))
    assert len(found) > 1, "the candidate cap splits the work into batches"
    pairs = {(int(h), int(o)) for hashes, owners in found for h, o in zip(hashes, owners)}
    everything = np.concatenate(arrays)
    owner = np.concatenate([np.full(len(a), i) for i, a in enumerate(arrays)])
    values, counts = np.unique(everything, return_counts=True)
    repeated = set(values[counts > 1].tolist())
    assert {h for h, _ in pairs} == repeated
    assert pairs == {(int(h), int(o)) for h, o in zip(everything, owner) if int(h) in repeated}


def test_a_retried_shard_leaves_no_stale_key_hashes_that_count_twice(synthetic, storage_root):
    """Running a shard's stats twice (a retry) uses only the hashes its stats name: no false duplicate, and the
    commit deletes the earlier attempt's hash file."""
    config, raw_uri = synthetic(num_rows=2_000, num_shards=2, dirty_fraction=0.0)
    out = str(storage_root / "runs" / "t" / "retry_keys")
    shards = preprocess.plan(raw_uri)
    preprocess.shard_stats(config, shards[0], 0, out)  # the first attempt, later retried
    manifest, _ = _run_all(config, raw_uri, out)
    assert sum(manifest["rows"].values()) == 2_000
    left = sorted(p.name for p in (Path(out) / "preprocess" / "stats").glob("*.u64"))
    named = sorted(Path(storage.read_json(str(Path(out) / "preprocess" / "stats" / f"shard-{i:05d}.json"))["key_hashes_uri"]).name
                   for i in range(2))
    assert left == named


def test_an_input_of_only_empty_files_says_it_has_no_rows(synthetic, storage_root):
    """Only 0-row files: the error says the input has no rows and names the files (not that rows were dirty)."""
    config, _ = synthetic(num_rows=100, num_shards=1, dataset={"uri": "raw/empty"})
    empty = pa.table(_good_columns()).slice(0, 0)
    uris = [_write_table(storage_root / "raw" / "empty", f"part-{i:05d}.parquet", empty) for i in range(2)]
    with pytest.raises(DataError) as caught:
        _stats_and_reduce(config, uris, str(storage_root / "runs" / "t" / "empty"))
    message = str(caught.value)
    assert "has no rows" in message and "dirty" not in message
    assert all(uri in message for uri in uris)


@pytest.mark.subprocess
def test_standalone_reduce_refuses_when_a_planned_shard_has_no_stats(synthetic, storage_root, subprocess_env):
    """`python -m stagewise.preprocess reduce` with one planned shard's stats missing exits USER_ERROR_EXIT naming that
    shard, and writes no stats.json (a failed shard is never silently left out)."""
    import subprocess
    import sys

    from stagewise.core.errors import USER_ERROR_EXIT

    config, raw_uri = synthetic(num_rows=3_000, num_shards=3, dirty_fraction=0.0)
    out = storage_root / "runs" / "t" / "partial"
    shards = preprocess.plan(raw_uri)
    for index in (0, 2):
        preprocess.shard_stats(config, shards[index], index, str(out))
    completed = subprocess.run([sys.executable, "-m", "stagewise.preprocess", "reduce", "--config",
                                str(storage_root.parent / "pipeline.yaml"), "--out", "runs/t/partial"],
                               cwd=REPO_ROOT, env=subprocess_env, capture_output=True, text=True, timeout=120)
    assert completed.returncode == USER_ERROR_EXIT, completed.stdout[-2000:] + completed.stderr[-2000:]
    assert f"no statistics for planned shard(s) 1 ({shards[1]})" in completed.stdout
    assert not (out / "preprocess" / "stats.json").exists()


def test_planned_stats_refuses_stats_of_another_file(synthetic, storage_root):
    """Stats left at a shard's index by another input (a stale file) are refused naming both files."""
    config, raw_uri = synthetic(num_rows=2_000, num_shards=2, dirty_fraction=0.0)
    out = str(storage_root / "runs" / "t" / "stale")
    shards = preprocess.plan(raw_uri)
    preprocess.shard_stats(config, shards[0], 0, out)
    preprocess.shard_stats(config, shards[0], 1, out)  # index 1 computed for the wrong file
    with pytest.raises(DataError, match=f"statistics of {shards[0]}, but planned shard 1 is {shards[1]}"):
        preprocess.planned_stats(out, shards)
    preprocess.shard_stats(config, shards[1], 1, out)
    assert len(preprocess.planned_stats(out, shards)) == 2


# --- broken files -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_a_broken_shard_fails_stats_and_transform_naming_the_file(synthetic, storage_root, kind):
    """An empty, non-Parquet, truncated or corrupt raw shard is a DataError (no retry) naming the file and what is
    wrong with it, in both the stats pass and the transform pass."""
    config, raw_uri = synthetic(num_rows=2_000, num_shards=2, dirty_fraction=0.0)
    out = str(storage_root / "runs" / "t" / "broken")
    shards = preprocess.plan(raw_uri)
    reduced = _stats_and_reduce(config, shards, out)
    bad = str(write_bad_file(kind, Path(raw_uri) / "part-99999.parquet", Path(shards[0]).read_bytes()))
    for step in (lambda: preprocess.shard_stats(config, bad, 2, out),
                 lambda: preprocess.transform_shard(config, bad, 2, out, reduced["stats_uri"])):
        with pytest.raises(DataError) as caught:
            step()
        assert bad in str(caught.value) and EXPECTED_WORDING[kind] in str(caught.value)


@pytest.mark.subprocess
def test_stats_cli_on_a_corrupt_shard_exits_as_user_error_naming_the_file(synthetic, storage_root, subprocess_env):
    """`python -m stagewise.preprocess stats` on a truncated shard exits USER_ERROR_EXIT (Airflow does not retry) and
    its log names the file."""
    import subprocess
    import sys

    from stagewise.core.errors import USER_ERROR_EXIT

    config, raw_uri = synthetic(num_rows=1_000, num_shards=1, dirty_fraction=0.0)
    shard = preprocess.plan(raw_uri)[0]
    bad = str(write_bad_file("truncated", Path(raw_uri) / "part-00001.parquet", Path(shard).read_bytes()))
    config_path = storage_root.parent / "pipeline.yaml"
    completed = subprocess.run([sys.executable, "-m", "stagewise.preprocess", "stats", "--config", str(config_path),
                                "--shard", bad, "--index", "1", "--out", "runs/t/cli"],
                               cwd=REPO_ROOT, env=subprocess_env, capture_output=True, text=True, timeout=120)
    assert completed.returncode == USER_ERROR_EXIT, completed.stdout[-2000:] + completed.stderr[-2000:]
    assert f"{bad}: has no Parquet footer" in completed.stdout
    assert "is truncated" in completed.stdout


# --- end to end -------------------------------------------------------------------------------------------------


def test_end_to_end_manifest_counts_and_disjoint_splits(synthetic, storage_root):
    """The manifest's row counts match the listed files; splits are disjoint and together hold exactly the clean keys."""
    config, raw_uri = synthetic(num_rows=3_000, num_shards=3, dirty_fraction=0.02)
    out = str(storage_root / "runs" / "t" / "e2e")
    manifest, shards = _run_all(config, raw_uri, out)
    for name, files in manifest["splits"].items():
        for entry in files:
            assert pq.ParquetFile(entry["uri"]).metadata.num_rows == entry["rows"]
        assert manifest["rows"][name] == sum(entry["rows"] for entry in files)
    keys = _keys_by_split(manifest)
    assert not (keys["train"] & keys["validation"]) and not (keys["train"] & keys["test"])
    assert not (keys["validation"] & keys["test"])
    clean = _clean_raw(shards)
    clean_keys = set(clean.column("row_id").to_numpy().tolist())
    assert keys["train"] | keys["validation"] | keys["test"] == clean_keys
    assert sum(manifest["rows"].values()) == len(clean_keys)
    assert manifest["rows_dropped"] == 3_000 - len(clean_keys)
    # Each key sits in the split its hash names.
    for code, name in enumerate(SPLITS):
        chosen = np.fromiter(keys[name], dtype=np.int64)
        assert (split_of(pa.array(chosen), config.preprocess.split) == code).all()


def test_retry_yields_the_same_splits_and_removes_stale_attempt_files(synthetic, storage_root):
    """Re-running transform and commit (a retry) gives the same keys per split; the first attempt's files are gone."""
    config, raw_uri = synthetic(num_rows=2_000, num_shards=2)
    out = str(storage_root / "runs" / "t" / "retry")
    first, shards = _run_all(config, raw_uri, out)
    first_keys = _keys_by_split(first)
    stats_uri = storage.join(out, "preprocess", "stats.json")
    # A crashed attempt of shard 0 leaves its files behind before the retry succeeds.
    preprocess.transform_shard(config, shards[0], 0, out, stats_uri)
    results = [preprocess.transform_shard(config, uri, i, out, stats_uri) for i, uri in enumerate(shards)]
    second = read_manifest(preprocess.commit(config, out, stats_uri, results)["manifest_uri"])
    assert _keys_by_split(second) == first_keys
    assert second["rows"] == first["rows"]
    listed = {entry["uri"] for files in second["splits"].values() for entry in files}
    on_disk = {str(p) for name in SPLITS for p in (Path(out) / "preprocess" / name).glob("*")}
    assert on_disk == listed
    assert not listed & {entry["uri"] for files in first["splits"].values() for entry in files}


def test_a_full_disk_during_transform_names_the_file_it_was_writing_and_stays_retryable(synthetic, storage_root,
                                                                                       monkeypatch):
    """ENOSPC while a split file is written (or while a JSON is) is an infrastructure fault, so it stays an OSError
    with its errno (retried), but its message names the file, where Python's names none."""
    import errno
    import os

    from stagewise.core.errors import UserError

    config, raw_uri = synthetic(num_rows=600, num_shards=1, dirty_fraction=0.0)
    out = str(storage_root / "runs" / "t" / "full")
    shard = preprocess.plan(raw_uri)[0]
    reduced = _stats_and_reduce(config, [shard], out)

    class FullDisk(pq.ParquetWriter):
        def write_batch(self, *args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(preprocess.pq, "ParquetWriter", FullDisk)
    with pytest.raises(OSError) as caught:
        preprocess.transform_shard(config, shard, 0, out, reduced["stats_uri"])
    assert not isinstance(caught.value, UserError) and caught.value.errno == errno.ENOSPC
    assert str(caught.value).startswith("[Errno 28] No space left on device, writing: ")
    assert caught.value.filename.startswith(f"{out}/preprocess/train/part-00000-") and caught.value.filename.endswith(".parquet")
    monkeypatch.undo()

    def no_space(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", no_space)
    target = str(Path(out) / "preprocess" / "stats.json")
    with pytest.raises(OSError, match="No space left on device") as caught:
        storage.write_json(target, {"a": 1})
    assert caught.value.filename == target and caught.value.errno == errno.ENOSPC


def test_normalised_features_are_standardised(synthetic, storage_root):
    """Written features are (x - mean) / std: zero mean and unit std over all clean rows; close to that on train."""
    config, raw_uri = synthetic(num_rows=6_000, num_shards=3, dirty_fraction=0.01)
    out = str(storage_root / "runs" / "t" / "norm")
    manifest, _ = _run_all(config, raw_uri, out)
    parts = {name: load_split(manifest, name)[0] for name in SPLITS}
    everything = np.concatenate(list(parts.values())).astype(np.float64)
    np.testing.assert_allclose(everything.mean(axis=0), 0.0, atol=1e-5)
    np.testing.assert_allclose(everything.std(axis=0, ddof=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(parts["train"].mean(axis=0), 0.0, atol=0.06)
    np.testing.assert_allclose(parts["train"].std(axis=0), 1.0, atol=0.06)
    assert parts["train"].dtype == np.float32


def test_digits_constant_columns_pass_through_centred(digits_run):
    """Blank pixel columns (std 0) are centred, not divided by zero: no NaN or inf reaches training."""
    _, out = digits_run
    manifest = read_manifest(storage.join(out, "preprocess", "manifest.json"))
    features, labels = load_split(manifest, "train")
    assert np.isfinite(features).all()
    assert sum(manifest["rows"].values()) == 1797
    assert set(labels.tolist()) == set(range(10))


def test_read_manifest_refuses_other_kinds(tmp_path):
    """Only a preprocess manifest is accepted where one is expected."""
    uri = str(tmp_path / "manifest.json")
    storage.write_json(uri, {"kind": "predictions"})
    with pytest.raises(DataError, match="not a preprocess manifest"):
        read_manifest(uri)


@pytest.mark.parametrize("kept_every_row", [True, False])
def test_moments_and_normalise_on_scratch_memory_equal_plain_numpy_bit_for_bit(kept_every_row):
    """The column-at-a-time moments and the block-wise normalised rows, computed into reused scratch arrays, equal
    plain numpy on the kept rows exactly, for contiguous vectors and strided ones (a tensor column's elements)."""
    rng = np.random.default_rng(3)
    matrix = rng.normal(5.0, 3.0, (9_001, 7))
    vectors = [matrix[:, 0].copy(), *(matrix[:, i] for i in range(1, 7))]  # one contiguous, six strided
    kept = None if kept_every_row else np.flatnonzero(rng.random(len(matrix)) > 0.1)
    clean = matrix if kept is None else matrix[kept]
    mean, std = clean.mean(axis=0), clean.std(axis=0)
    for size in (9_001, 5_000):  # the second call is smaller and reuses the first one's memory
        rows = rng.permutation(len(matrix))[:size]
        core = column_moments(vectors, kept)
        assert core["count"] == len(clean)
        assert core["mean"] == [clean[:, i].mean() for i in range(7)]
        assert core["m2"] == [((clean[:, i] - clean[:, i].mean()) ** 2).sum() for i in range(7)]
        assert core["min"] == clean.min(axis=0).tolist() and core["max"] == clean.max(axis=0).tolist()
        normalised = normalised_rows(vectors, rows, mean, std)
        assert normalised.flags.c_contiguous and normalised.dtype == np.float32
        assert np.array_equal(normalised, ((matrix[rows] - mean) / std).astype(np.float32))


def test_feature_vectors_keep_only_rows_present_and_finite_in_every_column():
    """A null or non-finite value in any feature column marks its row dirty; a float64 column is read in place, an
    integer one converted, and a tensor column gives one vector per element."""
    batch = pa.record_batch({
        "a": pa.array([1.0, None, 3.0, 4.0, 5.0]),
        "b": pa.array([1, 2, 3, None, 5], pa.int32()),
        "t": pa.array([[1.0, 2.0], [3.0, 4.0], [5.0, float("inf")], [7.0, 8.0], [9.0, 10.0]]),
    })
    vectors, keep = feature_vectors_of(batch, ["a", "b", "t"], {"t": [2]}, "mem.parquet")
    assert keep.tolist() == [True, False, False, False, True]
    assert np.shares_memory(vectors[0], np.frombuffer(batch.column("a").buffers()[1], np.float64))
    assert [v[[0, 4]].tolist() for v in vectors] == [[1.0, 5.0], [1.0, 5.0], [1.0, 9.0], [2.0, 10.0]]


def test_processed_rows_do_not_depend_on_the_batch_size(synthetic, storage_root, monkeypatch):
    """Batches of unequal size share scratch memory: each split's normalised rows, keys and labels are the same
    whether a shard is one batch or many."""
    config, raw_uri = synthetic(num_rows=6_000, num_shards=2, dirty_fraction=0.05)
    one_batch, _ = _run_all(config, raw_uri, str(storage_root / "runs" / "one"))
    monkeypatch.setattr(preprocess, "BATCH_ROWS", 777)
    stats_uri = str(storage_root / "runs" / "one" / "preprocess" / "stats.json")
    shards = preprocess.plan(raw_uri)
    out = str(storage_root / "runs" / "many")
    results = [preprocess.transform_shard(config, uri, i, out, stats_uri) for i, uri in enumerate(shards)]
    many = read_manifest(preprocess.commit(config, out, stats_uri, results)["manifest_uri"])
    assert many["rows"] == one_batch["rows"]
    for split in SPLITS:
        expected, got = load_split(one_batch, split), load_split(many, split)
        assert np.array_equal(expected[0], got[0]) and np.array_equal(expected[1], got[1])
        assert len(got[0]) > 0
