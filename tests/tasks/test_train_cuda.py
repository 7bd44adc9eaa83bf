"""Stages on a GPU: the growing-batch hand-off and kill-and-resume both load optimizer state onto CUDA.

These run only where CUDA is present (skipped with the reason elsewhere, CI included: its machine has
no GPU). The CPU tests in training/test_loop.py pin the order that makes them pass: the model is on its
device before the optimizer loads a checkpoint's state.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stagewise import train
from stagewise.definitions.loading import load_config

REPO_ROOT = Path(__file__).resolve().parents[2]
CUDA = {f"profiles.{name}.device": "cuda" for name in ("ddp1", "ddp2")}
ONE_GPU = {**CUDA, "profiles.ddp2.processes_per_node": 1}  # s2 still grows the batch: 64 per process vs s1's 32
PARAMS = {"lr": 0.05, "hidden": 64, "momentum": 0.9}

pytestmark = [pytest.mark.gpu, pytest.mark.torchrun,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU stage tests need one")]


@pytest.fixture
def single_process(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", train.FAULT_ENV):
        monkeypatch.delenv(name, raising=False)


def test_second_stage_starts_from_the_first_on_the_gpu(digits_run, single_process, tmp_path):
    """s1 trains on cuda and hands final.pt (SGD momentum included) to s2, which keeps training on cuda."""
    config_path, out = digits_run
    config = load_config(config_path, ONE_GPU)
    first = train.run_stage(config, "s1", out, PARAMS, None)
    second = train.run_stage(config, "s2", out, PARAMS, first["checkpoint_uri"])
    assert second["global_batch"] > first["global_batch"] and second["steps"] > 0
    assert second["val_metric"] > 0.9, "s2 should keep learning from s1's model"
    state = torch.load(second["checkpoint_uri"], weights_only=True)
    assert state["previous_global_batch"] == first["global_batch"]
    # The optimizer goes on as a sharded checkpoint final.pt names: read it back as one torch file.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(state["optimizer"]["sharded_checkpoint"], tmp_path / "optimizer.pt")
    handed = torch.load(tmp_path / "optimizer.pt", weights_only=True)["optimizer"]
    momentum = [buffer["momentum_buffer"] for buffer in handed["state"].values()]
    assert momentum and all(torch.isfinite(m).all() for m in momentum)


def _torchrun(config: Path, out: str, env: dict, result_name: str) -> subprocess.CompletedProcess:
    overrides = [f"--override={key}={json.dumps(value)}" for key, value in ONE_GPU.items()]
    command = [sys.executable, "-m", "stagewise.training.local_torchrun", "--nproc-per-node=1", "-m", "stagewise.train",  # as the launcher runs it
               "--config", str(config), "--stage", "s1", "--out", out, "--params", json.dumps(PARAMS),
               "--override=train.checkpoint_every_steps=10", "--override=train.stages.0.epochs=3", *overrides,
               "--override=train.stages.0.tf32=false",  # resume is tested, not precision: exact float32 matmuls
               "--result-file", str(Path(out) / result_name)]
    return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_killed_gpu_stage_resumes_from_its_checkpoint(digits_run, subprocess_env, tmp_path):
    """A rank SIGKILLed at step 25 on cuda; the retry loads the step-20 checkpoint onto the GPU and ends like a clean run."""
    config, out = digits_run
    reference_out = str(tmp_path / "reference")
    os.makedirs(f"{reference_out}/preprocess")
    shutil.copy(f"{out}/preprocess/manifest.json", f"{reference_out}/preprocess/manifest.json")
    faulty = {**subprocess_env, train.FAULT_ENV: "0:25"}
    crashed = _torchrun(config, out, faulty, "crashed.json")
    assert crashed.returncode != 0
    resumed = _torchrun(config, out, faulty, "resumed.json")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    result = json.loads(Path(out, "resumed.json").read_text())
    assert result["resumed_from_step"] == 20
    clean = _torchrun(config, reference_out, subprocess_env, "clean.json")
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    reference = json.loads(Path(reference_out, "clean.json").read_text())
    assert result["steps"] == reference["steps"]
    # Same batches and dropout masks; cuBLAS may sum in another order than the uninterrupted run.
    assert result["val_metric"] == pytest.approx(reference["val_metric"], abs=0.01)
    resumed_model = torch.load(Path(out, "train", "s1", "final.pt"), weights_only=True)["model"]
    clean_model = torch.load(Path(reference_out, "train", "s1", "final.pt"), weights_only=True)["model"]
    for name, tensor in clean_model.items():
        torch.testing.assert_close(resumed_model[name], tensor, rtol=1e-3, atol=1e-4)


def test_sweep_trials_train_on_the_gpu(digits_run, single_process):
    """A sweep worker on a cuda profile runs its trials on the device and the study gets real values."""
    pytest.importorskip("optuna")
    from stagewise.study.studies import create
    from stagewise.study.summary import summarize
    from stagewise.sweep import run_worker

    config_path, out = digits_run
    config = load_config(config_path, {"profiles.small.device": "cuda", "sweep.num_trials": 2, "sweep.num_workers": 1})
    create(config, "gpu")
    result = run_worker(config, "gpu", 0, out)
    summary = summarize(config, "gpu", out)
    assert result["trials_run"] == 2 and result["epochs_run"] > 0
    assert summary["n_complete"] >= 1 and summary["best_value"] > 0.5


# --- batches made on the device (stagewise.training.device_data) ----------------------------------------------------


def test_resident_and_streamed_batches_match_on_the_gpu(tmp_path):
    """On cuda both placements yield the same device batches (CUDA randperm, side-stream copies from pinned memory),
    each of the rank's rows once per epoch, and a mid-epoch resume gives the remaining batches."""
    from stagewise.datasets.loader import ParquetBatches
    from stagewise.training.device_data import DeviceBatches
    from tests.tasks.test_loader import FEATURES, _write

    uris, rows = _write(lambda name: (str(tmp_path / name), open(tmp_path / name, "wb")), [(240, 8), (160, 8)])
    source = ParquetBatches(uris, FEATURES, "label", rank=0, world_size=1, batch_size=16, seed=4)
    chunk_bytes = 50 * (4 * len(FEATURES) + 8)  # several chunks, batches spanning them
    resident = DeviceBatches(source, "cuda", resident=True, chunk_bytes=chunk_bytes)
    streamed = DeviceBatches(source, "cuda", resident=False, chunk_bytes=chunk_bytes)
    for epoch in range(2):
        ours = [(x.cpu(), y.cpu()) for x, y in resident.epoch(epoch)]
        theirs = list(streamed.epoch(epoch))
        assert all(x.is_cuda and y.is_cuda for x, y in theirs)
        assert len(ours) == len(theirs) == source.steps_per_epoch(epoch) == rows // 16
        for (x, y), (sx, sy) in zip(ours, theirs):
            assert torch.equal(x, sx.cpu()) and torch.equal(y, sy.cpu())
        ids = torch.cat([x[:, 0] for x, _ in ours]).long().tolist()
        assert sorted(ids) == list(range(rows))
        tail = [(x.cpu(), y.cpu()) for x, y in streamed.epoch(epoch, skip_steps=7)]
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(tail, ours[7:]))
        assert len(tail) == len(ours) - 7


