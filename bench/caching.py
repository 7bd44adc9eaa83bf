"""Step caching across runs: a second run with unchanged data and config, served from the first run's outputs.

``cache_rerun``: two ``airflow dags test ml_pipeline`` runs of the demo pipeline (digits, the demo's budget, SQLite,
LocalExecutor, one fresh Airflow home) with ``cache: true``; ours is the second run's wall time, the baseline the
first's, each as Airflow records it (the DAG run's start to its end: ``run_duration``; the second run reuses
preprocess, the study, both stages, the evaluation and the predictions: ratio = ours / baseline, goal <= 0.25). The
details add each ``airflow dags test`` command's whole wall time, its process start and DAG parse included. Run
alone: ``python -m bench --only cache_rerun``.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


def _timed_run(env: dict[str, str], storage_root: Path) -> tuple[float, float, dict[str, Any]]:
    """(the run's duration as Airflow logs it, the command's wall time, the run's report)."""
    from tests.dags.conftest import airflow

    started = time.perf_counter()
    done = airflow(env, "dags", "test", "ml_pipeline", timeout=3600)
    wall = time.perf_counter() - started
    durations = re.findall(r"run_duration=([0-9.]+)", done.stdout + done.stderr)
    if not durations:
        raise RuntimeError("airflow dags test logged no run_duration: cannot time the run")
    latest = max(storage_root.glob("runs/ml_pipeline/*/report.json"), key=os.path.getmtime)
    return float(durations[-1]), wall, json.loads(latest.read_text())


def cache_rerun() -> dict[str, Any]:
    """The DAG run duration of a second demo run with `cache: true`, data and config unchanged / the first run's."""
    import yaml

    from stagewise.datasets.demo import DEMO_WRITERS
    from tests.run_cache import migrated_sqlite_db

    with tempfile.TemporaryDirectory(prefix="stagewise-cache-bench-") as folder:
        workdir = Path(folder)
        storage_root, home = workdir / "storage", workdir / "home"
        home.mkdir()
        raw = yaml.safe_load((REPO_ROOT / "pipeline.yaml").read_text())
        raw.update({"storage_root": str(storage_root), "cache": True})
        raw["sweep"]["storage"] = f"journal://{workdir}/optuna.journal"
        config_path = home / "pipeline.yaml"
        config_path.write_text(yaml.safe_dump(raw))
        DEMO_WRITERS[raw["dataset"].get("demo_data", "digits")](str(storage_root / raw["dataset"]["uri"]), num_shards=4)
        env = {**os.environ, "AIRFLOW_HOME": str(home), "STAGEWISE_CONFIG": str(config_path),
               "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home}/airflow.db", "STAGEWISE_TEST_RUNS_WRITE": "ml"}
        migrated_sqlite_db(home / "airflow.db", pools_of=config_path)
        first_s, first_wall, first = _timed_run(env, storage_root)
        second_s, second_wall, second = _timed_run(env, storage_root)
    if set(second.get("reused") or {}) != {"preprocess", "sweep", "train_s1", "train_s2", "evaluate", "inference"}:
        raise RuntimeError(f"the second run reused {second.get('reused')}, not every step: nothing to compare")
    return {"ours": second_s, "baseline": first_s, "unit": "s (the DAG run's run_duration)",
            "details": {"first_run_s": round(first_s, 1), "cached_run_s": round(second_s, 1),
                        "first_command_s": round(first_wall, 1), "cached_command_s": round(second_wall, 1),
                        "command_ratio": round(second_wall / first_wall, 3),
                        "reused_from": sorted(set(second["reused"].values())),
                        "gate": second["registry"].get("reason"), "test_accuracy": second.get("test_accuracy")}}
