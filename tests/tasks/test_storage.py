"""Storage helpers: atomic writes, Parquet discovery, safe run paths and cleanup of unlisted attempt files."""

from __future__ import annotations

import os
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stagewise.core import storage
from stagewise.core.errors import DataError, UserError
from tests.bad_parquet import BAD_KINDS, EXPECTED_WORDING, write_bad_file


def _crash_on_replace(monkeypatch) -> None:
    def crash(*_args, **_kwargs):
        raise OSError("power cut before the rename")

    monkeypatch.setattr(os, "replace", crash)


def test_write_bytes_round_trips_and_creates_parents(tmp_path):
    """write_bytes creates missing folders and the file holds exactly the bytes given."""
    target = tmp_path / "a" / "b" / "blob.bin"
    storage.write_bytes(str(target), b"\x00payload\xff")
    assert target.read_bytes() == b"\x00payload\xff"


def test_write_bytes_accepts_file_uris(tmp_path):
    """A file:// URI takes the same path as a plain one."""
    target = tmp_path / "x.json"
    storage.write_json(f"file://{target}", {"b": 1, "a": [1, 2]})
    assert storage.read_json(str(target)) == {"a": [1, 2], "b": 1}


def test_crash_before_rename_keeps_the_previous_content(tmp_path, monkeypatch):
    """A crash mid-write leaves the old file whole: readers never see a torn or new-but-partial file."""
    target = tmp_path / "manifest.json"
    storage.write_bytes(str(target), b"committed")
    _crash_on_replace(monkeypatch)
    with pytest.raises(OSError, match="power cut"):
        storage.write_bytes(str(target), b"half-written replacement")
    monkeypatch.undo()
    assert target.read_bytes() == b"committed"


def test_crash_before_rename_leaves_no_target(tmp_path, monkeypatch):
    """A crash on a first write leaves the target absent, so a reader finds nothing rather than a partial file."""
    target = tmp_path / "out" / "part-00000.parquet"
    _crash_on_replace(monkeypatch)
    with pytest.raises(OSError):
        storage.write_bytes(str(target), b"partial")
    monkeypatch.undo()
    assert not target.exists()
    assert not list((tmp_path / "out").glob("*.parquet")), "no file a Parquet reader would pick up"


def test_read_json_of_a_missing_file_names_it(tmp_path):
    """Reading an absent JSON file raises FileNotFoundError naming the URI."""
    uri = str(tmp_path / "nope.json")
    with pytest.raises(FileNotFoundError, match=re.escape(uri)):
        storage.read_json(uri)


def _parquet(path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"x": [1, 2]}), path)


def test_list_parquet_of_a_single_file(tmp_path):
    """A file URI lists itself."""
    path = tmp_path / "one.parquet"
    _parquet(path)
    assert storage.list_parquet(str(path)) == [str(path)]


def test_a_csv_given_as_the_data_set_is_refused_at_planning_naming_it(tmp_path):
    """A single .csv file, or a folder of CSVs, fails listing (plan_shards) naming the file, not later at the stats."""
    csv = tmp_path / "train.csv"
    csv.write_text("row_id,label\n1,2\n")
    with pytest.raises(DataError, match=rf"{csv}: is not a Parquet file \(it starts with b'row_'\)"):
        storage.list_parquet(str(csv))
    with pytest.raises(DataError, match=r"folder holds no \*.parquet files \(it holds 1 other file\(s\), e.g. train.csv"):
        storage.list_parquet(str(tmp_path), root=str(tmp_path))  # under the storage root: what it holds instead
    renamed = tmp_path / "data"  # Parquet without the suffix still lists itself
    _parquet(renamed)
    assert storage.list_parquet(str(renamed)) == [str(renamed)]


