"""Training: LR scaling and warmup, per-rank data partition (stagewise.datasets.loader), the loop, params, and a whole stage in-process."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from stagewise import train
from stagewise.core import storage
from stagewise.core.errors import UserError
from stagewise.core.storage import stage_prefix
from stagewise.datasets.columns import Columns, feature_vectors, processed_schema
from stagewise.datasets.loader import ParquetBatches
from stagewise.definitions.config import LRSchedule
from stagewise.definitions.hyperparams import FRAMEWORK_DEFAULTS
from stagewise.definitions.loading import load_config
from stagewise.definitions.spec import ModelSpec
from stagewise.models.building import build, resolve_params
from stagewise.models.bundle import load_bundle
from stagewise.models.mlp import MLPClassifier
from stagewise.spec import DataInfo
from stagewise.training.distributed import DistEnv
from stagewise.training.loop import Loop, seed_step
from stagewise.training.lr_schedule import scaled_lr, schedule_factor, stage_lr, warmup_factor

CPU = DistEnv(rank=0, local_rank=0, world_size=1, device="cpu")


# --- learning-rate rules ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("global_batch,base_batch", [(32, 32), (128, 32), (16, 64), (1024, 32)])
def test_scaled_lr_rules(global_batch, base_batch):
    """linear scales lr by the batch ratio, sqrt by its square root, none keeps it; all agree at the base batch."""
    ratio = global_batch / base_batch
    assert scaled_lr(0.1, global_batch, base_batch, "linear") == pytest.approx(0.1 * ratio)
    assert scaled_lr(0.1, global_batch, base_batch, "sqrt") == pytest.approx(0.1 * math.sqrt(ratio))
    assert scaled_lr(0.1, global_batch, base_batch, "none") == pytest.approx(0.1)


def test_unknown_lr_rule_is_a_user_error():
    """A rule other than linear/sqrt/none is bad config, named in the message."""
    with pytest.raises(UserError, match="cubic"):
        scaled_lr(0.1, 64, 32, "cubic")


@pytest.mark.parametrize("warmup_steps", [1, 5, 20])
def test_warmup_ramps_linearly_and_reaches_one(warmup_steps):
    """The factor rises strictly from 1/warmup to 1 at the last warmup step, then stays 1."""
    factors = [warmup_factor(step, warmup_steps) for step in range(warmup_steps + 10)]
    assert factors[0] == pytest.approx(1 / warmup_steps)
    assert all(a < b for a, b in zip(factors[:warmup_steps], factors[1:warmup_steps]))
    assert factors[warmup_steps - 1] == 1.0
    assert all(f == 1.0 for f in factors[warmup_steps:])


def test_a_stages_warmup_starts_at_the_lr_the_stage_before_ended_at():
    """Goyal et al.'s gradual warmup across a hand-off: the first step trains at about the stage before's lr (never
    below it), rising linearly to this stage's own lr by the end of the warmup; a stage before at a higher lr than this
    one's means no warmup at all."""
    lr_at = stage_lr(0.4, warmup_steps=10, schedule=LRSchedule(), spec=ModelSpec(), total_steps=100,
                     steps_per_epoch=10, warmup_from=0.1)
    ramp = [lr_at(step) for step in range(12)]
    assert ramp[0] == pytest.approx(0.1 + 0.3 / 10) and ramp[9] == ramp[10] == pytest.approx(0.4)
    assert all(0.1 <= a < b for a, b in zip(ramp[:9], ramp[1:10]))
    assert warmup_factor(0, 10, start=1.0) == 1.0


def test_a_grown_stage_warms_up_from_the_stage_before_within_a_quarter_of_its_steps(digits_run, single_process):
    """s2 (a bigger batch) after s1: its warmup starts at s1's last lr, recorded in its result, and takes at most a
    quarter of s2's steps however many warmup_steps the stage asks for."""
    config_path, out = digits_run
    config = load_config(config_path, overrides={"train.stages.1.warmup_steps": 100000})
    first = train.run_stage(config, "s1", out, PARAMS, None)
    second = train.run_stage(config, "s2", out, PARAMS, first["checkpoint_uri"])
    s1_history = storage.read_json(storage.join(stage_prefix(out, "s1"), "metrics.json"))["history"]
    assert second["warmup_from_lr"] == s1_history[-1]["lr"] and 0 < second["warmup_steps"] <= second["steps"] // 4
    rows = second["rows_per_epoch"]
    assert rows["train"] - second["per_process_batch"] < rows["trained"] <= rows["train"], "less than a batch left out"


def test_no_warmup_means_full_lr_from_the_first_step():
    """warmup_steps = 0 applies the full learning rate at once."""
    assert [warmup_factor(step, 0) for step in range(3)] == [1.0, 1.0, 1.0]


# --- schedules after warmup --------------------------------------------------------------------------------------


