"""The training stages: batch, schedule, precision and strategy per stage, and the evaluation after them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from stagewise.definitions.hyperparams import hyperparameter_problem
from stagewise.definitions.sections.base import MAX_BATCH, MAX_EPOCHS, MAX_SEED, MAX_STEPS, StrictModel
from stagewise.definitions.sections.sweep import EntryPoint
from stagewise.definitions.sharding import stage_strategy_problem


class LRSchedule(StrictModel):
    """The learning rate after warmup, on the stage's optimizer steps (a resumed stage continues the curve)."""

    type: Literal["constant", "cosine", "linear", "step"] = Field(
        "constant", description="constant, cosine or linear decay to the floor, or step decay every step_epochs.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="The floor, as a fraction of the stage's (rescaled) lr.")
    step_epochs: int = Field(1, ge=1, le=MAX_EPOCHS, description="step: epochs between two decays (at most 10000).")
    gamma: float = Field(0.1, gt=0, lt=1, description="step: the factor of each decay.")


class EarlyStopping(StrictModel):
    """Stop a stage whose objective has not improved for a while."""

    patience: int = Field(ge=1, le=MAX_EPOCHS, description="Epochs without improvement before the stage stops (at most 10000).")
    min_delta: float = Field(0.0, ge=0, description="The least change of the objective that counts as improvement.")


# The built-in loop's knobs: a stage that runs the user's own script never gets them, so it may not change their defaults.
BUILT_IN_LOOP_KNOBS = ("lr_schedule", "grad_clip_norm", "hand_on", "hand_on_optimizer", "early_stopping", "precision",
                       "data_placement", "resident_memory_fraction", "shuffle_block_rows", "compile", "tf32", "cuda_graph", "strategy",
                       "activation_checkpointing")


class TrainStage(StrictModel):
    """One training stage: its own process count, batch and epochs."""

    name: str = Field(pattern=r"^[A-Za-z0-9_]+$", description="Stage name; used in task ids and paths.")
    profile: str = Field(description="Instance profile (processes_per_node sets the world size).")
    per_process_batch: int | None = Field(None, ge=1, le=MAX_BATCH, description="Micro-batch on each process (or give global_batch); at most 16777216.")
    global_batch: int | None = Field(None, ge=1, le=MAX_BATCH, description=(
        "Samples per optimizer step over all processes (or give per_process_batch); at most 16777216."))
    grad_accum_steps: int = Field(1, ge=1, le=65_536, description="Micro-batches accumulated per optimizer step (at most 65536).")
    epochs: int = Field(ge=1, le=10000, description="Epochs of this stage (at most 10000).")
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, description="Linear LR warmup steps when the global batch grew (at most 10^9).")
    entrypoint: EntryPoint | None = Field(None, description="Run this user script/module instead of stagewise.train.")
    data_placement: Literal["auto", "host", "resident", "streamed"] = Field("auto", description=(
        "Where batches are shuffled and sliced: auto (CUDA: resident if it fits, else streamed; CPU: host), host "
        "(stagewise.datasets.loader, copied per batch), resident (read and moved once) or streamed (chunks copied ahead) on the device."))
    resident_memory_fraction: float = Field(0.5, gt=0, le=1, description=(
        "auto: data is resident when the whole train split (per rank) fits in this fraction of the device's memory."))
    shuffle_block_rows: int = Field(1, ge=1, le=MAX_BATCH, description=(
        "Host loader: rows move within a shuffle window in runs of this many stored rows (1: single rows; more is "
        "coarser and faster, see bench parquet_loading's details; at most 16777216); device placements always "
        "shuffle single rows."))
    precision: Literal["fp32", "bf16", "fp16"] = Field("fp32", description=(
        "bf16 or fp16: forward and loss under autocast (weights stay fp32); fp16 adds a gradient scaler, checkpointed."))
    compile: Literal["off", "default", "reduce-overhead", "max-autotune"] = Field("off", description=(
        "torch.compile the model with this mode (reduce-overhead: CUDA graphs); checkpoints stay the plain model's."))
    tf32: bool = Field(True, description=(
        "On a GPU with TensorFloat-32 (Ampere and later), float32 matmuls and convolutions use it (several times "
        "faster, a 10-bit mantissa); false: exact float32. No effect on CPU."))
    cuda_graph: Literal["auto", "on", "off"] = Field("auto", description=(
        "Capture the training step (forward, loss, backward, clipping) as a CUDA graph and replay it: auto and on do "
        "where it is safe (one process on CUDA, a spec with static_shapes, fp32/bf16, no accumulation, compile off; "
        "otherwise eager, logged why: a WARNING for on); off: always eager."))
    strategy: Literal["ddp", "fsdp"] = Field("ddp", description=(
        "ddp: a full copy of parameters, gradients and optimizer state per rank; fsdp: all three sharded over the "
        "stage's ranks (FSDP2, sharded checkpoints), for models that do not fit one device (docs/stages.md)."))
    activation_checkpointing: bool = Field(False, description=(
        "fsdp: recompute each unit's activations in its backward instead of keeping them (less memory, ~1/3 more compute)."))
    lr_schedule: LRSchedule = Field(default_factory=LRSchedule, description=(
        "The lr after warmup (a spec's lr_schedule() replaces it); the batch rescale and warmup apply on top."))
    grad_clip_norm: float | None = Field(None, gt=0, description=(
        "Clip gradients to this global L2 norm before each optimizer step (the pre-clip norm is logged per epoch)."))
    hand_on: Literal["best", "last"] = Field("best", description=(
        "Which epoch's model the stage hands to the next stage, evaluation and the registry: best on the objective, or last."))
    hand_on_optimizer: bool = Field(True, description=(
        "Hand the optimizer state on with the model (a sharded checkpoint beside final.pt, ~2x the model with Adam)."))
    early_stopping: EarlyStopping | None = Field(None, description="Stop the stage early when the objective stalls.")

    @model_validator(mode="after")
    def _one_batch_size(self) -> TrainStage:
        if (self.per_process_batch is None) == (self.global_batch is None):
            raise ValueError("give exactly one of per_process_batch and global_batch")
        return self

    @model_validator(mode="after")
    def _one_way_to_cuda_graphs(self) -> TrainStage:
        if self.cuda_graph == "on" and self.compile != "off":
            raise ValueError(f"cuda_graph: 'on' captures the eager step; compile '{self.compile}' runs the forward through "
                             "torch.compile instead (reduce-overhead makes its own CUDA graphs): set one of them")
        return self

    @model_validator(mode="after")
    def _fsdp_knobs(self) -> TrainStage:
        if problem := stage_strategy_problem(self):
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _built_in_knobs_only_on_the_built_in_loop(self) -> TrainStage:
        # Compared with the defaults, not with the keys given: a run's config snapshot writes every key out.
        given = [knob for knob in BUILT_IN_LOOP_KNOBS if getattr(self, knob) != type(self).model_fields[knob].get_default(
            call_default_factory=True)]
        if self.entrypoint is not None and given:
            raise ValueError(f"{', '.join(given)}: the built-in loop's, but this stage runs its own entrypoint, which "
                             "never sees them; drop them (the script decides its schedule, clipping, epoch, precision and data itself)")
        return self

    def micro_batch(self, world_size: int) -> int:
        """Per-process batch: global batch = micro batch x world size x accumulation steps."""
        if self.per_process_batch is not None:
            return self.per_process_batch
        assert self.global_batch is not None
        return self.global_batch // (world_size * self.grad_accum_steps)

    def global_batch_for(self, world_size: int) -> int:
        """Samples per optimizer step over ``world_size`` processes."""
        return self.micro_batch(world_size) * world_size * self.grad_accum_steps


