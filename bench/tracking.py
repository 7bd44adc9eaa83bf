"""MLflow tracking's cost to a training stage: the same stage with tracking on (a local `mlflow server`) and off.

The server is the tests' own (tests/mlflow_server.py: `mlflow server` from .venv-mlflow on 127.0.0.1, a SQLite store,
proxied local artifacts); `make bench` builds that environment first.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.training import _prepare


def mlflow_overhead(rows: int = 120_000, rounds: int = 6, epochs: int = 4) -> dict[str, Any]:
    """Wall time of training stage s1 (run_stage, rank 0 tracking its nested run, params and every epoch) with tracking
    on ÷ the same stage with it off; the two alternate over ``rounds`` runs and each side's time is its median."""
    from stagewise.tracking.runs import start_parent
    from stagewise.train import run_stage
    from tests.mlflow_server import MlflowServer

    params = {"lr": 0.05, "hidden": 128}
    with tempfile.TemporaryDirectory(prefix="bench-mlflow-") as tmp:
        server = MlflowServer(Path(tmp) / "mlflow").start()
        try:
            config, out = _prepare(Path(tmp), rows, **{
                "train__checkpoint_every_steps": 10_000,
                "train__stages": [{"name": "s1", "profile": "ddp1", "per_process_batch": 64, "epochs": epochs}]})
            tracked = config.model_copy(update={"tracking": config.tracking.model_copy(update={
                "mlflow_uri": server.uri, "experiment": "bench"})})
            start_parent(tracked, dag_id="bench", run_id="r1", out=out, config_text="", config_hash="bench",
                         code_version="bench")

            def stage_seconds(chosen: Any) -> float:
                shutil.rmtree(Path(out, "train"), ignore_errors=True)
                started = time.perf_counter()
                run_stage(chosen, "s1", out, params, None)
                return time.perf_counter() - started

            stage_seconds(config)  # warm-up: imports, page cache
            on, off, pairs = [], [], []
            for number in range(rounds):
                order = (tracked, config) if number % 2 else (config, tracked)
                timed = {id(chosen): stage_seconds(chosen) for chosen in order}
                on.append(timed[id(tracked)])
                off.append(timed[id(config)])
                pairs.append(round(on[-1] / off[-1], 4))
            logged = server.client("""
                exp = client.get_experiment_by_name("bench").experiment_id
                runs = client.search_runs([exp], filter_string="tags.`stagewise.kind` = 'stage'")
                emit(sum(len(client.get_metric_history(r.info.run_id, "loss")) for r in runs))
            """)
        finally:
            server.stop()
    return {"ours": statistics.median(on), "baseline": statistics.median(off), "unit": "s per stage",
            "details": {"rows": rows, "epochs": epochs, "rounds": rounds, "ratio_per_round": pairs,
                        "seconds_on": [round(s, 3) for s in on], "seconds_off": [round(s, 3) for s in off],
                        "loss_points_logged": logged}}
