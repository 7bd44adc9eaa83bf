"""stagewise.datasets.loader: rows whole and once per epoch, an order fixed by (seed, epoch, rank, window), exact resume, files closed."""

from __future__ import annotations

from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from stagewise.datasets import loader
from stagewise.datasets.columns import Columns, feature_vectors, processed_schema
from stagewise.datasets.loader import ParquetBatches

COLUMNS = Columns(key="row_id", label="label", features=["a", "b", "c"], num_classes=5)
FEATURES = COLUMNS.features
# Files of uneven row groups, so windows mix files and batches span windows.
LAYOUT = [(23, 5), (17, 4), (30, 7)]  # (rows, rows per row group) per file


def _table(first: int, rows: int) -> pa.Table:
    """Rows whose features are (r, 2r, -r) and label r % 5: a batch shows which rows it holds, and whether they stayed whole."""
    ids = np.arange(first, first + rows)
    matrix = np.stack([ids, 2 * ids, -ids], axis=1).astype(np.float32)
    schema = processed_schema(COLUMNS, pa.int64())
    return pa.Table.from_arrays([pa.array(ids), pa.array(ids % 5), feature_vectors(matrix)], schema=schema)


def _write(open_file, layout=LAYOUT) -> tuple[list[str], int]:
    """Write the split through ``open_file(name) -> (uri, binary handle)``; returns the URIs and the row count."""
    uris, first = [], 0
    for number, (rows, per_group) in enumerate(layout):
        uri, handle = open_file(f"part-{number:05d}.parquet")
        with handle:
            pq.write_table(_table(first, rows), handle, row_group_size=per_group)
        uris.append(uri)
        first += rows
    return uris, first


@pytest.fixture
def split(tmp_path: Path) -> tuple[list[str], int]:
    return _write(lambda name: (str(tmp_path / name), open(tmp_path / name, "wb")))


def _make(uris: list[str], **kwargs) -> ParquetBatches:
    options = {"rank": 0, "world_size": 1, "batch_size": 6, "seed": 3, "window_row_groups": 3} | kwargs
    return ParquetBatches(uris, FEATURES, "label", **options)


def _ids(batches) -> list[list[int]]:
    return [inputs[:, 0].long().tolist() for inputs, _ in batches]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_row_arrives_whole_and_at_most_once(split, world_size):
    """Features and label stay together; ranks never share a row; only the tail for equal steps is dropped."""
    uris, total = split
    ranks = [_make(uris, rank=r, world_size=world_size) for r in range(world_size)]
    for epoch in range(2):
        kept = [list(batches.epoch(epoch)) for batches in ranks]  # held all at once: no batch may be overwritten later
        steps = ranks[0].steps_per_epoch(epoch)
        seen = []
        for part in kept:
            assert len(part) == steps and all(len(labels) == 6 for _, labels in part)
            for inputs, labels in part:
                ids = inputs[:, 0].long()
                assert (inputs[:, 1] == 2 * ids).all() and (inputs[:, 2] == -ids).all()
                assert (labels == ids % 5).all()
                seen += ids.tolist()
        assert len(seen) == len(set(seen)) == world_size * steps * 6
        assert set(seen) <= set(range(total))
        assert total - len(seen) < 6 * world_size, "each rank drops less than a batch, on any world size"


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ranks_hold_equal_rows_each_epoch_whatever_the_row_groups(tmp_path, world_size):
    """Files of very uneven row groups: each rank's run of the epoch holds the same number of rows (±1), a group on a
    cut read in part by each rank beside it, so training covers all but the last partial batch of each rank (every
    rank stopping at the smallest rank's count left ~15 % of the rows out on 2 ranks)."""
    uris, total = _write(lambda name: (str(tmp_path / name), open(tmp_path / name, "wb")),
                         layout=[(400, 400), (37, 37), (250, 125), (9, 9)])
    ranks = [_make(uris, rank=r, world_size=world_size, batch_size=8) for r in range(world_size)]
    for epoch in range(3):
        held = [sum(part.num_rows for part in batches.assignment(epoch)) for batches in ranks]
        assert sum(held) == total and max(held) - min(held) <= 1
        seen = [row for batches in ranks for row in sum(_ids(batches.epoch(epoch)), [])]
        assert len(seen) == len(set(seen)) and len(seen) >= total - 8 * world_size


def test_order_is_each_window_permuted_by_its_own_seed(split):
    """Window n of (seed, epoch, rank) puts its i-th row read at default_rng([seed, epoch, rank, n]).permutation(rows)[i].

    The window rule of earlier releases (a rank's rows are now a row-balanced run of the epoch's groups, its first and
    last group possibly a part of one)."""
    uris, _ = split
    batches = _make(uris, rank=1, world_size=2)
    for epoch in range(2):
        windows = []
        groups = batches.assignment(epoch)
        for number, start in enumerate(range(0, len(groups), 3)):
            ids = np.concatenate([pq.ParquetFile(g.uri).read_row_group(g.index).column("row_id").to_numpy()
                                  [g.start : g.start + g.num_rows] for g in groups[start : start + 3]])
            window = np.empty_like(ids)
            window[np.random.default_rng([3, epoch, 1, number]).permutation(len(ids))] = ids
            windows.append(window)
        expected = np.concatenate(windows)[: batches.steps_per_epoch(epoch) * 6].reshape(-1, 6).tolist()
        assert _ids(batches.epoch(epoch)) == expected


