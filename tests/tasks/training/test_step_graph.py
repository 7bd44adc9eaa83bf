"""The captured training step (stagewise.training.step_graph) where a CPU can check it: when a stage captures and why
not, the stage knobs, the TF32 switches, the loop's graph path with the CUDA parts stood in for on the CPU (the same
losses, norms, noise scale and weights as the eager loop, bit for bit, a failed capture included), and no host read of
a device value in any step between two checks. The CUDA parts themselves run in tests/tasks/test_train_cuda.py."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
import torch

from stagewise import train
from stagewise.core.errors import UserError
from stagewise.datasets.loader import ParquetBatches
from stagewise.definitions.config import TrainStage
from stagewise.definitions.loading import load_config
from stagewise.definitions.rows import InputColumn, RowLayout
from stagewise.models.building import build
from stagewise.models.mlp import MLPClassifier
from stagewise.spec import Classifier, DataInfo
from stagewise.training import loop as loop_module
from stagewise.training.device_data import DeviceBatches
from stagewise.training.distributed import DistEnv
from stagewise.training.loop import Loop
from stagewise.training.noise_scale import split_interval
from stagewise.training.step_graph import WARMUP_STEPS, StepGraph, graph_plan, set_tf32, static_shapes
from tests.tasks.training.test_loop import _blobs

CPU = DistEnv(rank=0, local_rank=0, world_size=1, device="cpu")


# --- when a stage captures ------------------------------------------------------------------------------------------


class _Plain(Classifier):
    """A spec that says nothing about its shapes."""


def _variable_length_spec() -> MLPClassifier:
    spec = MLPClassifier()
    tokens = InputColumn(name="tokens", dtype="int64", shape=[16], offset=0, variable=True)
    spec._row_layout = RowLayout(columns=[tokens], float_slots=0, int_slots=17)
    return spec


PLAN = dict(device="cuda:0", world_size=1, spec=MLPClassifier(), grad_accum_steps=1, precision="fp32", compile_mode="off")


@pytest.mark.parametrize(("changes", "captures", "why"), [
    ({}, True, "one process on CUDA, static shapes, fp32"),
    ({"precision": "bf16"}, True, "bf16"),
    ({"setting": "on"}, True, "one process on CUDA"),
    ({"setting": "off"}, False, "cuda_graph off"),
    ({"device": "cpu"}, False, "device cpu is not a CUDA device"),
    ({"compile_mode": "reduce-overhead"}, False, "compile reduce-overhead runs the forward through torch.compile"),
    ({"world_size": 2}, False, "2 processes: DDP's all-reduce runs inside the backward"),
    ({"spec": _Plain()}, False, "_Plain does not declare static_shapes = True"),
    ({"spec": _variable_length_spec()}, False, "variable-length columns ['tokens']"),
    ({"grad_accum_steps": 2}, False, "2 gradient accumulation steps per optimizer step"),
    ({"precision": "fp16"}, False, "fp16's gradient scaler decides on the host"),
])
def test_a_stage_captures_its_step_only_where_that_is_safe_and_says_why_not(changes, captures, why):
    """auto/on capture for one process on CUDA with a static-shaped spec in fp32 or bf16, one micro-batch a step and
    compile off; the reason names the first condition that fails (the stage logs it)."""
    arguments = {**PLAN, **changes}
    setting = arguments.pop("setting", "auto")
    captured, reason = graph_plan(setting, **arguments)
    assert captured is captures and why in reason, reason


def test_an_unknown_cuda_graph_setting_is_a_user_error():
    with pytest.raises(UserError, match="cuda_graph 'sometimes' is not one of auto, on, off"):
        graph_plan("sometimes", **PLAN)


def test_the_built_in_mlp_and_the_fixed_shape_examples_declare_static_shapes():
    """The built-in MLP, the CNN and the regressor examples say so; a variable-length data set never has static shapes."""
    from stagewise.examples.diabetes import DiabetesMLP
    from stagewise.examples.digits_cnn import DigitsCNN
    from stagewise.examples.token_transformer import TokenTransformer

    assert all(static_shapes(spec)[0] for spec in (MLPClassifier(), DigitsCNN(), DiabetesMLP()))
    assert not static_shapes(TokenTransformer())[0] and not static_shapes(_variable_length_spec())[0]


# --- the stage knobs ------------------------------------------------------------------------------------------------


def test_tf32_and_cuda_graph_stage_knobs_default_on_and_auto_and_are_validated():
    stage = TrainStage(name="s1", profile="p", per_process_batch=8, epochs=1)
    assert (stage.tf32, stage.cuda_graph) == (True, "auto")
    assert TrainStage(name="s1", profile="p", per_process_batch=8, epochs=1, tf32=False, cuda_graph="off").cuda_graph == "off"
    with pytest.raises(ValueError, match="cuda_graph"):
        TrainStage(name="s1", profile="p", per_process_batch=8, epochs=1, cuda_graph="always")
    with pytest.raises(ValueError, match="tf32"):
        TrainStage(name="s1", profile="p", per_process_batch=8, epochs=1, tf32="sometimes")
    with pytest.raises(ValueError, match="cuda_graph: 'on' captures the eager step; compile 'reduce-overhead'"):
        TrainStage(name="s1", profile="p", per_process_batch=8, epochs=1, cuda_graph="on", compile="reduce-overhead")
    # auto leaves a compiled stage alone: the loop steps through torch.compile and logs why it does not capture
    assert TrainStage(name="s1", profile="p", per_process_batch=8, epochs=1, compile="default").cuda_graph == "auto"


def test_a_script_stage_may_not_change_the_built_in_loops_tf32_or_cuda_graph():
    entry = {"script": "train.py"}
    for knob, value in (("tf32", False), ("cuda_graph", "off")):
        with pytest.raises(ValueError, match=f"{knob}: the built-in loop's"):
            TrainStage(name="s1", profile="p", per_process_batch=8, epochs=1, entrypoint=entry, **{knob: value})


@pytest.fixture
def single_process(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", train.FAULT_ENV):
        monkeypatch.delenv(name, raising=False)


def test_a_stage_hands_its_tf32_and_cuda_graph_knobs_to_the_loop(digits_run, single_process, monkeypatch, caplog):
    """train.stages[].tf32 reaches the TF32 switches and cuda_graph the loop; on a CPU profile `on` warns why it steps
    eagerly (`auto` says so at INFO)."""
    config_path, out = digits_run
    switched: list[tuple[str, bool]] = []
    monkeypatch.setattr(loop_module, "set_tf32", lambda device, enabled: switched.append((str(device), enabled)))
    config = load_config(config_path, {"train.stages.0.tf32": False, "train.stages.0.cuda_graph": "on",
                                       "train.stages.0.epochs": 1})
    with caplog.at_level(logging.INFO, logger="stagewise.train"):
        result = train.run_stage(config, "s1", out, {"lr": 0.05, "hidden": 16}, None)
    assert switched == [("cpu", False)]
    assert result["step_graph"] == {"captured": False, "replays": 0, "why": "device cpu is not a CUDA device"}
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and "no CUDA graph" in r.getMessage()]
    assert len(warned) == 1 and "device cpu is not a CUDA device" in warned[0].getMessage()


@pytest.fixture
def tf32_switches():
    """The process-wide switches as they were, restored after the test (through the legacy setters, which set both APIs)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_tf32_switches_on_and_off_for_cuda_and_leaves_the_cpu_alone(tf32_switches):
    """set_tf32 on a CUDA device sets matmuls and cuDNN together, readable through both of torch's APIs (inductor reads
    the legacy one); on the CPU it changes nothing."""
    set_tf32("cuda:0", True)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "high"
    set_tf32("cuda", False)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert torch.get_float32_matmul_precision() == "highest"
    set_tf32("cpu", True)
    assert not torch.backends.cuda.matmul.allow_tf32 and torch.get_float32_matmul_precision() == "highest"
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch >= 2.9: the new API reads the same
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        # A new-API write alone (as stagewise.models.scoring.exact_float32 restores) leaves the legacy reader refusing
        # to read; a stage's set_tf32 makes both consistent again, so a compiled stage after it can still start.
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        set_tf32("cuda", True)
        assert torch.get_float32_matmul_precision() == "high"


