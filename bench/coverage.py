"""``epoch_row_coverage``: the training rows one epoch of a 2-rank stage trains on ÷ the training rows.

A committed train split as preprocess writes it, one row group a shard, in shards of uneven size (32,463 rows in 7
shards of 9,000 down to 2,263 rows: what a skewed raw data set gives); each rank's batches at 64 rows a batch through
stagewise.datasets.loader, as a stage reads them. Ours = rows in the full batches every rank takes in epoch 0 (all
ranks take the same count), baseline = the split's rows. Details: each rank's rows, and the figure under the earlier
assignment (rank r took every 2nd whole row group of the epoch's order, and both ranks stopped at the smaller one's).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np

RANKS, BATCH = 2, 64
SHARD_ROWS = (9_000, 6_000, 5_000, 4_200, 3_300, 2_700, 2_263)


def _split(folder: Path) -> list[str]:
    """The uneven shards of a processed split (16 float features, 10 classes), one row group each."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from stagewise.datasets.columns import Columns, feature_vectors, processed_schema

    columns = Columns(key="row_id", label="label", features=[f"f_{i}" for i in range(16)], num_classes=10)
    uris, first, rng = [], 0, np.random.default_rng(0)
    for number, rows in enumerate(SHARD_ROWS):
        ids = np.arange(first, first + rows)
        table = pa.Table.from_arrays([pa.array(ids), pa.array(ids % 10),
                                      feature_vectors(rng.standard_normal((rows, 16)).astype(np.float32))],
                                     schema=processed_schema(columns, pa.int64()))
        uris.append(str(folder / f"part-{number:05d}.parquet"))
        pq.write_table(table, uris[-1], row_group_size=rows)
        first += rows
    return uris


def epoch_row_coverage() -> dict[str, Any]:
    """Rows trained in one epoch on 2 ranks ÷ training rows (goal >= 0.99)."""
    from stagewise.datasets.loader import ParquetBatches

    with tempfile.TemporaryDirectory(prefix="bench-coverage-") as tmp:
        uris = _split(Path(tmp))
        ranks = [ParquetBatches(uris, [f"f_{i}" for i in range(16)], "label", rank=rank, world_size=RANKS,
                                batch_size=BATCH, seed=7919) for rank in range(RANKS)]
        total, trained = ranks[0].num_rows, ranks[0].steps_per_epoch(0) * BATCH * RANKS
        order = np.random.default_rng(7919).permutation(len(ranks[0].groups))
        earlier = [sum(ranks[0].groups[index].num_rows for index in order[rank::RANKS]) for rank in range(RANKS)]
        held = [sum(group.num_rows for group in batches.assignment(0)) for batches in ranks]
    return {"ours": trained, "baseline": total, "unit": "training rows in one epoch on 2 ranks / training rows",
            "details": {"ranks": RANKS, "batch_per_rank": BATCH, "shard_rows": list(SHARD_ROWS),
                        "left_out": total - trained, "rows_per_rank": held,
                        "earlier_rows_per_rank": earlier,
                        "earlier_coverage": round(min(earlier) // BATCH * BATCH * RANKS / total, 4)}}
