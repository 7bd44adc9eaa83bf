"""DAG parse time: each DAG file as a fresh ``python <file>`` process (Airflow's best-practices check).

Run: ``python -m bench --only dag_parse``. Both sides run as ``bash -c '. scripts/airflow_env.sh && exec
python FILE'`` from the repo root, so both pay the same shell, environment and interpreter start-up.
The DAG file is parsed for the checkout's pipelines, for a folder of 20 pipelines (80 DAGs: what the dag-processor
does), and for that folder with Airflow's parsing context set to one DAG (what each task's process does).
ratio = median seconds of the slowest case / median seconds of a trivial one-task DAG file.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
REPEATS = 5
TRIVIAL_DAG = '''
import pendulum
from airflow.sdk import dag, task


@dag(schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False)
def trivial():
    @task
    def hello():
        return 1

    hello()


trivial()
'''
# Imports the design keeps out of parse time; the benchmark names any a DAG file pulls in.
HEAVY_MODULES = ("torch", "optuna", "pandas", "pyarrow", "sklearn")
_PROBE = ("import runpy, sys; runpy.run_path(sys.argv[1], run_name='__bench__'); "
          f"print(','.join(m for m in {HEAVY_MODULES!r} if m in sys.modules))")


PIPELINES = 20


def _once(path: Path, env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(["bash", "-c", f'. scripts/airflow_env.sh && exec python "{path}"'], cwd=REPO_ROOT,
                   env={**os.environ, **env}, check=True, capture_output=True)
    return time.perf_counter() - started


def _heavy_imports(path: Path, env: dict[str, str]) -> list[str]:
    done = subprocess.run(["bash", "-c", f'. scripts/airflow_env.sh && exec python -c "{_PROBE}" "{path}"'],
                          cwd=REPO_ROOT, env={**os.environ, **env}, check=True, capture_output=True, text=True)
    return [name for name in done.stdout.strip().splitlines()[-1].split(",") if name] if done.stdout.strip() else []


def _pipelines_folder(folder: Path, count: int) -> Path:
    """``count`` copies of pipeline.yaml, each its own pipeline (name and registry name)."""
    import yaml

    raw = yaml.safe_load((REPO_ROOT / "pipeline.yaml").read_text())
    folder.mkdir()
    for index in range(count):
        named = {**raw, "name": f"team{index:02d}", "storage_root": str(REPO_ROOT / "storage"),
                 "registry": {**raw.get("registry", {}), "model_name": f"team{index:02d}"}}
        (folder / f"team{index:02d}.yaml").write_text(yaml.safe_dump(named))
    return folder


def dag_parse(rows: int = 0) -> dict[str, Any]:
    """The slowest parse case / a trivial one-task DAG file's parse, both as fresh processes (median of 5)."""
    with tempfile.TemporaryDirectory(prefix="bench-dag-parse-") as tmp:
        trivial = Path(tmp) / "trivial.py"
        trivial.write_text(TRIVIAL_DAG)
        folder = str(_pipelines_folder(Path(tmp) / "pipelines", PIPELINES))
        cases: dict[str, tuple[Path, dict[str, str]]] = {"<trivial>": (trivial, {})}
        for path in sorted((REPO_ROOT / "dags").glob("*.py")):
            cases[path.name] = (path, {"STAGEWISE_PIPELINES": ""})
            cases[f"{path.name}, {PIPELINES} pipelines"] = (path, {"STAGEWISE_PIPELINES": folder})
            cases[f"{path.name}, {PIPELINES} pipelines, one task's DAG"] = (
                path, {"STAGEWISE_PIPELINES": folder, "_AIRFLOW_PARSING_CONTEXT_DAG_ID": "team07_pipeline"})
        for path, env in cases.values():  # warm-up: page cache and .pyc files for every side alike
            _once(path, env)
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(REPEATS):  # rounds interleave the cases, so drift in the machine hits them all alike
            for name, (path, env) in cases.items():
                times[name].append(_once(path, env))
        heavy = {name: _heavy_imports(path, env) for name, (path, env) in cases.items() if name != "<trivial>"}
    medians = {name: statistics.median(values) for name, values in times.items()}
    baseline = medians.pop("<trivial>")
    slowest = max(medians, key=medians.get)
    return {"ours": medians[slowest], "baseline": baseline, "unit": "s per parse",
            "details": {"slowest": slowest, "median_s": {name: round(s, 3) for name, s in medians.items()},
                        "trivial_s": round(baseline, 3), "repeats": REPEATS, "pipelines": PIPELINES,
                        "heavy_imports": {name: mods for name, mods in heavy.items() if mods} or "none",
                        "method": "bash -c '. scripts/airflow_env.sh && exec python FILE' per run, median of "
                                  f"{REPEATS} after a warm-up run, cases interleaved"}}