# --- the loop's graph path, its CUDA parts stood in for on the CPU ----------------------------------------------------


class _CpuGraph(StepGraph):
    """StepGraph with its CUDA parts done eagerly on the CPU, with a graph's memory semantics: the capture keeps static
    inputs, outputs and gradients, and each replay rewrites those same tensors in place, never accumulating, whatever
    the parameters' ``.grad`` point to then (a loop that forgot to put the graph's gradients back would step on none)."""

    def __init__(self, body, parameters, fail_capture: bool = False) -> None:
        super().__init__(body, parameters, "cpu")
        self.fail_capture = fail_capture

    def _warm_up(self, inputs, targets):
        return self.body(inputs, targets)

    def _capture(self, inputs, targets):
        if self.fail_capture:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        self._inputs, self._targets = inputs.clone(), targets.clone()
        self._outputs = self.body(self._inputs, self._targets)
        self.graph = "captured"
        return self._outputs

    def _replay(self, inputs, targets):
        self._inputs.copy_(inputs)
        self._targets.copy_(targets)
        pointed = [parameter.grad for parameter in self.parameters]
        for parameter in self.parameters:
            parameter.grad = None
        loss, norm = self.body(self._inputs, self._targets)
        for parameter, static, before in zip(self.parameters, self._grads, pointed):
            static.copy_(parameter.grad)
            parameter.grad = before
        self._outputs[0].copy_(loss)
        if norm is not None:
            self._outputs[1].copy_(norm)
        return self._outputs


