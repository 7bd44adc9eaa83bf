"""Row keys: a stable 64-bit hash per key, the train/validation/test split as a pure function of the key, and the
k-way merge of every shard's sorted key hashes that finds repeated keys in bounded memory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

from stagewise.core import storage
from stagewise.core.errors import DataError
from stagewise.definitions.config import Split

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(values: np.ndarray) -> np.ndarray:
    # splitmix64 finaliser: a fast, well-spread, platform-independent integer hash.
    z = values.astype(np.uint64, copy=True)
    z += _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def key_bits(keys: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """64 bits per key: an integer key's own bits, a string key's stable SipHash."""
    if pa.types.is_integer(keys.type):
        return np.asarray(keys.to_numpy(zero_copy_only=False)).astype(np.int64).view(np.uint64)
    from pandas.util import hash_array  # stable SipHash of strings with a fixed key

    return hash_array(np.asarray(keys.to_numpy(zero_copy_only=False), dtype=object))


def key_hashes(keys: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A 64-bit hash per key for the duplicate check: an integer key's own bits (never collide, and ids that
    arrive in order sort in linear time), a string key's SipHash (may collide)."""
    return key_bits(keys)


def key_units(keys: pa.Array | pa.ChunkedArray, salt: str) -> np.ndarray:
    """A number in [0, 1) per key from a salted hash of the key alone: uniform, and the same wherever the row is read."""
    seed = np.uint64(int.from_bytes(hashlib.sha256(salt.encode()).digest()[:8], "little"))
    return (_mix64(key_bits(keys) ^ seed) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def split_of(keys: pa.Array | pa.ChunkedArray, split: Split) -> np.ndarray:
    """0 = train, 1 = validation, 2 = test, decided by a salted hash of each key alone."""
    unit = key_units(keys, split.salt)
    return np.where(unit < split.test, 2, np.where(unit < split.test + split.validation, 1, 0)).astype(np.int8)


KEY_HASHES_SUFFIX = ".u64"


MERGE_BUDGET_HASHES = 8 << 20  # hashes buffered across all shards while merging: 64 MiB


MAX_CANDIDATES = 1 << 20  # hash matches gathered before they are confirmed against the files


def iter_hash_chunks(uri: str, num_hashes: int) -> Iterator[np.ndarray]:
    """A sidecar's hashes, ``num_hashes`` at a time."""
    leftover = b""
    for chunk in storage.iter_chunks(uri, num_hashes * 8):
        chunk = leftover + chunk
        whole = len(chunk) - len(chunk) % 8
        leftover = chunk[whole:]
        if whole:
            yield np.frombuffer(chunk[:whole], dtype="<u8")
    if leftover:
        raise DataError(f"{uri}: key hash file is cut off ({len(leftover)} stray bytes); run the shard's stats again")


def repeated_hashes(sidecars: list[str]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(hash, sidecar position) pairs of every hash found more than once over the sorted sidecars, in batches.

    A k-way merge by rounds: each round takes, from every buffer, the hashes up to the smallest of the
    buffers' last hashes, so at least one buffer empties per round and at most MERGE_BUDGET_HASHES are held.
    """
    chunk_hashes = max(1024, MERGE_BUDGET_HASHES // max(len(sidecars), 1))
    streams = [iter_hash_chunks(uri, chunk_hashes) for uri in sidecars]
    buffers: list[np.ndarray | None] = [next(stream, None) for stream in streams]
    carried_hash, carried_owner = np.zeros(0, np.uint64), np.zeros(0, np.int32)  # the last hash of the previous round
    found_hashes: list[np.ndarray] = []
    found_owners: list[np.ndarray] = []
    found = 0
    while True:
        active = [i for i, buffer in enumerate(buffers) if buffer is not None]
        if not active:
            break
        threshold = min(buffers[i][-1] for i in active)
        values, owners = [carried_hash], [carried_owner]
        for i in active:
            cut = int(np.searchsorted(buffers[i], threshold, side="right"))
            values.append(buffers[i][:cut])
            owners.append(np.full(cut, i, np.int32))
            rest = buffers[i][cut:]
            buffers[i] = rest if len(rest) else next(streams[i], None)
        merged = np.concatenate(values)
        owner = np.concatenate(owners)
        order = np.argsort(merged, kind="stable")
        merged, owner = merged[order], owner[order]
        repeated = np.zeros(len(merged), bool)
        same = merged[1:] == merged[:-1]
        repeated[1:] |= same
        repeated[:-1] |= same
        if repeated.any():
            found_hashes.append(merged[repeated])
            found_owners.append(owner[repeated])
            found += int(repeated.sum())
        carried_hash, carried_owner = merged[-1:], owner[-1:]
        if found >= MAX_CANDIDATES:
            yield np.concatenate(found_hashes), np.concatenate(found_owners)
            found_hashes, found_owners, found = [], [], 0
    if found:
        yield np.concatenate(found_hashes), np.concatenate(found_owners)