class Train(StrictModel):
    """Sequential DDP stages whose global batch grows."""

    base_batch: int = Field(32, ge=1, le=MAX_BATCH, description="Global batch at which the swept lr holds (at most 16777216).")
    lr_rule: Literal["linear", "sqrt", "none"] = Field("linear", description="How lr scales with global batch.")
    default_params: dict[str, float | int | str] = Field(
        default_factory=dict, description="Hyperparameters used where the sweep does not set them."
    )
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed of init, shuffling and dropout, 0 to 4294967295.")
    checkpoint_every_steps: int = Field(50, ge=1, le=MAX_STEPS, description=(
        "Rank 0 checkpoints every this many optimizer steps (a retry redoes at most these; at most "
        "10^9)."))
    keep_checkpoints: int = Field(2, ge=1, le=1000, description="Checkpoints kept per stage (older ones are deleted); at most 1000.")
    async_checkpoints: bool = Field(False, description=(
        "fsdp stages: write each sharded checkpoint in a background thread while training goes on (DCP async_save); "
        "it commits (meta.pt, then latest.json) once every shard is written."))
    trust_unrecorded_checkpoints: bool = Field(False, description=(
        "Load a checkpoint (step, best epoch, hand-off optimizer) that has no checksum record, unchecked; by default "
        "one without a record is refused, like one whose bytes changed."))
    noise_scale: bool = Field(True, description=(
        "Measure the gradient noise scale B_simple in every stage (epoch log, report, training chart)."))
    noise_scale_every_steps: int = Field(8, ge=1, le=MAX_STEPS, description=(
        "Measure it on one optimizer step in this many (at most 10^9): a measurement costs a few passes over the "
        "gradients; one process without accumulation (a second forward and backward) spaces them 4x as far apart after "
        "its first 10."))
    batch_growth: Literal["fixed", "adaptive"] = Field("fixed", description=(
        "fixed: the batches the stages give; adaptive: each stage after the first takes the noise scale measured at the "
        "end of the stage before as its global batch, clamped between its own configured global batch and max_global_batch (its "
        "per_process_batch is then a memory bound, gradient accumulation reaching beyond it)."))
    max_global_batch: int | None = Field(None, ge=1, le=MAX_BATCH, description="adaptive: the largest global batch a stage may take (at most 16777216).")
    stages: list[TrainStage] = Field(min_length=1, max_length=100, description="The stages, run in order (1 to 100).")

    @field_validator("default_params")
    @classmethod
    def _params_in_domain(cls, value: dict[str, float | int | str]) -> dict[str, float | int | str]:
        problems = [problem for name, v in value.items() if (problem := hyperparameter_problem(name, v, known=None))]
        if problems:
            raise ValueError("; ".join(problems))
        return value

    @model_validator(mode="after")
    def _adaptive_growth_has_what_it_needs(self) -> Train:
        if self.batch_growth != "adaptive":
            return self
        if self.max_global_batch is None:
            raise ValueError("batch_growth: 'adaptive' needs max_global_batch, the largest global batch a stage may take")
        if not self.noise_scale:
            raise ValueError("batch_growth: 'adaptive' chooses batches from the noise scale; turn noise_scale on")
        scripted = [stage.name for stage in self.stages[1:] if stage.entrypoint is not None]
        if scripted:
            raise ValueError(f"batch_growth: 'adaptive' sizes the built-in loop's stages; {scripted} run their own "
                             f"entrypoint, whose batch the script decides")
        return self

    @field_validator("stages")
    @classmethod
    def _unique_names(cls, value: list[TrainStage]) -> list[TrainStage]:
        names = [stage.name for stage in value]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names repeat: {names}")
        return value