def _make_loop(tmp_path: Path, *, placement: str = "host", clip: float | None = None, noise_every: int = 0,
               accumulation: int = 1, cuda_graph: str = "off") -> Loop:
    torch.manual_seed(0)
    model = build(MLPClassifier(), DataInfo(features=["x0", "x1"], num_classes=4), {"hidden": 16, "dropout": 0.0})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    source = ParquetBatches([_blobs(tmp_path, "train", 600, 1)], ["x0", "x1"], "label", rank=0, world_size=1,
                            batch_size=16, seed=0)
    train_data = source if placement == "host" else DeviceBatches(source, "cpu", resident=placement == "resident")
    validation = ParquetBatches([_blobs(tmp_path, "validation", 200, 2)], ["x0", "x1"], "label", rank=0,
                                world_size=1, batch_size=64, seed=0, shuffle=False)
    return Loop(model=model, optimizer=optimizer, env=CPU, train=train_data, validation=validation, spec=MLPClassifier(),
                grad_accum_steps=accumulation, seed=0, grad_clip_norm=clip, noise_scale_every=noise_every,
                cuda_graph=cuda_graph)


def _train(loop: Loop, epochs: int = 2) -> tuple[list, dict[str, torch.Tensor]]:
    results = [loop.train_epoch(lambda step: 0.05 * min(1.0, (step + 1) / 10)) for _ in range(epochs)]  # lr changes per step
    return results, {name: tensor.clone() for name, tensor in loop.module.state_dict().items()}


@pytest.mark.parametrize(("placement", "clip", "noise_every"), [("host", None, 0), ("resident", 1.0, 2),
                                                                ("streamed", 0.5, 3)])