def test_a_folder_outside_the_storage_root_is_never_listed_in_an_error(tmp_path):
    """An input_uri can name any folder the worker reads: its error says it holds no Parquet, never which files it
    holds (a folder of secrets would be named file by file), unless it lies under the storage root; '..' or a
    symlink out of the root counts as outside."""
    root, outside = tmp_path / "storage", tmp_path / "elsewhere"
    for folder in (root / "raw" / "csv", outside):
        folder.mkdir(parents=True)
        (folder / "id_rsa").write_text("secret")
    (root / "raw" / "link").symlink_to(outside)
    for uri in (str(outside), f"file://{outside}", str(root / "raw" / ".." / ".." / "elsewhere"), str(root / "raw" / "link")):
        for given in (None, str(root)):
            with pytest.raises(DataError) as caught:
                storage.list_parquet(uri, root=given)
            assert str(caught.value) == f"{uri}: folder holds no *.parquet files"
    with pytest.raises(DataError, match="e.g. id_rsa"):
        storage.list_parquet(str(root / "raw" / "csv"), root=str(root))
    assert storage.under(str(root / "raw"), f"file://{root}") and not storage.under(str(outside), str(root))


def test_list_parquet_of_a_folder_is_sorted_recursive_and_parquet_only(tmp_path):
    """A folder lists every *.parquet below it, nested ones too, sorted; other files are ignored."""
    for name in ("b.parquet", "a.parquet", "sub/c.parquet"):
        _parquet(tmp_path / "data" / name)
    (tmp_path / "data" / "notes.txt").write_text("x")
    (tmp_path / "data" / "_SUCCESS.json").write_text("{}")
    found = storage.list_parquet(str(tmp_path / "data"))
    assert found == sorted(found)
    assert sorted(os.path.relpath(p, tmp_path / "data") for p in found) == ["a.parquet", "b.parquet", "sub/c.parquet"]


def test_list_parquet_keeps_the_file_scheme(tmp_path):
    """A file:// folder lists file:// URIs, so callers can pass them on unchanged."""
    _parquet(tmp_path / "data" / "a.parquet")
    found = storage.list_parquet(f"file://{tmp_path / 'data'}")
    assert len(found) == 1 and found[0].startswith("file://") and found[0].endswith("a.parquet")


def test_list_parquet_of_a_missing_path_is_a_data_error(tmp_path):
    """A path that does not exist is bad input, named in the message."""
    uri = str(tmp_path / "missing")
    with pytest.raises(DataError, match="no such file or folder") as caught:
        storage.list_parquet(uri)
    assert uri in str(caught.value)


