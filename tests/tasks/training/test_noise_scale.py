"""The gradient noise scale estimator: on gradients drawn with a known mean G and covariance trace S, the estimate from
two batch sizes recovers |G|², S and B_simple = S/|G|²; measuring on one rank changes no weight; its state
round-trips through a checkpoint; an overflowed (non-finite) measurement is skipped."""

from __future__ import annotations

import json
import math
import weakref
from pathlib import Path

import pytest
import torch

from stagewise.training.noise_scale import NoiseScale

DIM, SIGMA = 200, 0.5  # per-sample noise N(0, SIGMA² I): tr(Σ) = DIM·SIGMA² = 50
TRUE_G = torch.full((DIM,), 0.05, dtype=torch.float64)  # |G|² = 0.5, so B_simple = 100
TRUE_G2, TRUE_S = float(TRUE_G.square().sum()), DIM * SIGMA**2


def _batch_gradient(generator: torch.Generator, batch: int) -> torch.Tensor:
    """The mean gradient of ``batch`` samples: G plus noise of covariance Σ/batch."""
    return TRUE_G + SIGMA / math.sqrt(batch) * torch.randn(DIM, generator=generator, dtype=torch.float64)


def _averaged(estimator: NoiseScale, steps: int, record) -> dict[str, float]:
    """The estimates averaged over the last half of ``steps`` updates (the EMA's own jitter averaged out)."""
    seen = []
    for step in range(steps):
        record()
        if step >= steps // 2:
            seen.append(estimator.estimates())
    return {key: sum(e[key] for e in seen) / len(seen) for key in seen[0]}


def test_parts_of_a_batch_recover_g_s_and_the_noise_scale():
    """4 parts of 16 samples: each part's squared norm (B_small = 16) against their average's (B_big = 64)."""
    generator = torch.Generator().manual_seed(0)
    estimator = NoiseScale("cpu", beta=0.9)
    ranks, per_rank = 4, 16

    def record() -> None:
        local = [_batch_gradient(generator, per_rank) for _ in range(ranks)]
        small_sq = torch.stack([g.square().sum() for g in local]).mean()
        big_sq = torch.stack(local).mean(0).square().sum()
        estimator.update(small_sq, big_sq, per_rank, per_rank * ranks)

    found = _averaged(estimator, 4000, record)
    assert found["grad_sq"] == pytest.approx(TRUE_G2, rel=0.1)
    assert found["trace_cov"] == pytest.approx(TRUE_S, rel=0.1)
    assert found["noise_scale"] == pytest.approx(TRUE_S / TRUE_G2, rel=0.15)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_measuring_on_one_rank_trains_the_same_weights_and_yields_a_noise_scale(digits_run, monkeypatch, accumulation):
    """A measured step runs its batch as two halves (or measures its first micro-batch): the step's gradient is the
    same, so a stage measuring every step ends on the weights of one that never measures, and reports a positive
    noise scale where the other reports none."""
    import shutil

    from stagewise import train
    from stagewise.definitions.loading import load_config

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    config_path, out = digits_run
    weights, results = {}, {}
    for measured in (True, False):
        shutil.rmtree(Path(out, "train"), ignore_errors=True)  # a fresh stage, never a resume of the other
        config = load_config(config_path, {"train.noise_scale": measured, "train.noise_scale_every_steps": 1,
                                           "train.stages.0.grad_accum_steps": accumulation, "train.stages.0.epochs": 3})
        results[measured] = train.run_stage(config, "s1", out, {"lr": 0.05, "hidden": 32, "dropout": 0.0}, None)
        weights[measured] = torch.load(results[measured]["checkpoint_uri"], weights_only=True)["model"]
        results[measured]["history"] = json.loads(Path(out, "train", "s1", "metrics.json").read_text())["history"]
    for name, tensor in weights[False].items():
        torch.testing.assert_close(weights[True][name], tensor, rtol=1e-4, atol=1e-6)
    assert all(entry["noise_scale"] is None for entry in results[False]["history"])
    # None only while the smoothed |G|² is not positive (the gradient's mean drowned in its noise): never 0 or inf.
    found = [entry["noise_scale"] for entry in results[True]["history"]]
    assert found[0] is not None and all(value is None or 1 < value < 1e6 for value in found), found


