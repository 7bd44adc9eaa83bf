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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stagewise.core.errors import UserError
from stagewise.datasets.loader import ParquetBatches, split_batches
from stagewise.datasets.typed import index_error_hint
from stagewise.definitions.spec import ModelSpec, batch_of
from stagewise.models.building import BuiltModel, model_for_run
from stagewise.training.device_data import DeviceBatches, choose_placement, resident_bytes
from stagewise.training.distributed import DistEnv, any_rank
from stagewise.training.measurement import NoiseMeasurement
from stagewise.training.noise_scale import NoiseScale, PartNorms, epoch_beta
from stagewise.training.optimizers import make_optimizer
from stagewise.training.step_graph import WARMUP_STEPS, CaptureFailed, StepGraph, StepOutputs, graph_plan, set_tf32
from stagewise.training.strategy import DDPStrategy, Strategy, make_strategy
from stagewise.training.validation import MetricTotals, accumulate_metrics, check_spec

Batches = ParquetBatches | DeviceBatches

log = logging.getLogger("stagewise.train")


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
    validation_s: float | None = None
    """Seconds the epoch's validation took on this rank: every metric's states, their all-reduce and computation."""


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


class Loop(NoiseMeasurement):
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
            # Counted at the configured interval: a spaced measurement weighs as the SPLIT_SPACING it stands for.
            measured_per_epoch = math.ceil(train.steps_per_epoch(0) / grad_accum_steps) / noise_scale_every
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
        self._metric_layout_checked = False
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

    def _all_reduce_vector(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.env.distributed:
            import torch.distributed as dist

            dist.all_reduce(tensor)
        return tensor

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
                check_spec(self.spec, self.module, inputs, targets, self.index_hint, objective=self.objective)
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
        validation_started = time.perf_counter()
        metrics = self.validation_metrics()
        validation_s = time.perf_counter() - validation_started
        loss_sum, seen, new_samples = position.loss_sum, position.seen, position.seen - samples_before
        if self.objective not in metrics:
            raise UserError(f"objective.metric '{self.objective}' is not among the validation metrics "
                            f"{type(self.spec).__name__} reports: {sorted(metrics)}")
        grad_norm = position.grad_norm_sum / position.norm_steps if position.norm_steps else None
        result = EpochResult(epoch=position.epoch, train_loss=loss_sum / max(seen, 1), val_metric=metrics[self.objective],
                             val_metrics=metrics, samples_per_s=new_samples / max(elapsed, 1e-9), lr=lr, steps=position.step,
                             grad_norm=grad_norm, noise_scale=self.noise_estimates().get("noise_scale"),
                             validation_s=validation_s)
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
    def validation_metrics(self) -> dict[str, float]:
        """Every validation metric, ``loss`` included: this rank's states, one all-reduce of them all, computed once."""
        totals = self.validation_totals()
        self._check_metric_layout(totals)
        return totals.values(self._all_reduce_vector(totals.vector()))

    @torch.no_grad()
    def validation_totals(self) -> MetricTotals:
        """This rank's summed metric states on the validation split, ``loss`` included."""
        self.module.eval()
        totals = accumulate_metrics(self.spec, self.module, self.validation_data.epoch(0), self.env.device)
        # A sharded module's forward all-gathers: a rank with fewer validation batches runs as many, on one row. A rank
        # with none learns the metrics' states from one such row (then zeroed), so its vector has every rank's layout.
        extra = self.strategy.forwards_to_match(self.validation_data.steps_per_epoch(0))
        probes = extra or int(totals.empty)
        if probes:
            features, labels = next(iter(self.validation_data.epoch(0) if self.validation_data.steps_per_epoch(0)
                                         else self.train_data.epoch(0)))
            inputs, targets = batch_of(self.spec, features[:1].to(self.env.device), labels[:1].to(self.env.device))
            for _ in range(probes):
                outputs = self.module(inputs)
                if totals.empty:
                    totals.add(self.spec.metrics(outputs, targets), len(targets), self.spec.loss(outputs, targets),
                               self.env.device)
                    totals.zero_()
        self.module.train()
        return totals

    def _check_metric_layout(self, totals: MetricTotals) -> None:
        # The ranks' state vectors are summed element by element: once, check that every rank lays them out alike.
        if self._metric_layout_checked or not self.env.distributed:
            return
        import torch.distributed as dist

        gathered: list[Any] = [None] * self.env.world_size
        dist.all_gather_object(gathered, totals.signature())
        if any(layout != gathered[0] for layout in gathered):
            raise UserError(f"{type(self.spec).__name__}.metrics() reports different metrics or state shapes on "
                            f"different ranks ({sorted({name for layout in gathered for name, _, _ in layout})}): "
                            f"each rank must report the same states, whatever its rows")
        self._metric_layout_checked = True


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



def eta_s(epochs_done: int, epochs_total: int, elapsed_s: float) -> float:
    return elapsed_s / max(epochs_done, 1) * (epochs_total - epochs_done)
