"""Broken raw files as users produce them: empty, not Parquet, cut off, a damaged footer or damaged pages.

``write_bad_file(kind, path, good)`` writes one of :data:`BAD_KINDS` at ``path``, derived from the
bytes of a valid Parquet file ``good``; :data:`EXPECTED_WORDING` is what the error must say about it.
"""

from __future__ import annotations

from pathlib import Path

BAD_KINDS = ("empty", "csv", "truncated", "corrupt_footer", "corrupt_pages")
EXPECTED_WORDING = {
    "empty": "is empty (0 bytes)",
    "csv": "is not a Parquet file",
    "truncated": "is truncated",
    "corrupt_footer": "is corrupt",
    "corrupt_pages": "is corrupt",
}


def write_bad_file(kind: str, path: Path, good: bytes) -> Path:
    """Write the ``kind`` of broken file at ``path`` and return it."""
    if kind == "empty":
        data = b""
    elif kind == "csv":
        data = b"row_id,label,f_000\n1,2,0.5\n"
    elif kind == "truncated":
        data = good[: len(good) // 2]
    elif kind == "corrupt_footer":
        # Zero the footer's thrift bytes but keep its length field and magic: the metadata cannot be decoded.
        footer_length = int.from_bytes(good[-8:-4], "little")
        start = len(good) - 8 - footer_length
        data = good[:start] + b"\x00" * footer_length + good[-8:]
    elif kind == "corrupt_pages":
        # Overwrite the data pages after the leading magic with noise; the footer stays valid.
        footer_length = int.from_bytes(good[-8:-4], "little")
        body_end = len(good) - 8 - footer_length
        noise = bytes((i * 131 + 7) % 251 for i in range(body_end - 4))
        data = good[:4] + noise + good[body_end:]
    else:
        raise ValueError(f"unknown bad file kind {kind!r}; known: {BAD_KINDS}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def write_repeated_column(path: Path, columns: dict, repeated: str) -> Path:
    """Write ``columns`` with ``repeated`` stored twice under one name, as pyarrow (and Spark's writers) let through."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = [*columns, repeated]
    table = pa.Table.from_arrays([*columns.values(), columns[repeated]], names=names)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path