def test_auto_placement_on_the_gpu_keeps_a_small_split_resident(digits_run):
    """auto on cuda: the digits fit easily, so train and validation batches are resident device batches."""
    from stagewise.core import storage
    from stagewise.datasets.manifest import read_manifest
    from stagewise.training.device_data import DeviceBatches
    from stagewise.training.distributed import DistEnv
    from stagewise.training.loop import rank_batches

    manifest = read_manifest(storage.join(digits_run[1], "preprocess", "manifest.json"))
    env = DistEnv(rank=0, local_rank=0, world_size=1, device="cuda:0")
    found = rank_batches(manifest, env, batch_size=32, seed=0, too_few_rows=str)
    assert all(isinstance(b, DeviceBatches) and b.resident for b in found)
    inputs, labels = next(iter(found[0].epoch(0)))
    assert inputs.device.type == labels.device.type == "cuda"


# Each GPU knob of a stage; every one trains with the noise scale on (the default) and off.
KNOBS = {
    "host": {"train.stages.0.data_placement": "host"},
    "resident": {"train.stages.0.data_placement": "resident"},
    "streamed": {"train.stages.0.data_placement": "streamed"},
    "bf16": {"train.stages.0.precision": "bf16"},
    "fp16": {"train.stages.0.precision": "fp16", "train.stages.0.grad_clip_norm": 1.0},
    "reduce-overhead": {"train.stages.0.compile": "reduce-overhead"},
    "reduce-overhead-accumulating": {"train.stages.0.compile": "reduce-overhead", "train.stages.0.grad_accum_steps": 2,
                                     "train.stages.0.per_process_batch": 16},
}