def test_state_round_trips_so_a_resumed_stage_continues_the_same_curve():
    """An estimator restored from another's state gives exactly the estimates the original gives on the same steps."""
    generator = torch.Generator().manual_seed(2)
    steps = [(_batch_gradient(generator, 8).square().sum(), _batch_gradient(generator, 16).square().sum()) for _ in range(60)]
    original = NoiseScale("cpu")
    for small, big in steps[:30]:
        original.update(small, big, 8, 16)
    restored = NoiseScale("cpu")
    restored.load_state_dict(original.state_dict())
    for small, big in steps[30:]:
        original.update(small, big, 8, 16)
        restored.update(small, big, 8, 16)
    assert restored.estimates() == original.estimates() and restored.updates == original.updates == 60


def test_no_noise_scale_while_the_smoothed_gradient_is_not_positive_yet():
    """Early, noise can make the unbiased |G|² estimate negative: the scale is then unknown (None), never inf."""
    estimator = NoiseScale("cpu")
    estimator.update(torch.tensor(1.0), torch.tensor(0.2), 8, 16)  # |G|² = (16·0.2 − 8·1)/8 < 0
    assert estimator.estimates()["grad_sq"] < 0 and estimator.estimates()["noise_scale"] is None


def test_a_non_finite_step_is_skipped_and_nothing_is_estimated_before_a_step():
    """An fp16 step whose gradients overflowed (inf) leaves the estimates as they were."""
    estimator = NoiseScale("cpu")
    assert estimator.estimates() is None
    estimator.update(torch.tensor(2.0), torch.tensor(1.0), 8, 32)
    before = estimator.estimates()
    estimator.update(torch.tensor(float("inf")), torch.tensor(1.0), 8, 32)
    assert estimator.estimates() == before


def test_the_interval_fills_the_memory_at_the_configured_rate_then_spaces_out():
    """The halves' interval: the configured one for the first MIN_MEMORY measurements, SPLIT_SPACING times it after."""
    from stagewise.training.noise_scale import MIN_MEMORY, SPLIT_SPACING, split_interval

    assert [split_interval(8, updates) for updates in (0, MIN_MEMORY - 1, MIN_MEMORY, 500)] == [8, 8, 8 * SPLIT_SPACING,
                                                                                                8 * SPLIT_SPACING]


def _measuring_loop(tmp_path: Path, grad_accum_steps: int, every: int):
    """A one-process loop over 4 blobs (37 steps an epoch) and the optimizer steps its measured backwards ran in."""
    from stagewise.datasets.loader import ParquetBatches
    from stagewise.models.building import build
    from stagewise.models.mlp import MLPClassifier
    from stagewise.spec import DataInfo
    from stagewise.training.distributed import DistEnv
    from stagewise.training.loop import Loop
    from tests.tasks.training.test_loop import _blobs

    torch.manual_seed(0)
    model = build(MLPClassifier(), DataInfo(features=["x0", "x1"], num_classes=4), {"hidden": 16, "dropout": 0.0})
    train = ParquetBatches([_blobs(tmp_path, "train", 600, 1)], ["x0", "x1"], "label", rank=0, world_size=1,
                           batch_size=16, seed=0)
    validation = ParquetBatches([_blobs(tmp_path, "validation", 200, 2)], ["x0", "x1"], "label", rank=0, world_size=1,
                                batch_size=64, seed=0, shuffle=False)
    loop = Loop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), train=train, validation=validation,
                env=DistEnv(rank=0, local_rank=0, world_size=1, device="cpu"), spec=MLPClassifier(),
                grad_accum_steps=grad_accum_steps, noise_scale_every=every)
    measured: list[int] = []
    inner = loop._measured_backward
    loop._measured_backward = lambda inputs, targets: measured.append(loop.position.step) or inner(inputs, targets)
    return loop, measured


