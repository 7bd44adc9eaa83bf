"""A sweep's row budget: the rounds a trial trains, over nested key-hashed subsets of the train split.

Run: ``python -m stagewise.sweep subsets --out <run prefix>`` (the create_study task does it when ``sweep.budget`` is
rows); each worker then reads ``sweep/subsets/manifest.json``.

Hyperband's resource here is the training rows a trial has seen. Round ``j`` of a trial ends at ``max_rows /
factor^(K-j)`` rows seen in all (the first at ``min_rows`` or more, the last at ``max_rows``), so every rung of the
pruner falls on a round's end. A round passes once over as many rows as it adds: the rows whose key hashes below a
threshold. The subsets are nested (each holds the one before) and the same for every trial, so trials at a rung are
compared after training on the very same rows. Once a round adds more rows than the split holds, it passes over the
whole split as often as that fits, then over a subset for the rest. Rows are chosen by a salted hash of the key alone,
like the split itself, so a retry or a re-run picks the same rows. The rows between one threshold and the next are
copied once into a file of their own (an increment, written attempt-unique, then the manifest that lists them: the
commit); a whole pass reads the split's own files. An optional cap on validation rows works the same way on the
validation split.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from stagewise.core import storage
from stagewise.core.errors import UserError
from stagewise.datasets.columns import FEATURES_COLUMN
from stagewise.datasets.keys import key_units

log = logging.getLogger("stagewise.sweep")

# Salted apart from the split's own hash, so a row's subset does not depend on where in the split its hash fell.
SUBSET_SALT = "stagewise/sweep-row-budget"
# Rounds of the default min_rows below max_rows: a first decision after max_rows / factor^3.
DEFAULT_RUNGS = 3
# The default min_rows gives every process at least this many batches in the first round.
MIN_FIRST_ROUND_BATCHES = 16
# Row groups an increment file is cut into (at least): the loader shuffles and splits ranks by row group.
ROW_GROUPS_PER_INCREMENT = 16
MAX_ROW_GROUP_ROWS = 16_384
READ_BATCH_ROWS = 65_536


@dataclass(frozen=True, kw_only=True)
class Round:
    """One round of a row-budget trial: its passes, then a report to the pruner."""

    number: int
    """Zero-based round number."""
    rows_seen: int
    """Rows a trial has seen at the round's end, as planned: the step the round reports (Hyperband's resource)."""
    fractions: list[float]
    """One pass per entry, over the rows whose key hash lies below it: a nested subset of the train split, or the
    whole split at 1.0 (whole passes first once a round adds more rows than the split holds, then the rest)."""

    def subset_rows(self, train_rows: int) -> list[int]:
        """Rows of each pass, as planned."""
        return [round(fraction * train_rows) for fraction in self.fractions]


def plan_rounds(train_rows: int, max_rows: int, min_rows: int, factor: int) -> list[Round]:
    """The rounds of a trial that is never pruned: they end at ``max_rows / factor^k`` rows seen, k down to 0, the
    first at ``min_rows`` or more, so each ends where a rung of Hyperband (min ``max_rows / factor^K``, that factor)
    decides; a round passes over the rows it adds: a subset of the split, or whole passes and then a subset."""
    if train_rows < 1:
        raise UserError("sweep.budget rows: the train split is empty")
    rungs = 0
    while max_rows // factor ** (rungs + 1) >= min_rows:
        rungs += 1
    # floor(max / f^(K-j)) >= floor(max / f^K) * f^j: each round ends at or past the pruner's rung
    ends = [max_rows // factor ** (rungs - j) for j in range(rungs + 1)]
    rounds, before = [], 0
    for number, rows_seen in enumerate(ends):
        whole, rest = divmod(rows_seen - before, train_rows)
        fractions = [1.0] * whole + ([rest / train_rows] if rest else [])
        rounds.append(Round(number=number, rows_seen=rows_seen, fractions=fractions))
        before = rows_seen
    return rounds


def resolve_budget(sweep: Any, train_rows: int, processes: int) -> list[Round]:
    """``sweep``'s row budget over a train split of ``train_rows`` as its rounds (the first round's and the last one's
    ends are the pruner's min and max resource), checked: the first round must give each of ``processes`` a batch."""
    factor = sweep.pruner.reduction_factor
    max_rows = sweep.max_rows or sweep.epochs * train_rows
    floor = MIN_FIRST_ROUND_BATCHES * sweep.batch_size * processes
    min_rows = sweep.min_rows or min(max_rows, max(max_rows // factor**DEFAULT_RUNGS, floor))
    if min_rows < sweep.batch_size * processes:
        raise UserError(f"sweep.min_rows {min_rows} gives the first round less than one batch of sweep.batch_size "
                        f"{sweep.batch_size} on each of {processes} process(es): raise sweep.min_rows")
    return plan_rounds(train_rows, max_rows, min_rows, factor)


def _row_group_rows(rows: int) -> int:
    return max(256, min(MAX_ROW_GROUP_ROWS, math.ceil(rows / ROW_GROUPS_PER_INCREMENT)))


class _BucketWriter:
    """Rows of one split, routed by key hash into the buckets below each threshold; one attempt-unique file a bucket."""

    def __init__(self, prefix: str, name: str, uppers: list[float], expected: list[int], key: str) -> None:
        self.prefix, self.name, self.uppers, self.expected, self.key = prefix, name, uppers, expected, key
        self.token = storage.unique_token()
        self.writers: dict[int, pq.ParquetWriter] = {}
        self.handles: list[Any] = []
        self.rows = [0] * len(uppers)

    def uri(self, bucket: int) -> str:
        return storage.join(self.prefix, f"{self.name}-{bucket:03d}-{self.token}.parquet")

    def add(self, batch: pa.RecordBatch) -> None:
        units = key_units(batch.column(self.key), SUBSET_SALT)
        buckets = np.searchsorted(np.asarray(self.uppers), units, side="right")
        for bucket in np.unique(buckets[buckets < len(self.uppers)]):
            rows = batch.filter(pa.array(buckets == bucket))
            if int(bucket) not in self.writers:
                fs, path = storage.filesystem(self.uri(int(bucket)))
                fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
                handle = fs.open(path, "wb")
                self.handles.append(handle)
                # as transform writes the split: feature bytes neither compress nor dictionary-encode
                self.writers[int(bucket)] = pq.ParquetWriter(
                    handle, batch.schema, use_dictionary=False, write_statistics=[self.key],
                    compression={name: "none" if name == FEATURES_COLUMN else "snappy" for name in batch.schema.names})
            self.writers[int(bucket)].write_batch(rows, row_group_size=_row_group_rows(self.expected[int(bucket)]))
            self.rows[int(bucket)] += rows.num_rows

    def close(self) -> list[dict[str, Any]]:
        for writer in self.writers.values():
            writer.close()
        for handle in self.handles:
            handle.close()
        return [{"upper": upper, "files": [{"uri": self.uri(bucket), "rows": self.rows[bucket]}] if self.rows[bucket] else []}
                for bucket, upper in enumerate(self.uppers)]


def _route(files: list[dict[str, Any]], writer: _BucketWriter) -> list[dict[str, Any]]:
    try:
        for entry in files:
            with storage.open_parquet(entry["uri"]) as parquet:
                for batch in storage.iter_batches(parquet, parquet.schema_arrow.names, READ_BATCH_ROWS, uri=entry["uri"]):
                    writer.add(batch)
    finally:
        buckets = writer.close()
    return buckets


def subsets_uri(out: str) -> str:
    return storage.join(out, "sweep", "subsets", "manifest.json")


def write_subsets(manifest: dict[str, Any], out: str, rounds: list[Round], validation_rows: int | None) -> dict[str, Any]:
    """Copy each partial round's new rows (and the capped validation rows) into files of their own, then commit the
    manifest that lists them (no rounds: the validation cap alone). A manifest already committed for the same plan is
    kept: a retry copies nothing."""
    uri = subsets_uri(out)
    plan = {"salt": SUBSET_SALT, "rounds": [asdict(r) for r in rounds], "train_rows": manifest["rows"]["train"],
            "validation_rows": validation_rows}
    if storage.exists(uri):
        committed = storage.read_json(uri)
        if {key: committed.get(key) for key in plan} == plan:
            log.info("row budget subsets already committed at %s", uri)
            return committed
    prefix = storage.join(out, "sweep", "subsets")
    key = manifest["key"]
    uppers = sorted({fraction for r in rounds for fraction in r.fractions if fraction < 1.0})
    increments: list[dict[str, Any]] = []
    if uppers:
        expected = [round((upper - lower) * manifest["rows"]["train"]) for lower, upper in zip([0.0, *uppers], uppers)]
        increments = _route(manifest["splits"]["train"], _BucketWriter(prefix, "train", uppers, expected, key))
    validation = None
    validation_total = manifest["rows"].get("validation", 0)
    if validation_rows is not None and validation_rows < validation_total:
        fraction = validation_rows / validation_total
        validation = _route(manifest["splits"]["validation"],
                            _BucketWriter(prefix, "validation", [fraction], [validation_rows], key))[0]
    committed = {**plan, "increments": increments, "validation": validation}
    storage.write_json(uri, committed)  # last: the commit
    listed = {f["uri"] for part in [*increments, *([validation] if validation else [])] for f in part["files"]}
    storage.remove_unlisted(prefix, listed)
    log.info("row budget: %d rounds ending at %s rows seen; %d subset rows copied in %d increment(s)%s", len(rounds),
             [r.rows_seen for r in rounds], sum(f["rows"] for part in increments for f in part["files"]),
             len(increments), f", validation capped at {sum(f['rows'] for f in validation['files'])} rows" if validation else "")
    return committed


def pass_splits(manifest: dict[str, Any], subsets: dict[str, Any] | None, fraction: float) -> dict[str, list[dict[str, Any]]]:
    """The train and validation files of one pass: the increments up to ``fraction`` (the whole split at 1.0), and
    the capped validation files when the sweep caps them."""
    if fraction >= 1.0 or subsets is None:
        train = manifest["splits"]["train"]
    else:
        train = [f for part in subsets["increments"] if part["upper"] <= fraction for f in part["files"]]
    validation = subsets["validation"]["files"] if subsets and subsets.get("validation") else manifest["splits"]["validation"]
    return {"train": train, "validation": validation}
