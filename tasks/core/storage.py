"""Storage through fsspec URIs: local paths, ``file://`` and ``s3://`` take the same code path.

Writes that others read are atomic: a local file is written beside its target and renamed; an S3
object appears whole on its single PUT. A manifest written last is the commit (see design notes).

S3 requests that meet throttling (503 SlowDown), 5xx answers or dropped connections are retried
with capped exponential backoff and jitter (botocore's "standard" mode, 10 attempts: about a
minute of trouble is ridden out inside the sub-job); a fault that outlasts that fails the sub-job
as an infrastructure fault, which Airflow retries with the profile's backoff. ``AWS_RETRY_MODE`` and
``AWS_MAX_ATTEMPTS`` change the in-process retries, as for any AWS SDK.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime as dt
import fcntl
import functools
import hashlib
import io
import json
import logging
import os
import re
import uuid
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import fsspec
import fsspec.asyn
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from stagewise.core.errors import DataError, UserError

log = logging.getLogger("stagewise.storage")
_UNSAFE = re.compile(r"[^A-Za-z0-9._=-]+")
_S3_PROTOCOLS = ("s3://", "s3a://")
S3_RETRY_MODE = "standard"
S3_MAX_ATTEMPTS = 10


def s3_options() -> dict[str, Any]:
    """s3fs arguments: botocore's retry mode and attempts, from the AWS environment or our defaults."""
    # botocore would read these variables itself, but only when the client is given no retry config at all.
    mode = os.environ.get("AWS_RETRY_MODE") or S3_RETRY_MODE
    attempts_text = os.environ.get("AWS_MAX_ATTEMPTS") or str(S3_MAX_ATTEMPTS)
    try:
        attempts = int(attempts_text)
    except ValueError:
        raise UserError(f"AWS_MAX_ATTEMPTS must be a whole number, got {attempts_text!r}") from None
    if attempts < 1:
        raise UserError(f"AWS_MAX_ATTEMPTS must be at least 1, got {attempts}")
    if mode not in ("legacy", "standard", "adaptive"):
        raise UserError(f"AWS_RETRY_MODE must be legacy, standard or adaptive, got {mode!r}")
    return {"config_kwargs": {"retries": {"mode": mode, "max_attempts": attempts}}}


def _log_failed_attempt(attempts: int, operation: Any, response: Any = None, caught_exception: BaseException | None = None,
                        **_: Any) -> None:
    """botocore's needs-retry hook: put each failed S3 attempt in the task log (botocore keeps them at DEBUG)."""
    if caught_exception is not None:
        cause = f"{type(caught_exception).__name__}: {caught_exception}"
    elif response is not None and response[0].status_code >= 500:
        code = (response[1].get("Error") or {}).get("Code", "")
        cause = f"{response[0].status_code} {code}" if code and code != str(response[0].status_code) else str(response[0].status_code)
    else:
        return None
    log.warning("S3 %s attempt %d of %d failed (%s)", operation.name, attempts,
                s3_options()["config_kwargs"]["retries"]["max_attempts"], cause)
    return None  # no opinion: botocore's own retry handler decides


@functools.lru_cache(maxsize=1)
def _s3_session() -> Any:
    """One botocore session per process (fsspec caches filesystems by their arguments, this one included)."""
    from aiobotocore.session import AioSession

    session = AioSession()
    session.register("needs-retry.s3", _log_failed_attempt)
    return session


# s3fs arguments of the block opened by using_options(), for this thread (or asyncio task) only.
_scoped_options: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("stagewise_storage_options",
                                                                                        default=None)


@contextlib.contextmanager
def using_options(options: dict[str, Any]) -> Iterator[None]:
    """Every ``s3://`` filesystem this thread opens in the block gets ``options`` (s3fs arguments: ``key``, ``secret``,
    ``token``, ``endpoint_url``, ``client_kwargs``; ``config_kwargs`` merge over s3_options()'s).

    For a process that reads several storages with different credentials at once (the api-server's pages, one
    connection per pipeline): the options travel with the calls, never through the process's environment.
    """
    token = _scoped_options.set(options)
    try:
        yield
    finally:
        _scoped_options.reset(token)