def test_one_process_spaces_out_the_halves_after_the_first_measurements_and_a_resume_measures_the_same_steps(tmp_path):
    """One process, no accumulation: a measurement runs the batch as two halves (a second forward and backward), so
    after its first MIN_MEMORY measurements at the configured interval the stage measures SPLIT_SPACING times less
    often; the rule reads the estimator's state, so a loop resumed from it measures the steps an uninterrupted one
    does. With accumulation (the micro-batches are the parts: no extra pass) every configured step stays measured."""
    from stagewise.training.loop import Position
    from stagewise.training.noise_scale import MIN_MEMORY, SPLIT_SPACING

    every, epochs = 2, 3
    loop, measured = _measuring_loop(tmp_path, 1, every)
    for _ in range(epochs):
        loop.train_epoch(lambda _step: 0.05)
    expected: list[int] = []
    for step in range(loop.position.step):
        if step % (every if len(expected) < MIN_MEMORY else every * SPLIT_SPACING) == 0:
            expected.append(step)
    assert measured == expected and len(expected) > MIN_MEMORY + 2
    assert loop.noise.updates == len(expected) and loop.noise_estimates()["noise_scale"] is not None

    first, first_measured = _measuring_loop(tmp_path, 1, every)
    first.train_epoch(lambda _step: 0.05)
    resumed, resumed_measured = _measuring_loop(tmp_path, 1, every)
    resumed.position = Position(epoch=1, step=first.position.step)
    resumed.load_noise_state(first.noise_state())
    for _ in range(epochs - 1):
        resumed.train_epoch(lambda _step: 0.05)
    assert first_measured + resumed_measured == expected

    accumulated, parts = _measuring_loop(tmp_path, 2, every)
    for _ in range(epochs):
        accumulated.train_epoch(lambda _step: 0.05)
    assert sorted(set(parts)) == list(range(0, accumulated.position.step, every))


def test_a_spaced_measurement_weighs_as_the_measurements_it_stands_for(tmp_path):
    """Once the halves are spaced out, each measurement folds in as SPLIT_SPACING configured-rate ones with its value
    would (the EMA's memory stays about an epoch of steps): weighed as one, the first 10 measurements outweighed every
    later one and a short stage handed on what its first steps measured. The loop's beta is counted at the configured
    interval, and it hands each fold the spacing the step was chosen at."""
    from stagewise.training.noise_scale import MIN_MEMORY, SPLIT_SPACING, epoch_beta

    early = [(torch.tensor(3.0), torch.tensor(2.0))] * MIN_MEMORY  # |G|² 1, S 16: B_simple 16
    late = (torch.tensor(0.5), torch.tensor(0.3))  # |G|² 0.1, S 3.2: B_simple 32, a later value
    spaced, repeated = NoiseScale("cpu", beta=0.9), NoiseScale("cpu", beta=0.9)
    for small, big in early:
        spaced.update(small, big, 8, 16)
        repeated.update(small, big, 8, 16)
    spaced.update(*late, 8, 16, spans=SPLIT_SPACING)
    for _ in range(SPLIT_SPACING):
        repeated.update(*late, 8, 16)
    assert spaced.estimates() == pytest.approx(repeated.estimates(), rel=1e-6)  # float32 inputs
    assert spaced.estimates()["grad_sq"] < 0.5  # weighed as one, the early |G|² of 1 kept 0.87 against the late 0.1
    assert spaced.updates == MIN_MEMORY + 1  # the spacing rule still counts measurements actually taken

    every = 2
    loop, _ = _measuring_loop(tmp_path, 1, every)
    assert loop.noise.beta == epoch_beta(loop.train_data.steps_per_epoch(0) / every)
    folded: list[int] = []
    inner = loop.noise.update
    loop.noise.update = lambda small, big, b_small, b_big, spans=1: folded.append(spans) or inner(
        small, big, b_small, b_big, spans)
    for _ in range(3):
        loop.train_epoch(lambda _step: 0.05)
    assert len(folded) > MIN_MEMORY + 2
    assert folded == [1] * MIN_MEMORY + [SPLIT_SPACING] * (len(folded) - MIN_MEMORY)


# --- one process on every placement; CUDA graphs' replays, emulated on the CPU --------------------------------------

STAGE_PARAMS = {"lr": 0.05, "hidden": 32, "dropout": 0.0}


