"""Per-rank batches streamed from Parquet row groups: disjoint, deterministic, bounded in memory.

Each epoch the row groups of a split are permuted with ``seed + epoch`` and rank r takes every
world_size-th one from r (DistributedSampler semantics at row-group granularity), so no process
loads the whole data set and every rank sees a different part each epoch. Rows are shuffled within
a window of ``window_row_groups`` row groups (rows move whole, thanks to the processed vector
column): each row group is read on its own and its rows are scattered straight to their shuffled
places in the window, one copy while the row group is still in cache. Background threads read the
row groups of the next windows while the current one trains, so memory stays bounded by a few
windows.
All ranks take the same number of steps per epoch (the smallest rank's full batches), computed
from Parquet metadata alone, so DDP never waits on a rank that ran out of data.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from fsspec.implementations.local import LocalFileSystem

from stagewise.core import storage
from stagewise.core.errors import DataError, UserError
from stagewise.datasets.columns import FEATURES_COLUMN, feature_matrix, layout_of
from stagewise.datasets.manifest import label_dtype

# Windows read ahead of the one being consumed: bounds memory at a few windows.
PREFETCH_WINDOWS = 2
# Threads reading row groups of those windows (pyarrow's read and numpy's row moves release the GIL).
PREFETCH_THREADS = 2


@dataclass(frozen=True)
class RowGroup:
    """One Parquet row group, or the part of it a rank reads: ``num_rows`` rows from row ``start`` of the group."""

    uri: str
    index: int
    num_rows: int
    start: int = 0
    """The first row of the group this part reads (0: from its start)."""


def list_row_groups(uris: list[str]) -> list[RowGroup]:
    groups = []
    for uri in uris:
        fs, path = storage.filesystem(uri)
        with fs.open(path, "rb") as handle:
            metadata = pq.ParquetFile(handle).metadata
        groups += [RowGroup(uri, i, metadata.row_group(i).num_rows) for i in range(metadata.num_row_groups)]
    return [g for g in groups if g.num_rows > 0]


@dataclass
class _Window:
    """A window's output: the i-th row read lands at ``destination[i]`` (at ``i`` when unshuffled)."""

    x: np.ndarray
    y: np.ndarray
    destination: np.ndarray | None


