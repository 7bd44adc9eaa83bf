"""The device a scoring sub-job (evaluation, batch inference) runs on, exact float32 there, overlapped copies to it,
and the threads that overlap a shard's reading, host preparation and writing with the model (:func:`read_ahead`,
:func:`ordered_map`, :class:`SerialWriter`, and :func:`interleave` for a shard scored as several parts)."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from stagewise.core.errors import UserError

T = TypeVar("T")
R = TypeVar("R")
_POLL_S = 0.05  # how soon a reader thread notices that its consumer has gone


def scoring_device(requested: str) -> Any:
    """The torch device a scoring sub-job uses for a profile's ``device``: cpu, cuda, or auto (cuda when present)."""
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError("profile asks for device 'cuda' but no CUDA device is visible")
    return torch.device("cuda" if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()) else "cpu")


@contextlib.contextmanager
def exact_float32(device: Any) -> Iterator[None]:
    """TF32 off on ``device`` for the block: GPU scores then agree with the CPU's to float32 rounding, not TF32's 1e-3."""
    import torch

    if device.type != "cuda":
        yield
        return
    # torch >= 2.9 refuses a mix of its legacy (allow_tf32) and new (fp32_precision) switches: use the new ones there.
    backends = [torch.backends.cuda.matmul, getattr(torch.backends.cudnn, "conv", None), getattr(torch.backends.cudnn, "rnn", None)]
    backends = [b for b in backends if b is not None and hasattr(b, "fp32_precision")]
    if backends:
        saved = [b.fp32_precision for b in backends]
        for backend in backends:
            backend.fp32_precision = "ieee"
    else:
        saved = [torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32]
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        if backends:
            for backend, value in zip(backends, saved):
                backend.fp32_precision = value
        else:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def prefetch(chunks: Iterable[tuple[Any, Any]], device: Any) -> Iterator[tuple[Any, Any]]:
    """Each ``(meta, tensors)`` of ``chunks`` (a tensor or a tuple of them) as ``(meta, the same on device)``, in order.

    On CUDA the next chunk is read (pulling ``chunks``), pinned unless it already is, and copied on a side
    stream when the caller asks for it, i.e. after it queued the current chunk's work: the copy overlaps that
    work, and the consumer's stream waits for the copy before it reads the tensors (no host sync). Elsewhere
    the tensors pass through ``.to(device)``, so the CPU path runs the same caller code.
    """
    import torch

    def each(tensors: Any, move: Any) -> Any:
        return tuple(move(t) for t in tensors) if isinstance(tensors, tuple) else move(tensors)

    if device.type != "cuda":
        for meta, tensors in chunks:
            yield meta, each(tensors, lambda t: t.to(device))
        return
    side = torch.cuda.Stream(device=device)

    def copy(tensor: Any) -> Any:
        pinned = tensor if tensor.is_pinned() else tensor.pin_memory()
        with torch.cuda.stream(side):
            return pinned.to(device, non_blocking=True)

    def hand_over(moved: Any) -> Any:
        moved.record_stream(current)  # allocated on the side stream: not reused before the consumer's work is done
        return moved

    for meta, tensors in chunks:
        moved = each(tensors, copy)
        current = torch.cuda.current_stream(device)
        current.wait_stream(side)  # the model reads the chunk only once its copy has landed
        yield meta, each(moved, hand_over)


def read_ahead(items: Iterable[T], depth: int, name: str = "scoring-read") -> Iterator[T]:
    """``items`` in order, pulled by a background thread at most ``depth`` ahead of the consumer (so a Parquet read,
    which releases the GIL, overlaps the consumer's work). An error of ``items`` is raised here, in its place in the
    order; when the consumer stops early (an error, ``close()``), the thread stops at its next item and is joined."""
    slots: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=max(1, depth))
    stop = threading.Event()

    def offer(entry: tuple[bool, Any]) -> bool:
        while not stop.is_set():
            try:
                slots.put(entry, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def pull() -> None:
        source = iter(items)
        try:
            for item in source:
                if not offer((False, item)):
                    return
            offer((True, None))
        except BaseException as exc:  # handed to the consumer, raised there
            offer((True, exc))
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=pull, name=name, daemon=True)
    thread.start()
    try:
        while True:
            last, value = slots.get()
            if last:
                if value is not None:
                    raise value
                return
            yield value
    finally:
        stop.set()
        thread.join()


def ordered_map(function: Callable[[T], R], items: Iterable[T], workers: int, depth: int | None = None,
                name: str = "scoring-prepare") -> Iterator[R]:
    """``function(item)`` for each of ``items``, computed by ``workers`` threads (numpy and pyarrow release the GIL)
    at most ``depth`` (default ``workers + 2``) items ahead, and yielded in the order of ``items``: the result does
    not depend on the threads' timing. An error is raised in its item's place; on early exit the work not yet
    started is cancelled and the threads are joined."""
    depth = max(1, depth if depth is not None else workers + 2)
    pending: deque[Future[R]] = deque()
    pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix=name)
    try:
        for item in items:
            pending.append(pool.submit(function, item))
            if len(pending) >= depth:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        close = getattr(items, "close", None)
        if close is not None:  # e.g. a read_ahead: its thread stops too
            close()


def interleave(streams: list[Iterator[T]]) -> Iterator[tuple[int, T]]:
    """``(k, item)`` taking one item of each of ``streams`` in turn (a shard's parts, each read and prepared by its own
    threads, scored by one model): each stream's items stay in their order. An error of a stream is raised in its
    place in the streams' order, not the threads' timing: after stream ``k`` fails, the streams before it are still
    drained (their items not yielded: the shard fails anyway) and the first failed stream's error is raised, so an
    error that a single stream over the same items would raise first is the one raised. The caller closes the streams
    (e.g. on its own error)."""
    live = list(range(len(streams)))
    failed: tuple[int, BaseException] | None = None
    while live:
        for k in list(live):
            if failed is not None and k > failed[0]:
                live.remove(k)  # after the first failed stream: never reached by a single stream
                continue
            try:
                item = next(streams[k])
            except StopIteration:
                live.remove(k)
                continue
            except Exception as exc:  # noqa: BLE001 - raised below, in its place in the order
                failed = (k, exc) if failed is None or k < failed[0] else failed
                live.remove(k)
                continue
            if failed is None:
                yield k, item
    if failed is not None:
        raise failed[1]


class SerialWriter:
    """One background thread that runs submitted calls in order (a shard's output writes), at most ``depth``
    outstanding: :meth:`submit` blocks beyond that, so memory stays bounded. A call's error is raised by the next
    :meth:`submit` or by :meth:`finish`; :meth:`close` (always, e.g. in ``finally``) drops what has not started and
    joins the thread, so nothing writes to a file after its owner has moved on."""

    def __init__(self, depth: int = 4, name: str = "scoring-write") -> None:
        self._depth = max(1, depth)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._pending: deque[Future[Any]] = deque()

    def submit(self, function: Callable[..., Any], *args: Any) -> None:
        while self._pending and (len(self._pending) >= self._depth or self._pending[0].done()):
            self._pending.popleft().result()  # raises the error of a failed write
        self._pending.append(self._pool.submit(function, *args))

    def finish(self) -> None:
        """Wait for every submitted call; raise the first error."""
        while self._pending:
            self._pending.popleft().result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()
