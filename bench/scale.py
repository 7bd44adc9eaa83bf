"""The whole ml_pipeline at growing data sizes: time per phase, how cost grows with rows, and the sweep's share.

Run: ``python -m bench --only pipeline_scale_linearity,pipeline_scale_sweep_share`` (``--rows N``: the largest size;
the others are N/5 and N/50), or ``python -m bench.scale 100000 1000000 5000000`` for the table of bench/README.md.

Each size is one ``airflow dags test ml_pipeline`` (SQLite, LocalExecutor, local files, a fresh Airflow home) over
synthetic rows (32 features, 10 classes) with :func:`scale_config`: the sweep on the row budget (bench.sweep's
ROW_BUDGET, validation capped), stages sized for large data. A phase's time is the sum of its tasks' durations, read
from the run's report.json (the task timeline), so Airflow's own start-up is in none.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent

# Tasks by phase, in DAG order; start_run, gate_model, register_model and report go under "other".
PHASES = {"preprocess": ("plan_shards", "preprocess_stats", "reduce_stats", "preprocess_transform", "commit_preprocess"),
          "sweep": ("create_study", "sweep_worker", "sweep_summary"),
          "train": ("train_",),
          "evaluate": ("evaluate",),
          "inference": ("resolve_model", "plan_inference", "infer_shard", "commit_predictions")}

# What changes from pipeline.yaml at scale: the row budget keeps the sweep flat (validation capped too), the stages
# train 2 epochs at larger batches (the demo's 12 epochs at batch 32 suit its 1,797 digits), inference shards of
# 250,000 rows.
SCALE_STAGES = [{"name": "s1", "profile": "ddp1", "per_process_batch": 256, "epochs": 2},
                {"name": "s2", "profile": "ddp2", "per_process_batch": 512, "epochs": 2, "warmup_steps": 20}]
SCALE_VALIDATION_ROWS = 20_000
SCALE_ROWS_PER_SHARD = 250_000


def scale_config(storage_root: Path, journal_dir: Path) -> dict[str, Any]:
    """pipeline.yaml over synthetic data at ``storage_root`` with the changes above."""
    import yaml

    from bench.sweep import ROW_BUDGET

    raw = yaml.safe_load((REPO_ROOT / "pipeline.yaml").read_text())
    raw["storage_root"] = str(storage_root)
    raw["dataset"] = {"uri": "raw/synthetic", "key": "row_id", "label": "label", "features": "f_*", "num_classes": 10}
    raw["sweep"].update({**ROW_BUDGET, "validation_rows": SCALE_VALIDATION_ROWS,
                         "storage": f"journal://{journal_dir}/optuna.journal"})
    raw["train"]["stages"] = SCALE_STAGES
    raw["inference"]["rows_per_shard"] = SCALE_ROWS_PER_SHARD
    return raw


def phase_of(task_id: str) -> str:
    for phase, prefixes in PHASES.items():
        if any(task_id == p or (p.endswith("_") and task_id.startswith(p)) for p in prefixes):
            return phase
    return "other"


def phase_seconds(tasks: list[dict[str, Any]]) -> dict[str, float]:
    """Seconds of each phase: the sum of its task attempts' durations (dags test runs tasks one after another)."""
    seconds: dict[str, float] = {}
    for task in tasks:
        if task.get("start") and task.get("end"):
            took = datetime.fromisoformat(task["end"]) - datetime.fromisoformat(task["start"])
            phase = phase_of(task["task_id"])
            seconds[phase] = seconds.get(phase, 0.0) + took.total_seconds()
    return {phase: round(value, 2) for phase, value in seconds.items()}