def _assert_measured(handed: dict, result: dict, measured: bool) -> None:
    """The handed-on checkpoint holds the noise scale's measurements (finite ones) when it was on, and none when off;
    the stage's value is theirs. A two-epoch digits stage's smoothed tr(Σ) can end below zero (2 of 16 seeds on the
    CPU): then there is no value, and the reason says so."""
    from stagewise.training.batch_growth import handed_noise_scale

    value, why = handed_noise_scale(handed)
    if not measured:
        assert not handed.get("noise_scale") and result["noise_scale"] is None
        return
    assert handed["noise_scale"]["updates"] > 0 and (value is not None or "not both positive" in why), why
    assert result["noise_scale"] == (None if value is None else pytest.approx(value))


@pytest.mark.parametrize("noise_scale", [True, False], ids=["noise-scale", "no-noise-scale"])
@pytest.mark.parametrize("knob", list(KNOBS))
def test_gpu_stage_knobs_train_and_checkpoints_load_into_a_plain_model(digits_run, single_process, knob, noise_scale):
    """Each placement, precision and overhead knob trains a stage on cuda, with the noise scale measured (a value at the
    end) or not, and final.pt loads into an uncompiled fp32 model. compile reduce-overhead replays CUDA graphs: the
    noise scale's two forwards per step crashed there ('accessing tensor output of CUDAGraphs that has been overwritten
    by a subsequent run'), as gradient accumulation would."""
    from stagewise.models.building import build
    from stagewise.models.mlp import MLPClassifier
    from stagewise.spec import DataInfo

    config_path, out = digits_run
    config = load_config(config_path, {**ONE_GPU, **KNOBS[knob], "train.noise_scale": noise_scale,
                                       "train.noise_scale_every_steps": 2})
    result = train.run_stage(config, "s1", out, PARAMS, None)
    assert result["val_metric"] > 0.9
    _assert_measured(torch.load(result["checkpoint_uri"], weights_only=True), result, noise_scale)
    # cuda_graph auto: the step is captured and replayed on every placement in fp32 and bf16, eager otherwise.
    assert result["step_graph"]["captured"] == (knob in ("host", "resident", "streamed", "bf16")), result["step_graph"]
    state = torch.load(result["checkpoint_uri"], weights_only=True)["model"]
    model = build(MLPClassifier(), DataInfo(features=[f"f{i}" for i in range(64)], num_classes=10),
                  {"hidden": PARAMS["hidden"], "dropout": 0.0})
    model.load_state_dict(state, strict=True)


def test_adaptive_batch_growth_grows_on_one_gpu(digits_run, single_process, caplog):
    """s1 on one GPU (device batches resident, as auto picks there) measures the noise scale, and the adaptive s2 trains
    at it, above s1's batch: before, one process measured none, s2 stayed at s1's batch and nothing warned."""
    config_path, out = digits_run
    # Four epochs, as the demo's first stage: at two, its few measurements can end with no positive estimate.
    config = load_config(config_path, {**ONE_GPU, "train.batch_growth": "adaptive", "train.max_global_batch": 512,
                                       "train.noise_scale_every_steps": 2, "train.stages.0.epochs": 4})
    first = train.run_stage(config, "s1", out, PARAMS, None)
    _assert_measured(torch.load(first["checkpoint_uri"], weights_only=True), first, True)
    assert first["noise_scale"] is not None, "the one GPU process measured the noise scale, but none was positive"
    with caplog.at_level("WARNING", logger="stagewise.train"):
        second = train.run_stage(config, "s2", out, PARAMS, first["checkpoint_uri"])
    decision = second["batch_decision"]
    assert decision["noise_scale"] == pytest.approx(first["noise_scale"]) and decision["no_measurement"] is None
    assert second["global_batch"] > first["global_batch"] and second["val_metric"] > 0.5
    assert "received no noise scale" not in caplog.text


