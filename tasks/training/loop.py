"""The training loop shared by sweep trials (one process) and DDP train stages (torchrun).

Batch arithmetic: global batch = per-process batch x world size x accumulation steps. The learning
rate is swept at ``base_batch`` and rescaled by a rule (Goyal et al. 2017: linear).
Data comes per rank from :mod:`stagewise.datasets.loader` (host batches, copied per step) or
:mod:`stagewise.training.device_data` (batches already on the device); the loop's :class:`Position` (epoch, micro-step,
optimizer step) is what a checkpoint stores to resume at exactly the same batch.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stagewise.core.errors import UserError
from stagewise.datasets.loader import ParquetBatches, split_batches
from stagewise.datasets.typed import index_error_hint
from stagewise.definitions.spec import Average, ModelSpec, batch_of, hook_error, hook_inputs, user_hook
from stagewise.models.building import BuiltModel, model_for_run
from stagewise.training.device_data import DeviceBatches, choose_placement, resident_bytes
from stagewise.training.distributed import DistEnv, any_rank
from stagewise.training.noise_scale import SPLIT_SPACING, NoiseScale, PartNorms, epoch_beta, split_interval
from stagewise.training.recipe import mark_source
from stagewise.training.step_graph import WARMUP_STEPS, CaptureFailed, StepGraph, StepOutputs, graph_plan, set_tf32
from stagewise.training.strategy import DDPStrategy, Strategy, make_strategy

Batches = ParquetBatches | DeviceBatches

log = logging.getLogger("stagewise.train")


def scaled_lr(base_lr: float, global_batch: int, base_batch: int, rule: str) -> float:
    """The learning rate for ``global_batch`` given the one that holds at ``base_batch``."""
    ratio = global_batch / base_batch
    if rule == "linear":
        return base_lr * ratio
    if rule == "sqrt":
        return base_lr * math.sqrt(ratio)
    if rule == "none":
        return base_lr
    raise UserError(f"train.lr_rule '{rule}' is not one of linear, sqrt, none")


def schedule_factor(schedule: Any, step: int, *, warmup_steps: int, total_steps: int, steps_per_epoch: int) -> float:
    """The factor of a stage's lr from its ``lr_schedule`` (stagewise.definitions.config.LRSchedule) at optimizer
    step ``step``: 1 through warmup, then decaying to ``min_lr_ratio`` by the stage's last step (cosine, linear) or by
    ``gamma`` every ``step_epochs`` epochs (step). The step is the stage's own, so a resume continues the curve."""
    if schedule.type == "constant":
        return 1.0
    floor = schedule.min_lr_ratio
    if schedule.type == "step":
        return max(schedule.gamma ** (step // (schedule.step_epochs * max(steps_per_epoch, 1))), floor)
    if step < warmup_steps:
        return 1.0
    progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule.type == "cosine" else 1 - progress
    return floor + (1 - floor) * shape


def stage_lr(lr: float, *, warmup_steps: int, schedule: Any, spec: ModelSpec, total_steps: int,
             steps_per_epoch: int, warmup_from: float | None = None) -> Callable[[int], float]:
    """A stage's lr at each optimizer step: the rescaled ``lr`` x warmup (from ``warmup_from``, the stage before's
    last lr, where there is one) x the spec's own ``lr_schedule`` (when it gives one) else the config's schedule."""
    start = None if warmup_from is None or lr <= 0 else min(1.0, max(0.0, warmup_from / lr))

    def lr_at(step: int) -> float:
        try:  # costs nothing per step until the user's schedule raises
            own = spec.lr_schedule(step, total_steps)
        except Exception as exc:
            if isinstance(exc, UserError):
                raise
            raise hook_error(spec, exc, "lr_schedule", context=f"at step {step} of {total_steps}") from exc
        factor = schedule_factor(schedule, step, warmup_steps=warmup_steps, total_steps=total_steps,
                                 steps_per_epoch=steps_per_epoch) if own is None else float(own)
        if not math.isfinite(factor) or factor < 0:
            raise UserError(f"{type(spec).__name__}.lr_schedule({step}, {total_steps}) gave {factor}: a factor >= 0")
        return lr * warmup_factor(step, warmup_steps, start) * factor

    return lr_at


def warmup_factor(step: int, warmup_steps: int, start: float | None = None) -> float:
    """Gradual warmup (Goyal et al. 2017): ramp linearly over the first ``warmup_steps`` steps from ``start`` (the
    stage before's lr as a fraction of this one's: no drop at the hand-off) to 1; from scratch, from 1/warmup_steps."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return 1.0
    if start is None:
        return (step + 1) / warmup_steps
    return start + (1.0 - start) * (step + 1) / warmup_steps


MAX_WARMUP_FRACTION = 0.25
"""The most of a stage's steps its warmup may take: a short stage still trains mostly at its own lr."""


class Diverged(UserError):
    """The training loss or the weights turned NaN/inf: the learning rate (or the data) is bad; a retry cannot help."""

    def __init__(self, message: str, *, epoch: int, step: int, lr: float) -> None:
        super().__init__(message)
        self.epoch, self.step, self.lr = epoch, step, lr


def seed_step(seed: int, device: str) -> None:
    """Seed the generators a step on ``device`` draws from: the CPU's and, on a GPU, that device's.

    Not torch.manual_seed: it also queues a seed for every other backend with a formatted stack trace
    (~0.4 ms a call, 3% of a 12 ms CPU step); the masks drawn are the same.
    """
    torch.default_generator.manual_seed(seed)
    if device != "cpu":
        index = torch.device(device).index
        _cuda_generator(torch.cuda.current_device() if index is None else index).manual_seed(seed)


@functools.cache
def _cuda_generator(index: int) -> torch.Generator:
    """GPU ``index``'s default generator: what torch.cuda.manual_seed seeds, without its device switch and lock."""
    torch.cuda.init()
    return torch.cuda.default_generators[index]


# torch.compile modes a stage can ask for ("off": eager).
COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune")
# The modes whose compiled forward and backward replay CUDA graphs (inductor's cudagraph trees): a replay reuses the
# memory of the replays before it, so nothing the loop keeps across two forwards may live there (see Loop._backward).
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")

# Stands for "no non-finite loss seen" in the divergence verdict.
_NO_STEP = 2**62
# Micro-steps whose losses wait on the device between two folds (a check, or a full buffer): one slot each.
LOSS_SLOTS = 1024


@dataclass(kw_only=True)
class EpochResult:
    """What one epoch did, reduced over ranks."""

    epoch: int
    """Zero-based epoch number."""
    train_loss: float
    """Mean training loss over the epoch's samples."""
    val_metric: float
    """The objective's metric on the validation split."""
    val_metrics: dict[str, float]
    """Every metric the spec reports on the validation split, plus ``loss``."""
    samples_per_s: float
    """Training samples per second over all ranks (validation excluded)."""
    lr: float
    """Learning rate at the epoch's last step."""
    steps: int
    """Optimizer steps taken so far in this stage."""
    grad_norm: float | None = None
    """Mean global gradient norm before clipping over the epoch's steps (None: the stage does not clip)."""
    noise_scale: float | None = None
    """The gradient noise scale B_simple at the epoch's end (stagewise.training.noise_scale; None: not measured)."""


@dataclass(kw_only=True)
class Position:
    """Where training stands: enough to resume at exactly the same batch."""

    epoch: int = 0
    """Current epoch."""
    micro_step: int = 0
    """Micro-batches of ``epoch`` already consumed (a multiple of the accumulation steps)."""
    step: int = 0
    """Optimizer steps taken in this stage."""
    loss_sum: float = 0.0
    """Every rank's summed loss over the epoch up to the last check (rank 0's position is what a checkpoint keeps)."""
    seen: int = 0
    """Every rank's samples over the epoch up to the last check."""
    grad_norm_sum: float = 0.0
    """Pre-clip gradient norms of the epoch's steps so far, summed (every rank holds the same)."""
    norm_steps: int = 0
    """The steps ``grad_norm_sum`` covers."""


class Loop:
    """Runs epochs of one model over per-rank Parquet batches; DDP-wrapped when the job has several ranks."""

    def __init__(self, *, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv,
                 train: Batches, validation: Batches, spec: ModelSpec, objective: str = "accuracy",
                 grad_accum_steps: int = 1, seed: int = 0, check_every_steps: int | None = None,
                 precision: str = "fp32", compile_mode: str = "off", grad_clip_norm: float | None = None,
                 noise_scale_every: int = 0, tf32: bool = True, cuda_graph: str = "off",
                 strategy: Strategy | None = None) -> None:
        """``check_every_steps``: also check for divergence after every this many optimizer steps (besides each
        epoch's end); give the checkpoint interval so no checkpoint is ever written from NaN weights.
        ``precision`` fp32, bf16 or fp16 (autocast around forward and loss; fp16 adds a gradient scaler, whose state
        :meth:`scaler_state` gives the checkpoint); ``compile_mode`` off or a torch.compile mode:
        only the training forward runs compiled, ``module`` stays the plain model (checkpoints, validation).
        ``grad_clip_norm``: clip the (all-reduced) gradients to this global L2 norm before each optimizer step.
        ``noise_scale_every``: measure the gradient noise scale on one optimizer step in this many (0: never;
        stagewise.training.noise_scale) from the parts of the step's batch (its micro-batches, or its two halves, each
        averaged over the ranks) against the whole, alike for every strategy; the two halves, a second forward and
        backward, are spaced out to ``SPLIT_SPACING`` x this after the first 10 measurements.
        ``tf32``: TensorFloat-32 float32 matmuls and convolutions on a CUDA device (process-wide; nothing on CPU).
        ``cuda_graph`` auto, on or off: capture the step as a CUDA graph where stagewise.training.step_graph.graph_plan
        allows it (the reason is logged once, a WARNING when ``on`` cannot).
        ``strategy``: how the model spreads over the ranks (stagewise.training.strategy; None: ddp); an fsdp module
        comes prepared (sharded) already, as its optimizer must see the sharded parameters."""
        self.env = env
        self.strategy = strategy if strategy is not None else DDPStrategy(env)
        self.module = model.to(env.device)
        self.model: nn.Module = self.strategy.wrap(self.module)
        self.noise_every = noise_scale_every
        self.noise: NoiseScale | None = None
        # Without accumulation the parts are two halves, a second forward and backward: spaced out once the EMA is filled.
        self._halves_spaced = noise_scale_every > 0 and grad_accum_steps == 1
        if noise_scale_every > 0:
            interval = noise_scale_every * (SPLIT_SPACING if self._halves_spaced else 1)
            measured_per_epoch = math.ceil(train.steps_per_epoch(0) / grad_accum_steps) / interval
            self.noise = NoiseScale(env.device, beta=epoch_beta(measured_per_epoch))
        self._parts: PartNorms | None = None  # a measured step's parts so far
        self.device_type = torch.device(env.device).type
        if precision not in ("fp32", "bf16", "fp16"):
            raise UserError(f"precision '{precision}' is not one of fp32, bf16, fp16")
        if precision == "bf16" and self.device_type == "cuda" and not torch.cuda.is_bf16_supported():
            raise UserError(f"precision 'bf16': the GPU {torch.cuda.get_device_name(env.device)} does not support bfloat16")
        self.precision = precision
        # fp16's narrow range underflows small gradients: the loss is scaled up and steps with inf/NaN are skipped.
        self.scaler = torch.amp.GradScaler(self.device_type) if precision == "fp16" else None
        if compile_mode not in COMPILE_MODES:
            raise UserError(f"compile '{compile_mode}' is not one of {', '.join(COMPILE_MODES)}")
        if compile_mode != "off":
            # The DDP wrapper is compiled (not the module inside) so DDP's graph breaks at its buckets apply (fsdp refuses compile).
            self.model = torch.compile(self.model, mode=None if compile_mode == "default" else compile_mode)
        # CUDA graphs: each compiled forward starts a new generation of replays (cudagraph_mark_step_begin, where this
        # torch has it), and gradients that several backwards of one step add up live in buffers made outside the graphs.
        self._graphs = compile_mode in CUDA_GRAPH_MODES
        self._mark_step: Callable[[], None] | None = (
            getattr(torch.compiler, "cudagraph_mark_step_begin", None) if self._graphs else None)
        self._trainable = [parameter for parameter in self.module.parameters() if parameter.requires_grad]
        self.optimizer = optimizer
        self.train_data, self.validation_data = train, validation
        self.grad_accum_steps = grad_accum_steps
        self.seed = seed
        self.position = Position()
        self.check_every_steps = check_every_steps
        self.spec, self.objective = spec, objective
        self._metric_names: list[str] | None = None
        self._spec_checked = False
        # What to add when the first batch indexes out of range (e.g. ids that were standardised): records -> text.
        self.index_hint: Callable[[torch.Tensor], str] | None = None
        # Kept on the device and read only at checks, so a step never waits for the GPU: each micro-step writes its
        # row-weighted loss into a slot (one kernel, where a running sum and a finite count took three), and a fold (at
        # a check, or when the slots run out) adds the slots to the loss sum and keeps the first micro-step since the
        # check whose loss was NaN/inf. Checks fall on optimizer-step boundaries, so micro-step k after a check belongs
        # to optimizer step (the step then) + k // accumulation steps.
        self._losses = torch.zeros(LOSS_SLOTS, dtype=torch.float64, device=env.device)
        self._filled = 0
        self._pending_loss = torch.zeros((), dtype=torch.float64, device=env.device)
        self._first_bad_micro = torch.full((), _NO_STEP, dtype=torch.int64, device=env.device)
        self._micro_since_check = 0
        self._step_at_check = 0
        self.grad_clip_norm = grad_clip_norm
        self._pending_norm = torch.zeros((), dtype=torch.float64, device=env.device)
        self._pending_norm_steps = 0
        self._pending_seen = 0  # this rank's samples since the last check, which adds every rank's into the position
        set_tf32(env.device, tf32)  # process-wide: each stage and trial sets its own
        self.tf32 = tf32
        capture, self.graph_reason = graph_plan(cuda_graph, device=env.device, world_size=env.world_size, spec=spec,
                                                grad_accum_steps=grad_accum_steps, precision=precision,
                                                compile_mode=compile_mode, strategy=self.strategy.name)
        self.step_graph = StepGraph(self._graph_body, self._trainable, env.device) if capture else None
        if env.master and cuda_graph != "off":
            if capture:
                log.info("training step: a CUDA graph, captured after %d eager steps (%s)", WARMUP_STEPS,
                         self.graph_reason)
            else:
                (log.warning if cuda_graph == "on" else log.info)("training step: eager, no CUDA graph (%s)",
                                                                 self.graph_reason)

    def scaler_state(self) -> dict[str, Any]:
        """The fp16 gradient scaler's state for a checkpoint (empty without one)."""
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_scaler_state(self, state: dict[str, Any]) -> None:
        """Resume the scaler where a checkpoint left it (its scale and growth tracker): the same steps are skipped."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)

    @property
    def global_batch(self) -> int:
        return self.train_data.batch_size * self.env.world_size * self.grad_accum_steps

    def _autocast(self, cache: bool = True) -> contextlib.AbstractContextManager:
        # A captured step casts its weights inside the graph each replay: no cache held across the capture's end.
        if self.precision in ("bf16", "fp16"):
            return torch.autocast(self.device_type, dtype=torch.bfloat16 if self.precision == "bf16" else torch.float16,
                                  cache_enabled=None if cache else False)
        return contextlib.nullcontext()

    def steps_per_epoch(self, epoch: int) -> int:
        """Optimizer steps in ``epoch``."""
        return math.ceil(self.train_data.steps_per_epoch(epoch) / self.grad_accum_steps)

    def _all_reduce(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.env.device)
        if self.env.distributed:
            import torch.distributed as dist

            dist.all_reduce(tensor)
        return tensor.tolist()

    def train_epoch(self, lr_at: Callable[[int], float],
                    on_step: Callable[[Loop], None] | None = None) -> EpochResult:
        """Finish the epoch at ``self.position`` (from its start, or mid-way after a resume)."""
        position = self.position
        self.model.train()
        micro_total = self.train_data.steps_per_epoch(position.epoch)
        started = time.perf_counter()
        samples_before, lr = position.seen, lr_at(position.step)
        # Batches of stagewise.training.device_data are on the device already: no second copy.
        to_device = self.env.device != "cpu" and not getattr(self.train_data, "on_device", False)
        for inputs, targets in self.train_data.epoch(position.epoch, skip_steps=position.micro_step):
            if to_device:
                inputs, targets = inputs.to(self.env.device, non_blocking=True), targets.to(self.env.device, non_blocking=True)
            if not self._spec_checked:
                check_spec(self.spec, self.module, inputs, targets, self.index_hint)
                self._spec_checked = True
            index = position.micro_step
            boundary = (index + 1) % self.grad_accum_steps == 0 or index + 1 == micro_total
            # Dropout masks depend only on (seed, epoch, micro-step, rank): a resumed run draws the same ones.
            seed_step(hash((self.seed, position.epoch, index, self.env.rank)) & 0x7FFFFFFF, self.env.device)
            split_measured = self.noise is not None and position.step % self._split_every() == 0
            graph = self.step_graph
            # The captured step (one micro-batch per step there); a measured step or a batch of other shapes runs eagerly.
            outputs = self._graph_step(inputs, targets) if (
                graph is not None and not split_measured and graph.fits(inputs, targets)) else None
            if outputs is not None:
                loss, graph_norm = outputs
            else:
                if graph is not None:
                    graph.release_grads()
                # A measured step's parts are each averaged over the ranks (as fsdp's every backward is): none unsynced.
                sync = self.strategy.no_sync() if not boundary and not split_measured else contextlib.nullcontext()
                with sync:
                    if split_measured:
                        loss = self._measured_backward(inputs, targets)
                    else:
                        loss = self._backward(inputs, targets, 1.0 / self.grad_accum_steps)
            rows = targets.shape[0]  # a host value (Tensor.__len__ is a Python call: several per step added up)
            # One device op (no host sync): the row-weighted loss into this micro-step's slot.
            if self._filled == self._losses.shape[0]:
                self._fold_losses()
            torch.mul(loss.detach(), rows, out=self._losses[self._filled])
            self._filled += 1
            if self._micro_since_check == 0:
                self._step_at_check = position.step
            self._micro_since_check += 1
            self._pending_seen += rows
            position.micro_step += 1
            if boundary:
                lr = lr_at(position.step)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr * group.get("lr_scale", 1.0)
                # The measurement reads the loss-scaled fp16 gradients and divides the scale out: before unscale_.
                if self._parts is not None:
                    self._fold_split_measurement()
                if outputs is not None:  # the graph clipped (in the graph) and keeps its gradients for the next replay
                    if graph_norm is not None:
                        self._pending_norm.add_(graph_norm)
                        self._pending_norm_steps += 1
                    self.optimizer.step()
                    if graph is not None and not graph.captured:  # a warm-up step: the next makes its own gradients
                        self.optimizer.zero_grad(set_to_none=True)
                else:
                    if self.grad_clip_norm is not None:
                        if self.scaler is not None:
                            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
                        # Averaged gradients (or their shards, the norm reduced over them): every rank clips alike.
                        self._pending_norm.add_(self.strategy.clip(self._trainable, self.grad_clip_norm))
                        self._pending_norm_steps += 1
                    if self.scaler is not None:
                        # Reads the overflow flag on the host (found_inf.item()): fp16's one sync per step, by design.
                        self.scaler.step(self.optimizer)  # skipped when the scaled gradients overflowed
                        self.scaler.update()
                    else:
                        self.optimizer.step()
                    self.optimizer.zero_grad(set_to_none=True)
                    if graph is not None:
                        graph.restore_grads()
                position.step += 1
                if self.check_every_steps and position.step % self.check_every_steps == 0:
                    self.check_finite(lr_at)
                if on_step is not None:
                    on_step(self)
        self.check_finite(lr_at)
        elapsed = time.perf_counter() - started
        sums = self.validation_sums()
        names = self._agreed_metric_names(sums)
        totals = [float(sums[name][0]) if name in sums else 0.0 for name in names]
        counts = [float(sums[name][1]) if name in sums else 0.0 for name in names]
        reduced = self._all_reduce([*totals, *counts])
        loss_sum, seen, new_samples = position.loss_sum, position.seen, position.seen - samples_before
        roots = {name: bool(sums[name][2]) for name in sums}
        metrics = {}
        for index, name in enumerate(names):
            mean = reduced[index] / max(reduced[len(names) + index], 1e-12)
            metrics[name] = math.sqrt(mean) if roots.get(name) else mean
        if self.objective not in metrics:
            raise UserError(f"objective.metric '{self.objective}' is not among the validation metrics "
                            f"{type(self.spec).__name__} reports: {sorted(metrics)}")
        grad_norm = position.grad_norm_sum / position.norm_steps if position.norm_steps else None
        result = EpochResult(epoch=position.epoch, train_loss=loss_sum / max(seen, 1), val_metric=metrics[self.objective],
                             val_metrics=metrics, samples_per_s=new_samples / max(elapsed, 1e-9), lr=lr, steps=position.step,
                             grad_norm=grad_norm, noise_scale=self.noise_estimates().get("noise_scale"))
        self.position = Position(epoch=position.epoch + 1, step=position.step)
        return result

    def _graph_body(self, inputs: torch.Tensor, targets: torch.Tensor) -> StepOutputs:
        """What the step graph warms up and captures: forward, the spec's loss, backward into fresh gradients and, when the
        stage clips, the clip (a device op: the norm is the graph's output, read after each replay)."""
        features, labels = batch_of(self.spec, inputs, targets)
        with self._autocast(cache=False):
            loss = self.spec.loss(self.model(features), labels)
        loss.backward()
        norm = (nn.utils.clip_grad_norm_(self._trainable, self.grad_clip_norm)
                if self.grad_clip_norm is not None else None)
        return loss.detach(), norm

    def _graph_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> StepOutputs | None:
        """The step through the step graph; None (and the graph dropped, with a WARNING) when its capture failed."""
        assert self.step_graph is not None
        try:
            return self.step_graph.step(inputs, targets)
        except CaptureFailed as failure:
            if self.env.master:
                log.warning("training step: the CUDA graph capture failed, so the stage steps eagerly from here (%s); "
                            "a spec whose step reads values on the host should not declare static_shapes", failure)
            self.step_graph = None
            self.graph_reason = f"the capture failed: {failure}"
            return None

    def _backward(self, inputs: torch.Tensor, targets: torch.Tensor, weight: float) -> torch.Tensor:
        """Forward, the spec's loss and the backward of ``weight`` × that loss (scaled for fp16); returns the loss.

        Under CUDA graphs (``compile`` reduce-overhead, max-autotune) each forward first marks a new step: the replays
        before it may be overwritten from then on. A gradient that a backward creates would be such a replay's output,
        so where a step runs several backwards (accumulation, the noise scale's parts) the gradients are allocated here
        first, outside the graphs, and each backward adds into them (PyTorch's advice for accumulation under
        cudagraph trees); the loss is computed outside the compiled module, so it is no replay's output."""
        features, labels = batch_of(self.spec, inputs, targets)
        if self._graphs:
            if self.grad_accum_steps > 1:
                self._allocate_grads()
            if self._mark_step is not None:
                self._mark_step()
        with self._autocast():
            loss = self.spec.loss(self.model(features), labels)
        weighted = loss * weight if weight != 1.0 else loss  # one kernel launch less per step
        (self.scaler.scale(weighted) if self.scaler is not None else weighted).backward()
        return loss

    def _grad_sq(self) -> torch.Tensor:
        """Σ |p.grad|² now, unscaled from fp16's loss scale, as a float64 device scalar (no host sync)."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        squared = self.strategy.grad_norm(grads).double().square()
        return squared / self.scaler._scale.double().square() if self.scaler is not None else squared

    def _allocate_grads(self) -> None:
        """Zeroed gradient buffers for the parameters that have none (eager: outside any CUDA graph)."""
        for parameter in self._trainable:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)

    def _measured_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """A measured step: each part's own squared gradient norm (averaged over the ranks), taken on the way to the
        step's gradient (the same gradient, as the batch's mean loss is the weighted mean of its parts' mean losses). With
        gradient accumulation the parts are the step's micro-batches; without, the micro-batch runs as two halves. Assumes
        the spec's loss is a mean over the batch, as torch's losses are by default."""
        size, accumulation = len(targets), self.grad_accum_steps
        if accumulation > 1:
            return self._part_backward(inputs, targets, 1.0 / accumulation)
        if size < 2:
            return self._backward(inputs, targets, 1.0)
        half = size // 2
        # Detached copy: a value the step keeps past the next forward is never a replay's memory (CUDA graphs).
        first_loss = self._part_backward(inputs[:half], targets[:half], half / size).detach().clone()
        second_loss = self._part_backward(inputs[half:], targets[half:], (size - half) / size).detach()
        return (first_loss * half + second_loss * (size - half)) / size

    def _part_backward(self, inputs: torch.Tensor, targets: torch.Tensor, weight: float) -> torch.Tensor:
        """One part of a measured step: its backward runs into fresh gradients (the step's so far set aside, no copy),
        its squared norm goes to :class:`PartNorms`, and the set-aside gradients are added back."""
        if self._parts is None:
            self._parts = PartNorms()
        kept = [parameter.grad for parameter in self._trainable]
        for parameter in self._trainable:
            parameter.grad = None
        if self._graphs:
            self._allocate_grads()
        loss = self._backward(inputs, targets, weight)
        # The part's gradient averages the ranks' parts (DDP's all-reduce, fsdp's reduce-scatter): that many rows.
        self._parts.add(self._grad_sq(), len(targets) * self.strategy.gradient_ranks, weight)
        into, added = [], []
        for parameter, grad in zip(self._trainable, kept):
            if grad is None:
                continue
            if parameter.grad is None:  # unused by this part
                parameter.grad = grad
            else:
                into.append(parameter.grad)
                added.append(grad)
        if into:
            torch._foreach_add_(into, added)
        return loss

    def _split_every(self) -> int:
        """Optimizer steps between one rank's measured steps (stagewise.training.noise_scale.split_interval)."""
        assert self.noise is not None
        return split_interval(self.noise_every, self.noise.updates) if self._halves_spaced else self.noise_every

    def _fold_split_measurement(self) -> None:
        assert self.noise is not None and self._parts is not None
        parts, self._parts = self._parts, None
        parts.fold(self.noise, self._grad_sq())

    def noise_state(self) -> dict[str, Any]:
        """The noise scale's state for a checkpoint (empty when not measured)."""
        return self.noise.state_dict() if self.noise is not None else {}

    def load_noise_state(self, state: dict[str, Any]) -> None:
        if self.noise is not None and state:
            self.noise.load_state_dict(state)

    def noise_estimates(self) -> dict[str, Any]:
        """The noise scale's estimates so far (empty when not measured or before its first measurement)."""
        if self.noise is None:
            return {}
        return self.noise.estimates() or {}

    @torch.no_grad()
    def _fold_losses(self) -> None:
        """The filled loss slots into the loss sum and the first non-finite micro-step since the check (device ops)."""
        if not self._filled:
            return
        filled = self._losses[: self._filled]
        self._pending_loss.add_(filled.sum())
        bad = ~torch.isfinite(filled)
        offset = self._micro_since_check - self._filled  # the micro-step of slot 0, counted from the check
        first = torch.where(bad.any(), bad.to(torch.int64).argmax() + offset, _NO_STEP)  # argmax: the first True
        torch.minimum(self._first_bad_micro, first, out=self._first_bad_micro)
        self._filled = 0

    @torch.no_grad()
    def check_finite(self, lr_at: Callable[[int], float]) -> None:
        """Fold every rank's losses and samples since the last check into the position (so rank 0's, which a checkpoint
        keeps, resumes the epoch's whole record); raise :class:`Diverged` when a loss or a weight is NaN/inf on any rank
        (every rank reaches the same verdict, so none is left waiting)."""
        self._fold_losses()
        weights_bad = torch.stack([~torch.isfinite(self.strategy.local(p)).all() for p in self.module.parameters()]).any()
        loss_sum, norm_sum, first_micro, weights_bad_here = torch.stack([
            self._pending_loss, self._pending_norm, self._first_bad_micro.double(), weights_bad.double()]).tolist()
        first_micro = int(first_micro)  # 2**62 and every micro-step count are exact in float64
        first_bad_here = (self._step_at_check + first_micro // self.grad_accum_steps
                          if first_micro < self._micro_since_check else _NO_STEP)
        self._micro_since_check = 0
        self._first_bad_micro.fill_(_NO_STEP)
        ranks = [[loss_sum, float(self._pending_seen), -float(first_bad_here), weights_bad_here]]
        if self.env.distributed:
            import torch.distributed as dist

            # One collective for sums and verdict: every rank adds the gathered rows in rank order, so all hold the same.
            mine = torch.tensor(ranks[0], dtype=torch.float64, device=self.env.device)
            gathered = [torch.empty_like(mine) for _ in range(self.env.world_size)]
            dist.all_gather(gathered, mine)
            ranks = torch.stack(gathered).tolist()
        negated_first_bad, any_weights_bad = max(row[2] for row in ranks), max(row[3] for row in ranks)
        self.position.loss_sum += sum(row[0] for row in ranks)
        self.position.seen += int(sum(row[1] for row in ranks))
        self._pending_seen = 0
        self._pending_loss.zero_()
        self.position.grad_norm_sum += norm_sum
        self.position.norm_steps += self._pending_norm_steps
        self._pending_norm.zero_()
        self._pending_norm_steps = 0
        first_bad = int(-negated_first_bad)
        if first_bad == _NO_STEP and not any_weights_bad:
            return
        epoch = self.position.epoch + 1
        if first_bad != _NO_STEP:  # steps count from 1 in messages, as in the progress log
            step, lr = first_bad + 1, lr_at(first_bad)
            what = f"the training loss turned NaN/inf at epoch {epoch}, step {step}"
        else:
            step, lr = self.position.step, lr_at(max(self.position.step - 1, 0))
            what = f"the weights turned NaN/inf by epoch {epoch}, step {step}"
        raise Diverged(f"training diverged: {what} (lr {lr:.4g}); lower the learning rate (sweep.search_space.lr, "
                       f"--params or train.default_params) or check the data", epoch=epoch, step=step, lr=lr)

    @torch.no_grad()
    def validation_sums(self) -> dict[str, tuple[float, float, bool]]:
        """This rank's (total, count, root) of every validation metric, ``loss`` included."""
        self.module.eval()
        sums = accumulate_metrics(self.spec, self.module, self.validation_data.epoch(0), self.env.device)
        # A sharded module's forward all-gathers: a rank with fewer validation batches runs as many, on one row.
        extra = self.strategy.forwards_to_match(self.validation_data.steps_per_epoch(0))
        if extra:
            features, labels = next(iter(self.validation_data.epoch(0) if self.validation_data.steps_per_epoch(0)
                                         else self.train_data.epoch(0)))
            inputs, _ = batch_of(self.spec, features[:1].to(self.env.device), labels[:1].to(self.env.device))
            for _ in range(extra):
                self.module(inputs)
        self.module.train()
        return sums

    def _agreed_metric_names(self, sums: dict[str, tuple[float, float, bool]]) -> list[str]:
        # A rank without validation rows has no names of its own: every rank takes the union, once.
        if self._metric_names is None:
            names = set(sums)
            if self.env.distributed:
                import torch.distributed as dist

                gathered: list[Any] = [None] * self.env.world_size
                dist.all_gather_object(gathered, sorted(names))
                names = set().union(*map(set, gathered))
            self._metric_names = sorted(names)
        return self._metric_names


def _shape(value: Any) -> str:
    return f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def check_spec(spec: ModelSpec, module: nn.Module, features: torch.Tensor, labels: torch.Tensor,
               index_hint: Callable[[torch.Tensor], str] | None = None) -> None:
    """Run the spec once on a real batch before training and name the part that breaks its contract.

    A module whose outputs do not fit the targets (e.g. fewer logits than classes) or a loss that is no
    scalar would otherwise fail deep inside the first step as a bare RuntimeError that Airflow retries.
    """
    name, rows = type(spec).__name__, len(labels)
    # Each hook on its own: a shape error is named in the hook that raised it, with where its inputs came from.
    first = f"on a first batch of {rows} rows"

    def hint(exc: BaseException) -> str:
        return index_hint(features) if index_hint is not None and "index out of range" in str(exc) else ""

    with user_hook(spec, "batch", context=first, shapes={"features": features, "labels": labels}, hint=hint):
        inputs, targets = batch_of(spec, features, labels)
    with user_hook(spec, "forward", module=module, context=first, hint=hint,
                   shapes=hook_inputs(spec, "forward", module, inputs)):
        outputs = module(inputs)
    with user_hook(spec, "loss", context=first, hint=hint, shapes=hook_inputs(spec, "loss", module, outputs, targets)):
        loss = spec.loss(outputs, targets)
    with user_hook(spec, "predict", context=first, shapes=hook_inputs(spec, "predict", module, outputs)):
        predictions = spec.predict(outputs.detach())
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad):
        raise UserError(f"{name}.loss must return a scalar tensor with a gradient (the batch mean), got {_shape(loss)}"
                        f"{'' if not isinstance(loss, torch.Tensor) or loss.requires_grad else ' without a gradient'}")
    for column, tensor in (predictions.items() if isinstance(predictions, dict) else [("(return value)", predictions)]):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0 or len(tensor) != rows:
            raise UserError(f"{name}.predict()['{column}'] must be a tensor with one row per input row ({rows}), "
                            f"got {_shape(tensor)}")


def accumulate_metrics(spec: ModelSpec, module: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                       device: str, on_outputs: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
                       ) -> dict[str, tuple[float, float, bool]]:
    """Sum a spec's metrics (and its loss) over batches: name -> (total, count, root). Shared by validation and test;
    ``on_outputs(outputs, targets)`` sees each batch's outputs too, so a caller needs no second forward pass."""
    totals: dict[str, list[Any]] = {}
    with user_hook(spec, module=module):  # batch, forward, metrics, loss (and predict in on_outputs) name themselves
        for features, labels in batches:
            inputs, targets = batch_of(spec, features.to(device), labels.to(device))
            outputs = module(inputs)
            if on_outputs is not None:
                on_outputs(outputs, targets)
            reported = spec.metrics(outputs, targets)
            if not isinstance(reported, dict):
                raise UserError(f"{type(spec).__name__}.metrics must return a dict of name -> Average, got "
                                f"{type(reported).__name__}")
            rows = len(targets)
            for name, value in {**reported, "loss": Average(spec.loss(outputs, targets).detach() * rows, rows)}.items():
                if not isinstance(value, Average):
                    raise UserError(f"{type(spec).__name__}.metrics()['{name}'] is a {type(value).__name__}, not an "
                                    f"Average(total, count): per-batch means cannot be reduced across batches and ranks")
                entry = totals.setdefault(name, [0.0, 0.0, value.root])
                entry[0] = entry[0] + value.total  # stays on the device until the end: no sync per batch
                entry[1] = entry[1] + value.count
    return {name: (float(total), float(count), root) for name, (total, count, root) in totals.items()}


def rank_batches(manifest: dict[str, Any], env: DistEnv, *, batch_size: int, seed: int,
                 too_few_rows: Callable[[int], str], placement: str = "auto",
                 memory_fraction: float = 0.5, shuffle_block_rows: int = 1, quiet: bool = False) -> tuple[Batches, Batches]:
    """This rank's shuffled train batches and its validation batches. A batch that leaves no optimizer step is a user
    error (``too_few_rows(rows per rank)`` says which setting); the ranks agree on it first (one all-reduce), so all refuse
    together, each saying why, and none hangs in DDP. ``placement`` (auto, host, resident, streamed) and ``memory_fraction`` pick where
    batches are made (stagewise.training.device_data.choose_placement); rank 0 logs the choice. ``shuffle_block_rows``
    coarsens the host loader's shuffle (stagewise.datasets.loader.ParquetBatches); ``quiet`` leaves the choice unlogged
    (a row-budget trial makes batches again each round)."""
    train = split_batches(manifest, "train", rank=env.rank, world_size=env.world_size, batch_size=batch_size, seed=seed,
                          shuffle_block_rows=shuffle_block_rows)
    validation = split_batches(manifest, "validation", rank=env.rank, world_size=env.world_size, batch_size=4096,
                               seed=0, shuffle=False)
    if any_rank(env, train.steps_per_epoch(0) == 0):
        raise UserError(too_few_rows(train.num_rows // env.world_size))
    chosen, why = choose_placement(placement, memory_fraction, env.device, resident_bytes(train) + resident_bytes(validation))
    if env.master and not quiet:
        log.info("data placement: %s", why)
    if chosen == "host":
        return train, validation
    if shuffle_block_rows > 1 and env.master:
        log.warning("shuffle_block_rows %d applies to the host loader only: %s batches shuffle single rows",
                    shuffle_block_rows, chosen)
    resident = chosen == "resident"
    return DeviceBatches(train, env.device, resident=resident), DeviceBatches(validation, env.device, resident=resident)


def start_loop(config: Any, manifest: dict[str, Any], env: DistEnv, swept: dict[str, Any], train: Batches,
               validation: Batches, *, seed: int, grad_accum_steps: int = 1, check_every_steps: int | None = None,
               precision: str = "fp32", compile_mode: str = "off", grad_clip_norm: float | None = None,
               noise_scale_every: int = 0, tf32: bool = True, cuda_graph: str = "off", strategy: str = "ddp",
               activation_checkpointing: bool = False) -> tuple[BuiltModel, Loop]:
    """The one setup of a sweep trial and a training stage: the config's model built with these hyperparameters, on the
    rank's device, spread over the ranks by ``strategy`` (ddp, fsdp), its optimizer, and the loop over the rank's
    batches (seed the RNG first for a reproducible init)."""
    built = model_for_run(config, manifest, swept)
    model = built.module.to(env.device)  # before the optimizer exists or loads state: its buffers follow the params
    spread = make_strategy(strategy, env, spec=built.spec, precision=precision,
                           activation_checkpointing=activation_checkpointing)
    spread.prepare(model)  # fsdp shards in place: the optimizer must see the sharded parameters
    loop = Loop(model=model, optimizer=make_optimizer(model, built.params, built.spec), env=env, train=train, validation=validation,
                spec=built.spec, objective=config.objective.metric, grad_accum_steps=grad_accum_steps, seed=seed,
                check_every_steps=check_every_steps, precision=precision, compile_mode=compile_mode,
                grad_clip_norm=grad_clip_norm, noise_scale_every=noise_scale_every, tf32=tf32, cuda_graph=cuda_graph,
                strategy=spread)
    loop.index_hint = lambda records: index_error_hint(manifest, records.detach().cpu().numpy())
    return built, loop


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Parameter groups with weight decay on weight matrices and kernels only: biases and norm scales (1-d tensors)
    are not pulled towards zero, as in most transformer and CNN recipes."""
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    groups = [{"params": [p for p in trainable if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def make_optimizer(model: nn.Module, params: dict, spec: ModelSpec | None = None) -> torch.optim.Optimizer:
    """The spec's own optimizer (``ModelSpec.optimizer``) when it builds one, else SGD with Nesterov momentum (what
    the linear scaling rule was shown on) or AdamW over :func:`decay_groups`. Each group keeps its lr as a multiple of
    ``params["lr"]`` (``lr_scale``), so the stage's rescaled, warmed-up, scheduled lr keeps per-group ratios."""
    optimizer = None
    if spec is not None:
        with user_hook(spec, "optimizer"):
            optimizer = spec.optimizer(model, params)
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UserError(f"{type(spec).__name__}.optimizer() returned {type(optimizer).__name__}, not a "
                            "torch.optim.Optimizer")
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        missing = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in owned]
        if missing:
            raise UserError(f"{type(spec).__name__}.optimizer() leaves trainable parameters out: {missing[:5]}")
        mark_source(optimizer, "spec")
    elif params.get("optimizer", "sgd") == "adamw":
        optimizer = torch.optim.AdamW(decay_groups(model, params["weight_decay"]), lr=params["lr"])
    else:
        momentum = params["momentum"]
        optimizer = torch.optim.SGD(decay_groups(model, params["weight_decay"]), lr=params["lr"], momentum=momentum,
                                    nesterov=momentum > 0)
    for group in optimizer.param_groups:
        group.setdefault("lr_scale", group["lr"] / params["lr"] if params["lr"] else 1.0)
    return optimizer


def eta_s(epochs_done: int, epochs_total: int, elapsed_s: float) -> float:
    return elapsed_s / max(epochs_done, 1) * (epochs_total - epochs_done)
