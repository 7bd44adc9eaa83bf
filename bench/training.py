"""Training benchmarks: steady-state throughput, the growing-batch schedule, and Parquet loading.

Each function returns ``{"ours", "baseline", "unit", "details"}``; the harness turns that into a ratio.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent


def _pack_image_column(folder: Path) -> None:
    """Rewrite each synthetic shard with its f_* columns packed into one fixed-size-list ``image`` column."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    for shard in sorted(folder.glob("*.parquet")):
        table = pq.read_table(shard)
        names = [name for name in table.column_names if name.startswith("f_")]
        pixels = np.column_stack([table.column(name).to_numpy() for name in names])
        image = pa.FixedSizeListArray.from_arrays(pa.array(pixels.reshape(-1)), len(names))
        pq.write_table(table.drop_columns(names).append_column("image", image), shard)


def _float_target(folder: Path) -> None:
    """Rewrite each synthetic shard's class label as a float target: the class index plus noise (a regression)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    for number, shard in enumerate(sorted(folder.glob("*.parquet"))):
        table = pq.read_table(shard)
        labels = table.column("label").to_numpy().astype(np.float64)
        target = labels + np.random.default_rng(number).normal(0.0, 0.5, len(labels))
        pq.write_table(table.set_column(table.column_names.index("label"), "label", pa.array(target)), shard)


def _prepare(workdir: Path, rows: int, features: int = 32, noise_seed: int = 0, noise: float = 1.1,
             image_shape: list[int] | None = None, tokens: bool = False, float_target: bool = False,
             **config_changes: Any) -> tuple[Any, str]:
    """Synthetic raw data, preprocessed by our own stage into a run prefix; returns (config, out).

    ``image_shape``: the features as one declared tensor column ``image`` of that shape instead of f_* columns.
    ``tokens``: the token sequences of examples/token_transformer.yaml (its dataset block) instead.
    ``float_target``: a float label (a regression, as examples/diabetes.yaml): no num_classes, objective rmse.
    """
    from stagewise import preprocess
    from stagewise.datasets.demo import write_synthetic, write_tokens
    from stagewise.definitions.loading import load_config

    raw = yaml.safe_load((REPO_ROOT / "pipeline.yaml").read_text())
    raw["storage_root"] = str(workdir)
    raw["sweep"]["storage"] = f"journal://{workdir}/optuna.journal"
    raw["dataset"].update({"uri": "raw/synthetic",
                           "features": [{"column": "image", "shape": image_shape}] if image_shape else "f_*"})
    if tokens:
        example = yaml.safe_load((REPO_ROOT / "examples" / "token_transformer.yaml").read_text())
        raw["dataset"] = {**example["dataset"], "uri": "raw/synthetic"}
    if float_target:
        raw["dataset"].pop("num_classes", None)
        raw["objective"] = {"metric": "rmse", "direction": "minimize"}
        raw["registry"].pop("gate_metric", None)
        raw["evaluate"].pop("min_test_accuracy", None)
    for dotted, value in config_changes.items():
        node = raw
        *parents, leaf = dotted.split("__")
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[leaf] = value
    config_path = workdir / "pipeline.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    config = load_config(config_path)
    if tokens:
        write_tokens(str(workdir / "raw" / "synthetic"), num_shards=8, num_rows=rows)
    else:
        write_synthetic(str(workdir / "raw" / "synthetic"), rows, num_features=features, num_shards=8, seed=noise_seed,
                        dirty_fraction=0.0, noise=noise)
    if image_shape:
        _pack_image_column(workdir / "raw" / "synthetic")
    if float_target:
        _float_target(workdir / "raw" / "synthetic")
    out = str(workdir / "runs" / "bench" / "r1")
    shards = preprocess.plan(str(workdir / "raw" / "synthetic"))
    stats = [preprocess.shard_stats(config, uri, i, out)["stats_uri"] for i, uri in enumerate(shards)]
    reduced = preprocess.reduce_stats(config, out, stats)
    results = [preprocess.transform_shard(config, uri, i, out, reduced["stats_uri"]) for i, uri in enumerate(shards)]
    preprocess.commit(config, out, reduced["stats_uri"], results)
    return config, out


def _stage_rates(config: Any, out: str, params: dict[str, Any]) -> tuple[list[float], dict[str, Any]]:
    """Run stage s1 afresh (never a resume); samples/s of its epochs after the first, and the stage's result."""
    from stagewise.train import run_stage

    shutil.rmtree(Path(out, "train"), ignore_errors=True)
    result = run_stage(config, "s1", out, params, None)
    history = json.loads(Path(out, "train", "s1", "metrics.json").read_text())["history"]
    return [h["samples_per_s"] for h in history[1:]], result


