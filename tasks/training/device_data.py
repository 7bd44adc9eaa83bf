"""Per-rank batches shuffled and sliced on the training device: resident epochs, or chunks streamed in.

Used by :func:`stagewise.training.loop.rank_batches` (``train.stages[].data_placement``); try it alone with
``python -c "from stagewise.training.device_data import choose_placement; help(choose_placement)"``.

Which rows a rank reads is :class:`stagewise.datasets.loader.ParquetBatches`'s: each epoch the split's row groups are
permuted with ``seed + epoch`` and rank r takes every world_size-th one (ranks disjoint per epoch, the
same number of steps on every rank). The rank's row groups are cut, in that order, into chunks of about
``chunk_bytes``; each chunk's rows are permuted by ``torch.randperm`` on the device with a generator
seeded from (seed, epoch, rank, chunk), and batches are consecutive slices of the chunks so permuted
(a batch may span two chunks). Both placements produce exactly that sequence:

- **resident**: the data is read once and moved once; each epoch only index tensors are built on the
  device and every batch is one ``index_select``. Because the row-group permutation hands any row group
  to any rank in some epoch, a rank holds the *whole* training split (not just this epoch's share):
  the only way to keep the ParquetBatches assignment (and so disjoint DDP ranks) without re-reading.
  The fit check therefore counts the whole split per rank. An unshuffled split (validation) keeps a
  fixed share per rank, so only that share is held.
- **streamed**: each epoch the rank's chunks are read on a background thread into pinned host memory
  (pinned only on CUDA) and copied on a side CUDA stream while the previous chunk trains, in the style
  of torchtnt's ``CudaDataPrefetcher``: the consuming stream ``wait_stream``s the side stream and the
  copied tensors ``record_stream`` it, so the caching allocator never hands their memory to the next
  copy while a kernel still reads them. Device memory: about two chunks.

Resume: ``epoch(e, skip_steps=k)`` yields exactly the batches after the first k (chunks before the k-th
batch are not even read on the streamed path). The device sequence differs from the host loader's
(numpy shuffles per window there), so the placement is part of a stage's config hash; resident and
streamed are interchangeable, even across ranks of one job.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from stagewise.core.errors import UserError
from stagewise.datasets.loader import ParquetBatches, RowGroup, read_row_groups

log = logging.getLogger("stagewise.train")

PLACEMENTS = ("auto", "host", "resident", "streamed")
# Target size of one streamed chunk (and of one shuffle unit on both device paths): big copies, a few in flight.
CHUNK_BYTES = 64 * 2**20
# Chunks read ahead of the one training: bounds pinned host memory at a few chunks.
READ_AHEAD = 2


def row_bytes(source: ParquetBatches) -> int:
    """Bytes one row takes on the device: its record (float32 features, typed slots) and its label."""
    return 4 * source.width + np.dtype(source.label_dtype).itemsize


def resident_bytes(source: ParquetBatches) -> int:
    """Device memory the resident path holds for ``source``: the whole split when shuffled, else the rank's share."""
    groups = source.groups if source.shuffle else source.assignment(0)
    return sum(g.num_rows for g in groups) * row_bytes(source)


def _generator_seed(*parts: int) -> int:
    """One 63-bit seed from several ints, mixed (so nearby epochs or ranks do not give related streams)."""
    state = np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


@dataclass
class _Chunk:
    """Consecutive row groups of a rank's epoch: positions ``start``..``end`` of the epoch's row sequence."""

    number: int
    groups: list[RowGroup]
    start: int
    end: int