def run_at(rows: int, workdir: Path) -> dict[str, Any]:
    """One ml_pipeline run over ``rows`` synthetic rows: seconds per phase, the whole run's, and what it did."""
    import os

    import yaml

    from stagewise.datasets.demo import write_synthetic
    from tests.dags.conftest import airflow
    from tests.run_cache import migrated_sqlite_db

    storage_root = workdir / "storage"
    write_synthetic(str(storage_root / "raw" / "synthetic"), rows, num_shards=8, dirty_fraction=0.001)
    home = workdir / "home"
    home.mkdir()
    config_path = home / "pipeline.yaml"
    config_path.write_text(yaml.safe_dump(scale_config(storage_root, workdir)))
    env = {**os.environ, "AIRFLOW_HOME": str(home), "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db",
           "STAGEWISE_CONFIG": str(config_path), "STAGEWISE_TEST_RUNS_WRITE": "ml"}  # the report read below
    migrated_sqlite_db(home / "airflow.db", pools_of=config_path)
    started = time.perf_counter()
    airflow(env, "dags", "test", "ml_pipeline", timeout=7200)
    wall = time.perf_counter() - started
    [report_uri] = sorted(storage_root.glob("runs/ml_pipeline/*/report.json"))
    report = json.loads(report_uri.read_text())
    phases = phase_seconds(report.get("tasks") or [])
    return {"rows": rows, "phases": phases, "run_s": round(sum(phases.values()), 2), "dags_test_s": round(wall, 2),
            "test_accuracy": report.get("test_accuracy"), "sweep_rows_trained": report["sweep"].get("rows_consumed"),
            "train_rows": (report.get("data") or {}).get("rows", {}).get("train")}


_RUNS: dict[int, list[dict[str, Any]]] = {}


def scale_runs(largest: int) -> list[dict[str, Any]]:
    """The pipeline at largest/50, largest/5 and largest rows (once per process: both benchmarks read them)."""
    if largest not in _RUNS:
        runs = []
        for rows in (largest // 50, largest // 5, largest):
            with tempfile.TemporaryDirectory(prefix=f"bench-scale-{rows}-") as tmp:
                runs.append(run_at(rows, Path(tmp)))
            print(f"scale: {rows:,} rows: {runs[-1]}", file=sys.stderr, flush=True)
        _RUNS[largest] = runs
    return _RUNS[largest]


def pipeline_scale_linearity(rows: int = 5_000_000) -> dict[str, Any]:
    """Seconds per row of the whole run at the largest size / at the smallest (50x fewer rows): at most 1 when cost
    grows at most linearly with rows. Details give every phase at every size and each phase's own ratio."""
    runs = scale_runs(rows)
    smallest, largest = runs[0], runs[-1]
    per_row = {run["rows"]: run["run_s"] / run["rows"] for run in runs}
    by_phase = {phase: round((largest["phases"].get(phase, 0.0) / largest["rows"])
                             / max(smallest["phases"].get(phase, 0.0) / smallest["rows"], 1e-12), 3)
                for phase in largest["phases"]}
    return {"ours": per_row[largest["rows"]] * 1e6, "baseline": per_row[smallest["rows"]] * 1e6,
            "unit": "s per 1M rows of the whole run", "details": {"runs": runs, "per_row_ratio_by_phase": by_phase}}


def pipeline_scale_sweep_share(rows: int = 5_000_000) -> dict[str, Any]:
    """The sweep's seconds / the whole run's seconds at the largest size, with the row budget: at most a third."""
    largest = scale_runs(rows)[-1]
    return {"ours": largest["phases"]["sweep"], "baseline": largest["run_s"], "unit": "s (sweep / whole run)",
            "details": {"rows": largest["rows"], "phases": largest["phases"]}}


def main(argv: list[str]) -> None:
    """Print the per-phase table of bench/README.md for the sizes given."""
    runs = []
    for rows in [int(arg) for arg in argv] or [100_000, 1_000_000, 5_000_000]:
        with tempfile.TemporaryDirectory(prefix=f"bench-scale-{rows}-") as tmp:
            runs.append(run_at(rows, Path(tmp)))
        print(json.dumps(runs[-1]), flush=True)
    phases = [*PHASES, "other"]
    print("| rows | " + " | ".join(phases) + " | whole run | sweep share |")
    print("|---" * (len(phases) + 3) + "|")
    for run in runs:
        cells = [f"{run['phases'].get(phase, 0.0):.1f}" for phase in phases]
        share = run["phases"].get("sweep", 0.0) / run["run_s"]
        print(f"| {run['rows']:,} | " + " | ".join(cells) + f" | {run['run_s']:.1f} | {share:.0%} |")


if __name__ == "__main__":
    main(sys.argv[1:])