def test_the_graph_path_trains_exactly_as_the_eager_step(tmp_path, placement, clip, noise_every):
    """Warm-up, capture and replays (stood in for), with clipping in the graph and noise-scale measured steps running
    eagerly between replays (their own gradients, the graph's put back): the same losses, norms, noise scale,
    validation and weights as the eager loop, bit for bit, under an lr that changes every step."""
    eager_results, eager_weights = _train(_make_loop(tmp_path, placement=placement, clip=clip, noise_every=noise_every))
    loop = _make_loop(tmp_path, placement=placement, clip=clip, noise_every=noise_every)
    graph = loop.step_graph = _CpuGraph(loop._graph_body, loop._trainable)
    results, weights = _train(loop)
    assert graph.warmed == WARMUP_STEPS and graph.captured
    measured = 0  # one process without accumulation: spaced out after the first measurements (split_interval)
    for step in range(results[-1].steps):
        measured += bool(noise_every) and step % split_interval(noise_every, measured) == 0
    assert graph.replays == results[-1].steps - measured - WARMUP_STEPS
    for ours, theirs in zip(results, eager_results):
        assert (ours.train_loss, ours.grad_norm, ours.noise_scale, ours.val_metrics) == (
            theirs.train_loss, theirs.grad_norm, theirs.noise_scale, theirs.val_metrics)
    assert (results[-1].grad_norm is None) == (clip is None)
    assert all(torch.equal(weights[name], eager_weights[name]) for name in eager_weights)


def test_a_failed_capture_falls_back_to_the_eager_step_with_a_warning(tmp_path, caplog):
    """A capture that raises (a step that reads a value on the host) leaves no gradient of its own behind: that step
    and every later one run eagerly, the stage warns once, and it trains exactly as the eager loop."""
    eager_results, eager_weights = _train(_make_loop(tmp_path, clip=1.0))
    loop = _make_loop(tmp_path, clip=1.0)
    loop.step_graph = _CpuGraph(loop._graph_body, loop._trainable, fail_capture=True)
    with caplog.at_level(logging.WARNING, logger="stagewise.train"):
        results, weights = _train(loop)
    warned = [r.getMessage() for r in caplog.records if "capture failed" in r.getMessage()]
    assert len(warned) == 1 and "operation not permitted when stream is capturing" in warned[0]
    assert loop.step_graph is None and "the capture failed" in loop.graph_reason
    assert [r.train_loss for r in results] == [r.train_loss for r in eager_results]
    assert all(torch.equal(weights[name], eager_weights[name]) for name in eager_weights)


def test_once_captured_only_batches_of_the_captured_shapes_take_the_graph():
    parameter = torch.nn.Parameter(torch.ones(3))

    def body(inputs, targets):
        loss = (parameter * inputs).sum()
        loss.backward()
        return loss.detach(), None

    graph = _CpuGraph(body, [parameter])
    x, y = torch.ones(4, 3), torch.zeros(4, dtype=torch.int64)
    assert graph.fits(x, y) and not graph.fits({"tokens": x}, y)
    for _ in range(WARMUP_STEPS + 1):
        graph.step(x, y)
    assert graph.captured and graph.fits(x + 1, y)
    assert not graph.fits(torch.ones(3, 3), y[:3]) and not graph.fits(x, y.float()) and not graph.fits(x.double(), y)


def test_the_loop_logs_why_it_steps_eagerly(tmp_path, caplog):
    """auto on a CPU says why at INFO, on says it as a WARNING, off says nothing."""
    for setting, level in (("auto", logging.INFO), ("on", logging.WARNING), ("off", None)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="stagewise.train"):
            loop = _make_loop(tmp_path, cuda_graph=setting)
        lines = [r for r in caplog.records if "training step" in r.getMessage()]
        assert loop.step_graph is None
        if level is None:
            assert lines == []
        else:
            assert [r.levelno for r in lines] == [level] and "device cpu is not a CUDA device" in lines[0].getMessage()


# --- no host sync between checks --------------------------------------------------------------------------------------


# The Python ways a value leaves a tensor for the host; on a GPU each is a sync. Counted on CPU tensors as a stand-in.
HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu")