def _stage_vs_plain_loop(rows: int, *, features: int, spec: str, spec_args: dict[str, Any], params: dict[str, Any],
                         batch: int, image_shape: list[int] | None = None, threads: int = 2, epochs: int = 2,
                         rounds: int = 6, tokens: bool = False, float_target: bool = False,
                         device: str = "cpu") -> dict[str, Any]:
    """Samples/s of our stage (stagewise.train.run_stage, Parquet per-rank loader, the spec's batch/loss) and of a
    plain PyTorch loop over in-memory tensors with the same module, optimizer, batch and threads.

    ``device`` cuda: our stage on a cuda profile (its defaults: data resident, TF32, the step a CUDA graph where the
    spec allows) against the plain loop with the split resident on the GPU and the same TF32 setting.

    The sides alternate in ``rounds`` short runs (which goes first alternates too), and each side's rate is the
    median of its epochs after the first (warm-up) of every run: on a shared machine load comes in bursts of
    seconds, and short alternating runs spread each burst over both sides instead of letting one side's whole
    block meet it. Validation and process start are excluded; details keep each round's pair.
    """
    import torch

    from stagewise.datasets.manifest import load_split, read_manifest
    from stagewise.models.building import load_spec, resolve_params
    from stagewise.training.step_graph import set_tf32

    on = torch.device(device)
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        config, out = _prepare(Path(tmp), rows, features=features, image_shape=image_shape, tokens=tokens,
                               float_target=float_target, **{
            "model": {"spec": spec, "args": spec_args}, "profiles__ddp1__device": on.type,
            "profiles__ddp1__threads_per_process": threads, "train__checkpoint_every_steps": 10_000,
            "train__stages": [{"name": "s1", "profile": "ddp1", "per_process_batch": batch, "epochs": epochs}]})
        manifest = read_manifest(f"{out}/preprocess/manifest.json")
        x, y = (torch.from_numpy(a) for a in load_split(manifest, "train"))
        model_spec = load_spec(config)
        full = resolve_params(config, params, model_spec)

        def plain_loop() -> list[float]:
            torch.set_num_threads(threads)
            set_tf32(on, config.stage("s1").tf32)  # the stage's float32 matmul precision (a no-op on the CPU)
            if tokens:
                return padded_loop(model_spec, manifest, full, x, y, batch, epochs, on)
            return resident_loop(model_spec, manifest, full, x, y, batch, epochs, on)

        our_rates, baseline_rates, pairs = [], [], []
        for number in range(rounds):
            if number % 2:  # every other round ours goes first: drift and order effects fall on both sides alike
                rates, result = _stage_rates(config, out, params)
                baseline_rates += plain_loop()
            else:
                baseline_rates += plain_loop()
                rates, result = _stage_rates(config, out, params)
            our_rates += rates
            pairs.append(round(statistics.median(our_rates[-(epochs - 1):]) /
                               statistics.median(baseline_rates[-(epochs - 1):]), 4))
        ours, baseline = statistics.median(our_rates), statistics.median(baseline_rates)
    return {"ours": ours, "baseline": baseline, "unit": "samples/s",
            "details": {"rows": rows, "train_rows": int(len(y)), "spec": spec, "spec_args": spec_args,
                        "params": params, "batch": batch, "threads": threads, "device": on.type,
                        "baseline_step_ms": round(1000 * batch / baseline, 2), "rounds": rounds,
                        "epochs_measured_per_round": epochs - 1, "ratio_per_round": pairs,
                        f"ours_val_{config.objective.metric}": result["val_metric"],
                        "step_graph": result.get("step_graph")}}


