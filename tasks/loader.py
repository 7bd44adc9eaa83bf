"""Per-rank batches streamed from Parquet row groups: disjoint, deterministic, bounded in memory.

Each epoch the row groups of a split are permuted with ``seed + epoch`` and rank r takes every
world_size-th one from r (DistributedSampler semantics at row-group granularity), so no process
loads the whole data set and every rank sees a different part each epoch. Rows are shuffled within
a window of ``window_row_groups`` row groups (rows move whole, thanks to the processed vector
column); background threads read the next windows while the current one trains, so memory stays
bounded by a few windows.
All ranks take the same number of steps per epoch (the smallest rank's full batches), computed
from Parquet metadata alone, so DDP never waits on a rank that ran out of data.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pyarrow.parquet as pq
import torch

from tasks import storage
from tasks.errors import UserError

# Windows read ahead in parallel (pyarrow and numpy's row moves release the GIL): 2 cores stay busy.
PREFETCH_WINDOWS = 2


@dataclass(frozen=True)
class RowGroup:
    """One Parquet row group: the unit that ranks split between them."""

    uri: str
    index: int
    num_rows: int


def list_row_groups(uris: list[str]) -> list[RowGroup]:
    groups = []
    for uri in uris:
        fs, path = storage.filesystem(uri)
        with fs.open(path, "rb") as handle:
            metadata = pq.ParquetFile(handle).metadata
        groups += [RowGroup(uri, i, metadata.row_group(i).num_rows) for i in range(metadata.num_row_groups)]
    return [g for g in groups if g.num_rows > 0]


def read_row_groups(groups: list[RowGroup], label: str, rng: np.random.Generator | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The (rows, features) float32 matrix and int64 labels of ``groups``, rows shuffled when ``rng`` is given.

    Each row group maps onto a matrix without a copy (the processed vector column); the shuffle
    scatters each group's rows to random places of the output: one pass, rows moved whole.
    """
    from tasks.preprocess import FEATURES_COLUMN, feature_matrix

    matrices, labels = [], []
    for uri, indices in _by_file(groups):
        with storage.open_parquet(uri) as parquet:
            table = parquet.read_row_groups(indices, columns=[label, FEATURES_COLUMN])
        for batch in table.to_batches():  # row groups stay separate chunks: zero-copy views
            matrices.append(feature_matrix(batch))
            labels.append(batch.column(label).to_numpy().astype(np.int64, copy=False))
    if not matrices:
        return np.zeros((0, 0), np.float32), np.zeros(0, np.int64)
    if rng is None:
        return np.concatenate(matrices), np.concatenate(labels)
    total = sum(len(m) for m in matrices)
    destination = rng.permutation(total)
    out_x = np.empty((total, matrices[0].shape[1]), np.float32)
    out_y = np.empty(total, np.int64)
    start = 0
    for matrix, group_labels in zip(matrices, labels):
        rows = destination[start : start + len(matrix)]
        out_x[rows] = matrix
        out_y[rows] = group_labels
        start += len(matrix)
    return out_x, out_y


def _by_file(groups: list[RowGroup]) -> list[tuple[str, list[int]]]:
    """Consecutive row groups of the same file, so each file is opened once per window."""
    runs: list[tuple[str, list[int]]] = []
    for group in groups:
        if runs and runs[-1][0] == group.uri:
            runs[-1][1].append(group.index)
        else:
            runs.append((group.uri, [group.index]))
    return runs


class ParquetBatches:
    """Batches of one rank over a split's Parquet files."""

    def __init__(self, uris: list[str], features: list[str], label: str, *, rank: int, world_size: int,
                 batch_size: int, seed: int, window_row_groups: int = 8, shuffle: bool = True) -> None:
        self.groups = list_row_groups(uris)
        if shuffle and len(self.groups) < world_size:
            raise UserError(f"the split has {len(self.groups)} row group(s) in {len(uris)} file(s), fewer than "
                            f"world size {world_size}: every rank needs data; use fewer processes or more shards")
        self.features, self.label = features, label
        self.rank, self.world_size = rank, world_size
        self.batch_size, self.seed = batch_size, seed
        self.window_row_groups = max(1, window_row_groups)
        self.shuffle = shuffle

    @property
    def num_rows(self) -> int:
        return sum(g.num_rows for g in self.groups)

    def assignment(self, epoch: int, rank: int | None = None) -> list[RowGroup]:
        """The row groups ``rank`` reads in ``epoch``, in reading order."""
        rank = self.rank if rank is None else rank
        order = np.arange(len(self.groups))
        if self.shuffle:
            order = np.random.default_rng(self.seed + epoch).permutation(len(self.groups))
        return [self.groups[i] for i in order[rank :: self.world_size]]

    def steps_per_epoch(self, epoch: int) -> int:
        """Full batches every rank can take this epoch (the same number on all ranks)."""
        rows = [sum(g.num_rows for g in self.assignment(epoch, r)) for r in range(self.world_size)]
        return min(rows) // self.batch_size

    def _windows(self, epoch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        groups = self.assignment(epoch)
        for number, start in enumerate(range(0, len(groups), self.window_row_groups)):
            rng = np.random.default_rng([self.seed, epoch, self.rank, number]) if self.shuffle else None
            yield groups[start : start + self.window_row_groups], rng

    def _prefetched(self, epoch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Windows in order, read and shuffled up to PREFETCH_WINDOWS ahead on background threads."""
        from concurrent.futures import ThreadPoolExecutor

        windows = iter(self._windows(epoch))
        pending: collections.deque = collections.deque()
        with ThreadPoolExecutor(max_workers=PREFETCH_WINDOWS, thread_name_prefix="parquet-prefetch") as pool:

            def submit_next() -> None:
                item = next(windows, None)
                if item is not None:
                    pending.append(pool.submit(read_row_groups, item[0], self.label, item[1]))

            for _ in range(PREFETCH_WINDOWS):
                submit_next()
            try:
                while pending:
                    window = pending.popleft().result()
                    submit_next()
                    yield window
            finally:
                for future in pending:
                    future.cancel()

    def epoch(self, epoch: int, skip_steps: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's batches for ``epoch``; ``skip_steps`` resumes mid-epoch at the same position."""
        total = self.steps_per_epoch(epoch) if self.shuffle else None
        size = self.batch_size
        carry_x = np.zeros((0, len(self.features)), np.float32)
        carry_y = np.zeros(0, np.int64)
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
                  shuffle: bool = True) -> ParquetBatches:
    """Batches over a committed split: only the files the manifest lists."""
    uris = [entry["uri"] for entry in manifest["splits"].get(split, [])]
    if not uris:
        raise UserError(f"the committed '{split}' split is empty; check preprocess.split and the input data")
    return ParquetBatches(uris, manifest["features"], manifest["label"], rank=rank, world_size=world_size,
                          batch_size=batch_size, seed=seed, shuffle=shuffle)