def _curve(schedule: LRSchedule, *, warmup: int = 0, total: int = 100, per_epoch: int = 10) -> list[float]:
    return [schedule_factor(schedule, step, warmup_steps=warmup, total_steps=total, steps_per_epoch=per_epoch)
            for step in range(total)]


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_cosine_and_linear_hold_through_warmup_then_fall_to_the_floor_by_the_last_step(kind):
    """1 through warmup, then falling without a rise to min_lr_ratio at the stage's last step; cosine is flat at both
    ends (its midpoint halfway to the floor), linear falls evenly."""
    curve = _curve(LRSchedule(type=kind, min_lr_ratio=0.1), warmup=10, total=110)
    assert curve[:11] == [1.0] * 11 and all(a >= b for a, b in zip(curve, curve[1:]))
    assert curve[-1] == pytest.approx(0.1 + 0.9 * (0.5 * (1 + math.cos(math.pi * 99 / 100)) if kind == "cosine" else 0.01))
    assert schedule_factor(LRSchedule(type=kind, min_lr_ratio=0.1), 110, warmup_steps=10, total_steps=110,
                           steps_per_epoch=10) == pytest.approx(0.1)
    assert curve[60] == pytest.approx(0.55), "halfway after warmup: halfway to the floor"


def test_step_decay_multiplies_by_gamma_every_step_epochs_down_to_the_floor():
    """Epochs 0-1 at 1, 2-3 at 0.5, 4-5 at 0.25, then the floor 0.2."""
    curve = _curve(LRSchedule(type="step", gamma=0.5, step_epochs=2, min_lr_ratio=0.2), total=80, per_epoch=10)
    assert [curve[epoch * 10] for epoch in range(8)] == [1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.2, 0.2]


def test_constant_is_todays_behaviour():
    assert set(_curve(LRSchedule())) == {1.0}


class _OwnSchedule(MLPClassifier):
    """A spec with its own schedule: half the lr for the second half of the stage."""

    def lr_schedule(self, step: int, total_steps: int) -> float | None:
        return 1.0 if step < total_steps // 2 else 0.5


class _BadSchedule(MLPClassifier):
    def lr_schedule(self, step: int, total_steps: int) -> float | None:
        return -1.0


def test_a_specs_own_schedule_replaces_the_configs_and_composes_with_rescale_and_warmup():
    """stage_lr = rescaled lr x warmup x (the spec's factor, else the config's); a negative factor names the spec."""
    lr_at = stage_lr(0.4, warmup_steps=4, schedule=LRSchedule(type="cosine"), spec=_OwnSchedule(), total_steps=20,
                     steps_per_epoch=5)
    assert [lr_at(step) for step in (0, 3, 9, 10, 19)] == pytest.approx([0.1, 0.4, 0.4, 0.2, 0.2])
    config_curve = stage_lr(0.4, warmup_steps=0, schedule=LRSchedule(type="linear"), spec=MLPClassifier(),
                            total_steps=20, steps_per_epoch=5)
    assert config_curve(0) == pytest.approx(0.4) and config_curve(10) == pytest.approx(0.2)
    with pytest.raises(UserError, match=r"_BadSchedule.lr_schedule\(3, 20\) gave -1.0"):
        stage_lr(0.4, warmup_steps=0, schedule=LRSchedule(), spec=_BadSchedule(), total_steps=20, steps_per_epoch=5)(3)


# --- per-rank data (stagewise.datasets.loader): what Loop trains on ----------------------------------------------------------


def _write_processed(path: Path, labels: np.ndarray, matrix: np.ndarray, num_classes: int, rows_per_group: int) -> str:
    """Write a split file in the schema preprocess declares for its outputs (whatever its feature layout)."""
    names = [f"x{j}" for j in range(matrix.shape[1])]
    columns = Columns(key="row_id", label="label", features=names, num_classes=num_classes)
    schema = processed_schema(columns, pa.int64())
    arrays = []
    for field in schema:
        if field.name == "row_id":
            arrays.append(pa.array(np.arange(len(labels), dtype=np.int64)))
        elif field.name == "label":
            arrays.append(pa.array(labels.astype(np.int64)))
        elif field.name in names:  # one column per feature
            arrays.append(pa.array(matrix[:, names.index(field.name)].astype(np.float32)))
        else:  # one packed vector column, encoded by preprocess itself
            arrays.append(feature_vectors(matrix.astype(np.float32)))
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_arrays(arrays, schema=schema), path, row_group_size=rows_per_group)
    return str(path)


def _indexed_split(tmp_path: Path, num_rows: int = 120, rows_per_group: int = 10, num_classes: int = 3) -> str:
    """A split whose single feature is the row number, so yielded batches reveal which rows they hold."""
    return _write_processed(tmp_path / "split" / "part-00000.parquet", np.arange(num_rows) % num_classes,
                            np.arange(num_rows, dtype=np.float32)[:, None], num_classes, rows_per_group)