def test_list_parquet_of_an_empty_folder_is_a_data_error(tmp_path):
    """A folder without Parquet files is bad input, not an empty success."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.txt").write_text("nothing here")
    with pytest.raises(DataError, match="no \\*.parquet"):
        storage.list_parquet(str(tmp_path / "empty"))


@pytest.mark.parametrize("text", ["manual__2024-05-01T10:20:30.123456+00:00", "scheduled__2024-05-01T00:00:00+00:00",
                                  "my run/with spaces?", "ünïcode✓", "a" * 3])
def test_safe_name_yields_only_path_safe_characters(text):
    """Run ids become a single path segment of [A-Za-z0-9._=-], with no leading/trailing underscore."""
    name = storage.safe_name(text)
    assert re.fullmatch(r"[A-Za-z0-9._=-]+", name)
    assert not name.startswith("_") and not name.endswith("_")
    assert storage.safe_name(name) == name, "idempotent: a safe name stays as it is"


def test_safe_name_keeps_plain_names_and_never_returns_empty():
    """Already-safe names are unchanged; a name with no safe character falls back to 'run-<hash>'."""
    assert storage.safe_name("ml_pipeline") == "ml_pipeline"
    assert storage.safe_name("run-1.2=x") == "run-1.2=x"
    assert re.fullmatch(r"run-[0-9a-f]{8}", storage.safe_name(""))
    assert re.fullmatch(r"run-[0-9a-f]{8}", storage.safe_name("///"))
    assert storage.safe_name("") != storage.safe_name("///")


@pytest.mark.parametrize("run_id", ["..", "."])
def test_safe_name_never_yields_a_dot_segment(run_id):
    """A run id of dots must not become '.' or '..' in a path (it would write outside its run prefix)."""
    assert storage.safe_name(run_id) not in {".", ".."}


@pytest.mark.parametrize("run_id", ["x" * 248 + ":", "y" * 250, "é" * 200])
def test_a_long_run_id_becomes_a_bounded_folder_name_that_stays_unique(run_id):
    """Airflow allows 250-character run ids; a folder name is capped (a file system takes 255 bytes) and keeps a hash."""
    name = storage.safe_name(run_id)
    assert len(name.encode()) <= storage.MAX_NAME_CHARS and re.fullmatch(r"[A-Za-z0-9._=-]+-[0-9a-f]{8}", name)
    assert storage.safe_name(run_id[:-1] + "z") != name and storage.safe_name(name) == name


@pytest.mark.parametrize("value", ["..", ".", "", "a/b", "../x", "a\\b", "m-x/../m-y", "x" * 121, "a b"])
def test_segment_refuses_anything_but_one_safe_path_segment(value):
    """An id that becomes a path (a model version, a model name) is one segment, or a UserError naming what it is."""
    with pytest.raises(UserError, match=r"model version .* is not one path segment"):
        storage.segment(value, "model version")
    assert storage.segment("m-0123456789ab", "model version") == "m-0123456789ab"


def test_a_torn_json_file_is_a_data_error_naming_it(tmp_path):
    """A manifest, card or pointer that exists but does not parse names its file (not a bare JSONDecodeError)."""
    path = tmp_path / "manifest.json"
    path.write_bytes(b'{"files": [1, 2')
    with pytest.raises(DataError, match=rf"{path}: is not valid JSON .*15 bytes.*torn"):
        storage.read_json(str(path))


def test_distinct_run_ids_get_distinct_prefixes():
    """Two different run ids of one DAG never write into the same run prefix."""
    assert storage.run_prefix("/root", "dag", "exp:1") != storage.run_prefix("/root", "dag", "exp+1")


def test_run_prefix_layout():
    """Every task of a run writes under <root>/runs/<dag_id>/<run_id>, both made safe."""
    prefix = storage.run_prefix("/data/root/", "ml_pipeline", "manual__2024-01-01T00:00:00+00:00")
    assert prefix == f"/data/root/runs/ml_pipeline/{storage.safe_name('manual__2024-01-01T00:00:00+00:00')}"
    assert storage.run_prefix("s3://bucket/x", "d", "r") == "s3://bucket/x/runs/d/r"


def test_resolve_relative_absolute_and_schemed():
    """Relative URIs land under the root; absolute paths and schemed URIs are kept."""
    assert storage.resolve("/root", "raw/digits") == "/root/raw/digits"
    assert storage.resolve("/root", "/abs/raw") == "/abs/raw"
    assert storage.resolve("/root", "s3://b/raw") == "s3://b/raw"


def test_unique_tokens_differ():
    """Attempt tokens are unique, so a retry never overwrites an attempt's files."""
    assert len({storage.unique_token() for _ in range(200)}) == 200


def test_remove_unlisted_keeps_listed_files_and_json(tmp_path):
    """Cleanup deletes unlisted attempt files (nested too) but keeps the listed ones and every .json."""
    prefix = tmp_path / "predictions"
    keep = prefix / "part-00000-aaa.parquet"
    stale = [prefix / "part-00000-bbb.parquet", prefix / "nested" / "part-00001-ccc.parquet", prefix / "x.tmp-123"]
    for path in [keep, *stale]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    (prefix / "manifest.json").write_text("{}")
    removed = storage.remove_unlisted(str(prefix), {str(keep)})
    assert removed == len(stale)
    remaining = sorted(str(p.relative_to(prefix)) for p in prefix.rglob("*") if p.is_file())
    assert remaining == ["manifest.json", "part-00000-aaa.parquet"]


def test_remove_unlisted_matches_file_uris_against_paths(tmp_path):
    """A keep-set given as file:// URIs protects the same files as plain paths."""
    prefix = tmp_path / "p"
    prefix.mkdir()
    (prefix / "a.parquet").write_bytes(b"x")
    assert storage.remove_unlisted(str(prefix), {f"file://{prefix / 'a.parquet'}"}) == 0
    assert (prefix / "a.parquet").exists()


def test_remove_unlisted_on_a_missing_prefix_is_a_no_op(tmp_path):
    """Nothing to clean when the folder was never written."""
    assert storage.remove_unlisted(str(tmp_path / "never"), set()) == 0


# --- broken Parquet files are the user's data error; I/O faults stay retryable ------------------------------------