def _empty(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """An uninitialised array in Arrow's memory pool, which keeps freed memory: a fresh numpy array of a window's size
    is new pages the kernel must fault in and zero (~10% of an epoch), one from the pool is memory just released."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    return np.frombuffer(pa.allocate_buffer(count * dtype.itemsize), dtype, count).reshape(shape)


def _block_destination(total: int, block_rows: int, rng: np.random.Generator) -> np.ndarray:
    """Where each row of a window goes when runs of ``block_rows`` consecutive rows (in reading order) move as one."""
    blocks = -(-total // block_rows)
    sizes = np.full(blocks, block_rows)
    sizes[-1] = total - block_rows * (blocks - 1)
    order = rng.permutation(blocks)  # the k-th block out is block order[k]
    start = np.empty(blocks, np.int64)
    start[order] = np.cumsum(sizes[order]) - sizes[order]
    return np.repeat(start - block_rows * np.arange(blocks), sizes) + np.arange(total)


def _allocate_window(groups: list[RowGroup], width: int, rng: np.random.Generator | None, label_dtype: type,
                     block_rows: int = 1) -> _Window:
    total = sum(g.num_rows for g in groups)
    destination = None
    if rng is not None:
        destination = rng.permutation(total) if block_rows == 1 else _block_destination(total, block_rows, rng)
    return _Window(_empty((total, width), np.float32), _empty((total,), label_dtype), destination)


def _as_rows(matrix: np.ndarray) -> np.ndarray:
    """One opaque element per row: numpy then moves a row with one memcpy (2-D fancy indexing: ~2x slower)."""
    return matrix.view(np.dtype((np.void, matrix.shape[1] * matrix.itemsize))).reshape(-1)


class _OpenFiles:
    """Local Parquet files kept open for one epoch, each reader lent to one thread at a time.

    A window's row groups come from many files, so re-opening one per row group (footer read and
    parse) cost ~10% of an epoch. Remote files are opened per task through storage as before: an
    open s3 handle holds its read-ahead buffer (up to 50 MB).
    """

    def __init__(self, keep: int = 64) -> None:
        self.keep = keep  # idle readers kept, so thousands of shards cannot exhaust file descriptors
        self._idle: list[tuple[str, pq.ParquetFile]] = []  # oldest first
        self._lock = threading.Lock()
        self._local_paths: dict[str, str | None] = {}

    @contextlib.contextmanager
    def open(self, uri: str) -> Iterator[pq.ParquetFile]:
        if uri not in self._local_paths:
            fs, path = storage.filesystem(uri)
            self._local_paths[uri] = path if isinstance(fs, LocalFileSystem) else None
        path = self._local_paths[uri]
        if path is None:
            with storage.open_parquet(uri) as parquet:
                yield parquet
            return
        with self._lock:
            found = [i for i, (idle_uri, _) in enumerate(self._idle) if idle_uri == uri]
            parquet = self._idle.pop(found[-1])[1] if found else None
        if parquet is None:
            parquet = storage.local_parquet(path)  # as storage.open_parquet opens it; pre-buffering cost the loader ~7%
        try:
            yield parquet
        except BaseException:
            parquet.close()
            raise
        with self._lock:
            self._idle.append((uri, parquet))
            evicted = self._idle.pop(0)[1] if len(self._idle) > self.keep else None
        if evicted is not None:
            evicted.close()

    def close(self) -> None:
        """Close every reader; only once no thread reads any more."""
        for _, parquet in self._idle:
            parquet.close()
        self._idle.clear()


def _read_into(files: _OpenFiles, groups: list[RowGroup], label: str, window: Future, offset: int) -> None:
    """Read consecutive row groups of one file and move their rows to their places in the window.

    Each task owns a disjoint range of the window's reading order, so tasks write disjoint rows.
    """
    with files.open(groups[0].uri) as parquet:
        for group in groups:
            # One row group per read: ~20% faster than several (no merged chunk to grow), and still in cache for the scatter.
            table = parquet.read_row_group(group.index, columns=[label, FEATURES_COLUMN], use_threads=False)
            if table.num_rows < group.start + group.num_rows:
                raise DataError(f"{group.uri}: row group {group.index} has {table.num_rows} rows, its metadata says at "
                                f"least {group.start + group.num_rows}")
            if group.start or group.num_rows != table.num_rows:  # a rank's part of a group another rank shares
                table = table.slice(group.start, group.num_rows)
            out = window.result()  # allocated by a task queued before this one, so it is running or done
            for batch in table.to_batches():
                matrix = feature_matrix(batch)
                if matrix.shape[1] != out.x.shape[1]:
                    raise DataError(f"{group.uri}: {matrix.shape[1]} features per row, the split declares {out.x.shape[1]}")
                labels = batch.column(label).to_numpy()
                end = offset + len(matrix)
                if out.destination is None:
                    out.x[offset:end] = matrix
                    out.y[offset:end] = labels
                else:
                    rows = out.destination[offset:end]
                    np.put(_as_rows(out.x), rows, _as_rows(matrix))
                    out.y[rows] = labels
                offset = end


def _by_file(groups: list[RowGroup]) -> list[list[RowGroup]]:
    """Runs of consecutive row groups from the same file: one task and one open each."""
    runs: list[list[RowGroup]] = []
    for group in groups:
        if runs and runs[-1][0].uri == group.uri:
            runs[-1].append(group)
        else:
            runs.append([group])
    return runs


class ParquetBatches:
    """Batches of one rank over a split's Parquet files."""

    def __init__(self, uris: list[str], features: list[str], label: str, *, rank: int, world_size: int,
                 batch_size: int, seed: int, window_row_groups: int = 8, shuffle: bool = True,
                 label_dtype: type = np.int64, shuffle_block_rows: int = 1, width: int | None = None) -> None:
        """``width``: 4-byte words of a processed record (default: one float32 per feature).
        ``shuffle_block_rows`` > 1 (opt-in, coarser): rows move within a window in runs of that many consecutive
        stored rows instead of one by one; the copy into the window is then near sequential (parquet_loading measures
        its speed and its effect on accuracy), but a batch holds rows that were neighbours on disk."""
        if isinstance(shuffle_block_rows, bool) or not isinstance(shuffle_block_rows, int) or shuffle_block_rows < 1:
            raise UserError(f"shuffle_block_rows must be an integer >= 1 (1 = shuffle single rows), got {shuffle_block_rows!r}")
        self.groups = list_row_groups(uris)
        if shuffle and len(self.groups) < world_size:
            raise UserError(f"the split has {len(self.groups)} row group(s) in {len(uris)} file(s), fewer than "
                            f"world size {world_size}: every rank needs data; use fewer processes or more shards")
        self.features, self.label = features, label
        self.width = len(features) if width is None else width
        self.rank, self.world_size = rank, world_size
        self.batch_size, self.seed = batch_size, seed
        self.window_row_groups = max(1, window_row_groups)
        self.shuffle = shuffle
        self.label_dtype = label_dtype  # int64 class labels, or float32 targets
        self.shuffle_block_rows = shuffle_block_rows

    @property
    def num_rows(self) -> int:
        return sum(g.num_rows for g in self.groups)

    def assignment(self, epoch: int, rank: int | None = None) -> list[RowGroup]:
        """The row groups (or parts of them) ``rank`` reads in ``epoch``, in reading order. Shuffled (training), the
        epoch's permuted groups are one sequence of rows cut into ``world_size`` equal runs, a group on a cut shared
        by the two ranks beside it, so every rank holds as many rows (±1) and an epoch leaves out less than a batch a
        rank; unshuffled (evaluation), rank r takes every world_size-th whole group."""
        rank = self.rank if rank is None else rank
        if not self.shuffle:
            return self.groups[rank :: self.world_size]
        order = np.random.default_rng(self.seed + epoch).permutation(len(self.groups))
        total = self.num_rows
        first, last = total * rank // self.world_size, total * (rank + 1) // self.world_size
        taken, offset = [], 0
        for index in order:
            group = self.groups[index]
            begin, end = max(first, offset), min(last, offset + group.num_rows)
            if begin < end:
                taken.append(group if end - begin == group.num_rows else
                             RowGroup(group.uri, group.index, end - begin, group.start + begin - offset))
            offset += group.num_rows
        return taken

    def steps_per_epoch(self, epoch: int) -> int:
        """Full batches every rank can take this epoch (the same number on all ranks)."""
        rows = [sum(g.num_rows for g in self.assignment(epoch, r)) for r in range(self.world_size)]
        return min(rows) // self.batch_size

    def _windows(self, epoch: int) -> Iterator[tuple[list[RowGroup], np.random.Generator | None]]:
        groups = self.assignment(epoch)
        for number, start in enumerate(range(0, len(groups), self.window_row_groups)):
            rng = np.random.default_rng([self.seed, epoch, self.rank, number]) if self.shuffle else None
            yield groups[start : start + self.window_row_groups], rng

    def _prefetched(self, epoch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Windows in order; the row groups of up to PREFETCH_WINDOWS windows ahead are read on background threads.

        Each file's run of row groups in a window is a task of its own, so both threads share every
        window: no thread idles while the other finishes the last window, and the first batch waits
        for about half a window's reads.
        """
        windows = iter(self._windows(epoch))
        pending: collections.deque[tuple[Future, list[Future]]] = collections.deque()
        files = _OpenFiles()
        with contextlib.closing(files), ThreadPoolExecutor(max_workers=PREFETCH_THREADS,
                                                           thread_name_prefix="parquet-prefetch") as pool:

            def submit_next() -> None:
                item = next(windows, None)
                if item is None:
                    return
                groups, rng = item
                window = pool.submit(_allocate_window, groups, self.width, rng, self.label_dtype,
                                     self.shuffle_block_rows)
                reads, offset = [], 0
                for run in _by_file(groups):
                    reads.append(pool.submit(_read_into, files, run, self.label, window, offset))
                    offset += sum(g.num_rows for g in run)
                pending.append((window, reads))

            for _ in range(PREFETCH_WINDOWS):
                submit_next()
            try:
                while pending:
                    window, reads = pending.popleft()
                    for read in reads:
                        read.result()
                    submit_next()
                    out = window.result()
                    yield out.x, out.y
            finally:
                for window, reads in pending:
                    for future in [*reads, window]:
                        future.cancel()

    def epoch(self, epoch: int, skip_steps: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's batches for ``epoch``; ``skip_steps`` resumes mid-epoch at the same position."""
        total = self.steps_per_epoch(epoch) if self.shuffle else None
        size = self.batch_size
        carry_x = np.zeros((0, self.width), np.float32)
        carry_y = np.zeros(0, self.label_dtype)
        step = 0
        for window_x, window_y in self._prefetched(epoch):
            start = 0
            if len(carry_y):  # stitch only the batch that spans two windows, never copy a whole window
                start = min(size - len(carry_y), len(window_y))
                carry_x = np.concatenate([carry_x, window_x[:start]])
                carry_y = np.concatenate([carry_y, window_y[:start]])
                if len(carry_y) < size:
                    continue
                if total is not None and step >= total:
                    return
                if step >= skip_steps:
                    yield torch.from_numpy(carry_x), torch.from_numpy(carry_y)
                step += 1
            full = (len(window_y) - start) // size
            for b in range(full):
                if total is not None and step >= total:
                    return
                if step >= skip_steps:
                    rows = slice(start + b * size, start + (b + 1) * size)
                    yield torch.from_numpy(window_x[rows]), torch.from_numpy(window_y[rows])
                step += 1
            carry_x, carry_y = window_x[start + full * size :], window_y[start + full * size :]
        if total is None and len(carry_y):  # evaluation keeps the last partial batch
            yield torch.from_numpy(np.ascontiguousarray(carry_x)), torch.from_numpy(np.ascontiguousarray(carry_y))


def split_batches(manifest: dict, split: str, *, rank: int, world_size: int, batch_size: int, seed: int,
                  shuffle: bool = True, shuffle_block_rows: int = 1) -> ParquetBatches:
    """Batches over a committed split: only the files the manifest lists."""
    uris = [entry["uri"] for entry in manifest["splits"].get(split, [])]
    if not uris:
        raise UserError(f"the committed '{split}' split is empty; check preprocess.split and the input data")

    return ParquetBatches(uris, manifest["features"], manifest["label"], rank=rank, world_size=world_size,
                          batch_size=batch_size, seed=seed, shuffle=shuffle, label_dtype=label_dtype(manifest),
                          shuffle_block_rows=shuffle_block_rows, width=layout_of(manifest).words)


def read_row_groups(groups: list[RowGroup], label: str, x: np.ndarray, y: np.ndarray) -> None:
    """Read ``groups`` in order, unshuffled, into caller-owned ``x`` (rows x features, float32) and ``y`` (labels):
    row i of their concatenation lands at index i (stagewise.training.device_data reads into pinned host memory so)."""
    total = sum(g.num_rows for g in groups)
    if len(x) != total or len(y) != total:
        raise ValueError(f"read_row_groups: {total} rows need buffers of that length, got {len(x)} and {len(y)}")
    done: Future = Future()
    done.set_result(_Window(x, y, None))
    files = _OpenFiles()
    with contextlib.closing(files), ThreadPoolExecutor(max_workers=PREFETCH_THREADS,
                                                       thread_name_prefix="parquet-read") as pool:
        reads, offset = [], 0
        for run in _by_file(groups):
            reads.append(pool.submit(_read_into, files, run, label, done, offset))
            offset += sum(g.num_rows for g in run)
        for read in reads:
            read.result()