def sync(device: Any) -> None:
    """Wait for a CUDA device's queued kernels (they belong to the epoch that queued them); nothing on CPU."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def resident_loop(model_spec: Any, manifest: dict, full: dict, x: Any, y: Any, batch: int, epochs: int,
                  device: Any) -> list[float]:
    """The plain loop baseline: the whole split on ``device`` once, a seeded ``randperm`` per epoch and slicing
    there; samples/s of each epoch after the first."""
    import torch

    from stagewise.models.building import build, data_info
    from stagewise.training.optimizers import make_optimizer

    torch.manual_seed(0)
    model = build(model_spec, data_info(manifest), full).to(device)
    optimizer = make_optimizer(model, full)
    x, y = x.to(device), y.to(device)
    steps, rates = len(y) // batch, []
    for epoch in range(epochs):
        order = torch.randperm(len(y), device=device, generator=torch.Generator(device).manual_seed(epoch))
        sync(device)
        started = time.perf_counter()
        for step in range(steps):
            index = order[step * batch : (step + 1) * batch]
            inputs, targets = model_spec.batch(x[index], y[index])
            loss = model_spec.loss(model(inputs), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        sync(device)
        rates.append(steps * batch / (time.perf_counter() - started))
    return rates[1:]


class _PaddedBatch:
    """What a plain loop hands the token model: padded ids cut to the batch's longest row, their mask, the other
    columns (the few methods examples/token_transformer.py calls)."""

    def __init__(self, columns: dict[str, Any], lengths: Any, dense: Any) -> None:
        import torch

        self.columns, self.dense, self.lengths = columns, dense, lengths
        self._mask = torch.arange(columns["tokens"].shape[1], device=lengths.device) < lengths[:, None]

    def __getitem__(self, name: str) -> Any:
        return self.columns[name]

    def mask(self, name: str) -> Any:
        return self._mask


def padded_loop(model_spec: Any, manifest: dict, full: dict, x: Any, y: Any, batch: int, epochs: int,
                device: Any = None) -> list[float]:
    """The plain loop over variable-length tokens: plain tensors resident on ``device`` (the CPU by default: ids padded
    to max_length, lengths, the channel ids and the hour), a seeded ``randperm`` per epoch, each batch cut to its
    longest row (read on the host) with a mask."""
    import torch

    from stagewise.models.building import build, data_info
    from stagewise.training.optimizers import make_optimizer

    device = torch.device(device or "cpu")
    data = data_info(manifest)
    decoded = data.layout.decode(x)  # once, before timing: the baseline starts from plain tensors
    tokens = decoded["tokens"].to(device, copy=True)
    lengths, channel = decoded.lengths("tokens").to(device, copy=True), decoded["channel"].to(device, copy=True)
    hour, y = decoded.dense.to(device, copy=True), y.to(device)
    torch.manual_seed(0)
    model = build(model_spec, data, full).to(device)
    optimizer = make_optimizer(model, full, model_spec)
    steps, rates = len(y) // batch, []
    for epoch in range(epochs):
        order = torch.randperm(len(y), device=device, generator=torch.Generator(device).manual_seed(epoch))
        sync(device)
        started = time.perf_counter()
        for step in range(steps):
            index = order[step * batch : (step + 1) * batch]
            batch_lengths = lengths[index]
            longest = int(batch_lengths.max())
            inputs = _PaddedBatch({"tokens": tokens[index, :longest], "channel": channel[index]}, batch_lengths, hour[index])
            loss = model_spec.loss(model(inputs), y[index])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        sync(device)
        rates.append(steps * batch / (time.perf_counter() - started))
    return rates[1:]


def variable_length_throughput(rows: int = 40_000, rounds: int = 6) -> dict[str, Any]:
    """A user's transformer over variable-length int64 token rows (examples/token_transformer.py, dim 32, one layer;
    2..16 tokens a row, each batch padded to its longest row), batch 256, 2 threads: our stage vs a plain loop with
    the same padding, model and optimizer. Quick: ``python -m bench --only variable_length_throughput --rows 20000``,
    or ``rounds=2`` from Python."""
    return _stage_vs_plain_loop(rows, features=0, tokens=True, spec="stagewise.examples.token_transformer:TokenTransformer",
                                spec_args={}, params={"lr": 0.003}, batch=256, rounds=rounds)


def train_throughput(rows: int = 120_000) -> dict[str, Any]:
    """The built-in MLP (hidden 1024, a step of several ms), batch 256, 2 threads: our stage vs a plain loop."""
    return _stage_vs_plain_loop(rows, features=32, spec="stagewise.model:MLPClassifier", spec_args={},
                                params={"lr": 0.01, "hidden": 1024, "dropout": 0.0}, batch=256)


def custom_model_throughput(rows: int = 60_000) -> dict[str, Any]:
    """A user's spec, the example CNN (stagewise.examples.digits_cnn, 32 channels) on a declared 1x8x8 image column, batch 256, 2 threads:
    our stage vs a plain PyTorch loop over the same CNN, data and batch."""
    return _stage_vs_plain_loop(rows, features=64, image_shape=[1, 8, 8], spec="stagewise.examples.digits_cnn:DigitsCNN",
                                spec_args={"channels": 32}, params={"lr": 0.01, "dropout": 0.0}, batch=256)


KNOBS = {"fp32": {}, "bf16": {"precision": "bf16"}, "compile": {"compile": "default"},
         "bf16_compile": {"precision": "bf16", "compile": "default"}}


def train_bf16(rows: int = 120_000, rounds: int = 2, epochs: int = 3) -> dict[str, Any]:
    """The stage knobs on CPU: our stage with ``precision: bf16`` / the same stage in fp32 (built-in MLP, hidden 1024,
    batch 256, 2 threads); details give ``compile: default`` and both together, and each one's validation accuracy."""
    from stagewise.definitions.loading import load_config

    params = {"lr": 0.01, "hidden": 1024, "dropout": 0.0}
    with tempfile.TemporaryDirectory(prefix="bench-knobs-") as tmp:
        workdir = Path(tmp)
        _, out = _prepare(workdir, rows, **{
            "profiles__ddp1__threads_per_process": 2, "train__checkpoint_every_steps": 10_000,
            "train__stages": [{"name": "s1", "profile": "ddp1", "per_process_batch": 256, "epochs": epochs}]})
        configs = {}
        for name, knobs in KNOBS.items():
            raw = yaml.safe_load((workdir / "pipeline.yaml").read_text())
            raw["train"]["stages"][0].update(knobs)
            (workdir / f"{name}.yaml").write_text(yaml.safe_dump(raw))
            configs[name] = load_config(workdir / f"{name}.yaml")
        rates: dict[str, list[float]] = {name: [] for name in KNOBS}
        accuracy: dict[str, float] = {}
        for number in range(rounds):  # interleaved, the order reversed every other round
            for name in (list(KNOBS) if number % 2 == 0 else list(reversed(KNOBS))):
                measured, result = _stage_rates(configs[name], out, params)
                rates[name] += measured
                accuracy[name] = round(result["val_metric"], 4)
    median = {name: statistics.median(values) for name, values in rates.items()}
    return {"ours": median["bf16"], "baseline": median["fp32"], "unit": "samples/s", "details": {
        "rows": rows, "spec": "stagewise.model:MLPClassifier", "params": params, "batch": 256, "threads": 2,
        "rounds": rounds, "epochs_measured_per_run": epochs - 1,
        "samples_per_s": {name: round(value) for name, value in median.items()},
        "vs_fp32": {name: round(value / median["fp32"], 4) for name, value in median.items()},
        "val_accuracy": accuracy,
        "note": "CPU only (the GPU's bf16 and reduce-overhead are not measured here): bf16 autocast pays where the CPU "
                "has bf16 matrix instructions (avx512_bf16, AMX) and costs elsewhere; compile's first epoch holds the "
                "compilation and is not counted"}}


