"""The bytes of a local Parquet file that a shard of some of its row groups reads, and their digests.

Nothing to run: stagewise.datasets.sharding pins a file cut into several shards by the SHA-256 of each row group's
bytes and of its footer, taken in the one pass that hashes the whole file at plan; each shard then hashes only its own
row groups and the footer, not the whole file once per shard. Equal footer bytes mean equal row group offsets, and
equal bytes there mean equal values read.
"""

from __future__ import annotations

import hashlib
from typing import Any

from stagewise.core import storage

DIGEST_CHARS = 32  # 128 bits of SHA-256 for each span: a shard's plan carries one per row group
_TAIL = 8  # a Parquet file ends with the footer's length (4 bytes, little-endian) and b"PAR1"


def group_spans(metadata: Any) -> list[tuple[int, int]]:
    """``(offset, length)`` of each row group's column chunks (dictionary pages included), from a file's footer."""
    spans = []
    for index in range(metadata.num_row_groups):
        group = metadata.row_group(index)
        starts, ends = [], []
        for column in (group.column(c) for c in range(group.num_columns)):
            start = column.dictionary_page_offset if column.has_dictionary_page and column.dictionary_page_offset else \
                column.data_page_offset
            starts.append(start)
            ends.append(start + column.total_compressed_size)
        spans.append((min(starts), max(ends) - min(starts)))
    return spans


def footer_span(fs: Any, path: str, size: int) -> tuple[int, int]:
    """``(offset, length)`` of the footer with its length and magic, read from the file's last 8 bytes."""
    with fs.open(path, "rb") as handle:
        handle.seek(size - _TAIL)
        length = int.from_bytes(handle.read(4), "little")
    return size - _TAIL - length, length + _TAIL


def whole_and_spans(uri: str, spans: list[tuple[int, int]]) -> tuple[str, list[str]]:
    """The hex SHA-256 of the whole file and the digest of each of ``spans`` (sorted by offset), in one read."""
    whole, parts = hashlib.sha256(), [hashlib.sha256() for _ in spans]
    position, first = 0, 0
    for chunk in storage.iter_chunks(uri):
        view, end = memoryview(chunk), position + len(chunk)
        whole.update(view)
        for k in range(first, len(spans)):
            start, stop = spans[k][0], spans[k][0] + spans[k][1]
            if start >= end:
                break
            if stop <= position:
                first = k + 1  # spans are sorted: this one and those before it are done
                continue
            parts[k].update(view[max(start, position) - position:min(stop, end) - position])
        position = end
    return whole.hexdigest(), [part.hexdigest()[:DIGEST_CHARS] for part in parts]


def span_digests(fs: Any, path: str, spans: list[tuple[int, int]]) -> list[str]:
    """The digest of each of ``spans``, reading only them."""
    found = []
    with fs.open(path, "rb") as handle:
        for start, length in spans:
            handle.seek(start)
            digest, left = hashlib.sha256(), length
            while left > 0 and (chunk := handle.read(min(left, storage.COPY_CHUNK_BYTES))):
                digest.update(chunk)
                left -= len(chunk)
            found.append(digest.hexdigest()[:DIGEST_CHARS])
    return found


def pinned_digests(uri: str, size: int, metadata: Any) -> dict[str, Any]:
    """A local file's ``content`` (its SHA-256), and when it has several row groups the digest of each
    (``group_digests``) and of its footer (``footer_digest``), in one read of the file."""
    fs, path = storage.filesystem(uri)
    groups = group_spans(metadata) if metadata.num_row_groups > 1 else []
    footer = [footer_span(fs, path, size)] if groups else []
    order = sorted(range(len(groups) + len(footer)), key=lambda k: [*groups, *footer][k][0])
    whole, digests = whole_and_spans(uri, [[*groups, *footer][k] for k in order])
    by_span = dict(zip(order, digests, strict=True))
    found: dict[str, Any] = {"content": f"sha256:{whole}"}
    if groups:
        found.update(group_digests=[by_span[k] for k in range(len(groups))], footer_digest=by_span[len(groups)])
    return found


def changed_spans(uri: str, row_groups: list[int], group_digests: list[str], footer_digest: str) -> str | None:
    """What of a local file differs from the digests its plan took of its footer and of ``row_groups`` (None:
    nothing): reads the footer and those row groups only."""
    fs, path = storage.filesystem(uri)
    footer = footer_span(fs, path, fs.size(path))
    if span_digests(fs, path, [footer]) != [footer_digest]:
        return "its footer"
    with storage.open_parquet(uri) as parquet:
        spans = group_spans(parquet.metadata)
    found = span_digests(fs, path, [spans[g] for g in row_groups])
    differ = [g for g, now, then in zip(row_groups, found, group_digests, strict=True) if now != then]
    return f"row group(s) {differ}" if differ else None