@pytest.mark.parametrize(("placement", "knobs"), [
    ("host", {}),
    ("resident", {"clip": 1.0, "noise_every": 2}),
    ("streamed", {"accumulation": 2, "noise_every": 2, "clip": 1.0}),
    ("resident", {"clip": 1.0, "noise_every": 3, "graph": True}),
])
def test_no_step_reads_a_device_value_on_the_host_between_checks(tmp_path, monkeypatch, placement, knobs):
    """Between two checks (the checkpoint interval, the epoch's end) no step reads a tensor's value back (item, tolist,
    float, int, bool, numpy, cpu): losses, norms, the finite check and the noise scale stay on the device. On a GPU
    each such read would wait for the device (tests/tasks/test_train_cuda.py runs the same under
    torch.cuda.set_sync_debug_mode('error'))."""
    graph = knobs.pop("graph", False)
    loop = _make_loop(tmp_path, placement=placement, **knobs)
    if graph:
        loop.step_graph = _CpuGraph(loop._graph_body, loop._trainable)
    loop.check_every_steps = 7
    counting, reads = [False], []
    stepping = threading.get_ident()  # the streamed reader thread fills host buffers through numpy: no device there

    def counted(name, original):
        def read(self, *args, **kwargs):
            if counting[0] and threading.get_ident() == stepping:
                reads.append(name)
            return original(self, *args, **kwargs)
        return read

    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))

    def paused(function):  # the checks, the validation and the spec's first-batch check may read: that is their job
        def run(*args, **kwargs):
            counting[0] = False
            try:
                return function(*args, **kwargs)
            finally:
                counting[0] = True
        return run

    for name in ("check_finite", "validation_metrics", "noise_estimates"):
        monkeypatch.setattr(Loop, name, paused(getattr(Loop, name)))
    monkeypatch.setattr(loop_module, "check_spec", paused(loop_module.check_spec))
    counting[0] = True
    try:
        result = loop.train_epoch(lambda step: 0.05)
    finally:
        counting[0] = False
    assert result.steps > 7 and reads == []


def test_loss_slots_folded_when_they_run_out_give_the_same_epoch_loss(tmp_path, monkeypatch):
    """A check interval longer than the loss slots folds them on the device as they fill: the epoch's training loss
    is the one a single fold at the check gives."""
    losses = {}
    for slots in (loop_module.LOSS_SLOTS, 3):
        monkeypatch.setattr(loop_module, "LOSS_SLOTS", slots)
        loop = _make_loop(tmp_path)
        loop.check_every_steps = 10
        losses[slots] = [result.train_loss for result in _train(loop)[0]]
    assert losses[3] == pytest.approx(losses[loop_module.LOSS_SLOTS], rel=1e-12)


@pytest.mark.parametrize("slots", [loop_module.LOSS_SLOTS, 2])
@pytest.mark.parametrize(("accumulation", "bad_micro_step", "bad_step"), [(1, 5, 5), (3, 7, 2), (3, 12, 4)])
def test_the_first_bad_step_is_found_from_the_device_count_between_checks(tmp_path, monkeypatch, accumulation,
                                                                          bad_micro_step, bad_step, slots):
    """Each micro-step's loss stays on the device in a slot; a fold (at a check, or when the slots run out: 2 here)
    keeps the first non-finite micro-step since the check, and the check turns it into the optimizer step (steps count
    from 1 in the message) where the loss first turned NaN, gradient accumulation included."""
    monkeypatch.setattr(loop_module, "LOSS_SLOTS", slots)
    loop = _make_loop(tmp_path, accumulation=accumulation)
    loop.check_every_steps = 2
    original, seen = Loop._backward, [0]

    def poisoned(self, inputs, targets, weight):
        loss = original(self, inputs, targets, weight)
        seen[0] += 1
        return loss * float("nan") if seen[0] > bad_micro_step else loss

    monkeypatch.setattr(Loop, "_backward", poisoned)
    with pytest.raises(loop_module.Diverged, match=f"training loss turned NaN/inf at epoch 1, step {bad_step + 1} ") as caught:
        loop.train_epoch(lambda step: 0.05)
    assert caught.value.step == bad_step + 1
