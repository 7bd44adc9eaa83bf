"""Inference benchmarks: shard throughput against a plain loop, memory as shards grow, parallel workers.

Each function returns ``{"ours", "baseline", "unit", "details"}``; the harness turns that into a ratio.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent


def _trained_model(workdir: Path, rows: int = 20_000) -> tuple[Any, str, str]:
    """A model trained by our stage on synthetic data; returns (config, run prefix, model URI)."""
    from bench.training import _prepare
    from stagewise.train import run_stage

    config, out = _prepare(workdir, rows, **{
        "train__stages": [{"name": "s1", "profile": "ddp1", "per_process_batch": 256, "epochs": 1}]})
    result = run_stage(config, "s1", out, {"lr": 0.05, "hidden": 256}, None)
    return config, out, result["model_uri"]


def _raw_file(workdir: Path, name: str, rows: int, row_group_rows: int = 65_536) -> str:
    import pyarrow.parquet as pq

    from stagewise.datasets.demo import synthetic_table

    path = workdir / name
    pq.write_table(synthetic_table(rows, seed=3, dirty_fraction=0.0), path, row_group_size=row_group_rows)
    return str(path)


def inference_throughput(rows: int = 400_000) -> dict[str, Any]:
    """Rows/s of our shard task (stagewise.infer.score_shard) / a plain PyTorch loop over the same Parquet file
    read with pyarrow, same model and batch size (4096), one thread each, in one process. Both write the
    key, the prediction and the class probabilities to Parquet; ours also checks rows and tags the version."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from stagewise import infer
    from stagewise.models.bundle import load_bundle

    with tempfile.TemporaryDirectory(prefix="bench-infer-") as tmp:
        workdir = Path(tmp)
        config, _, model_uri = _trained_model(workdir)
        config = config.model_copy(update={"inference": config.inference.model_copy(update={"batch_size": 4096})})
        source = _raw_file(workdir, "score.parquet", rows)
        shard = {"index": 0, "uri": source, "row_groups": list(range(pq.ParquetFile(source).num_row_groups))}

        def ours_once() -> float:
            started = time.perf_counter()
            result = infer.score_shard(config, model_uri, shard, str(workdir / "out"))
            return result["rows"] / (time.perf_counter() - started)

        def plain_once() -> float:
            torch.set_num_threads(1)
            bundle = load_bundle(model_uri)
            model, prep = bundle.module, bundle.preprocessing
            mean, std = np.asarray(prep["mean"]), np.asarray(prep["std"])
            started, seen = time.perf_counter(), 0
            parquet = pq.ParquetFile(source)
            writer = None
            for batch in parquet.iter_batches(batch_size=4096, columns=[prep["key"], *prep["features"]]):
                x = np.column_stack([batch.column(c).to_numpy() for c in prep["features"]])
                with torch.no_grad():
                    p = torch.softmax(model(torch.from_numpy(((x - mean) / std).astype(np.float32))), dim=1).numpy()
                table = pa.table({prep["key"]: batch.column(prep["key"]), "prediction": p.argmax(axis=1),
                                  "probabilities": pa.FixedSizeListArray.from_arrays(pa.array(p.reshape(-1)), p.shape[1])})
                writer = writer or pq.ParquetWriter(str(workdir / "plain.parquet"), table.schema)
                writer.write_table(table)
                seen += batch.num_rows
            writer.close()
            return seen / (time.perf_counter() - started)

        ours_once(), plain_once()  # warm-up: page cache, model load, allocator
        ours_rates, plain_rates = [], []
        for number in range(4):  # interleaved, which goes first alternating: a burst of load meets both sides
            if number % 2:
                plain_rates.append(plain_once())
                ours_rates.append(ours_once())
            else:
                ours_rates.append(ours_once())
                plain_rates.append(plain_once())
        ours, baseline = max(ours_rates), max(plain_rates)
    return {"ours": ours, "baseline": baseline, "unit": "rows/s",
            "details": {"rows": rows, "batch": 4096, "threads": 1, "method": "best of 4 after a warm-up, interleaved",
                        "ours_rows_per_s": [round(r) for r in ours_rates],
                        "baseline_rows_per_s": [round(r) for r in plain_rates],
                        "ours_also_does": "row checks with quarantine, the model_version column, progress logs"}}


