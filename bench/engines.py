"""Preprocess against the single-node engines users would pick instead: Polars (lazy, streaming) and DuckDB (SQL).

Run: ``python -m bench --only preprocess_vs_polars,preprocess_vs_duckdb [--rows N]`` (needs
bench/requirements.txt, which ``make bench`` installs). One engine run alone, e.g. to profile it:
``python -m bench.engines polars --raw DIR --out DIR --threads 2 --salt N --validation F --test F``.

The work is the one of bench/preprocess.py, written as an expert in each engine would: read the
raw files, validate the schema (key and label present, numeric features, integer label), drop rows
with a null/non-finite feature or a null label/key, statistics over the clean rows (count, mean,
sample std, min, max per feature; label range; key uniqueness, which our stage also checks),
normalise to float32 with the data set's mean/std, split by our rule (splitmix64 of the key xor the
salted hash, same fractions, so every split holds the same rows as ours), and write each split as
Parquet (uncompressed, as our stage writes its float bytes: random floats barely compress). Each
engine run is a fresh process with its thread count fixed before import (Polars reads
POLARS_MAX_THREADS once); its time runs from its first read to its last write, imports excluded.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.preprocess import DIRTY_FRACTION, NUM_FEATURES, NUM_SHARDS, REPO_ROOT, _overrides, run_ours

ROUNDS = 4  # the first is the warm-up; the best of the other 3 counts
THREADS = 2  # our headline runs each mapped step's shards in 2 processes (all cores here); the engines get 2 threads
KEY, LABEL, PREFIX, NUM_CLASSES = "row_id", "label", "f_", 10
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_MASK64 = (1 << 64) - 1
PHASES = ("validate", "stats", "write")


def split_rule(config: Any) -> tuple[int, float, float]:
    """(salt as u64, validation fraction, test fraction): the split our stage draws with ``config``."""
    split = config.preprocess.split
    salt = int.from_bytes(hashlib.sha256(split.salt.encode()).digest()[:8], "little")
    return salt, split.validation, split.test


def _check_stats(stats: dict[str, Any], rows_in: int) -> None:
    """The checks our reduce step makes: labels in range, keys unique, not too many dirty rows."""
    if stats["count"] == 0:
        raise ValueError("every row was dropped as dirty")
    if stats["label_min"] < 0 or stats["label_max"] >= NUM_CLASSES:
        raise ValueError(f"label outside [0, {NUM_CLASSES}): {stats['label_min']}..{stats['label_max']}")
    if stats["distinct_keys"] != stats["count"]:
        raise ValueError(f"{stats['count'] - stats['distinct_keys']} repeated key(s) in '{KEY}'")
    if rows_in - stats["count"] > 0.5 * rows_in:
        raise ValueError("more than half the rows are dirty")


def run_polars(raw_dir: str, out: str, rule: tuple[int, float, float]) -> tuple[dict[str, float], dict[str, int], float]:
    """The work in Polars' lazy API: one streaming aggregate for the statistics, one streaming sink per split.

    Returns (seconds per phase, rows per split, CPU seconds of all its threads).
    """
    import polars as pl

    salt, validation, test = rule
    seconds: dict[str, float] = {}
    started, cpu_started = time.perf_counter(), time.process_time()
    raw = pl.scan_parquet(f"{raw_dir}/*.parquet")
    schema = raw.collect_schema()
    features = [name for name in schema.names() if name.startswith(PREFIX)]
    if KEY not in schema or LABEL not in schema or not features:
        raise ValueError(f"bad schema: need '{KEY}', '{LABEL}' and '{PREFIX}*' columns, got {schema.names()}")
    bad = [name for name in features if not schema[name].is_numeric()]
    if bad or not schema[LABEL].is_integer() or not (schema[KEY].is_integer() or schema[KEY] == pl.String):
        raise ValueError(f"bad schema: non-numeric features {bad}, label {schema[LABEL]}, key {schema[KEY]}")
    # is_finite of a null is null, and filter drops null as well as false
    clean = raw.filter(pl.all_horizontal(pl.col(features).is_finite()), pl.col(LABEL).is_not_null(),
                       pl.col(KEY).is_not_null())
    seconds["validate"] = time.perf_counter() - started
    stats = clean.select(
        pl.len().alias("count"), pl.col(LABEL).min().alias("label_min"), pl.col(LABEL).max().alias("label_max"),
        pl.col(KEY).n_unique().alias("distinct_keys"),
        pl.col(features).mean().name.suffix("__mean"), pl.col(features).std().name.suffix("__std"),
        pl.col(features).min().name.suffix("__min"), pl.col(features).max().name.suffix("__max"),
    ).collect(engine="streaming").row(0, named=True)
    rows_in = raw.select(pl.len()).collect().item()  # from the footers: no data read
    _check_stats(stats, rows_in)
    seconds["stats"] = time.perf_counter() - started - seconds["validate"]

    def u64(value: int) -> pl.Expr:
        return pl.lit(value, pl.UInt64)

    # splitmix64 of (key ^ salt); UInt64 multiplication wraps, and // 2**k is the logical shift
    z = pl.col(KEY).reinterpret(signed=False).xor(u64(salt)) + u64(_GOLDEN)
    z = (z.xor(z // u64(1 << 30))) * u64(_MIX1)
    z = (z.xor(z // u64(1 << 27))) * u64(_MIX2)
    unit = (z.xor(z // u64(1 << 31)) // u64(1 << 11)).cast(pl.Float64) * (1.0 / (1 << 53))
    split = pl.when(unit < test).then(2).when(unit < test + validation).then(1).otherwise(0).cast(pl.Int8)
    normalised = clean.select(
        KEY, LABEL,
        *[((pl.col(name) - stats[f"{name}__mean"]) / (stats[f"{name}__std"] if stats[f"{name}__std"] > 1e-12 else 1.0))
          .cast(pl.Float32) for name in features],
        split.alias("split"))
    # One plan with three sinks: Polars runs the shared scan once and streams rows to each file.
    sinks = [normalised.filter(pl.col("split") == code).drop("split")
             .sink_parquet(f"{out}/{name}.parquet", compression="uncompressed", lazy=True, mkdir=True)
             for code, name in enumerate(("train", "validation", "test"))]
    pl.collect_all(sinks, engine="streaming")
    seconds["write"] = time.perf_counter() - started - seconds["validate"] - seconds["stats"]
    cpu = time.process_time() - cpu_started
    rows = {name: pl.scan_parquet(f"{out}/{name}.parquet").select(pl.len()).collect().item()
            for name in ("train", "validation", "test")}  # after the clock: the sanity check, not the work
    return seconds, rows, cpu


def run_duckdb(raw_dir: str, out: str, rule: tuple[int, float, float], threads: int) -> tuple[dict[str, float], dict[str, int], float]:
    """The work in DuckDB SQL: a view over the files, one aggregate query for the statistics, one partitioned
    COPY ... TO parquet for the three splits. Returns (seconds per phase, rows per split, CPU seconds of all its threads)."""
    import duckdb

    salt, validation, test = rule
    seconds: dict[str, float] = {}
    started, cpu_started = time.perf_counter(), time.process_time()
    con = duckdb.connect()
    con.execute(f"SET threads = {threads}")
    con.execute("SET preserve_insertion_order = false")  # lets COPY write from every thread without reordering
    con.execute(f"CREATE VIEW raw AS SELECT * FROM read_parquet('{raw_dir}/*.parquet')")
    schema = dict(con.execute("SELECT column_name, column_type FROM (DESCRIBE raw)").fetchall())
    features = [name for name in schema if name.startswith(PREFIX)]
    numeric = {"TINYINT", "SMALLINT", "INTEGER", "BIGINT", "UTINYINT", "USMALLINT", "UINTEGER", "UBIGINT", "HUGEINT",
               "FLOAT", "DOUBLE"}
    if KEY not in schema or LABEL not in schema or not features:
        raise ValueError(f"bad schema: need '{KEY}', '{LABEL}' and '{PREFIX}*' columns, got {list(schema)}")
    bad = [name for name in features if schema[name] not in numeric]
    if bad or schema[LABEL] not in numeric - {"FLOAT", "DOUBLE"} or schema[KEY] not in numeric | {"VARCHAR"}:
        raise ValueError(f"bad schema: non-numeric features {bad}, label {schema[LABEL]}, key {schema[KEY]}")
    keep = " AND ".join([f"isfinite({name})" for name in features] + [f"{LABEL} IS NOT NULL", f"{KEY} IS NOT NULL"])
    con.execute(f"CREATE VIEW clean AS SELECT * FROM raw WHERE {keep}")  # isfinite(NULL) is NULL: WHERE drops it
    seconds["validate"] = time.perf_counter() - started
    aggregates = ", ".join(f"avg({n}), stddev_samp({n}), min({n}), max({n})" for n in features)
    values = con.execute(f"SELECT count(*), min({LABEL}), max({LABEL}), count(DISTINCT {KEY}), {aggregates} "
                         f"FROM clean").fetchone()
    stats = dict(zip(("count", "label_min", "label_max", "distinct_keys"), values[:4]))
    rows_in = con.execute("SELECT count(*) FROM raw").fetchone()[0]  # from the footers: no data read
    _check_stats(stats, rows_in)
    seconds["stats"] = time.perf_counter() - started - seconds["validate"]
    columns = []
    for index, name in enumerate(features):
        mean, std = values[4 + 4 * index], values[5 + 4 * index]
        columns.append(f"CAST(({name} - {mean!r}) / {std if std > 1e-12 else 1.0!r} AS FLOAT) AS {name}")
    # splitmix64 of (key ^ salt): UBIGINT arithmetic refuses to overflow, so multiply in UHUGEINT and keep the low 64 bits
    con.execute(f"CREATE MACRO mul64(a, b) AS ((a::UHUGEINT * b::UHUGEINT) & {_MASK64}::UHUGEINT)::UBIGINT")
    con.execute(f"CREATE MACRO add64(a, b) AS ((a::UHUGEINT + b::UHUGEINT) & {_MASK64}::UHUGEINT)::UBIGINT")
    z0 = f"add64(xor({KEY}::UBIGINT, {salt}::UBIGINT), {_GOLDEN})"
    con.execute(f"""CREATE VIEW normalised AS
        WITH h0 AS (SELECT *, {z0} AS z FROM clean),
             h1 AS (SELECT * REPLACE (mul64(xor(z, z >> 30), {_MIX1}) AS z) FROM h0),
             h2 AS (SELECT * REPLACE (mul64(xor(z, z >> 27), {_MIX2}) AS z) FROM h1),
             h3 AS (SELECT *, (xor(z, z >> 31) >> 11)::DOUBLE * {1.0 / (1 << 53)!r} AS unit FROM h2)
        SELECT {KEY}, {LABEL}, {", ".join(columns)},
               CASE WHEN unit < {test!r} THEN 'test' WHEN unit < {test + validation!r} THEN 'validation'
                    ELSE 'train' END AS split
        FROM h3""")
    # One pass: PARTITION_BY streams each split's rows into its own folder (split=train/...), the column left out.
    con.execute(f"COPY normalised TO '{out}' (FORMAT parquet, PARTITION_BY (split), COMPRESSION uncompressed)")
    seconds["write"] = time.perf_counter() - started - seconds["validate"] - seconds["stats"]
    cpu = time.process_time() - cpu_started
    counted = con.execute(f"SELECT split, count(*) FROM read_parquet('{out}/*/*.parquet', hive_partitioning = true) "
                          "GROUP BY split").fetchall()  # after the clock: the sanity check, not the work
    rows = dict(counted)
    con.close()
    return seconds, rows, cpu


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.engines", description="One engine's preprocess run; JSON out.")
    parser.add_argument("engine", choices=("polars", "duckdb"))
    parser.add_argument("--raw", required=True, help="folder of raw Parquet files")
    parser.add_argument("--out", required=True, help="folder for the three split files")
    parser.add_argument("--threads", type=int, default=THREADS, help="DuckDB's threads (Polars': POLARS_MAX_THREADS)")
    parser.add_argument("--salt", type=int, required=True, help="the split salt as a u64 (see split_rule)")
    parser.add_argument("--validation", type=float, required=True, help="validation fraction")
    parser.add_argument("--test", type=float, required=True, help="test fraction")
    args = parser.parse_args(argv)
    rule = (args.salt, args.validation, args.test)
    if args.engine == "polars":
        seconds, rows, cpu = run_polars(args.raw, args.out, rule)
    else:
        seconds, rows, cpu = run_duckdb(args.raw, args.out, rule, args.threads)
    print(json.dumps({"seconds": seconds, "rows": rows, "cpu_s": cpu}))


def run_engine(engine: str, raw_dir: str, out: Path, rule: tuple[int, float, float], threads: int) -> dict[str, Any]:
    """One engine run in a fresh process with ``threads`` threads: {"seconds": per phase, "rows": per split, "cpu_s"}."""
    env = {**os.environ, "POLARS_MAX_THREADS": str(threads)}
    salt, validation, test = rule
    done = subprocess.run([sys.executable, "-m", "bench.engines", engine, "--raw", raw_dir, "--out", str(out),
                           "--threads", str(threads), "--salt", str(salt), "--validation", repr(validation),
                           "--test", repr(test)], env=env, capture_output=True, text=True, check=False, cwd=REPO_ROOT)
    if done.returncode:
        raise RuntimeError(f"{engine} run failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


_MEASURED: dict[int, dict[str, Any]] = {}  # both engine benchmarks share one measurement per row count
ENGINES = ("polars", "duckdb")


def _cpu_seconds() -> float:
    """CPU seconds of this process (all threads) and of its reaped children."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _measure(rows: int) -> dict[str, Any]:
    """Best of 3 per side after a warm-up round, sides interleaved, on the same files; refuses differing splits."""
    if rows in _MEASURED:
        return _MEASURED[rows]
    from stagewise.datasets.demo import write_synthetic
    from stagewise.definitions.loading import load_config

    missing = [engine for engine in ENGINES if importlib.util.find_spec(engine) is None]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not installed: `make bench` installs bench/requirements.txt "
                           f"(or: .venv/bin/python -m pip install --no-deps -r bench/requirements.txt)")
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp:
        workdir = Path(tmp)
        config = load_config(REPO_ROOT / "pipeline.yaml", overrides=_overrides(workdir))
        rule = split_rule(config)
        raw_dir = str(workdir / "raw" / "synthetic")
        files = write_synthetic(raw_dir, rows, num_features=NUM_FEATURES, num_shards=NUM_SHARDS,
                                dirty_fraction=DIRTY_FRACTION)

        def ours(out: Path, processes: int) -> dict[str, Any]:
            cpu_started = _cpu_seconds()
            took, _ = run_ours(config, files, str(out), processes=processes)
            cpu = _cpu_seconds() - cpu_started  # the pool's workers are reaped by now, so their CPU is counted
            manifest = json.loads((out / "preprocess" / "manifest.json").read_text())
            return {"seconds": {"all": took}, "rows": manifest["rows"], "cpu_s": cpu}

        sides = {"ours": lambda out: ours(out, THREADS), "ours_1_process": lambda out: ours(out, 1)}
        for engine in ENGINES:
            sides[engine] = lambda out, engine=engine: run_engine(engine, raw_dir, out, rule, THREADS)
            sides[f"{engine}_1_thread"] = lambda out, engine=engine: run_engine(engine, raw_dir, out, rule, 1)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
        for attempt in range(ROUNDS):
            for name, side in sides.items():
                runs[name].append(side(workdir / "out" / f"{name}-{attempt}"))
    splits = {name: runs[name][-1]["rows"] for name in sides}
    differing = {name: split for name, split in splits.items() if split != splits["ours"]}
    if differing:  # not the same split, so not the same work: refuse to compare
        raise RuntimeError(f"rows per split differ from ours {splits['ours']}: {differing}")
    best = {name: min(values[1:], key=lambda run: sum(run["seconds"].values())) for name, values in runs.items()}
    total = {name: sum(run["seconds"].values()) for name, run in best.items()}
    _MEASURED[rows] = {
        "rows_per_s": {name: rows / seconds for name, seconds in total.items()},
        "best_s": {name: round(seconds, 3) for name, seconds in total.items()},
        "all_s": {name: [round(sum(run["seconds"].values()), 3) for run in values] for name, values in runs.items()},
        "cpu_s": {name: round(min(run["cpu_s"] for run in values[1:]), 3) for name, values in runs.items()},
        "phases_s": {name: {phase: round(s, 3) for phase, s in run["seconds"].items()}
                     for name, run in best.items() if name not in ("ours", "ours_1_process")},
        "rows_per_split": splits["ours"]}
    return _MEASURED[rows]