def growing_batch_steps(rows: int = 60_000) -> dict[str, Any]:
    """Steps the growing-batch stages need to reach the accuracy of a fixed batch with step LR decay.

    Fixed: batch 32 for 12 epochs, lr 0.05 divided by 5 at epochs 4 and 8 (our Loop, one stage).
    Growing (Smith et al. 2018): the same lr throughout, the batch multiplied by 5 instead, as three
    of our training stages (32 -> 160 -> 800, 4 epochs each, lr_rule none, no warmup), each starting
    from the previous one's checkpoint. ratio = growing steps to reach (fixed final accuracy - 0.5
    points) / fixed steps.
    """
    from stagewise.datasets.loader import split_batches
    from stagewise.datasets.manifest import read_manifest
    from stagewise.models.building import build, data_info, resolve_params
    from stagewise.models.mlp import MLPClassifier
    from stagewise.train import run_stage
    from stagewise.training.distributed import DistEnv
    from stagewise.training.loop import Loop
    from stagewise.training.optimizers import make_optimizer

    base_lr, factor, epochs_per_phase = 0.05, 5, 4
    params = {"lr": base_lr, "hidden": 128, "dropout": 0.0, "momentum": 0.9, "weight_decay": 0.0}
    stages = [{"name": f"g{i}", "profile": "ddp1", "per_process_batch": 32 * factor**i, "epochs": epochs_per_phase}
              for i in range(3)]
    with tempfile.TemporaryDirectory(prefix="bench-growing-") as tmp:
        config, out = _prepare(Path(tmp), rows, noise=3.0, **{"train__stages": stages, "train__lr_rule": "none",
                                                   "train__checkpoint_every_steps": 100_000})
        manifest = read_manifest(f"{out}/preprocess/manifest.json")
        full = resolve_params(config, params)
        import torch

        torch.manual_seed(config.train.seed)
        model = build(MLPClassifier(), data_info(manifest), full)
        env = DistEnv(rank=0, local_rank=0, world_size=1, device="cpu")
        loop = Loop(model=model, optimizer=make_optimizer(model, full), env=env, spec=MLPClassifier(),
                    train=split_batches(manifest, "train", rank=0, world_size=1, batch_size=32, seed=1),
                    validation=split_batches(manifest, "validation", rank=0, world_size=1, batch_size=4096, seed=0, shuffle=False))
        steps_per_epoch = loop.steps_per_epoch(0)

        def decayed(step: int) -> float:
            return base_lr / factor ** min(step // (steps_per_epoch * epochs_per_phase), 2)

        fixed = [loop.train_epoch(decayed) for _ in range(3 * epochs_per_phase)]
        fixed_accuracy, fixed_steps = fixed[-1].val_metric, fixed[-1].steps

        growing, offset, previous = [], 0, None
        for stage in stages:
            result = run_stage(config, stage["name"], out, params, previous)
            history = json.loads(Path(out, "train", stage["name"], "metrics.json").read_text())["history"]
            growing += [(offset + h["steps"], h["val_metric"]) for h in history]
            offset += result["steps"]
            previous = result["checkpoint_uri"]
        target = fixed_accuracy - 0.005
        reached = next((steps for steps, accuracy in growing if accuracy >= target), None)
    ours_steps = reached if reached is not None else growing[-1][0]
    return {"ours": float(ours_steps), "baseline": float(fixed_steps), "unit": "optimizer steps",
            "details": {"fixed_final_accuracy": fixed_accuracy, "growing_final_accuracy": growing[-1][1],
                        "growing_reached_target": reached is not None, "target_accuracy": target,
                        "growing_total_steps": growing[-1][0], "rows": rows, "schedule": "batch 32 -> 160 -> 800 vs lr / 5 twice"}}


def _accuracy_by_shuffle(manifest: dict[str, Any], block_rows: int, epochs: int = 2) -> dict[str, float]:
    """Validation accuracy of one small MLP trained with the row shuffle and with ``block_rows`` runs, same init and lr."""
    import torch

    from stagewise.datasets.loader import split_batches
    from stagewise.models.building import build, data_info
    from stagewise.models.mlp import MLPClassifier
    from stagewise.training.distributed import DistEnv
    from stagewise.training.loop import Loop

    accuracy = {}
    for name, rows in (("row_shuffle", 1), (f"block_{block_rows}_shuffle", block_rows)):
        torch.manual_seed(0)
        model = build(MLPClassifier(), data_info(manifest), {"hidden": 64, "dropout": 0.0})
        loop = Loop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                    env=DistEnv(rank=0, local_rank=0, world_size=1, device="cpu"), spec=MLPClassifier(),
                    train=split_batches(manifest, "train", rank=0, world_size=1, batch_size=256, seed=1,
                                        shuffle_block_rows=rows),
                    validation=split_batches(manifest, "validation", rank=0, world_size=1, batch_size=4096, seed=0,
                                             shuffle=False))
        accuracy[name] = round([loop.train_epoch(lambda _step: 0.05) for _ in range(epochs)][-1].val_metric, 4)
    return accuracy