@pytest.mark.parametrize("threads,ahead", [(1, 1), (3, 1), (1, 3), (4, 4)])
def test_order_does_not_depend_on_prefetch_threads_or_depth(split, monkeypatch, threads, ahead):
    """Background threads race to fill a window; the batches must not show it."""
    uris, _ = split
    reference = [_ids(_make(uris).epoch(epoch)) for epoch in range(2)]
    monkeypatch.setattr(loader, "PREFETCH_THREADS", threads)
    monkeypatch.setattr(loader, "PREFETCH_WINDOWS", ahead)
    assert [_ids(_make(uris).epoch(epoch)) for epoch in range(2)] == reference


def test_skip_steps_equals_the_uninterrupted_run_at_every_step(split):
    """Resuming at any step, a batch spanning two windows included, yields exactly the rest of the epoch."""
    uris, _ = split
    batches = _make(uris, batch_size=7, window_row_groups=2)
    full = _ids(batches.epoch(1))
    assert len(full) == batches.steps_per_epoch(1) > 3
    for skip in range(len(full) + 1):
        assert _ids(batches.epoch(1, skip_steps=skip)) == full[skip:]


def test_unshuffled_reads_every_file_in_order_with_the_last_partial_batch(split):
    """Evaluation order: files in split order, rows in file order, nothing dropped."""
    uris, total = split
    rows = [row for ids in _ids(_make(uris, batch_size=8, shuffle=False).epoch(0)) for row in ids]
    assert rows == list(range(total))


class _Tracker:
    """Counts Parquet readers opened and closed from now on."""

    def __init__(self, monkeypatch) -> None:
        self.opened = self.closed = 0
        tracker = self

        class Tracked(pq.ParquetFile):
            def __init__(self, *args, **kwargs) -> None:
                super().__init__(*args, **kwargs)
                tracker.opened += 1

            def close(self, *args, **kwargs) -> None:
                tracker.closed += 1
                super().close(*args, **kwargs)

        monkeypatch.setattr(pq, "ParquetFile", Tracked)


def test_an_epoch_closes_its_files_and_opens_each_local_one_at_most_once_per_thread(split, monkeypatch):
    """Local files stay open across windows (not re-opened per row group) and are all closed at the end."""
    uris, _ = split
    batches = _make(uris, window_row_groups=2)
    tracker = _Tracker(monkeypatch)
    assert len(list(batches.epoch(0))) == batches.steps_per_epoch(0)
    assert tracker.opened == tracker.closed
    assert tracker.opened <= len(uris) * loader.PREFETCH_THREADS < len(batches.groups)


def test_an_abandoned_epoch_closes_its_files(split, monkeypatch):
    """A consumer that stops after one batch (a failed step, a finished sweep trial) leaves no file open."""
    uris, _ = split
    batches = _make(uris, window_row_groups=2)
    tracker = _Tracker(monkeypatch)
    epoch = batches.epoch(0)
    next(epoch)
    epoch.close()
    assert tracker.opened == tracker.closed > 0


def test_remote_files_give_the_same_batches(split):
    """Through fsspec (memory:// here, s3:// in production) files are opened per task, with the same batches."""
    uris, _ = split
    fs = fsspec.filesystem("memory")
    root = f"/loader-test-{id(split)}"
    remote, _ = _write(lambda name: (f"memory://{root}/{name}", fs.open(f"{root}/{name}", "wb")))
    try:
        for epoch in range(2):
            assert _ids(_make(remote).epoch(epoch)) == _ids(_make(uris).epoch(epoch))
        assert _ids(_make(remote, shuffle=False).epoch(0)) == _ids(_make(uris, shuffle=False).epoch(0))
    finally:
        fs.rm(root, recursive=True)


@pytest.mark.parametrize("shuffle", [True, False])
def test_float_targets_arrive_as_float32_with_their_rows(tmp_path, shuffle):
    """A float-target split (label float32) yields float32 label tensors, each still with its own row, also in the
    batches stitched across windows and the last partial batch of evaluation."""
    columns = Columns(key="row_id", label="label", features=FEATURES, num_classes=None)
    uris = []
    for number, first in enumerate((0, 23)):
        ids = np.arange(first, first + 23)
        table = pa.Table.from_arrays([pa.array(ids), pa.array(ids * 0.5 + 0.25, pa.float32()),
                                      feature_vectors(np.stack([ids, 2 * ids, -ids], axis=1))],
                                     schema=processed_schema(columns, pa.int64()))
        uris.append(str(tmp_path / f"part-{number}.parquet"))
        pq.write_table(table, uris[-1], row_group_size=5)
    batches = list(_make(uris, shuffle=shuffle, label_dtype=np.float32).epoch(0))
    assert batches and all(labels.dtype == torch.float32 for _, labels in batches)
    for inputs, labels in batches:
        np.testing.assert_array_equal(labels.numpy(), inputs[:, 0].numpy() * 0.5 + 0.25)