class DeviceBatches:
    """One rank's batches of a split as device tensors: the ParquetBatches interface Loop uses."""

    on_device = True  # Loop copies no batch of these

    def __init__(self, source: ParquetBatches, device: str | torch.device, *, resident: bool,
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        self.source = source
        self.device = torch.device(device)
        self.resident = resident
        self.chunk_rows = max(1, chunk_bytes // row_bytes(source))
        self.batch_size, self.shuffle = source.batch_size, source.shuffle
        self._x: torch.Tensor | None = None
        self._y: torch.Tensor | None = None
        self._offsets: dict[tuple[str, int], int] = {}
        if resident:
            self._load()

    @property
    def num_rows(self) -> int:
        return self.source.num_rows

    @property
    def placement(self) -> str:
        return "resident" if self.resident else "streamed"

    def steps_per_epoch(self, epoch: int) -> int:
        return self.source.steps_per_epoch(epoch)

    def assignment(self, epoch: int, rank: int | None = None) -> list[RowGroup]:
        return self.source.assignment(epoch, rank)

    def chunks(self, epoch: int) -> list[_Chunk]:
        """The rank's row groups of ``epoch`` in reading order, cut into chunks of at least ``chunk_rows`` rows."""
        return _cut(self.source.assignment(epoch), self.chunk_rows)

    def _permutation(self, epoch: int, chunk: _Chunk) -> torch.Tensor | None:
        if not self.shuffle:
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(_generator_seed(self.source.seed, epoch, self.source.rank, chunk.number))
        return torch.randperm(chunk.end - chunk.start, generator=generator, device=self.device)

    # --- resident -----------------------------------------------------------------------------------------------

    def _load(self) -> None:
        """Read the held row groups once, chunk by chunk (bounded host memory), into one device tensor each for x, y."""
        groups = self.source.groups if self.shuffle else self.source.assignment(0)
        total = sum(g.num_rows for g in groups)
        self._x = torch.empty((total, self.source.width), dtype=torch.float32, device=self.device)
        self._y = torch.empty(total, dtype=_torch_dtype(self.source.label_dtype), device=self.device)
        offset = 0
        for group in groups:
            self._offsets[(group.uri, group.index)] = offset
            offset += group.num_rows
        chunks = _cut(groups, self.chunk_rows)
        prefetcher = _Prefetcher(self.source, chunks, self.device)
        try:
            for chunk in chunks:
                x, y = prefetcher.next()
                self._x[chunk.start : chunk.end].copy_(x)
                self._y[chunk.start : chunk.end].copy_(y)
        finally:
            prefetcher.close()

    def _resident_chunk(self, epoch: int, chunk: _Chunk) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        """(x, y, order, base): the chunk's rows are ``x[order]`` (``x[base:base + n]`` when order is None)."""
        assert self._x is not None and self._y is not None
        permutation = self._permutation(epoch, chunk)
        spans = [(self._offsets[(g.uri, g.index)] + g.start, g.num_rows) for g in chunk.groups]
        contiguous = all(spans[i][0] + spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))
        if permutation is None and contiguous:
            return self._x, self._y, None, spans[0][0]
        rows = torch.cat([torch.arange(start, start + n, device=self.device) for start, n in spans])
        return self._x, self._y, rows if permutation is None else rows[permutation], 0

    # --- the epoch ----------------------------------------------------------------------------------------------

    def epoch(self, epoch: int, skip_steps: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's batches for ``epoch``; ``skip_steps`` resumes mid-epoch at the same position."""
        size = self.batch_size
        chunks = self.chunks(epoch)
        rows = chunks[-1].end if chunks else 0
        limit = self.steps_per_epoch(epoch) * size if self.shuffle else rows  # shuffled: equal full batches on all ranks
        begin = skip_steps * size
        needed = [c for c in chunks if c.end > begin and c.start < limit]  # chunks before a resume point are not read
        prefetcher = None if self.resident else _Prefetcher(self.source, needed, self.device)
        carry: list[tuple[torch.Tensor, torch.Tensor]] = []
        carried = 0
        try:
            for chunk in needed:
                if prefetcher is None:
                    x, y, order, base = self._resident_chunk(epoch, chunk)
                else:
                    (x, y), order, base = prefetcher.next(), self._permutation(epoch, chunk), 0
                position, end = max(chunk.start, begin), min(chunk.end, limit)
                if carried:  # the batch that spans chunks: only it is stitched
                    count = min(size - carried, end - position)
                    carry.append(_take(x, y, order, base, position - chunk.start, position - chunk.start + count))
                    carried += count
                    position += count
                    if carried < size:
                        continue
                    yield torch.cat([part[0] for part in carry]), torch.cat([part[1] for part in carry])
                    carry, carried = [], 0
                while end - position >= size:
                    yield _take(x, y, order, base, position - chunk.start, position - chunk.start + size)
                    position += size
                    if prefetcher is not None:
                        prefetcher.poll()
                if position < end:
                    carry, carried = [_take(x, y, order, base, position - chunk.start, end - chunk.start)], end - position
            if carried:  # only unshuffled (evaluation) ends on a partial batch
                yield torch.cat([part[0] for part in carry]), torch.cat([part[1] for part in carry])
        finally:
            if prefetcher is not None:
                prefetcher.close()


def _cut(groups: list[RowGroup], rows: int) -> list[_Chunk]:
    """Consecutive row groups joined into chunks of at least ``rows`` rows (the last may be smaller)."""
    chunks: list[_Chunk] = []
    current: list[RowGroup] = []
    start = count = 0
    for group in groups:
        current.append(group)
        count += group.num_rows
        if count >= rows:
            chunks.append(_Chunk(len(chunks), current, start, start + count))
            current, start, count = [], start + count, 0
    if current:
        chunks.append(_Chunk(len(chunks), current, start, start + count))
    return chunks


def _take(x: torch.Tensor, y: torch.Tensor, order: torch.Tensor | None, base: int, a: int, b: int,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows a..b of a chunk whose rows are ``x[order]`` (``x[base:]`` when order is None): one gather, or a view."""
    if order is None:
        return x[base + a : base + b], y[base + a : base + b]
    index = order[a:b]
    return x.index_select(0, index), y.index_select(0, index)


class _Prefetcher:
    """Chunks read on a background thread into (pinned, on CUDA) host memory and copied on a side stream, in order.

    Each chunk's host-to-device copy is issued on the side stream as soon as its read is done and the
    chunk before it was handed out (:meth:`poll` between batches), so it overlaps that chunk's training;
    the consumer's stream waits for the side stream (no host sync) and the copies are marked used by it
    (``record_stream``), so the caching allocator cannot give their memory to a later copy early.
    Pinned blocks come from torch's caching host allocator, which records each non-blocking copy's event on
    its block and reuses a freed block only once that copy is done.
    """

    def __init__(self, source: ParquetBatches, chunks: list[_Chunk], device: torch.device) -> None:
        self.source, self.device = source, device
        self.cuda = device.type == "cuda"
        self._queued = iter(chunks)
        self._reads: collections.deque[Future] = collections.deque()
        self._copied: tuple[torch.Tensor, torch.Tensor] | None = None  # the next chunk, copy issued
        self._side = torch.cuda.Stream(device=device) if self.cuda else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="device-prefetch")
        for _ in range(READ_AHEAD):
            self._read_next()

    def _read(self, chunk: _Chunk) -> tuple[torch.Tensor, torch.Tensor]:
        rows = chunk.end - chunk.start
        # A new thread's current device is 0: pin under this rank's device, so no context is made on another GPU.
        with torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext():
            x = torch.empty((rows, self.source.width), dtype=torch.float32, pin_memory=self.cuda)
            y = torch.empty(rows, dtype=_torch_dtype(self.source.label_dtype), pin_memory=self.cuda)
        read_row_groups(chunk.groups, self.source.label, x.numpy(), y.numpy())
        return x, y

    def _read_next(self) -> None:
        chunk = next(self._queued, None)
        if chunk is not None:
            self._reads.append(self._pool.submit(self._read, chunk))

    def _copy_next(self) -> None:
        x, y = self._reads.popleft().result()
        self._read_next()
        if self._side is None:  # CPU stands in for the device: the read buffers are the batches' storage
            self._copied = x, y
            return
        with torch.cuda.stream(self._side):
            self._copied = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def poll(self) -> None:
        """Issue the next chunk's copy if its read is done (a host check only: never waits)."""
        if self._copied is None and self._reads and self._reads[0].done():
            self._copy_next()

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next chunk, usable on the current stream; waits for its read only if it is not done yet."""
        if self._copied is None:
            self._copy_next()
        assert self._copied is not None
        x, y = self._copied
        self._copied = None
        if self._side is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self._side)
            x.record_stream(current)
            y.record_stream(current)
        self.poll()
        return x, y

    def close(self) -> None:
        for read in self._reads:
            read.cancel()
        self._pool.shutdown(wait=True)


def _torch_dtype(numpy_dtype: type) -> torch.dtype:
    return torch.from_numpy(np.empty(0, numpy_dtype)).dtype


def choose_placement(setting: str, fraction: float, device: str, need_bytes: int) -> tuple[str, str]:
    """(placement, why): ``auto`` on CUDA is resident when ``need_bytes`` fit in ``fraction`` of the device's memory
    (and in what is free), else streamed; on CPU it is host (stagewise.datasets.loader). Forced settings are kept."""
    if setting not in PLACEMENTS:
        raise UserError(f"data_placement '{setting}' is not one of {', '.join(PLACEMENTS)}")
    if not 0 < fraction <= 1:
        raise UserError(f"resident_memory_fraction {fraction} must be in (0, 1]")
    need = f"{need_bytes / 2**30:.3g} GiB"
    if not str(device).startswith("cuda"):
        if setting == "auto":
            return "host", f"host (device {device}: each rank streams its Parquet row groups through the host loader)"
        return setting, f"{setting} (forced; {need} on {device})"
    free, total = torch.cuda.mem_get_info(torch.device(device))
    allowed = min(fraction * total, free)
    budget = f"{need} of {allowed / 2**30:.3g} GiB allowed"
    if setting != "auto":
        return setting, f"{setting} (forced; {budget})"
    placement = "resident" if need_bytes <= allowed else "streamed"
    return placement, f"{placement} ({budget})"
