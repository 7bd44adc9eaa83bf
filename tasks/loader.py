"""Per-rank batches streamed from Parquet row groups: disjoint, deterministic, bounded in memory.

Each epoch the row groups of a split are permuted with ``seed + epoch`` and rank r takes every
world_size-th one from r (DistributedSampler semantics at row-group granularity), so no process
loads the whole data set and every rank sees a different part each epoch. Rows are shuffled within
a window of ``window_row_groups`` row groups; a background thread reads the next window while the
current one trains (pyarrow releases the GIL), so memory stays bounded by two windows.
All ranks take the same number of steps per epoch (the smallest rank's full batches), computed
from Parquet metadata alone, so DDP never waits on a rank that ran out of data.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pyarrow.parquet as pq
import torch

from tasks import storage
from tasks.errors import UserError


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


def read_row_groups(groups: list[RowGroup], features: list[str], label: str) -> tuple[np.ndarray, np.ndarray]:
    """The float32 feature matrix and int64 labels of ``groups``, in order."""
    blocks, labels = [], []
    for group in groups:
        fs, path = storage.filesystem(group.uri)
        with fs.open(path, "rb") as handle:
            table = pq.ParquetFile(handle).read_row_group(group.index, columns=[label, *features])
        matrix = np.empty((table.num_rows, len(features)), dtype=np.float32)
        for j, name in enumerate(features):
            matrix[:, j] = table.column(name).to_numpy()
        blocks.append(matrix)
        labels.append(table.column(label).to_numpy().astype(np.int64, copy=False))
    if not blocks:
        return np.zeros((0, len(features)), np.float32), np.zeros(0, np.int64)
    return np.concatenate(blocks), np.concatenate(labels)


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
        for start in range(0, len(groups), self.window_row_groups):
            yield read_row_groups(groups[start : start + self.window_row_groups], self.features, self.label)

    def _prefetched(self, epoch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        slots: queue.Queue = queue.Queue(maxsize=1)
        stop = threading.Event()

        def produce() -> None:
            try:
                for window in self._windows(epoch):
                    while not stop.is_set():
                        try:
                            slots.put(window, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
                slots.put(None)
            except BaseException as exc:  # surface read errors in the training thread
                slots.put(exc)

        thread = threading.Thread(target=produce, name="parquet-prefetch", daemon=True)
        thread.start()
        try:
            while True:
                item = slots.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()

    def epoch(self, epoch: int, skip_steps: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's batches for ``epoch``; ``skip_steps`` resumes mid-epoch at the same position."""
        total = self.steps_per_epoch(epoch) if self.shuffle else None
        rng = np.random.default_rng([self.seed, epoch, self.rank])
        carry_x = np.zeros((0, len(self.features)), np.float32)
        carry_y = np.zeros(0, np.int64)
        step = 0
        for window_x, window_y in self._prefetched(epoch):
            if self.shuffle:
                order = rng.permutation(len(window_y))
                window_x, window_y = window_x[order], window_y[order]
            x = np.concatenate([carry_x, window_x]) if len(carry_y) else window_x
            y = np.concatenate([carry_y, window_y]) if len(carry_y) else window_y
            full = len(y) // self.batch_size
            for b in range(full):
                if total is not None and step >= total:
                    return
                if step >= skip_steps:
                    rows = slice(b * self.batch_size, (b + 1) * self.batch_size)
                    yield torch.from_numpy(x[rows]), torch.from_numpy(y[rows])
                step += 1
            carry_x, carry_y = x[full * self.batch_size :], y[full * self.batch_size :]
        if total is None and len(carry_y):  # evaluation keeps the last partial batch
            yield torch.from_numpy(carry_x), torch.from_numpy(carry_y)


def split_batches(manifest: dict, split: str, *, rank: int, world_size: int, batch_size: int, seed: int,
                  shuffle: bool = True) -> ParquetBatches:
    """Batches over a committed split: only the files the manifest lists."""
    uris = [entry["uri"] for entry in manifest["splits"].get(split, [])]
    if not uris:
        raise UserError(f"the committed '{split}' split is empty; check preprocess.split and the input data")
    return ParquetBatches(uris, manifest["features"], manifest["label"], rank=rank, world_size=world_size,
                          batch_size=batch_size, seed=seed, shuffle=shuffle)