class Threshold(StrictModel):
    """How a binary classifier's decision threshold is chosen on the validation split (its best epoch's)."""

    rule: Literal["f1", "precision", "recall"] = Field(
        "f1", description="f1: the threshold with the best F1; precision / recall: reach target with the most of the other.")
    target: float | None = Field(None, gt=0, le=1, description="The precision or recall to reach (rule precision or recall).")

    @model_validator(mode="after")
    def _target_for_its_rule(self) -> Threshold:
        if self.rule == "f1" and self.target is not None:
            raise ValueError("evaluate.threshold.target: rule f1 takes no target (give rule precision or recall)")
        if self.rule != "f1" and self.target is None:
            raise ValueError(f"evaluate.threshold.target: rule {self.rule} needs the {self.rule} to reach, e.g. 0.9")
        return self


class Evaluate(StrictModel):
    """Test-split evaluation."""

    profile: str = Field(description="Instance profile of the evaluation task.")
    min_test_accuracy: float = Field(0.0, ge=0, le=1, description="Fail the run below this test accuracy.")
    objective_limit: float | None = Field(
        None, allow_inf_nan=False,
        description="Fail the run when test_<objective.metric> is worse than this in objective.direction; null: no limit.")
    threshold: Threshold = Field(default_factory=Threshold,
                                 description="A binary classifier's decision threshold: the label inference writes.")