def parquet_loading(rows: int = 1_000_000, block_rows: int = 64) -> dict[str, Any]:
    """Rows/s from Parquet shards into shuffled, batched tensors through our loader vs pyarrow's raw read.

    The headline is the default row shuffle. The opt-in coarse shuffle (``shuffle_block_rows``) is measured alongside,
    in the same interleaved rounds, with the validation accuracy a small MLP reaches under each shuffle.
    """
    import pyarrow.parquet as pq

    from stagewise.datasets.loader import ParquetBatches

    with tempfile.TemporaryDirectory(prefix="bench-loading-") as tmp:
        _, out = _prepare(Path(tmp), rows)
        manifest = json.loads(Path(out, "preprocess", "manifest.json").read_text())
        uris = [entry["uri"] for entry in manifest["splits"]["train"]]
        total = sum(entry["rows"] for entry in manifest["splits"]["train"])

        def ours_once(block: int = 1) -> float:
            loader = ParquetBatches(uris, manifest["features"], manifest["label"], rank=0, world_size=1,
                                    batch_size=1024, seed=0, shuffle_block_rows=block)
            started, seen = time.perf_counter(), 0
            for _x, y in loader.epoch(0):
                seen += len(y)
            return seen / (time.perf_counter() - started)

        def raw_once() -> float:
            started = time.perf_counter()
            count = sum(pq.read_table(uri).num_rows for uri in uris)
            return count / (time.perf_counter() - started)

        ours_once(), raw_once()  # warm the page cache for both
        ours_runs, raw_runs, block_runs = [], [], []
        for _ in range(5):  # sides interleaved, so load from elsewhere in one stretch of time hits both alike
            ours_runs.append(ours_once())
            raw_runs.append(raw_once())
            block_runs.append(ours_once(block_rows))
        ours, baseline = max(ours_runs), max(raw_runs)
        accuracy = _accuracy_by_shuffle(manifest, block_rows)
    return {"ours": ours, "baseline": baseline, "unit": "rows/s",
            "details": {"rows": total, "files": len(uris), "batch": 1024, "features": len(manifest["features"]),
                        "ours_runs": [round(r) for r in ours_runs], "baseline_runs": [round(r) for r in raw_runs],
                        "block_shuffle": {"shuffle_block_rows": block_rows, "rows_per_s": round(max(block_runs)),
                                          "ratio": round(max(block_runs) / baseline, 4),
                                          "runs": [round(r) for r in block_runs],
                                          "val_accuracy_2_epochs": accuracy,
                                          "note": "opt-in, off by default; the synthetic rows are stored in random order, "
                                                  "so neighbours on disk are unrelated here: data stored sorted (by label, "
                                                  "time, key) would correlate a block's rows"}}}