def _result(rows: int, engine: str) -> dict[str, Any]:
    measured = _measure(rows)
    speed = measured["rows_per_s"]
    single = f"{engine}_1_thread"
    return {"ours": speed["ours"], "baseline": speed[engine], "unit": "rows/s", "details": {
        "rows": rows, "shards": NUM_SHARDS, "features": NUM_FEATURES, "dirty_fraction": DIRTY_FRACTION,
        "threads": THREADS, "rows_per_split": measured["rows_per_split"],
        "best_s": {name: measured["best_s"][name] for name in ("ours", engine, "ours_1_process", single)},
        "all_s": {name: measured["all_s"][name] for name in ("ours", engine, "ours_1_process", single)},
        "cpu_s": {name: measured["cpu_s"][name] for name in ("ours", engine, "ours_1_process", single)},
        f"{engine}_phases_s": measured["phases_s"][engine],
        "ratio_1_process_vs_1_thread": round(speed["ours_1_process"] / speed[single], 4),
        "note": f"headline = ours with each mapped step's shards in {THREADS} processes ÷ {engine} with {THREADS} "
                f"threads (all cores, each the way it spreads work); ratio_1_process_vs_1_thread = ours in one process "
                f"÷ {engine} with 1 thread. Every side's rows per split equal ours (same hash of the key)",
        "method": "best of 3 after a warm-up round, sides interleaved; wall time from first read to last write "
                  f"({engine} in a fresh process per run, import excluded); cpu_s = the least CPU seconds (all threads "
                  "and processes) over the 3 rounds, steadier than wall time on a shared machine"}}


def preprocess_vs_polars(rows: int = 1_000_000) -> dict[str, Any]:
    """Our preprocess stage's rows/s / the same work in Polars' lazy API (streaming), same cores and split."""
    return _result(rows, "polars")


def preprocess_vs_duckdb(rows: int = 1_000_000) -> dict[str, Any]:
    """Our preprocess stage's rows/s / the same work in DuckDB SQL (COPY ... TO parquet), same cores and split."""
    return _result(rows, "duckdb")


if __name__ == "__main__":
    main()
