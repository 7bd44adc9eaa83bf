"""What identifies a file's bytes, on any storage: S3's ETag with the size (S3 computes the ETag from the content
and a HEAD reads it without a download), elsewhere the SHA-256 of the bytes (a full read: a local file has no
checksum of its content, and size and mtime survive a rewrite in place).

Nothing to run: the step cache records these when an output commits and compares them before serving it, and a
batch inference plan pins its inputs by them.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from stagewise.core import storage

# hashlib releases the GIL while it hashes, so files hash side by side on as many cores as there are.
HASH_THREADS = 8


def content_id(uri: str, info: dict[str, Any] | None = None) -> str:
    """``etag:<ETag>:<size>`` on S3 (``info``: a HEAD already made, else one is), else ``sha256:<hex>``; asked of
    the store itself, never of a listing this process cached."""
    fs, path = storage.filesystem(uri)
    if type(fs).__name__ == "S3FileSystem":
        if info is None:
            fs.invalidate_cache(path)
            info = fs.info(path)
        if etag := str(info.get("ETag") or info.get("etag") or "").strip('"'):
            return f"etag:{etag}:{info.get('size')}"
    return f"sha256:{storage.sha256_of(uri)}"


def content_ids(uris: Iterable[str]) -> list[str]:
    """:func:`content_id` of each of ``uris``, in order, several at a time."""
    uris = list(uris)
    if len(uris) < 2:
        return [content_id(uri) for uri in uris]
    with ThreadPoolExecutor(min(HASH_THREADS, len(uris))) as pool:
        return list(pool.map(content_id, uris))


def described(found: str) -> str:
    """A content id short enough for a message: its kind and first 12 characters."""
    kind, _, value = found.partition(":")
    return f"{kind} {value[:12]}…" if value else found
