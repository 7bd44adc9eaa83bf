"""GPU benchmarks: our training stage and our scoring on one CUDA device against plain PyTorch loops.

Run: ``python -m bench --only train_throughput_gpu,train_vs_dataloader_gpu,inference_throughput_gpu``

Where CUDA is absent each raises :class:`bench.harness.BenchmarkSkipped` ('no CUDA') before any work, and the
harness records the skip, never a number. They need what a training sub-job needs and nothing else: torch,
pyarrow, numpy, fsspec, pydantic and pyyaml (stagewise.definitions.loading parses the pipeline YAML with them); no Airflow,
optuna, pandas or services. ``make bench`` runs ``airflow-init`` first, so on a box without Airflow call
``python -m bench`` as above.

Each function returns ``{"ours", "baseline", "unit", "details"}``; the harness turns that into a ratio.
"""

from __future__ import annotations

import functools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import BenchmarkSkipped
from bench.training import resident_loop, sync
from stagewise.models.scoring import exact_float32

# The rows of issue 13's table: (MLP hidden width, batch).
TRAIN_ROWS = ((1024, 1024), (4096, 1024), (1024, 256))
TRAIN_FRACTION = 0.65  # pipeline.yaml's split: validation 0.15, test 0.2


def cuda_device() -> Any:
    """The CUDA device the benchmarks run on; BenchmarkSkipped where there is none."""
    import torch

    if not torch.cuda.is_available():
        raise BenchmarkSkipped("no CUDA")
    return torch.device("cuda")


def _dataloader_loop(model_spec: Any, manifest: dict, full: dict, x: Any, y: Any, batch: int, epochs: int,
                     device: Any) -> list[float]:
    """What most users write: DataLoader(TensorDataset, shuffle, pin_memory) and a non_blocking copy per batch."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from stagewise.models.building import build, data_info
    from stagewise.training.loop import make_optimizer

    torch.manual_seed(0)
    model = build(model_spec, data_info(manifest), full).to(device)
    optimizer = make_optimizer(model, full)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True, drop_last=True,
                        pin_memory=device.type == "cuda", generator=torch.Generator().manual_seed(0))
    rates = []
    for _ in range(epochs):
        sync(device)
        started, seen = time.perf_counter(), 0
        for features, labels in loader:
            inputs, targets = model_spec.batch(features.to(device, non_blocking=True), labels.to(device, non_blocking=True))
            loss = model_spec.loss(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            seen += len(labels)
        sync(device)
        rates.append(seen / (time.perf_counter() - started))
    return rates[1:]


def measure_training(rows: int, device: Any, epochs: int = 3, table: tuple = TRAIN_ROWS,
                     threads: int = 4) -> list[dict[str, Any]]:
    """Per (hidden, batch) row: samples/s (median of the epochs after the first) of our stage
    (stagewise.train.run_stage, one process, its profile on ``device``), of the resident loop and of the DataLoader loop."""
    import torch

    from bench.training import _prepare
    from stagewise.datasets.manifest import load_split, read_manifest
    from stagewise.models.building import load_spec, resolve_params
    from stagewise.train import run_stage

    stages = [{"name": f"h{hidden}_b{batch}", "profile": "ddp1", "per_process_batch": batch, "epochs": epochs}
              for hidden, batch in table]
    measured = []
    with tempfile.TemporaryDirectory(prefix="bench-gpu-train-") as tmp:
        config, out = _prepare(Path(tmp), rows, features=32, **{
            "profiles__ddp1__device": device.type, "profiles__ddp1__threads_per_process": threads,
            "train__checkpoint_every_steps": 10**9, "train__stages": stages})
        manifest = read_manifest(f"{out}/preprocess/manifest.json")
        x, y = (torch.from_numpy(a) for a in load_split(manifest, "train"))
        model_spec = load_spec(config)
        torch.set_num_threads(threads)
        for (hidden, batch), stage in zip(table, stages):
            params = {"lr": 0.01, "hidden": hidden, "dropout": 0.0}
            full = resolve_params(config, params, model_spec)
            result = run_stage(config, stage["name"], out, params, None)
            torch.set_num_threads(threads)  # the stage set its own; the loops get the same
            history = json.loads(Path(out, "train", stage["name"], "metrics.json").read_text())["history"]
            ours = statistics.median(h["samples_per_s"] for h in history[1:])
            resident = statistics.median(resident_loop(model_spec, manifest, full, x, y, batch, epochs, device))
            loader = statistics.median(_dataloader_loop(model_spec, manifest, full, x, y, batch, epochs, device))
            measured.append({"hidden": hidden, "batch": batch, "ours": round(ours), "resident": round(resident),
                             "dataloader": round(loader), "ours_vs_resident": round(ours / resident, 4),
                             "ours_vs_dataloader": round(ours / loader, 4),
                             f"ours_val_{config.objective.metric}": result["val_metric"]})
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return measured


@functools.lru_cache(maxsize=1)
def _training_on_cuda(rows: int) -> tuple[dict[str, Any], ...]:
    # One measurement serves both training benchmarks when they run in the same process.
    return tuple(measure_training(rows, cuda_device()))


def _worst(rows: int, baseline: str) -> dict[str, Any]:
    measured = _training_on_cuda(rows)
    worst = min(measured, key=lambda row: row[f"ours_vs_{baseline}"])
    return {"ours": float(worst["ours"]), "baseline": float(worst[baseline]), "unit": "samples/s",
            "details": {"raw_rows": rows, "train_rows": round(rows * TRAIN_FRACTION), "features": 32,
                        "spec": "stagewise.model:MLPClassifier", "epochs": 3, "epochs_measured": 2,
                        "ratio_is": f"the lowest ours/{baseline} of the rows (this entry's ours and baseline are that row's)",
                        "worst_row": {"hidden": worst["hidden"], "batch": worst["batch"]}, "table": list(measured)}}


def train_throughput_gpu(rows: int = 1_000_000) -> dict[str, Any]:
    """Our stage on one GPU (run_stage, cuda profile) / a plain loop with the split resident on the GPU, same MLP, batch
    and optimizer; samples/s after the first epoch; ratio = the lowest of issue 13's three (hidden, batch) rows."""
    return _worst(rows, "resident")