@pytest.fixture
def good_parquet_bytes(tmp_path) -> bytes:
    """The bytes of a small valid Parquet file with two row groups."""
    path = tmp_path / "good.parquet"
    pq.write_table(pa.table({"row_id": list(range(400)), "value": [float(i) for i in range(400)]}), path, row_group_size=200)
    return path.read_bytes()


@pytest.mark.parametrize("kind", BAD_KINDS)
def test_a_broken_parquet_file_is_a_data_error_naming_it(tmp_path, good_parquet_bytes, kind):
    """Opening and reading an empty, non-Parquet, truncated or corrupt file raises DataError naming the file and
    saying what is wrong with it, on one line (not pyarrow's bare ArrowInvalid/OSError, which Airflow would retry)."""
    path = write_bad_file(kind, tmp_path / "raw" / f"part-{kind}.parquet", good_parquet_bytes)
    with pytest.raises(DataError) as caught:
        with storage.open_parquet(str(path)) as parquet:
            for _ in storage.iter_batches(parquet, ["row_id", "value"], 100, uri=str(path)):
                pass
    assert str(path) in str(caught.value)
    assert EXPECTED_WORDING[kind] in str(caught.value)
    assert "\n" not in str(caught.value), "one line in the task log"


def test_read_schema_of_a_broken_file_names_it(tmp_path, good_parquet_bytes):
    """read_schema (the footer only) fails on a truncated file with a DataError naming it."""
    path = write_bad_file("truncated", tmp_path / "part-00000.parquet", good_parquet_bytes)
    with pytest.raises(DataError, match=re.escape(str(path))):
        storage.read_schema(str(path))


class _DroppingHandle:
    """A readable file whose reads fail with ``fault`` after ``good_reads`` reads: a connection lost mid-file."""

    def __init__(self, data: bytes, fault: OSError, good_reads: int) -> None:
        import io

        self._data, self._fault, self._left = io.BytesIO(data), fault, good_reads
        self.closed = False

    def read(self, size: int = -1) -> bytes:
        if self._left <= 0:
            raise self._fault
        self._left -= 1
        return self._data.read(size)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._data.seek(offset, whence)

    def tell(self) -> int:
        return self._data.tell()

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("fault", [ConnectionResetError(104, "Connection reset by peer"),
                                   OSError("An error occurred (SlowDown) when calling the GetObject operation"),
                                   OSError("Read timeout on endpoint URL")], ids=["reset", "slow-down", "timeout"])
@pytest.mark.parametrize("good_reads", [0, 2], ids=["at-open", "mid-file"])
def test_an_io_fault_while_reading_parquet_is_not_a_data_error(good_parquet_bytes, fault, good_reads):
    """A connection fault while pyarrow reads passes through unchanged (retryable), at open or in the second row group."""
    handle = _DroppingHandle(good_parquet_bytes, fault, good_reads)
    with pytest.raises(OSError) as caught:
        with storage.reading_parquet("s3://bucket/raw/part-00000.parquet"):
            parquet = pq.ParquetFile(handle)
            for index in range(parquet.num_row_groups):
                parquet.read_row_group(index)
    assert caught.value is fault
    assert not isinstance(caught.value, DataError)


# --- copy_atomic ----------------------------------------------------------------------------------------------------


def test_copy_atomic_copies_the_bytes_and_leaves_no_partial(tmp_path):
    """A streamed copy holds exactly the source's bytes and leaves no '.partial' file beside it."""
    source = tmp_path / "src.parquet"
    source.write_bytes(os.urandom(3 * 1024 + 17))
    destination = tmp_path / "data" / "copy.parquet"
    storage.copy_atomic(str(source), str(destination))
    assert destination.read_bytes() == source.read_bytes()
    assert [p.name for p in destination.parent.iterdir()] == ["copy.parquet"]


def test_copy_atomic_publishes_nothing_when_the_source_changed(tmp_path):
    """When the bytes read differ from the checked digest (the source changed since), nothing appears at the target."""
    source = tmp_path / "src.parquet"
    source.write_bytes(b"changed since it was checked")
    destination = tmp_path / "data" / "copy.parquet"
    with pytest.raises(RuntimeError, match="changed while it was being copied"):
        storage.copy_atomic(str(source), str(destination), expected_sha256="0" * 64)
    assert list(destination.parent.iterdir()) == []