# --- the captured step (stagewise.training.step_graph) and TF32 ---------------------------------------------------------


def _cuda_loop(digits_run, **knobs):
    """A one-process loop on cuda:0 over the digits, resident, built as a stage builds it (seeded: the same init)."""
    from stagewise.core import storage
    from stagewise.datasets.manifest import read_manifest
    from stagewise.training.distributed import DistEnv
    from stagewise.training.loop import rank_batches, start_loop

    config_path, out = digits_run
    config = load_config(config_path, ONE_GPU)
    manifest = read_manifest(storage.join(out, "preprocess", "manifest.json"))
    env = DistEnv(rank=0, local_rank=0, world_size=1, device="cuda:0")
    train_data, validation = rank_batches(manifest, env, batch_size=32, seed=0, too_few_rows=str, placement="resident")
    torch.manual_seed(0)
    return start_loop(config, manifest, env, PARAMS, train_data, validation, seed=0, **knobs)[1]


@pytest.fixture
def tf32_switches():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize(("clip", "noise_every"), [(None, 0), (1.0, 4)], ids=["plain", "clipped-noise-scale"])
def test_the_captured_step_trains_along_the_eager_steps_trajectory(digits_run, tf32_switches, clip, noise_every):
    """Three epochs with the step captured and replayed (after 3 warm-up steps; clipping in the graph; noise-scale
    measured steps eager between replays) follow the eager loop's losses, validation and weights: the same kernels in
    another launch, so equal up to float32 summation order (TF32 off, dropout 0, the same seed and batches)."""
    knobs = {"tf32": False, "grad_clip_norm": clip, "noise_scale_every": noise_every}
    eager = _cuda_loop(digits_run, cuda_graph="off", **knobs)
    eager_results = [eager.train_epoch(lambda step: 0.05) for _ in range(3)]
    graphed = _cuda_loop(digits_run, cuda_graph="on", **knobs)
    assert graphed.step_graph is not None, graphed.graph_reason
    results = [graphed.train_epoch(lambda step: 0.05) for _ in range(3)]
    assert graphed.step_graph is not None and graphed.step_graph.captured
    assert graphed.step_graph.replays > results[-1].steps // 2
    for ours, theirs in zip(results, eager_results):
        assert ours.train_loss == pytest.approx(theirs.train_loss, rel=1e-3)
        assert ours.val_metric == pytest.approx(theirs.val_metric, abs=0.02)
        if clip is not None:
            assert ours.grad_norm == pytest.approx(theirs.grad_norm, rel=1e-3)
    assert results[-1].val_metric > 0.9 and (results[-1].noise_scale is not None) == bool(noise_every)
    theirs = eager.module.state_dict()
    for name, tensor in graphed.module.state_dict().items():
        torch.testing.assert_close(tensor, theirs[name], rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("cuda_graph", ["on", "off"])
def test_no_step_waits_for_the_gpu_between_checks(digits_run, monkeypatch, cuda_graph):
    """After the warm-up and the capture, steps with clipping and noise-scale measurements run under
    torch.cuda.set_sync_debug_mode('error') until the epoch's check: no step reads a device value on the host, on the
    captured path and on the eager one (tests/tasks/training/test_step_graph.py counts host reads on the CPU)."""
    from stagewise.training.loop import Loop

    loop = _cuda_loop(digits_run, cuda_graph=cuda_graph, grad_clip_norm=1.0, noise_scale_every=3)

    def quiet(function):
        def run(*args, **kwargs):
            torch.cuda.set_sync_debug_mode(0)
            return function(*args, **kwargs)
        return run

    for name in ("check_finite", "validation_totals"):
        monkeypatch.setattr(Loop, name, quiet(getattr(Loop, name)))
    watched: list[int] = []

    def on_step(current):
        if current.position.step == 10:
            assert cuda_graph == "off" or current.step_graph.captured
            torch.cuda.set_sync_debug_mode("error")
        if torch.cuda.get_sync_debug_mode():
            watched.append(current.position.step)

    try:
        result = loop.train_epoch(lambda step: 0.05, on_step=on_step)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(watched) >= 15 and result.steps == watched[-1] and result.grad_norm is not None


def test_tf32_follows_the_stage_knob(digits_run, tf32_switches):
    """tf32 true (the default) turns TensorFloat-32 on for float32 matmuls and cuDNN, false turns it off; on a GPU that
    has it (compute capability 8+) a float32 matmul then rounds like TF32 (errors ~1e-3) or like float32 (~1e-6)."""
    errors = {}
    a, b = torch.randn(1024, 1024, device="cuda"), torch.randn(1024, 1024, device="cuda")
    exact = (a.double() @ b.double()).float()
    for enabled in (False, True):
        _cuda_loop(digits_run, tf32=enabled)
        assert torch.backends.cuda.matmul.allow_tf32 is enabled and torch.backends.cudnn.allow_tf32 is enabled
        assert torch.get_float32_matmul_precision() == ("high" if enabled else "highest")
        errors[enabled] = float((a @ b - exact).abs().max())
    if torch.cuda.get_device_capability()[0] >= 8:
        assert errors[True] > 10 * errors[False], errors


@pytest.mark.parametrize(("knobs", "why"), [
    ({"precision": "fp16"}, "fp16's gradient scaler"),
    ({"grad_accum_steps": 2}, "2 gradient accumulation steps"),
    ({"compile_mode": "default"}, "compile default runs the forward through torch.compile"),
    ({"cuda_graph": "off"}, "cuda_graph off"),
])
def test_a_gpu_stage_steps_eagerly_where_capture_is_not_safe_and_says_why(digits_run, caplog, knobs, why):
    with caplog.at_level("INFO", logger="stagewise.train"):
        loop = _cuda_loop(digits_run, **{"cuda_graph": "auto", **knobs})
    assert loop.step_graph is None and why in loop.graph_reason
    said = [r.getMessage() for r in caplog.records if "training step" in r.getMessage()]
    assert said == ([] if knobs.get("cuda_graph") == "off" else [f"training step: eager, no CUDA graph ({loop.graph_reason})"])


_CAPTURE_FAILS = r"""
import json, logging, sys

import torch

from stagewise.core import storage
from stagewise.datasets.manifest import read_manifest
from stagewise.models.building import build, data_info
from stagewise.models.mlp import MLPClassifier
from stagewise.training.distributed import DistEnv
from stagewise.training.loop import Loop, rank_batches
from stagewise.training.optimizers import make_optimizer

logging.basicConfig(level=logging.INFO)


class ReadsTheLoss(MLPClassifier):
    static_shapes = True  # wrongly: its loss reads a value on the host, which a capture cannot

    def loss(self, outputs, targets):
        loss = super().loss(outputs, targets)
        assert loss.item() >= 0
        return loss


manifest = read_manifest(storage.join(sys.argv[1], "preprocess", "manifest.json"))
env = DistEnv(rank=0, local_rank=0, world_size=1, device="cuda:0")
train, validation = rank_batches(manifest, env, batch_size=32, seed=0, too_few_rows=str, placement="resident")
params = {"lr": 0.05, "hidden": 64, "dropout": 0.0, "momentum": 0.9, "weight_decay": 0.0}
spec = ReadsTheLoss()
torch.manual_seed(0)
model = build(spec, data_info(manifest), params).to(env.device)
loop = Loop(model=model, optimizer=make_optimizer(model, params), env=env, train=train, validation=validation, spec=spec,
            seed=0, cuda_graph="on", noise_scale_every=8)
assert loop.step_graph is not None, loop.graph_reason
results = [loop.train_epoch(lambda step: 0.05) for _ in range(2)]
torch.cuda.synchronize()
print(json.dumps({"graph": loop.step_graph is not None, "reason": loop.graph_reason, "val": results[-1].val_metric,
                  "steps": results[-1].steps}))
"""


def test_a_step_that_cannot_be_captured_falls_back_to_eager_and_trains(digits_run, subprocess_env):
    """A spec that declares static_shapes but reads its loss on the host (.item()) fails its capture: the stage warns
    once, steps eagerly from then on and trains to the end on the same CUDA context (in its own process, so a broken
    context could not spill into the other tests)."""
    done = subprocess.run([sys.executable, "-c", _CAPTURE_FAILS, digits_run[1]], cwd=REPO_ROOT, env=subprocess_env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    assert not outcome["graph"] and outcome["reason"].startswith("the capture failed"), outcome
    assert outcome["val"] > 0.9 and outcome["steps"] > 0
    assert done.stderr.count("the CUDA graph capture failed") == 1, done.stderr[-3000:]


def test_a_sharded_bf16_stage_trains_on_one_gpu_and_hands_on_a_full_model(digits_run, single_process):
    """strategy fsdp on one GPU (NCCL, a group of one), bf16 parameters with fp32 reduction, clipped, from s1's model:
    trains, checkpoints its shard, hands on a full fp32 model, and its peak device memory is recorded."""
    from stagewise.models.bundle import load_bundle

    config_path, out = digits_run
    config = load_config(config_path, ONE_GPU)
    first = train.run_stage(config, "s1", out, PARAMS, None)
    sharded = load_config(config_path, {**ONE_GPU, "train.stages.1.strategy": "fsdp", "train.stages.1.precision": "bf16",
                                        "train.stages.1.grad_clip_norm": 1.0})
    torch.cuda.reset_peak_memory_stats()
    second = train.run_stage(sharded, "s2", out, PARAMS, first["checkpoint_uri"])
    assert second["strategy"] == "fsdp" and second["val_metric"] > 0.9 and second["steps"] > 0
    bundle = load_bundle(second["model_uri"])
    assert all(t.dtype == torch.float32 and t.device.type == "cpu" for t in bundle.module.state_dict().values())
    assert Path(out, "train", "s2", "checkpoints", "latest.json").exists()
    print(f"fsdp bf16 one GPU: {second['val_metric']:.4f} val accuracy, peak "
          f"{torch.cuda.max_memory_allocated() / 2**20:.1f} MiB allocated")


def test_metric_states_on_the_gpu_equal_the_cpus():
    """Confusion counts, log-odds histograms and sums are built on the device and reduced as float64: every built-in
    metric computed from CUDA states equals the CPU's (counts exactly; log_loss and the curves to rounding)."""
    from stagewise.definitions.metric_names import CLASSIFICATION
    from stagewise.definitions.metrics import classification_metrics
    from stagewise.training.validation import MetricTotals

    generator = torch.Generator().manual_seed(0)
    logits, targets = torch.randn(5000, 4, generator=generator) * 3, torch.randint(0, 4, (5000,), generator=generator)
    values = {}
    for device in ("cpu", "cuda"):
        totals = MetricTotals("spec")
        for start in range(0, 5000, 777):
            outputs, labels = logits[start:start + 777].to(device), targets[start:start + 777].to(device)
            totals.add(classification_metrics(outputs, labels, CLASSIFICATION), len(labels), torch.tensor(0.0, device=device), device)
        values[device] = totals.values()
    for name in CLASSIFICATION:
        assert values["cuda"][name] == pytest.approx(values["cpu"][name], abs=1e-9 if name != "auprc" else 1e-6), name


def test_a_gpu_stage_hands_on_its_best_epoch_by_a_curve_metric(digits_run, single_process):
    """A stage on cuda whose objective is the one-vs-rest auroc: every epoch records the new metrics, and the epoch
    handed on is the best auroc."""
    config_path, out = digits_run
    config = load_config(config_path, {**ONE_GPU, "objective.metric": "auroc", "registry.gate_metric": "test_auroc",
                                       "evaluate.min_test_accuracy": 0.0})
    result = train.run_stage(config, "s1", out, PARAMS, None)
    history = json.loads((Path(out) / "train" / "s1" / "metrics.json").read_text())["history"]
    values = [entry["val_metrics"]["auroc"] for entry in history]
    assert all({"f1_macro", "log_loss", "auprc"} <= set(entry["val_metrics"]) for entry in history)
    assert result["handed_epoch"] == values.index(max(values)) + 1 and max(values) > 0.95