def _rows(batches: ParquetBatches, epoch: int) -> list[int]:
    return [int(v) for inputs, _ in batches.epoch(epoch) for v in inputs[:, 0].tolist()]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ranks_get_disjoint_equal_parts_covering_the_split(tmp_path, world_size):
    """Each epoch: ranks' rows are disjoint, cover every row, and all ranks take the same number of steps."""
    uri = _indexed_split(tmp_path)  # 12 row groups of 10 rows: divisible by 1, 2 and 3 ranks
    ranks = [ParquetBatches([uri], ["x0"], "label", rank=r, world_size=world_size, batch_size=5, seed=11,
                            window_row_groups=4) for r in range(world_size)]
    for epoch in range(3):
        parts = [_rows(batches, epoch) for batches in ranks]
        assert len({len(part) for part in parts}) == 1, "equal lengths across ranks"
        assert len({batches.steps_per_epoch(epoch) for batches in ranks}) == 1
        assert len(parts[0]) == ranks[0].steps_per_epoch(epoch) * 5
        seen = [row for part in parts for row in part]
        assert len(seen) == len(set(seen)), "no row on two ranks or twice on one"
        assert set(seen) == set(range(120)), "the union covers the split"
        groups = [{(g.uri, g.index) for g in batches.assignment(epoch)} for batches in ranks]
        assert sum(len(g) for g in groups) == len(set().union(*groups)) == 12


def test_each_epoch_draws_a_new_order_and_a_seed_repeats_it(tmp_path):
    """Epochs differ in order; the same seed and epoch give the same order (what an exact resume needs)."""
    uri = _indexed_split(tmp_path)

    def make(seed: int) -> ParquetBatches:
        return ParquetBatches([uri], ["x0"], "label", rank=1, world_size=2, batch_size=4, seed=seed, window_row_groups=3)

    first, again = make(5), make(5)
    assert _rows(first, 0) != _rows(first, 1)
    assert _rows(first, 0) == _rows(again, 0) and _rows(first, 2) == _rows(again, 2)
    assert _rows(first, 0) != _rows(make(6), 0)


def test_skip_steps_resumes_mid_epoch_at_the_same_batch(tmp_path):
    """epoch(e, skip_steps=k) yields exactly the batches after the first k of epoch e."""
    uri = _indexed_split(tmp_path)
    batches = ParquetBatches([uri], ["x0"], "label", rank=0, world_size=1, batch_size=8, seed=2, window_row_groups=5)
    full = [inputs[:, 0].tolist() for inputs, _ in batches.epoch(1)]
    resumed = [inputs[:, 0].tolist() for inputs, _ in batches.epoch(1, skip_steps=4)]
    assert resumed == full[4:]


def test_fewer_row_groups_than_ranks_is_a_user_error(tmp_path):
    """A rank with no data would stall DDP: refused up front with a hint."""
    uri = _indexed_split(tmp_path, num_rows=20, rows_per_group=10)
    with pytest.raises(UserError, match="fewer than world size 3"):
        ParquetBatches([uri], ["x0"], "label", rank=0, world_size=3, batch_size=2, seed=0)


def test_unshuffled_evaluation_reads_every_row_in_order(tmp_path):
    """Validation batches keep every row (the last partial batch too) in file order."""
    uri = _indexed_split(tmp_path, num_rows=47, rows_per_group=10)
    batches = ParquetBatches([uri], ["x0"], "label", rank=0, world_size=1, batch_size=8, seed=0, shuffle=False)
    assert _rows(batches, 0) == list(range(47))


# --- the loop ---------------------------------------------------------------------------------------------------


