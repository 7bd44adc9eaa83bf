"""The training step captured once as a CUDA graph and replayed, and the float32 matmul precision of a stage.

Used by :class:`stagewise.training.loop.Loop` (stage keys ``cuda_graph`` and ``tf32``); see when a stage captures with
``python -c "from stagewise.training.step_graph import graph_plan; help(graph_plan)"``.

A small model's step on a GPU is bound by the host launching its kernels one by one (issue 35: a plain loop's step
at MLP hidden 1024, batch 256 was ~1.2 ms of host work for a few tens of µs of GPU work). A captured graph launches the
whole forward, loss, backward and clipping at once, PyTorch's "whole-network capture" (docs: notes/cuda, CUDA Graphs):

- the first :data:`WARMUP_STEPS` steps run eagerly on a side stream, so lazy initialisations (cuBLAS workspaces,
  autograd's streams) happen outside the capture; they are real steps of the stage, not extra ones;
- the next step copies its batch into static input buffers and is captured (``capture_error_mode="thread_local"``:
  the streamed placement's reader thread may pin memory meanwhile), then replayed to run it;
- every later batch of the same shapes is copied into those buffers and replayed. The gradients are the graph's
  outputs (allocated in its private memory pool, rewritten by each replay, never zeroed); the loss and the clipped
  norm are read from its static outputs into the loop's device accumulators before the next replay overwrites them.

The optimizer's step runs eagerly after each replay: any optimizer (a spec's own included) and any per-step lr
(warmup, schedules: a host float per group) work unchanged, and nothing in the optimizer must be capturable. A step
that differs (a noise-scale measured step, a batch of other shapes) runs eagerly with gradients of its own, and the
graph's are put back after it. Only one process (DDP's all-reduce hooks fire between the backward's kernels) and
only a spec whose step has static shapes and reads nothing on the host (:attr:`stagewise.spec.ModelSpec.static_shapes`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from stagewise.core.errors import UserError

log = logging.getLogger("stagewise.train")

GRAPH_SETTINGS = ("auto", "on", "off")
# Eager steps on a side stream before the capture (PyTorch's own examples and make_graphed_callables use 3).
WARMUP_STEPS = 3

StepOutputs = tuple[torch.Tensor, torch.Tensor | None]  # (the step's loss, its pre-clip gradient norm or None)


def set_tf32(device: Any, enabled: bool) -> None:
    """TensorFloat-32 for float32 matmuls and cuDNN convolutions, on (Ampere and later GPUs use it) or off (exact
    float32); nothing changes off CUDA (the CPU's float32 matmuls stay as they are).

    Process-wide switches, set through the legacy ``allow_tf32`` names on purpose: torch >= 2.9 refuses to read its
    legacy state (``torch.get_float32_matmul_precision``, which inductor reads) after the new ``fp32_precision`` switch
    alone was set, while a legacy write sets both consistently."""
    if torch.device(device).type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def static_shapes(spec: Any) -> tuple[bool, str]:
    """(the spec's training step has static shapes, why not): a spec says so (``ModelSpec.static_shapes``), and a
    data set with variable-length columns never has them (each batch is padded to its own longest row)."""
    layout = getattr(spec, "_row_layout", None)
    variable = [column.name for column in layout.columns if column.variable] if layout is not None else []
    if variable:
        return False, f"variable-length columns {variable}: each batch is padded to its own longest row"
    if not getattr(spec, "static_shapes", False):
        return False, f"{type(spec).__name__} does not declare static_shapes = True"
    return True, ""


def graph_plan(setting: str, *, device: Any, world_size: int, spec: Any, grad_accum_steps: int, precision: str,
               compile_mode: str, strategy: str = "ddp") -> tuple[bool, str]:
    """(capture the training step as a CUDA graph?, why) for a stage's ``cuda_graph`` setting: ``auto`` and ``on``
    capture where it is safe, i.e. one process on CUDA, a spec with static shapes, fp32 or bf16, one micro-batch per
    optimizer step and compile off; ``off`` never does. The reason names the first condition that fails."""
    if setting not in GRAPH_SETTINGS:
        raise UserError(f"cuda_graph '{setting}' is not one of {', '.join(GRAPH_SETTINGS)}")
    if setting == "off":
        return False, "cuda_graph off"
    if torch.device(device).type != "cuda":
        return False, f"device {device} is not a CUDA device"
    if compile_mode != "off":
        return False, f"compile {compile_mode} runs the forward through torch.compile instead"
    if strategy != "ddp":
        return False, f"strategy {strategy}: each unit's all-gather and reduce-scatter run inside the step"
    if world_size > 1:
        return False, f"{world_size} processes: DDP's all-reduce runs inside the backward, so only one process captures"
    shapes_static, why = static_shapes(spec)
    if not shapes_static:
        return False, why
    if grad_accum_steps > 1:
        return False, f"{grad_accum_steps} gradient accumulation steps per optimizer step"
    if precision == "fp16":
        return False, "fp16's gradient scaler decides on the host, each step, whether the step is skipped"
    return True, f"one process on CUDA, static shapes, {precision}, one micro-batch per step"


class CaptureFailed(RuntimeError):
    """The capture raised (e.g. the step reads a value on the host); the step graph is unusable, the step runs eagerly."""


class StepGraph:
    """One training step's forward, loss, backward and clipping, warmed up, captured and replayed (see the module).

    ``body(inputs, targets) -> (loss, norm or None)`` runs the step into gradients that are None when it starts;
    ``parameters`` are the trainable parameters whose gradients it makes."""

    def __init__(self, body: Callable[[torch.Tensor, torch.Tensor], StepOutputs], parameters: list[torch.Tensor],
                 device: Any) -> None:
        self.body, self.parameters = body, parameters
        self.device = torch.device(device)
        self.warmed = 0
        self.replays = 0
        self.graph: Any = None  # torch.cuda.CUDAGraph once captured
        self._side = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        self._inputs: torch.Tensor | None = None
        self._targets: torch.Tensor | None = None
        self._outputs: StepOutputs | None = None
        self._grads: list[torch.Tensor | None] = []

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def fits(self, inputs: Any, targets: Any) -> bool:
        """Whether this batch can take the graph's path: tensors, and once captured, of the captured shapes and dtypes."""
        if not (isinstance(inputs, torch.Tensor) and isinstance(targets, torch.Tensor)):
            return False
        if self._inputs is None or self._targets is None:
            return True
        return all(a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                   for a, b in ((inputs, self._inputs), (targets, self._targets)))

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> StepOutputs:
        """This batch's forward, loss, backward and clipping: a warm-up step, the capture (then its replay), or a replay.
        Raises :class:`CaptureFailed` when the capture does (every parameter's gradient is None then)."""
        if self.graph is not None:
            outputs = self._replay(inputs, targets)
            self.replays += 1
            return outputs
        for parameter in self.parameters:
            parameter.grad = None
        if self.warmed < WARMUP_STEPS:
            self.warmed += 1
            return self._warm_up(inputs, targets)
        try:
            outputs = self._capture(inputs, targets)
        except Exception as exc:  # whatever the capture raised, the eager step still works
            cause = exc.__context__ if exc.__context__ is not None else exc
            for parameter in self.parameters:
                parameter.grad = None
            self.graph = self._inputs = self._targets = self._outputs = None
            first_line = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
            raise CaptureFailed(f"{type(cause).__name__}: {first_line[:300]}") from exc
        self._grads = [parameter.grad for parameter in self.parameters]
        self.replays += 1
        return outputs

    # The CUDA parts (tests/tasks/training/test_step_graph.py stands in for them on the CPU).

    def _warm_up(self, inputs: torch.Tensor, targets: torch.Tensor) -> StepOutputs:
        current = torch.cuda.current_stream(self.device)
        self._side.wait_stream(current)
        with torch.cuda.stream(self._side):
            outputs = self.body(inputs, targets)
        current.wait_stream(self._side)
        return outputs

    def _capture(self, inputs: torch.Tensor, targets: torch.Tensor) -> StepOutputs:
        """Capture the body on static copies of this batch, then replay it once: that runs this step."""
        current = torch.cuda.current_stream(self.device)
        self._inputs, self._targets = inputs.clone(), targets.clone()
        self._side.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        # The outer stream context restores the current stream even when the capture's own exit raises.
        with torch.cuda.stream(self._side):
            with torch.cuda.graph(graph, stream=self._side, capture_error_mode="thread_local"):
                outputs = self.body(self._inputs, self._targets)
        current.wait_stream(self._side)
        self.graph, self._outputs = graph, outputs
        graph.replay()
        return outputs

    def _replay(self, inputs: torch.Tensor, targets: torch.Tensor) -> StepOutputs:
        assert self._inputs is not None and self._targets is not None and self._outputs is not None
        self._inputs.copy_(inputs)
        self._targets.copy_(targets)
        self.graph.replay()
        return self._outputs

    def release_grads(self) -> None:
        """Before an eager step: the parameters' gradients None, so it makes its own (the graph keeps writing its own)."""
        if self.graph is not None:
            for parameter in self.parameters:
                parameter.grad = None

    def restore_grads(self) -> None:
        """After an eager step: the gradients are the graph's outputs again, which the optimizer reads after a replay."""
        if self.graph is not None:
            for parameter, grad in zip(self.parameters, self._grads):
                parameter.grad = grad