def _stage_chain(config: Any, out: str, params: dict[str, Any]) -> dict[str, Any]:
    """Run the config's stages in order from scratch (each from the one before's handed-on checkpoint): every epoch's
    validation objective at its optimizer step counted across stages, the last stage's test objective, the batches."""
    from stagewise.evaluate import evaluate
    from stagewise.train import run_stage

    shutil.rmtree(Path(out, "train"), ignore_errors=True)
    curve, offset, previous, batches, started = [], 0, None, [], time.perf_counter()
    for stage in config.train.stages:
        result = run_stage(config, stage.name, out, params, previous)
        history = json.loads(Path(out, "train", stage.name, "metrics.json").read_text())["history"]
        curve += [(offset + entry["steps"], entry["val_metric"]) for entry in history]
        offset += result["steps"]
        previous = result["checkpoint_uri"]
        batches.append({"stage": stage.name, "steps": result["steps"], "global_batch": result["global_batch"],
                        "lr": round(result["lr"], 4), "noise_scale_at_end": result["noise_scale"]})
    wall = time.perf_counter() - started
    tested = evaluate(config, result["model_uri"], out)
    return {"curve": curve, "steps": offset, "wall_s": wall, "test": tested["test_objective"],
            "test_rows": tested.get("test_rows"), "stages": batches}