_PEAK_PROBE = """
import json, sys
sys.path[:0] = [{root!r}]
from stagewise import infer
from stagewise.definitions.loading import load_config
import pyarrow.parquet as pq
config = load_config({config!r})
shard = {{"index": 0, "uri": {source!r}, "row_groups": list(range(pq.ParquetFile({source!r}).num_row_groups))}}
infer.score_shard(config, {model!r}, shard, {out!r})
# VmHWM belongs to this address space; ru_maxrss would keep the parent's high-water mark across exec.
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({{"peak_kib": peak}}))
"""


def inference_memory_growth(rows: int = 200_000) -> dict[str, Any]:
    """Peak memory (VmHWM of a fresh process) scoring a shard 10x larger / scoring the base shard."""
    with tempfile.TemporaryDirectory(prefix="bench-infer-mem-") as tmp:
        workdir = Path(tmp)
        config, _, model_uri = _trained_model(workdir)
        config_path = workdir / "pipeline.yaml"
        peaks = {}
        for label, size in (("base", rows), ("large", rows * 10)):
            source = _raw_file(workdir, f"{label}.parquet", size)
            code = _PEAK_PROBE.format(root=str(REPO_ROOT), config=str(config_path), source=source, model=model_uri,
                                      out=str(workdir / f"out-{label}"))
            result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            peaks[label] = json.loads(result.stdout.strip().splitlines()[-1])["peak_kib"]
    return {"ours": float(peaks["large"]), "baseline": float(peaks["base"]), "unit": "KiB peak RSS",
            "details": {"base_rows": rows, "large_rows": rows * 10, "batch": config.inference.batch_size}}


def inference_parallel_speedup(rows: int = 400_000) -> dict[str, Any]:
    """batch_inference wall time over 4 shards with 1 worker / with 2, through a real scheduler (LocalExecutor).

    The number of workers is the slots of the inference pool (1, then 2); wall time is first
    infer_shard start to last infer_shard end.
    """
    from bench.sweep import _span_of
    from tests.live_airflow import LiveAirflow

    with tempfile.TemporaryDirectory(prefix="bench-infer-par-") as tmp:
        workdir = Path(tmp)
        config, _, model_uri = _trained_model(workdir)
        from stagewise import registry

        name = config.registry.model_name
        version = registry.register(config.storage_root, name, model_uri, {"test_accuracy": 0.0, "source_run": "bench"})["version"]
        registry.promote(config.storage_root, name, version)
        source = _raw_file(workdir, "score.parquet", rows, row_group_rows=rows // 4)
        raw = yaml.safe_load((workdir / "pipeline.yaml").read_text())
        raw["pools"]["infer_pool"] = {"slots": 2, "description": "bench"}
        raw["profiles"]["infer"] = {**raw["profiles"]["small"], "pool": "infer_pool"}
        raw["inference"].update({"profile": "infer", "rows_per_shard": rows // 4})
        config_path = workdir / "bench-pipeline.yaml"
        config_path.write_text(yaml.safe_dump(raw))
        spans = {}
        with LiveAirflow(workdir / "airflow", REPO_ROOT / "dags", env={"STAGEWISE_CONFIG": str(config_path)}) as live:
            live.api("POST", "/api/v2/pools", expect=(200, 201), json={"name": "cpu_cores", "slots": 2})
            live.api("POST", "/api/v2/pools", expect=(200, 201), json={"name": "infer_pool", "slots": 1})
            live.wait_for_dag("ml_batch_inference")
            live.unpause("ml_batch_inference")
            for workers in (1, 2):
                live.api("PATCH", "/api/v2/pools/infer_pool", json={"name": "infer_pool", "slots": workers, "include_deferred": False})
                run_id = live.trigger("ml_batch_inference", {"input_uri": source})
                state = live.wait_for_run("ml_batch_inference", run_id, timeout=600)
                if state != "success":
                    raise RuntimeError(f"batch_inference with {workers} worker(s) ended {state}:\n{live.logs_tail()}")
                spans[workers] = _span_of(live.task_instances("ml_batch_inference", run_id), "infer_shard")
    return {"ours": spans[1], "baseline": spans[2], "unit": "s (1 worker / 2 workers)",
            "details": {"one_worker_s": round(spans[1], 2), "two_workers_s": round(spans[2], 2), "shards": 4, "rows": rows,
                        "note": "ratio = 1-worker time / 2-worker time (a speed-up)"}}