def _one_process(monkeypatch) -> None:
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("placement", ["host", "resident", "streamed"])
def test_one_process_measures_the_noise_scale_on_every_placement(digits_run, monkeypatch, placement):
    """Every epoch of a one-process stage ends with a noise scale (what adaptive growth reads), on the host loader and
    on device batches alike (CPU tensors stand in for the device). Measuring one half of the step's batch against the
    whole left the smoothed |G|² negative after the first epoch, so adaptive growth on one GPU got none."""
    from stagewise import train
    from stagewise.definitions.loading import load_config

    _one_process(monkeypatch)
    config_path, out = digits_run
    config = load_config(config_path, {"train.stages.0.data_placement": placement, "train.stages.0.epochs": 3})
    assert config.train.noise_scale and config.train.noise_scale_every_steps == 8, "the defaults are what is guarded"
    result = train.run_stage(config, "s1", out, STAGE_PARAMS, None)
    history = json.loads(Path(out, "train", "s1", "metrics.json").read_text())["history"]
    found = [entry["noise_scale"] for entry in history]
    assert all(value is not None and 1 < value < 1e5 for value in found), found
    assert result["noise_scale"] == found[-1]


class ReplayedGraphs(torch.nn.Module):
    """torch.compile(mode="reduce-overhead") as a GPU runs it, on the CPU: each forward starts a new generation of CUDA
    graph replays, which overwrite what earlier generations returned: the forward's outputs and every gradient that a
    backward created rather than added into (NaN here, where a replay would have written other numbers)."""

    def __init__(self, model: torch.nn.Module, marks: list[int]) -> None:
        super().__init__()
        self.inner, self.marks, self.forwards = model, marks, 0
        self._replayed: list = []  # weak references to what the generation so far returned
        self._created: dict[int, bool] = {}
        for parameter in model.parameters():
            parameter.register_hook(lambda grad, p=parameter: self._created.__setitem__(id(p), p.grad is None))
            parameter.register_post_accumulate_grad_hook(self._after_accumulate)

    def _after_accumulate(self, parameter: torch.Tensor) -> None:
        if self._created.get(id(parameter)):
            self._replayed.append(weakref.ref(parameter.grad))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for reference in self._replayed:
                if (tensor := reference()) is not None:
                    tensor.fill_(float("nan"))
        self.forwards += 1
        outputs = self.inner(inputs)
        self._replayed = [weakref.ref(outputs)]
        return outputs


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_measured_step_under_cuda_graph_replays_trains_the_eager_weights(digits_run, monkeypatch, accumulation,
                                                                            precision):
    """compile reduce-overhead with the noise scale measured on every step (two halves, or the micro-batches, each a
    forward of its own): each forward marks a new step for the graphs, and nothing the step keeps is a replay's memory,
    so the stage ends on the eager stage's weights and noise scale (a crash on a GPU before: 'accessing tensor output of
    CUDAGraphs that has been overwritten by a subsequent run'). fp16 with its gradient scaler alike."""
    import shutil

    from stagewise import train
    from stagewise.definitions.loading import load_config

    _one_process(monkeypatch)
    marks: list[int] = []
    compiled: list[ReplayedGraphs] = []

    def fake_compile(model, mode=None, **kwargs):
        assert mode == "reduce-overhead"
        compiled.append(ReplayedGraphs(model, marks))
        return compiled[-1]

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(len(marks)))
    config_path, out = digits_run
    weights, results = {}, {}
    for mode in ("reduce-overhead", "off"):
        shutil.rmtree(Path(out, "train"), ignore_errors=True)
        config = load_config(config_path, {
            "train.noise_scale_every_steps": 1, "train.stages.0.epochs": 2, "train.stages.0.compile": mode,
            "train.stages.0.grad_accum_steps": accumulation, "train.stages.0.precision": precision})
        results[mode] = train.run_stage(config, "s1", out, STAGE_PARAMS, None)
        weights[mode] = torch.load(results[mode]["checkpoint_uri"], weights_only=True)["model"]
    assert len(compiled) == 1 and compiled[0].forwards > 0 and len(marks) == compiled[0].forwards
    for name, tensor in weights["off"].items():
        torch.testing.assert_close(weights["reduce-overhead"][name], tensor)
    assert results["off"]["noise_scale"] is not None
    assert results["reduce-overhead"]["noise_scale"] == pytest.approx(results["off"]["noise_scale"])