def _adaptive_vs_fixed(workdir: Path, *, rows: int | None, first_epochs: int, later: list[int], max_global_batch: int,
                       params: dict[str, Any], noise_every: int, noise: float = 1.1, lr_rule: str = "sqrt") -> dict[str, Any]:
    """The same data, params and stages (a first stage at batch 32, then ``later`` stages of that many epochs) twice:
    fixed at batch 128 after the first stage (the demo's schedule), and adaptive (each later stage configured at 128
    too, at the noise scale the stage before measured, between 128 and ``max_global_batch``). Both chains share the first stage bit for bit; the steps
    each takes after it until its validation objective first comes within one standard error of the fixed chain's
    final one are compared, and their test objectives."""
    from stagewise.definitions.loading import load_config

    settings = {"checkpoint_every_steps": 1_000_000, "noise_scale_every_steps": noise_every, "lr_rule": lr_rule}
    if rows is None:  # the digits, as the tests preprocess them
        from tests.conftest import base_config, preprocess_digits

        config_path = workdir / "pipeline.yaml"
        config_path.write_text(yaml.safe_dump(base_config(workdir)))
        out = str(workdir / "runs" / "bench" / "r1")
        preprocess_digits(config_path, out)
    else:
        _, out = _prepare(workdir, rows, noise=noise)
        config_path = workdir / "pipeline.yaml"
    raw = yaml.safe_load(config_path.read_text())
    first = {"name": "s1", "profile": "ddp1", "per_process_batch": 32, "epochs": first_epochs}
    runs = {}
    # Both chains configure the later stages at 128: an adaptive stage's configured batch is its clamp's floor (and
    # its per-process memory bound), so at 1024 every adaptive stage trained at 1024 and nothing adapted.
    for name, batch, growth in (("fixed", 128, {}), ("adaptive", 128, {"batch_growth": "adaptive",
                                                                       "max_global_batch": max_global_batch})):
        stages = [first, *({"name": f"s{i + 2}", "profile": "ddp1", "per_process_batch": batch, "epochs": epochs}
                           for i, epochs in enumerate(later))]
        raw["train"].update({**settings, "stages": stages, **growth})
        path = workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(raw))
        runs[name] = _stage_chain(load_config(path), out, params)
    fixed_run, adaptive_run = runs["fixed"], runs["adaptive"]
    shared = fixed_run["stages"][0]["steps"]
    assert adaptive_run["stages"][0]["steps"] == shared and adaptive_run["curve"][:first_epochs] == fixed_run["curve"][:first_epochs]
    validation_rows = json.loads(Path(out, "preprocess", "manifest.json").read_text())["rows"]["validation"]
    final = fixed_run["curve"][-1][1]
    # within one standard error of the validation accuracy: a few rows of the digits, noise on the synthetic set
    target = final - (final * (1 - final) / validation_rows) ** 0.5
    if fixed_run["curve"][first_epochs - 1][1] >= target:
        raise RuntimeError(f"the shared first stage already reaches the fixed chain's final {final:.4f}: this set "
                           "saturates before the batch matters, so it measures nothing")

    def steps_to_target(run: dict[str, Any]) -> int | None:
        return next((steps - shared for steps, value in run["curve"][first_epochs:] if value >= target), None)

    fixed_steps, adaptive_steps = steps_to_target(fixed_run), steps_to_target(adaptive_run)
    assert fixed_steps is not None  # its own final value is within the target
    test_error = (fixed_run["test"] * (1 - fixed_run["test"]) / fixed_run["test_rows"]) ** 0.5
    test_ok = adaptive_run["test"] >= fixed_run["test"] - test_error
    ours = adaptive_steps if adaptive_steps is not None and test_ok else max(adaptive_run["steps"] - shared, fixed_steps)
    return {"fixed_steps": fixed_steps, "adaptive_steps": ours, "reached": adaptive_steps is not None,
            "ratio": ours / fixed_steps, "first_stage_steps": shared, "target_val": round(target, 4),
            "fixed_final_val": round(final, 4),
            "whole_chain_steps_to_target": {"fixed": fixed_steps + shared,
                                            "adaptive": None if adaptive_steps is None else adaptive_steps + shared},
            "total_steps": {"fixed": fixed_run["steps"], "adaptive": adaptive_run["steps"]},
            "test": {"fixed": round(fixed_run["test"], 4), "adaptive": round(adaptive_run["test"], 4),
                     "standard_error": round(test_error, 4), "adaptive_equal_or_better": test_ok},
            "wall_s": {"fixed": round(fixed_run["wall_s"], 2), "adaptive": round(adaptive_run["wall_s"], 2)},
            "stages": {"fixed": fixed_run["stages"], "adaptive": adaptive_run["stages"]}}