def _blobs(tmp_path: Path, name: str, num_rows: int, seed: int) -> str:
    """Four well-separated Gaussian blobs in 2-D, as a split file with several row groups."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, num_rows)
    centres = np.array([[3.0, 3.0], [-3.0, 3.0], [3.0, -3.0], [-3.0, -3.0]])
    points = centres[labels] + rng.normal(0, 0.7, (num_rows, 2))
    return _write_processed(tmp_path / name / "part-00000.parquet", labels, points, 4, 50)


def _loop(tmp_path: Path, grad_accum_steps: int = 1) -> Loop:
    torch.manual_seed(0)
    model = build(MLPClassifier(), DataInfo(features=["x0", "x1"], num_classes=4), {"hidden": 16, "dropout": 0.0})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train_data = ParquetBatches([_blobs(tmp_path, "train", 600, 1)], ["x0", "x1"], "label", rank=0, world_size=1,
                                batch_size=16, seed=0)
    validation = ParquetBatches([_blobs(tmp_path, "validation", 200, 2)], ["x0", "x1"], "label", rank=0, world_size=1,
                                batch_size=64, seed=0, shuffle=False)
    return Loop(model=model, optimizer=optimizer, env=CPU, train=train_data, validation=validation, spec=MLPClassifier(),
                grad_accum_steps=grad_accum_steps, seed=0)


def test_single_process_loop_learns_a_separable_set(tmp_path):
    """A few epochs lift validation accuracy far above chance (0.25) and lower the training loss."""
    loop = _loop(tmp_path)
    results = [loop.train_epoch(lambda _step: 0.05) for _ in range(3)]
    assert results[-1].val_metric > 0.9 and results[-1].val_metrics["accuracy"] == results[-1].val_metric
    assert results[-1].train_loss < results[0].train_loss
    assert [r.epoch for r in results] == [0, 1, 2]
    assert results[-1].steps == sum(loop.steps_per_epoch(e) for e in range(3))
    assert loop.position.epoch == 3 and loop.position.micro_step == 0


def test_gradient_accumulation_takes_one_step_per_k_micro_batches(tmp_path):
    """With k accumulation steps an epoch takes ceil(micro-batches / k) optimizer steps; lr_at sees each step."""
    loop = _loop(tmp_path, grad_accum_steps=3)
    asked: list[int] = []
    result = loop.train_epoch(lambda step: asked.append(step) or 0.05)
    micro = loop.train_data.steps_per_epoch(0)
    assert result.steps == math.ceil(micro / 3) == loop.steps_per_epoch(0)
    assert set(range(result.steps)) <= set(asked)
    assert loop.global_batch == 16 * 3


def test_a_step_draws_the_masks_of_its_seed_without_torch_manual_seed(tmp_path, monkeypatch):
    """seed_step leaves the CPU generator where torch.manual_seed would (same dropout masks, so resume holds), and the
    loop never calls torch.manual_seed per step (it formats a stack trace per call: ~3% of a CPU step)."""
    torch.manual_seed(12345)
    expected = torch.rand(8)
    torch.manual_seed(0)
    seed_step(12345, "cpu")
    assert torch.equal(torch.rand(8), expected)
    loop = _loop(tmp_path)
    calls: list[int] = []
    monkeypatch.setattr(torch, "manual_seed", lambda seed: calls.append(seed))
    loop.train_epoch(lambda _step: 0.05)
    assert calls == []


# --- hyperparameters --------------------------------------------------------------------------------------------


def test_resolve_params_precedence(write_config):
    """Built-in defaults < train.default_params < the sweep's values; hidden becomes an int."""
    config = load_config(write_config(), overrides={"train.default_params": {"momentum": 0.5, "weight_decay": 0.01}})
    params = resolve_params(config, {"weight_decay": 0.02, "lr": 0.2, "hidden": 64.0})
    assert params["momentum"] == 0.5, "train.default_params beats the built-in default"
    assert params["weight_decay"] == 0.02 and params["lr"] == 0.2, "the sweep beats train.default_params"
    assert params["dropout"] == MLPClassifier.default_params["dropout"], "untouched keys keep the spec's default"
    assert params["hidden"] == 64 and isinstance(params["hidden"], int)
    assert resolve_params(config, {})["lr"] == FRAMEWORK_DEFAULTS["lr"]


@pytest.mark.parametrize("where", ["swept", "default_params"])
def test_unknown_param_is_a_user_error(write_config, where):
    """An unknown hyperparameter, from the sweep or from train.default_params, is refused by name."""
    overrides = {"train.default_params": {"gamma": 0.5}} if where == "default_params" else {}
    with pytest.raises(UserError, match="gamma"):
        config = load_config(write_config(), overrides=overrides)
        resolve_params(config, {"gamma": 0.5} if where == "swept" else {})


@pytest.mark.parametrize("name,value", [("lr", -0.05), ("hidden", 0), ("momentum", 5), ("dropout", 1.0),
                                        ("weight_decay", -1e-4), ("optimizer", "lion"), ("lr", "fast")])
def test_params_outside_their_domain_are_a_user_error(write_config, name, value):
    """--params (or a sweep's best) outside a hyperparameter's obvious domain is refused naming the key and value."""
    config = load_config(write_config())
    with pytest.raises(UserError, match=f"{name}={value!r} is out of range"):
        resolve_params(config, {name: value})


# --- a whole stage, one process, in-process ---------------------------------------------------------------------

PARAMS = {"lr": 0.05, "hidden": 32}