def test_windows_come_from_arrows_pool_and_go_back_when_no_batch_holds_them(split):
    """Window memory is Arrow's pool (freed memory reused, no fresh pages for the kernel to zero), held while any batch
    of the window lives and returned, all of it, once none does."""
    uris, _ = split
    before = pa.total_allocated_bytes()
    kept = list(_make(uris).epoch(0))
    assert pa.total_allocated_bytes() > before
    del kept
    assert pa.total_allocated_bytes() == before


@pytest.mark.parametrize("block_rows", [2, 4, 100])
def test_block_shuffle_moves_runs_of_stored_rows_and_covers_every_row_once(split, block_rows):
    """The opt-in coarse shuffle: each window is cut, in reading order, into runs of ``block_rows`` rows that land whole
    and in order in a permuted sequence; every row arrives once per epoch, features with their label; the same seed and
    epoch repeat the order and a resume at any step yields the rest of it."""
    uris, total = split
    batches = _make(uris, shuffle_block_rows=block_rows, batch_size=1, window_row_groups=3)
    for epoch in range(2):
        got = [(inputs[0].tolist(), int(labels[0])) for inputs, labels in batches.epoch(epoch)]
        ids = [int(features[0]) for features, _ in got]
        assert sorted(ids) == list(range(total))
        assert all(features == [i, 2 * i, -i] and label == i % 5 for (features, label), i in zip(got, ids, strict=True))
        groups = batches.assignment(epoch)
        offset = 0
        for start in range(0, len(groups), 3):
            read = np.concatenate([pq.ParquetFile(g.uri).read_row_group(g.index).column("row_id").to_numpy()
                                   for g in groups[start : start + 3]])
            window, offset = ids[offset : offset + len(read)], offset + len(read)
            runs = [read[i : i + block_rows].tolist() for i in range(0, len(read), block_rows)]
            position = {run[0]: k for k, run in enumerate(runs)}
            landed, cursor = [], 0
            while cursor < len(window):
                run = runs[position[window[cursor]]]
                assert window[cursor : cursor + len(run)] == run
                landed.append(position[window[cursor]])
                cursor += len(run)
            assert sorted(landed) == list(range(len(runs)))
        assert _ids(batches.epoch(epoch)) == _ids(batches.epoch(epoch))
    full = _ids(batches.epoch(1))
    for skip in (0, 1, len(full) // 2, len(full)):
        assert _ids(batches.epoch(1, skip_steps=skip)) == full[skip:]


@pytest.mark.parametrize("block_rows", [1, 3, 4])
def test_batches_are_pinned_to_each_windows_seeded_permutation(split, block_rows):
    """Exact batches, features and labels, for (seed, epoch, rank, window): window n's k-th run of ``block_rows`` rows
    out is run default_rng([seed, epoch, rank, n]).permutation(runs)[k] of its reading order (for one row, the i-th
    row read lands at .permutation(rows)[i]), and batches cut the windows' concatenation, spanning windows. Any faster
    way to move rows must keep this, or resumed checkpoints change their data."""
    uris, _ = split
    batches = _make(uris, rank=1, world_size=2, batch_size=5, shuffle_block_rows=block_rows)
    for epoch in range(2):
        windows, groups = [], batches.assignment(epoch)
        for number, start in enumerate(range(0, len(groups), 3)):
            ids = np.concatenate([pq.ParquetFile(g.uri).read_row_group(g.index).column("row_id").to_numpy()
                                  [g.start : g.start + g.num_rows] for g in groups[start : start + 3]])
            rng = np.random.default_rng([3, epoch, 1, number])
            if block_rows == 1:
                window = np.empty_like(ids)
                window[rng.permutation(len(ids))] = ids
            else:
                runs = [ids[i : i + block_rows] for i in range(0, len(ids), block_rows)]
                window = np.concatenate([runs[k] for k in rng.permutation(len(runs))])
            windows.append(window)
        expected = np.concatenate(windows)[: batches.steps_per_epoch(epoch) * 5].reshape(-1, 5)
        got = list(batches.epoch(epoch))
        assert len(got) == len(expected)
        for (inputs, labels), ids in zip(got, expected, strict=True):
            np.testing.assert_array_equal(inputs.numpy(), np.stack([ids, 2 * ids, -ids], axis=1).astype(np.float32))
            np.testing.assert_array_equal(labels.numpy(), ids % 5)


def test_block_shuffle_of_one_row_is_the_default_order(split):
    """shuffle_block_rows=1 is the row shuffle, batch for batch."""
    uris, _ = split
    assert _ids(_make(uris, shuffle_block_rows=1).epoch(1)) == _ids(_make(uris).epoch(1))


@pytest.mark.parametrize("value", [0, -3, 2.5, True])
def test_a_bad_block_size_names_the_parameter(split, value):
    """Anything but an integer >= 1 is refused up front, naming shuffle_block_rows."""
    with pytest.raises(loader.UserError, match="shuffle_block_rows"):
        _make(split[0], shuffle_block_rows=value)