def adaptive_batch_steps(rows: int = 200_000) -> dict[str, Any]:
    """Optimizer steps the adaptive stages (train.batch_growth adaptive) take to reach the fixed schedule's final
    validation accuracy / the steps the fixed schedule's stages take, on the digits and on ``rows`` synthetic rows
    (noise 3.0: the classes overlap, so accuracy keeps climbing for a few epochs); the ratio is the worse set's.

    Both chains train the same stages, epochs and params in one process each and share their first stage (batch 32)
    bit for bit: the stages after it run at the demo's batch 128, or at the noise scale the stage before measured
    (clamped between their configured 128 and the set's max_global_batch); steps count from the end of the first stage. lr_rule sqrt on both sides:
    the linear rule's lr at a batch of thousands diverged on the synthetic set. Reaching the target means coming within
    one standard error of it on the validation split; an adaptive chain whose test accuracy is worse than the fixed
    one's by more than one standard error, or that never reaches the target, scores all its steps. Details keep each
    set's whole-chain steps (first stage included), both test accuracies, wall times and every stage's batch and lr.
    """
    params = {"lr": 0.05, "hidden": 128, "dropout": 0.0, "momentum": 0.9, "weight_decay": 0.0}
    # The digits' first stage runs 4 epochs (144 steps at batch 32): at 2 it took 13 measurements, 10 of them in its
    # first 20 steps, and at batch 32 (0.06 B_simple, docs/stages.md) the value it hands on is mostly noise.
    sets = {"digits": {"rows": None, "first_epochs": 4, "later": [6, 6, 6], "max_global_batch": 1024, "noise_every": 2},
            "synthetic": {"rows": rows, "first_epochs": 1, "later": [2, 2], "max_global_batch": 8192, "noise_every": 8,
                          "noise": 3.0}}
    results = {}
    for name, setting in sets.items():
        with tempfile.TemporaryDirectory(prefix=f"bench-adaptive-{name}-") as tmp:
            results[name] = _adaptive_vs_fixed(Path(tmp), params=params, **setting)
    worst = max(results, key=lambda name: results[name]["ratio"])
    return {"ours": float(results[worst]["adaptive_steps"]), "baseline": float(results[worst]["fixed_steps"]),
            "unit": f"optimizer steps after the first stage ({worst}, the worse set)",
            "details": {**results, "params": params, "lr_rule": "sqrt"}}