@pytest.fixture
def single_process(monkeypatch):
    """No torchrun variables: run_stage runs as a one-process job."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", train.FAULT_ENV):
        monkeypatch.delenv(name, raising=False)


def _files(root: str) -> set[str]:
    return {str(p) for p in Path(root).rglob("*") if p.is_file()}


def test_stage_writes_its_outputs_only_under_its_prefix(digits_run, storage_root, single_process):
    """A stage adds final.pt, model.pt, metrics.json (and checkpoints) under train/<stage>/ and nothing elsewhere."""
    config_path, out = digits_run
    config = load_config(config_path)
    before = _files(str(storage_root))
    result = train.run_stage(config, "s1", out, PARAMS, None)
    prefix = stage_prefix(out, "s1")
    added = _files(str(storage_root)) - before
    assert added and all(path.startswith(prefix + "/") for path in added)
    assert {"final.pt", "model.pt", "metrics.json"} <= {Path(p).name for p in added}
    assert result["checkpoint_uri"] == storage.join(prefix, "final.pt")
    metrics = storage.read_json(storage.join(prefix, "metrics.json"))
    assert metrics["complete"] is True and len(metrics["history"]) == config.stage("s1").epochs
    assert 0.0 <= result["val_metric"] <= 1.0 and result["world_size"] == 1
    # Checkpoints hold tensors and plain values only.
    state = torch.load(result["checkpoint_uri"], weights_only=True)
    assert state["global_batch"] == result["global_batch"] and set(state["model"]) == set(build(
        MLPClassifier(), DataInfo(features=[f"f{i}" for i in range(64)], num_classes=10), {"hidden": 32, "dropout": 0.0}
    ).state_dict())
    for path in added:
        if path.endswith(".pt"):
            torch.load(path, weights_only=True)
    bundle = load_bundle(result["model_uri"])
    model = bundle.module
    manifest = storage.read_json(storage.join(out, "preprocess", "manifest.json"))
    assert bundle.preprocessing["features"] == manifest["features"], "the bundle carries its normalisation"
    assert bundle.preprocessing["mean"] == manifest["mean"] and not model.training
    assert bundle.ref.path == "stagewise.model:MLPClassifier" and bundle.params["hidden"] == 32


def test_rerun_resumes_from_the_checkpoint_without_retraining(digits_run, single_process):
    """With a checkpoint at the last step, a second call resumes there: same result, no epoch trained again."""
    config_path, out = digits_run
    config = load_config(config_path, overrides={"train.checkpoint_every_steps": 1})
    first = train.run_stage(config, "s1", out, PARAMS, None)
    history = storage.read_json(storage.join(stage_prefix(out, "s1"), "metrics.json"))["history"]
    weights = torch.load(first["checkpoint_uri"], weights_only=True)["model"]
    second = train.run_stage(config, "s1", out, PARAMS, None)
    assert second["resumed_from_step"] == first["steps"] == second["steps"]
    again = storage.read_json(storage.join(stage_prefix(out, "s1"), "metrics.json"))["history"]
    assert len(again) == len(history)
    assert again[:-1] == history[:-1], "finished epochs come from the checkpoint, not from training again"
    assert again[-1]["val_metric"] == history[-1]["val_metric"]
    for name, tensor in torch.load(second["checkpoint_uri"], weights_only=True)["model"].items():
        assert torch.equal(tensor, weights[name])


def test_rerun_with_default_checkpointing_reproduces_the_result(digits_run, single_process):
    """A re-run of a finished stage (default checkpoint interval) ends with the same steps, metric and weights."""
    config_path, out = digits_run
    config = load_config(config_path)
    first = train.run_stage(config, "s1", out, PARAMS, None)
    weights = torch.load(first["checkpoint_uri"], weights_only=True)["model"]
    second = train.run_stage(config, "s1", out, PARAMS, None)
    assert second["steps"] == first["steps"] and second["val_metric"] == first["val_metric"]
    history = storage.read_json(storage.join(stage_prefix(out, "s1"), "metrics.json"))["history"]
    assert len(history) == config.stage("s1").epochs
    for name, tensor in torch.load(second["checkpoint_uri"], weights_only=True)["model"].items():
        torch.testing.assert_close(tensor, weights[name], rtol=1e-6, atol=1e-7)


def test_rerun_of_a_finished_stage_trains_no_step_again(digits_run, single_process):
    """Re-running a finished stage (Airflow retry after success, or a cleared task) resumes at its last step."""
    config_path, out = digits_run
    config = load_config(config_path)
    first = train.run_stage(config, "s1", out, PARAMS, None)
    second = train.run_stage(config, "s1", out, PARAMS, None)
    assert second["resumed_from_step"] == first["steps"]


def test_init_from_loads_the_previous_stage(digits_run, single_process):
    """s2 started from s1's final checkpoint begins with s1's weights and records s1's global batch."""
    config_path, out = digits_run
    config = load_config(config_path)
    first = train.run_stage(config, "s1", out, PARAMS, None)
    # A vanishing lr keeps s2's weights where they started, so they must equal s1's.
    second = train.run_stage(config, "s2", out, {**PARAMS, "lr": 1e-12}, first["checkpoint_uri"])
    start = torch.load(first["checkpoint_uri"], weights_only=True)
    end = torch.load(second["checkpoint_uri"], weights_only=True)
    assert end["previous_global_batch"] == first["global_batch"]
    assert second["global_batch"] > first["global_batch"]
    assert second["warmup_steps"] == min(config.stage("s2").warmup_steps, second["steps"] // 4), \
        "warmup applies when the batch grew, over at most a quarter of the stage"
    for name, tensor in start["model"].items():
        torch.testing.assert_close(end["model"][name], tensor, rtol=0, atol=1e-6)
    assert second["val_metric"] == pytest.approx(first["val_metric"], abs=0.02)


def test_a_stage_that_hands_on_no_optimizer_leaves_final_pt_with_the_model_alone(digits_run, single_process):
    """hand_on_optimizer: false: s1's final.pt holds the model and no optimizer state (none beside it either); s2 starts
    from that model with a fresh optimizer (the default hand-off is tested in tests/tasks/test_fsdp_handoff.py)."""
    config_path, out = digits_run
    config = load_config(config_path, overrides={"train.stages.0.hand_on_optimizer": False})
    first = train.run_stage(config, "s1", out, PARAMS, None)
    handed = torch.load(first["checkpoint_uri"], weights_only=True)
    assert "optimizer" not in handed and "best_epoch_state" not in handed
    assert not list(Path(stage_prefix(out, "s1")).glob("final-optimizer-*"))
    second = train.run_stage(config, "s2", out, {**PARAMS, "lr": 1e-12}, first["checkpoint_uri"])
    for name, tensor in handed["model"].items():
        torch.testing.assert_close(torch.load(second["checkpoint_uri"], weights_only=True)["model"][name], tensor,
                                   rtol=0, atol=1e-6)


def test_init_from_a_model_of_another_shape_is_a_user_error(digits_run, single_process):
    """Handing a stage a checkpoint whose layers do not fit fails as bad input naming the file."""
    config_path, out = digits_run
    config = load_config(config_path)
    first = train.run_stage(config, "s1", out, PARAMS, None)
    with pytest.raises(UserError, match="does not fit") as caught:
        train.run_stage(config, "s2", out, {**PARAMS, "hidden": 48}, first["checkpoint_uri"])
    assert first["checkpoint_uri"] in str(caught.value)


def test_unknown_stage_is_a_config_error(digits_run, single_process):
    """Asking for a stage not in train.stages names the known ones."""
    config_path, out = digits_run
    with pytest.raises(UserError, match="s9"):
        train.run_stage(load_config(config_path), "s9", out, PARAMS, None)


def test_state_is_loaded_only_after_the_model_is_on_its_device(digits_run, single_process, monkeypatch):
    """Hand-off and resume move the model to the stage's device before the optimizer loads state.

    Optimizer.load_state_dict puts momentum buffers on their parameters' device; loaded the other way
    round, a GPU stage keeps CPU buffers and its first step fails (seen on an H100).
    """
    config_path, out = digits_run
    config = load_config(config_path, overrides={"train.checkpoint_every_steps": 1})
    first = train.run_stage(config, "s1", out, PARAMS, None)
    events: list[str] = []
    original_to, original_load = torch.nn.Module.to, torch.optim.Optimizer.load_state_dict

    def recording_to(module, *args, **kwargs):
        if isinstance(module, torch.nn.Sequential):
            events.append(f"model.to({args[0] if args else kwargs})")
        return original_to(module, *args, **kwargs)

    def recording_load(optimizer, *args, **kwargs):  # DCP's set_optimizer_state_dict passes state_dict= by name
        events.append("optimizer.load_state_dict")
        return original_load(optimizer, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", recording_to)
    monkeypatch.setattr(torch.optim.Optimizer, "load_state_dict", recording_load)
    train.run_stage(config, "s2", out, PARAMS, first["checkpoint_uri"])  # hand-off
    assert "optimizer.load_state_dict" in events
    assert events.index("model.to(cpu)") < events.index("optimizer.load_state_dict"), events
    events.clear()
    train.run_stage(config, "s2", out, PARAMS, first["checkpoint_uri"])  # resume from s2's own checkpoint
    assert events.index("model.to(cpu)") < events.index("optimizer.load_state_dict"), events



def _finite(state_dict: dict) -> bool:
    return all(torch.isfinite(tensor).all() for tensor in state_dict.values() if tensor.is_floating_point())


def test_diverging_stage_fails_naming_stage_epoch_step_and_lr_and_writes_no_model(digits_run, single_process):
    """An absurd lr makes the loss NaN/inf: the stage fails as a user error naming stage, epoch, step and lr;
    no final.pt or model.pt is written and every checkpoint left on disk holds finite weights."""
    config_path, out = digits_run
    config = load_config(config_path, overrides={"train.checkpoint_every_steps": 1, "train.keep_checkpoints": 100})
    with pytest.raises(UserError) as caught:
        train.run_stage(config, "s1", out, {"lr": 1e6, "hidden": 32}, None)
    message = str(caught.value)
    assert "stage s1: training diverged" in message and "epoch 1, step " in message and "lr 1e+06" in message
    prefix = Path(stage_prefix(out, "s1"))
    assert not (prefix / "final.pt").exists() and not (prefix / "model.pt").exists()
    assert not (prefix / "metrics.json").exists() or not storage.read_json(str(prefix / "metrics.json")).get("complete")
    for checkpoint in prefix.glob("checkpoints/*.pt"):
        assert _finite(torch.load(checkpoint, weights_only=True)["model"]), f"{checkpoint} holds NaN/inf weights"


def test_divergence_is_caught_before_a_checkpoint_is_written(tmp_path):
    """With checks at the checkpoint interval, a loop whose loss turns NaN raises before on_step could save its state."""
    loop = _loop(tmp_path)
    loop.check_every_steps = 1
    saved: list[bool] = []
    with pytest.raises(UserError, match="training diverged") as caught:
        loop.train_epoch(lambda _step: 1e9, on_step=lambda current: saved.append(_finite(current.module.state_dict())))
    assert all(saved), "on_step (where checkpoints are written) never saw non-finite weights"
    assert caught.value.lr == 1e9 and caught.value.epoch == 1 and caught.value.step >= 1


KNOBS = {"train.stages.0.epochs": 5, "train.stages.0.lr_schedule": {"type": "cosine", "min_lr_ratio": 0.1},
         "train.stages.0.grad_clip_norm": 0.5, "train.checkpoint_every_steps": 1,
         # No epoch can beat the first by more than 1.0 accuracy: the stage stops after 1 + patience epochs.
         "train.stages.0.early_stopping": {"patience": 2, "min_delta": 1.0}}


def test_a_scheduled_clipped_stage_stops_early_and_hands_on_its_best_epoch(digits_run, single_process):
    """Cosine lr falls epoch by epoch, each epoch logs its pre-clip gradient norm, the stage stops after patience
    epochs without improvement, and what it hands on (final.pt, model.pt, the result) is its best epoch's."""
    config_path, out = digits_run
    config = load_config(config_path, overrides=KNOBS)
    result = train.run_stage(config, "s1", out, PARAMS, None)
    history = storage.read_json(storage.join(stage_prefix(out, "s1"), "metrics.json"))["history"]
    values = [entry["val_metric"] for entry in history]
    assert (result["epochs_run"], result["stopped_early"], len(history)) == (3, True, 3)
    assert all(a["lr"] > b["lr"] > 0.1 * result["lr"] for a, b in zip(history, history[1:]))
    assert all(entry["grad_norm"] > 0 for entry in history)
    best = values.index(max(values))
    assert result["handed_epoch"] == best + 1 and result["val_metric"] == values[best]
    final = torch.load(result["checkpoint_uri"], weights_only=True)
    last = torch.load(Path(stage_prefix(out, "s1")) / "checkpoints" / f"step-{result['steps']:09d}.pt", weights_only=True)
    assert "best_epoch_state" not in final, "the best epoch lives in its own file, not in the hand-off"
    kept = torch.load(last["best_epoch_state"]["uri"], weights_only=True)
    for name, tensor in final["model"].items():
        assert torch.equal(tensor, kept["model"][name])
        assert torch.equal(load_bundle(result["model_uri"]).module.state_dict()[name], tensor)
    # A retry after the stage finished decides alike from the checkpoint: no epoch again, the same epoch handed on.
    again = train.run_stage(config, "s1", out, PARAMS, None)
    assert (again["resumed_from_step"], again["handed_epoch"], again["stopped_early"]) == (result["steps"], best + 1, True)
    for name, tensor in torch.load(again["checkpoint_uri"], weights_only=True)["model"].items():
        assert torch.equal(tensor, final["model"][name])


def test_hand_on_last_hands_on_the_last_epoch(digits_run, single_process):
    """hand_on: last keeps the old behaviour: the last epoch's weights and metric, whatever came before."""
    config_path, out = digits_run
    config = load_config(config_path, overrides={**KNOBS, "train.stages.0.hand_on": "last"})
    result = train.run_stage(config, "s1", out, PARAMS, None)
    history = storage.read_json(storage.join(stage_prefix(out, "s1"), "metrics.json"))["history"]
    assert result["handed_epoch"] == len(history) and result["val_metric"] == history[-1]["val_metric"]
    last = torch.load(Path(stage_prefix(out, "s1")) / "checkpoints" / f"step-{result['steps']:09d}.pt", weights_only=True)
    for name, tensor in torch.load(result["checkpoint_uri"], weights_only=True)["model"].items():
        assert torch.equal(tensor, last["model"][name])


def test_an_fp16_stage_resumed_mid_way_ends_exactly_where_an_uninterrupted_one_does(digits_run, single_process):
    """fp16 autocast with its gradient scaler, cosine, clipping and the best epoch: a retry resuming from a checkpoint
    half-way (the scaler's scale and growth tracker come back from it) ends with the same weights, history and epoch
    handed on as the run that was never interrupted."""
    config_path, out = digits_run
    config = load_config(config_path, overrides={
        "train.stages.0.epochs": 3, "train.stages.0.precision": "fp16", "train.stages.0.grad_clip_norm": 1.0,
        "train.stages.0.lr_schedule": {"type": "cosine"}, "train.checkpoint_every_steps": 7, "train.keep_checkpoints": 1000})
    prefix = Path(stage_prefix(out, "s1"))
    clean = train.run_stage(config, "s1", out, PARAMS, None)
    clean_history = storage.read_json(str(prefix / "metrics.json"))["history"]
    clean_final = torch.load(clean["checkpoint_uri"], weights_only=True)
    assert clean_final["grad_scaler"]["scale"] > 0, "the scaler's state is in the checkpoint"
    steps = sorted(int(path.stem.split("-")[1]) for path in (prefix / "checkpoints").glob("step-*.pt"))
    middle = steps[len(steps) // 2]
    for step in steps:  # the retry finds what a crash after step `middle` would have left
        if step > middle:
            (prefix / "checkpoints" / f"step-{step:09d}.pt").unlink()
    storage.write_json(str(prefix / "checkpoints" / "latest.json"), {"uri": str(prefix / "checkpoints" / f"step-{middle:09d}.pt"),
                                                                     "step": middle})
    resumed = train.run_stage(config, "s1", out, PARAMS, None)
    assert resumed["resumed_from_step"] == middle and resumed["steps"] == clean["steps"]
    assert resumed["handed_epoch"] == clean["handed_epoch"]
    history = storage.read_json(str(prefix / "metrics.json"))["history"]
    for key in ("lr", "grad_norm", "val_metric"):
        assert [e[key] for e in history] == pytest.approx([e[key] for e in clean_history], rel=1e-6), key
    final = torch.load(resumed["checkpoint_uri"], weights_only=True)
    assert final["grad_scaler"] == clean_final["grad_scaler"]
    for name, tensor in clean_final["model"].items():
        torch.testing.assert_close(final["model"][name], tensor, rtol=1e-5, atol=1e-6)


class _AdamWithSlowHead(MLPClassifier):
    """A spec with its own optimizer: Adam, the last layer at a tenth of the lr and without weight decay."""

    def optimizer(self, module, params):
        head_params = list(module[-1].parameters())
        rest = [p for p in module.parameters() if all(p is not h for h in head_params)]
        return torch.optim.Adam([{"params": rest, "weight_decay": params["weight_decay"]},
                                 {"params": head_params, "lr": params["lr"] / 10, "weight_decay": 0.0}], lr=params["lr"])


def test_the_default_optimizer_decays_weights_but_not_biases_and_a_specs_own_keeps_its_group_ratios(tmp_path):
    """SGD/AdamW put weight matrices in a decayed group and biases (1-d) in an undecayed one; a spec's own optimizer
    is used as built, and the loop's lr moves each group by its own multiple of params['lr']."""
    from stagewise.training.optimizers import make_optimizer

    data = DataInfo(features=["a", "b"], num_classes=2)
    params = {**FRAMEWORK_DEFAULTS, "lr": 0.1, "hidden": 8, "weight_decay": 0.01}
    model = build(MLPClassifier(), data, params)
    default = make_optimizer(model, params, MLPClassifier())
    decayed, plain = default.param_groups
    assert all(p.ndim >= 2 for p in decayed["params"]) and all(p.ndim == 1 for p in plain["params"])
    assert (decayed["weight_decay"], plain["weight_decay"]) == (0.01, 0.0)
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))

    spec = _AdamWithSlowHead()
    own = make_optimizer(build(spec, data, params), params, spec)
    assert isinstance(own, torch.optim.Adam) and [g["lr_scale"] for g in own.param_groups] == pytest.approx([1.0, 0.1])
    loop = _loop(tmp_path)  # the loop sets each group's lr at every step: the stage's lr times the group's scale
    loop.optimizer = make_optimizer(loop.module, {**params, "lr": 0.05}, spec)
    loop.train_epoch(lambda _step: 0.02)
    assert [g["lr"] for g in loop.optimizer.param_groups] == pytest.approx([0.02, 0.002])


class _ForgetfulOptimizer(MLPClassifier):
    def optimizer(self, module, params):
        return torch.optim.SGD(list(module.parameters())[:1], lr=params["lr"])


def test_a_specs_optimizer_that_leaves_parameters_out_is_a_user_error():
    from stagewise.training.optimizers import make_optimizer

    params = {**FRAMEWORK_DEFAULTS, "lr": 0.1, "hidden": 8}
    spec = _ForgetfulOptimizer()
    with pytest.raises(UserError, match=r"_ForgetfulOptimizer.optimizer\(\) leaves trainable parameters out"):
        make_optimizer(build(spec, DataInfo(features=["a"], num_classes=2), params), params, spec)


def test_a_stage_whose_newest_checkpoint_was_altered_resumes_from_the_one_before(digits_run, single_process, caplog):
    """A finished stage run again resumes at its last checkpoint; with 64 bytes of that file flipped it resumes from
    the one before instead (named in the log as cut or altered), never from the altered weights."""
    config_path, out = digits_run
    config = load_config(config_path, overrides={"train.checkpoint_every_steps": 5, "train.stages.0.epochs": 1})
    first = train.run_stage(config, "s1", out, PARAMS, None)
    folder = Path(stage_prefix(out, "s1")) / "checkpoints"
    newest = folder / f"step-{first['steps']:09d}.pt"
    data = bytearray(newest.read_bytes())
    data[-2064:-2000] = bytes(byte ^ 0xFF for byte in data[-2064:-2000])
    newest.write_bytes(bytes(data))
    again = train.run_stage(config, "s1", out, PARAMS, None)
    older = max(int(path.name[5:14]) for path in folder.glob("step-*.pt") if path != newest)
    assert again["resumed_from_step"] == older < first["steps"] and again["steps"] == first["steps"]
    assert f"{newest} is cut or altered since it was written" in caplog.text