def filesystem(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and the protocol-free path of ``uri`` (with the options of an enclosing using_options())."""
    if uri.startswith(_S3_PROTOCOLS):
        options = s3_options()
        if scoped := _scoped_options.get():
            options = {**options, **scoped,
                       "config_kwargs": {**options["config_kwargs"], **scoped.get("config_kwargs", {})}}
        # No listings cache: a cached listing hides another process's new file for this process's life (the UI's).
        return url_to_fs(uri, session=_s3_session(), **{**options, "use_listings_cache": False})
    return url_to_fs(uri)


def _bucket_of(uri: str) -> str:
    return uri.split("://", 1)[1].split("/", 1)[0]


def require_bucket(uri: str, setting: str) -> None:
    """For an s3:// URI: a missing bucket or missing credentials is a UserError naming ``setting``, ``uri`` and the bucket.

    Only these two answers are the user's; a throttled or unreachable endpoint raises as before (retryable).
    """
    if uri.startswith(_S3_PROTOCOLS):
        _check_bucket(_bucket_of(uri), setting, uri)


@functools.lru_cache(maxsize=64)
def _check_bucket(bucket: str, setting: str, uri: str) -> None:
    from botocore.exceptions import NoCredentialsError

    fs, _ = filesystem(uri)
    try:
        fs.call_s3("list_objects_v2", Bucket=bucket, MaxKeys=1)
    except NoCredentialsError:
        raise UserError(f"{setting} {uri}: no AWS credentials found to reach S3 bucket '{bucket}' (set "
                        f"AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, or run with an instance role)") from None
    except FileNotFoundError as exc:
        if "NoSuchBucket" not in repr(exc.__cause__) and "bucket does not exist" not in str(exc):
            raise
        raise UserError(f"{setting} {uri}: S3 bucket '{bucket}' does not exist (or these credentials cannot see it); "
                        f"create the bucket or correct the {setting}") from None


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *(part.strip("/") for part in parts if part)])


# Longest folder name safe_name makes: a file system allows 255 bytes a name, and an S3 key 1,024 bytes in all.
MAX_NAME_CHARS = 120


def safe_name(text: str) -> str:
    """A run id or study name made safe for paths and S3 keys, still unique per input, at most MAX_NAME_CHARS long.

    Unsafe characters become '_'; when that changed anything, or the name is too long and is cut, a short hash
    of the original is appended so that ids differing only there ('exp:1', 'exp+1') never share a prefix.
    """
    safe = _UNSAFE.sub("_", text).strip("_.")
    if safe == text and safe and len(safe) <= MAX_NAME_CHARS:
        return safe
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return f"{safe[:MAX_NAME_CHARS - len(digest) - 1] or 'run'}-{digest}"


def segment(value: str, what: str) -> str:
    """``value`` when it is one safe path segment, else a UserError naming ``what``: no traversal ('..', '/'), no
    characters outside letters, digits and '._=-', at most MAX_NAME_CHARS long."""
    if not value or value in (".", "..") or _UNSAFE.search(value) or len(value) > MAX_NAME_CHARS:
        shown = value if len(value) <= 80 else f"{value[:80]}... ({len(value)} characters)"
        raise UserError(f"{what} {shown!r} is not one path segment: use letters, digits, '.', '_', '=' or '-' "
                        f"(not '.' or '..'), at most {MAX_NAME_CHARS} characters")
    return value


def child(parent: str, name: str, what: str) -> str:
    """``parent/name`` for a ``name`` that comes from a user (a model version, a model name): refused unless it is
    one segment, so the result always stays under ``parent``."""
    return join(parent, segment(name, what))


def run_prefix(storage_root: str, dag_id: str, run_id: str) -> str:
    """``<root>/runs/<dag_id>/<run_id>``: every task of a run writes under it."""
    return join(storage_root, "runs", safe_name(dag_id), safe_name(run_id))


def stage_prefix(out: str, stage: str) -> str:
    """Where a training stage of the run under ``out`` keeps its checkpoints, metrics and models."""
    return join(out, "train", stage)


def resolve(storage_root: str, uri: str) -> str:
    """An absolute URI: ``uri`` itself when it has a scheme or is absolute, else under the root."""
    if "://" in uri or os.path.isabs(uri):
        return uri
    return join(storage_root, uri)


def unique_token() -> str:
    """A short attempt-unique token for file names, so retries never overwrite committed files."""
    return uuid.uuid4().hex[:10]


def exists(uri: str) -> bool:
    fs, path = filesystem(uri)
    return fs.exists(path)


@contextlib.contextmanager
def writing(uri: str) -> Iterator[None]:
    """Re-raise an OSError of the block (a full disk, a quota, a dead mount) as one naming ``uri``, the file being
    written: Python's own names a temporary file or nothing. It stays an OSError with its errno, so it is retried
    as the infrastructure fault it is."""
    try:
        yield
    except OSError as exc:
        if type(exc) is not OSError or exc.filename == uri:
            raise  # a kind its handlers know (not found, denied, a timeout), or it names the file already
        if exc.errno is None:  # Arrow's IO errors: a message, no errno
            raise OSError(f"writing {uri}: {exc}") from exc
        raise OSError(exc.errno, f"{exc.strerror or exc}, writing", uri) from exc


def write_bytes(uri: str, data: bytes) -> None:
    """Write ``data`` so that readers see either nothing or all of it."""
    fs, path = filesystem(uri)
    with writing(uri):
        if isinstance(fs, LocalFileSystem):
            _write_local(path, data)
            return
        fs.pipe_file(path, data)


def write_with(uri: str, write: Callable[[BinaryIO], None]) -> None:
    """Like write_bytes, with ``write(handle)`` making the bytes: a local file streams them to disk (no copy of them
    in memory: a large model's state is written as it is serialised); other storages get them in one PUT."""
    fs, path = filesystem(uri)
    with writing(uri):
        if isinstance(fs, LocalFileSystem):
            _write_local(path, write)
            return
        buffer = io.BytesIO()
        write(buffer)
        fs.pipe_file(path, buffer.getvalue())


def _write_local(path: str, data: bytes | Callable[[BinaryIO], None]) -> None:
    """Write a local file (``data``, or what ``data(handle)`` writes) beside its target and rename it into place."""
    os.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    tmp = f"{path}.tmp-{unique_token()}"
    try:
        with open(tmp, "wb") as handle:
            if callable(data):
                data(handle)
            else:
                handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def json_bytes(obj: Any) -> bytes:
    """The bytes :func:`write_json` writes for ``obj``."""
    return json.dumps(obj, indent=2, sort_keys=True).encode()


def write_json(uri: str, obj: Any) -> None:
    write_bytes(uri, json_bytes(obj))


def read_bytes(uri: str) -> bytes:
    """The whole file at ``uri``, on any storage; read faults pass (the caller's retry reads again)."""
    fs, path = filesystem(uri)
    with fs.open(path, "rb") as handle:
        return handle.read()


def read_json(uri: str) -> Any:
    """The JSON at ``uri``; a file that exists but does not parse is a DataError naming it (no retry can mend it)."""
    try:
        data = read_bytes(uri)
    except FileNotFoundError:
        raise FileNotFoundError(f"{uri} does not exist") from None
    return parse_json(uri, data)


def parse_json(uri: str, data: bytes) -> Any:
    """``data`` read from ``uri`` as JSON; bytes that do not parse are a DataError naming ``uri``."""
    try:
        return json.loads(data)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError: the bytes, not the storage, are at fault
        raise DataError(f"{uri}: is not valid JSON ({exc}; {len(data)} bytes): the file is torn or was edited; "
                        f"restore or remove it") from None


# Compare-and-swap of a small JSON file (the registry's pointer): read it with a token naming that version, then
# write only if it is still that version. Locally every conditional writer holds a lock file beside the target
# while it compares and renames (local storage is one machine); on S3 the PUT itself is conditional: If-None-Match: *
# to create, If-Match: <ETag> to replace (S3 has honoured both since 2024).

# Error codes of a conditional PUT that lost: changed since read (412), another conditional write in flight (409), gone.
_LOST_RACE_CODES = frozenset({"PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey"})


def read_versioned(uri: str) -> tuple[Any, str | None]:
    """The JSON at ``uri`` and a token naming this version of it for write_if_unchanged; (None, None) when absent."""
    fs, path = filesystem(uri)
    data, token = _local_read(path) if isinstance(fs, LocalFileSystem) else _s3_read(fs, path)
    return (None, None) if data is None else (parse_json(uri, data), token)


def write_if_unchanged(uri: str, obj: Any, token: str | None) -> bool:
    """Write ``obj`` as JSON at ``uri`` only if it is still the version ``token`` names (None: only if absent); else False."""
    fs, path = filesystem(uri)
    if isinstance(fs, LocalFileSystem):
        return _local_write_if_unchanged(path, json_bytes(obj), token)
    return _s3_write_if_unchanged(fs, path, json_bytes(obj), token)


def _local_read(path: str) -> tuple[bytes | None, str | None]:
    """A local file's bytes and their hash as the version token; (None, None) when absent."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        return None, None
    return data, hashlib.sha256(data).hexdigest()


def _local_write_if_unchanged(path: str, data: bytes, token: str | None) -> bool:
    os.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with open(f"{path}.lock", "ab") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes; readers need no lock, the rename is atomic
        if _local_read(path)[1] != token:
            return False
        _write_local(path, data)
    return True


def _s3_read(fs: Any, path: str) -> tuple[bytes | None, str | None]:
    """An S3 object's bytes and ETag from one GET (a HEAD apart could pair the ETag with other bytes); (None, None) when absent."""
    bucket, key, _ = fs.split_path(path)
    try:
        response = fs.call_s3("get_object", Bucket=bucket, Key=key)
    except FileNotFoundError:
        return None, None
    try:
        return fsspec.asyn.sync(fs.loop, response["Body"].read), response["ETag"]
    finally:
        response["Body"].close()


def _s3_write_if_unchanged(fs: Any, path: str, data: bytes, token: str | None) -> bool:
    bucket, key, _ = fs.split_path(path)
    condition = {"IfMatch": token} if token else {"IfNoneMatch": "*"}
    try:
        fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)
    except OSError as exc:
        response = getattr(exc.__cause__, "response", None) or {}
        if response.get("Error", {}).get("Code") not in _LOST_RACE_CODES:
            raise
        # botocore retries a PUT whose answer was lost; that retry meets its own write, which is no lost race.
        return _s3_read(fs, path)[0] == data
    finally:
        fs.invalidate_cache(path)
    return True


def makedirs(uri: str) -> None:
    fs, path = filesystem(uri)
    fs.makedirs(path, exist_ok=True)


def under(uri: str, root: str) -> bool:
    """Whether ``uri`` is ``root`` or lies below it (local paths resolved, so '..' or a symlink cannot leave it)."""
    fs, path = filesystem(uri)
    root_fs, root_path = filesystem(root)
    if type(fs) is not type(root_fs):
        return False
    if isinstance(fs, LocalFileSystem):
        path, root_path = os.path.realpath(path), os.path.realpath(root_path)
    root_path = root_path.rstrip("/")
    return path == root_path or path.startswith(root_path + "/")


def list_parquet(uri: str, root: str | None = None) -> list[str]:
    """The Parquet files at ``uri`` (one file, or every ``*.parquet`` below a folder), sorted.

    A folder holding no Parquet is named with what else it holds only when it lies under the storage ``root``: an
    error about a folder outside it (an input_uri anywhere on the worker) never lists that folder's files.
    """
    fs, path = filesystem(uri)
    if fs.isfile(path):
        if not path.endswith(".parquet"):  # a .csv or .json given as the data set: refused here, not at every shard
            if (head := _head(uri)) != PARQUET_MAGIC:
                raise DataError(f"{uri}: is not a Parquet file (it starts with {head!r}); Stagewise reads Parquet only: "
                                f"convert it first (pyarrow.csv.read_csv, then pyarrow.parquet.write_table)")
        return [uri]
    if not fs.isdir(path):
        require_bucket(uri, "input URI")
        raise DataError(f"{uri}: no such file or folder")
    found = sorted(fs.glob(path.rstrip("/") + "/**/*.parquet"))
    if not found:
        others = sorted(p.rsplit("/", 1)[-1] for p in fs.find(path)) if root and under(uri, root) else []
        shown = f" (it holds {len(others)} other file(s), e.g. {others[0]}: Stagewise reads Parquet only)" if others else ""
        raise DataError(f"{uri}: folder holds no *.parquet files{shown}")
    return [fs.unstrip_protocol(p) if "://" in uri else p for p in found]


# Messages pyarrow gives an OSError (not ArrowInvalid) when the bytes are not valid Parquet; network faults never say these.
_PARQUET_CORRUPTION = re.compile(r"thrift|corrupt|decompress|page header|end of stream|snappy|zstd|lz4|gzip|brotli", re.I)
PARQUET_MAGIC = b"PAR1"


def parquet_problem(exc: BaseException) -> str | None:
    """What a read error says about the file when it is the file's fault (not Parquet, cut, corrupt), else None.

    Only Arrow's format errors count: an OSError raised by the filesystem (S3 503, a reset
    connection) passes through pyarrow unchanged, carries no Parquet wording and stays retryable.
    """
    import pyarrow as pa

    message = " ".join(str(exc).split())  # pyarrow's messages span lines; the task log wants one
    if isinstance(exc, pa.ArrowInvalid):
        if "size is 0 bytes" in message:
            return "is empty (0 bytes)"
        if "magic bytes not found" in message:
            return "has no Parquet footer (magic bytes PAR1 missing at its end)"
        if "smaller than the minimum file footer" in message:
            return f"is too short to be Parquet ({message})"
        return f"is not valid Parquet ({message})"
    if type(exc) is OSError and exc.errno is None and _PARQUET_CORRUPTION.search(message):
        return f"is corrupt ({message})"
    return None


def _head(uri: str) -> bytes:
    """The file's first bytes, as many as Parquet's magic: what a Parquet file starts (and ends) with."""
    fs, path = filesystem(uri)
    with fs.open(path, "rb") as handle:
        return handle.read(len(PARQUET_MAGIC))


def _describe_headless(uri: str) -> str:
    """For a file without a footer: truncated (starts like Parquet) or not Parquet at all (shows its first bytes)."""
    try:
        head = _head(uri)
    except Exception:  # the error being reported matters more than this detail
        return ""
    if head == PARQUET_MAGIC:
        return "; it starts like Parquet, so it is truncated (cut off while being written or copied)"
    return f"; it starts with {head!r}, so it is not a Parquet file"


@contextlib.contextmanager
def reading_parquet(uri: str) -> Iterator[None]:
    """Turn a Parquet format error raised inside the block into a DataError naming ``uri``; I/O faults pass."""
    try:
        yield
    except (ValueError, OSError) as exc:
        problem = parquet_problem(exc)
        if problem is None:
            raise
        detail = _describe_headless(uri) if "footer" in problem or "too short" in problem else ""
        raise DataError(f"{uri}: {problem}{detail}; fix or remove the file") from exc


def local_parquet(path: str) -> Any:
    """Arrow's native reader over a local Parquet file.

    Not memory-mapped: mapped pages would count against the worker's memory. Not pre-buffered: coalescing
    pays on high-latency stores; locally it hands reads to Arrow's IO threads and buffers each row group
    twice (about a third more pages for a fresh task process to fault in).
    """
    import pyarrow.parquet as pq

    return pq.ParquetFile(path, pre_buffer=False)


@contextlib.contextmanager
def open_parquet(uri: str) -> Iterator[Any]:
    """A ``pyarrow.parquet.ParquetFile``: Arrow's native reader for local files, fsspec for the rest.

    A file that is empty, not Parquet, truncated or has a corrupt footer raises DataError naming it.
    """
    import pyarrow.parquet as pq

    fs, path = filesystem(uri)
    if isinstance(fs, LocalFileSystem):
        with reading_parquet(uri):
            parquet = local_parquet(path)
        try:
            yield parquet
        finally:
            parquet.close()
        return
    with fs.open(path, "rb") as handle:
        with reading_parquet(uri):
            parquet = pq.ParquetFile(handle)
        yield parquet


def read_schema(uri: str) -> Any:
    """The Arrow schema of a Parquet file (its footer only); a bad file raises DataError naming it."""
    with open_parquet(uri) as parquet:
        return parquet.schema_arrow


def iter_batches(parquet: Any, columns: list[str], batch_size: int, row_groups: list[int] | None = None,
                 *, uri: str = "a Parquet file") -> Iterator[Any]:
    """Record batches of ``columns``, one row group in memory at a time; corrupt pages raise DataError naming ``uri``.

    pyarrow's own ``ParquetFile.iter_batches`` reads ahead and held ~1.5x the file in memory in our
    measurement (2M rows: 800 MB); reading row group by row group kept it at ~150 MB.
    """
    groups = range(parquet.num_row_groups) if row_groups is None else row_groups
    for index in groups:
        with reading_parquet(uri):
            table = parquet.read_row_group(index, columns=columns)
        yield from table.to_batches(max_chunksize=batch_size)
        del table


COPY_CHUNK_BYTES = 8 << 20


def iter_chunks(uri: str, chunk_bytes: int = COPY_CHUNK_BYTES) -> Iterator[bytes]:
    """The bytes of ``uri`` in chunks, so a file of any size streams through bounded memory."""
    fs, path = filesystem(uri)
    with fs.open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            yield chunk


def sha256_of(uri: str) -> str:
    """The hex SHA-256 of a file's bytes, streamed."""
    digest = hashlib.sha256()
    for chunk in iter_chunks(uri):
        digest.update(chunk)
    return digest.hexdigest()


def copy_atomic(source: str, destination: str, expected_sha256: str | None = None) -> None:
    """Stream ``source`` to ``destination`` so that the destination appears whole or not at all.

    The bytes go to a ``.partial-<token>`` name beside the target (no ``*.parquet`` glob matches it)
    and are renamed at the end: os.replace locally, a whole-object copy on S3. When
    ``expected_sha256`` is given and the bytes differ (the source changed since it was checked),
    nothing is published.
    """
    fs, path = filesystem(destination)
    partial = f"{path}.partial-{unique_token()}"
    digest = hashlib.sha256()
    local = isinstance(fs, LocalFileSystem)
    if local:
        os.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    try:
        with (open(partial, "wb") if local else fs.open(partial, "wb")) as handle:
            for chunk in iter_chunks(source):
                digest.update(chunk)
                handle.write(chunk)
            if local:
                handle.flush()
                os.fsync(handle.fileno())
        if expected_sha256 is not None and digest.hexdigest() != expected_sha256:
            raise RuntimeError(f"{source} changed while it was being copied to {destination}; a retry checks it again")
        if local:
            os.replace(partial, path)
        else:
            fs.mv(partial, path)
    except BaseException:
        with contextlib.suppress(Exception):
            fs.rm_file(partial)
        raise


def remove_unlisted(prefix: str, keep: set[str]) -> int:
    """Delete files under ``prefix`` that no manifest lists (leftovers of failed attempts)."""
    fs, path = filesystem(prefix)
    if not fs.isdir(path):
        return 0
    keep_paths = {filesystem(uri)[1] for uri in keep}
    stale = [p for p in fs.find(path) if p not in keep_paths and not p.endswith(".json")]
    for p in stale:
        fs.rm_file(p)
    return len(stale)


def modified_time(info: dict[str, Any]) -> dt.datetime | None:
    """When an object of an fsspec listing last changed (local: mtime, S3: LastModified), in UTC; None if unknown."""
    stamp = info.get("mtime") or info.get("LastModified") or info.get("last_modified")
    if isinstance(stamp, dt.datetime):
        return stamp if stamp.tzinfo else stamp.replace(tzinfo=dt.UTC)
    return dt.datetime.fromtimestamp(stamp, dt.UTC) if isinstance(stamp, int | float) else None