def train_vs_dataloader_gpu(rows: int = 1_000_000) -> dict[str, Any]:
    """Our stage on one GPU / a plain loop over DataLoader(TensorDataset, shuffle, pin_memory=True), same MLP, batch and
    optimizer; samples/s after the first epoch; ratio = the lowest of issue 13's three (hidden, batch) rows."""
    return _worst(rows, "dataloader")


def measure_inference(rows: int, device: Any, hidden: int = 1024, batch: int = 65_536, threads: int = 4,
                      repeats: int = 3) -> dict[str, Any]:
    """Rows/s of stagewise.infer.score_shard on ``device`` (best of ``repeats`` after a warm-up), of a plain loop over the
    same rows already normalised and resident on ``device`` (forward, softmax, argmax, both back to the host per
    chunk), and of our scoring on the CPU for scale."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    from bench.inference import _raw_file
    from bench.training import _prepare
    from stagewise import infer
    from stagewise.definitions.loading import load_config
    from stagewise.models.bundle import load_bundle
    from stagewise.train import run_stage

    with tempfile.TemporaryDirectory(prefix="bench-gpu-infer-") as tmp:
        workdir = Path(tmp)
        _, _ = _prepare(workdir, 20_000, **{
            "train__stages": [{"name": "s1", "profile": "ddp1", "per_process_batch": 256, "epochs": 1}]})
        overrides = {"profiles.small.device": device.type, "profiles.small.threads_per_process": threads,
                     "profiles.ddp1.threads_per_process": threads, "inference.batch_size": batch}
        config = load_config(workdir / "pipeline.yaml", overrides)
        out = str(workdir / "runs" / "bench" / "r1")
        model_uri = run_stage(load_config(workdir / "pipeline.yaml", {**overrides, "profiles.small.device": "cpu"}),
                              "s1", out, {"lr": 0.05, "hidden": hidden}, None)["model_uri"]
        source = _raw_file(workdir, "score.parquet", rows)
        shard = {"index": 0, "uri": source, "row_groups": list(range(pq.ParquetFile(source).num_row_groups))}

        def ours_once(on: Any) -> float:
            started = time.perf_counter()
            result = infer.score_shard(on, model_uri, shard, str(workdir / "out"))
            return result["rows"] / (time.perf_counter() - started)

        bundle = load_bundle(model_uri)
        prep = bundle.preprocessing
        table = pq.read_table(source, columns=prep["features"])
        matrix = np.column_stack([table.column(c).to_numpy() for c in prep["features"]])
        resident = torch.from_numpy(((matrix - np.asarray(prep["mean"])) / np.asarray(prep["std"])).astype(np.float32))
        resident = resident.to(device)
        model = bundle.module.to(device).eval()

        def plain_once() -> float:
            sync(device)
            started = time.perf_counter()
            with torch.inference_mode():
                for start in range(0, len(resident), batch):
                    probabilities = torch.softmax(model(resident[start : start + batch]), dim=1)
                    _ = probabilities.cpu(), probabilities.argmax(dim=1).cpu()
            return len(resident) / (time.perf_counter() - started)

        torch.set_num_threads(threads)
        with exact_float32(device):  # the same float32 matmuls as our scoring
            plain_once()
            baseline = max(plain_once() for _ in range(repeats))
        ours_once(config)  # warm-up: page cache, model load, CUDA context, allocator
        ours = max(ours_once(config) for _ in range(repeats))
        on_cpu = load_config(workdir / "pipeline.yaml", {**overrides, "profiles.small.device": "cpu"})
        ours_cpu = max(ours_once(on_cpu) for _ in range(2))
    return {"ours": ours, "baseline": baseline, "unit": "rows/s",
            "details": {"rows": rows, "features": 32, "hidden": hidden, "batch": batch, "threads": threads,
                        "ours_on_cpu_rows_per_s": round(ours_cpu), "gpu_vs_cpu_scoring": round(ours / ours_cpu, 3),
                        "ours_also_does": "Parquet read, row checks with quarantine, normalisation, Parquet write with "
                                          "the model_version column; the baseline starts from normalised rows on the GPU"}}


def inference_throughput_gpu(rows: int = 2_000_000) -> dict[str, Any]:
    """Rows/s of our shard scoring (stagewise.infer.score_shard, cuda profile) / a plain GPU loop over the same rows already
    normalised and resident on the device; MLP hidden 1024, batch 65,536."""
    return measure_inference(rows, cuda_device())