@pytest.mark.torchrun
@pytest.mark.slow
def test_two_processes_measure_the_noise_scale_on_every_placement(digits_run, subprocess_env, tmp_path):
    """A 2-process DDP stage (gloo) ends each epoch with a noise scale on the host loader and on device batches."""
    import shutil

    from tests.tasks.test_train_ddp import torchrun

    config, out = digits_run
    for placement in ("host", "resident", "streamed"):
        run_out = str(tmp_path / placement)
        shutil.copytree(Path(out) / "preprocess", Path(run_out) / "preprocess")
        result = torchrun(2, config, "s2", run_out, subprocess_env,
                          f"--override=train.stages.1.data_placement={placement}").result
        history = json.loads(Path(run_out, "train", "s2", "metrics.json").read_text())["history"]
        found = [entry["noise_scale"] for entry in history]
        assert result["world_size"] == 2 and all(value is not None and 1 < value < 1e5 for value in found), (
            placement, found)


def _measuring_rank(rank: int, train_uri: str, validation_uri: str, every: int, epochs: int, folder: str) -> None:
    """One of two gloo ranks: a DDP loop over the blobs; writes the optimizer steps it measured and its estimate."""
    import torch.distributed as dist

    from stagewise.datasets.loader import ParquetBatches
    from stagewise.models.building import build
    from stagewise.models.mlp import MLPClassifier
    from stagewise.spec import DataInfo
    from stagewise.training.distributed import DistEnv
    from stagewise.training.loop import Loop

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = build(MLPClassifier(), DataInfo(features=["x0", "x1"], num_classes=4), {"hidden": 16, "dropout": 0.0})
        train = ParquetBatches([train_uri], ["x0", "x1"], "label", rank=rank, world_size=2, batch_size=16, seed=0)
        validation = ParquetBatches([validation_uri], ["x0", "x1"], "label", rank=rank, world_size=2, batch_size=64,
                                    seed=0, shuffle=False)
        loop = Loop(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05), train=train,
                    validation=validation, env=DistEnv(rank=rank, local_rank=rank, world_size=2, device="cpu"),
                    spec=MLPClassifier(), noise_scale_every=every)
        measured: list[int] = []
        inner = loop._measured_backward
        loop._measured_backward = lambda inputs, targets: measured.append(loop.position.step) or inner(inputs, targets)
        for _ in range(epochs):
            loop.train_epoch(lambda _step: 0.05)
        Path(folder, f"rank{rank}.json").write_text(json.dumps(
            {"measured": measured, "steps": loop.position.step, "updates": loop.noise.updates,
             "noise_scale": loop.noise_estimates()["noise_scale"]}))
    finally:
        dist.destroy_process_group()


@pytest.mark.torchrun
def test_several_ranks_measure_the_steps_one_process_measures(tmp_path):
    """Two DDP ranks measure as one process and fsdp do (each rank's batch in two halves, each half all-reduced): the
    configured interval until the EMA's least memory is filled, SPLIT_SPACING times it after, on both ranks alike (a
    rank measuring alone would wait on the other's all-reduce)."""
    from stagewise.training.noise_scale import MIN_MEMORY, SPLIT_SPACING
    from tests.tasks.training.test_loop import _blobs

    every, epochs = 2, 2
    uris = (_blobs(tmp_path, "train", 1200, 1), _blobs(tmp_path, "validation", 200, 2))
    torch.multiprocessing.spawn(_measuring_rank, args=(*uris, every, epochs, str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads(Path(tmp_path, f"rank{rank}.json").read_text()) for rank in range(2)]
    expected: list[int] = []
    for step in range(ranks[0]["steps"]):
        if step % (every if len(expected) < MIN_MEMORY else every * SPLIT_SPACING) == 0:
            expected.append(step)
    assert len(expected) > MIN_MEMORY
    for rank in ranks:
        assert rank["measured"] == expected and rank["updates"] == len(expected)
        assert rank["noise_scale"] is not None and rank["noise_scale"] > 0
