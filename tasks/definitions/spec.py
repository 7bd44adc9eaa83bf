"""Your own model in every stage: subclass :class:`ModelSpec` and name it in the pipeline config.

Use::

    model:
      spec: "stagewise.examples.digits_cnn:DigitsCNN"      # module:Class, importable from the repo or installed
      args: {channels: 16}                         # passed to the class as keyword arguments
    objective: {metric: accuracy, direction: maximize}

A spec answers only what the framework cannot know: how to build the ``nn.Module`` from the
hyperparameters and the data's description, how a batch of rows becomes (inputs, targets), the
loss, metrics as states that reduce across batches and ranks (sums, counts, confusion matrices) and what a
prediction row holds. The framework keeps the rest: torchrun and DDP, batch arithmetic and the LR
rules, warmup, checkpoints and exact resume, sharding, the sweep and pruning, evaluation, the
registry and its gate, batch inference and the report. The built-in
``stagewise.model:MLPClassifier`` is one example of a spec. :class:`Classifier` (integer classes) and
:class:`Regressor` (a float target: no ``dataset.num_classes``) supply the loss, metrics and
predictions, so a subclass of either writes only :meth:`ModelSpec.build`.

Artifacts hold the spec's import path and arguments, never pickled code: loading a model imports
the spec, builds the module and loads the state dict with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import os
import sysconfig
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from types import CodeType, FrameType, TracebackType
from typing import Any

import torch
from torch import nn

from stagewise.core.errors import UserError
from stagewise.definitions.metrics import (
    CLASSIFICATION,
    REGRESSION,
    Average,
    MetricState,
    classification_metrics,
    predicted_classes,
    regression_metrics,
)
from stagewise.definitions.rows import Features, InputColumn, RowLayout


@dataclass(frozen=True, kw_only=True)
class DataInfo:
    """What a spec may know about the data when it builds a model."""

    features: list[str]
    """Input columns, in the order of each row's feature vector."""
    num_classes: int | None = None
    """Classes of an integer label; None when the label is a float target."""
    target_mean: float | None = None
    """Mean of a float target over the data set (None for classes)."""
    target_std: float | None = None
    """Standard deviation of a float target (None for classes)."""
    class_counts: list[int] | None = None
    """Rows of each class in the kept data, all splits (None for a float target, or data preprocessed before they were kept)."""
    shapes: dict[str, list[int]] = field(default_factory=dict)
    """Declared tensor columns -> their shape; column ``c``'s elements are the features ``c[0]``, ``c[1]``, ... in row-major order."""
    layout: RowLayout | None = None
    """Every input column with its dtype and shape (None: float features only); see :meth:`input`."""

    def __post_init__(self) -> None:
        if isinstance(self.layout, dict):  # as a bundle stores it
            object.__setattr__(self, "layout", RowLayout(**self.layout))

    @property
    def num_features(self) -> int:
        """Elements of the float feature vector (``features.dense`` when the data has typed columns)."""
        return len(self.features)

    @property
    def typed(self) -> bool:
        """The data has int64, categorical or variable-length columns: :meth:`ModelSpec.batch` receives :class:`Features`."""
        return self.layout is not None and self.layout.typed

    def input(self, name: str) -> InputColumn:
        """Column ``name``: its dtype, shape, ``max_length`` (``shape[0]`` of a variable-length column), ``max_value``
        (largest int64 id) or ``num_categories`` (categorical, id 0 for an unseen value): what an embedding is sized by."""
        if self.layout is None:
            raise KeyError(f"no typed input column '{name}': the data set declares float features only")
        return self.layout.column(name)


class ModelSpec:
    """Subclass this; override :meth:`build`, :meth:`loss`, :meth:`metrics` and :meth:`predict` (and
    :meth:`batch` when rows are not the model's input as they are)."""

    default_params: dict[str, Any] = {}
    """The hyperparameters :meth:`build` reads, with their defaults (the sweep may search any of them)."""
    static_shapes: bool = False
    """True when every training batch of one size gives the module and the loss tensors of the same shapes, and the
    step reads nothing back on the host (no ``.item()``, no data-dependent shapes): then a stage on one GPU captures
    the step as a CUDA graph and replays it (stage key ``cuda_graph``, docs/stages.md). A data set with
    variable-length columns never has static shapes, whatever the spec says."""
    _row_layout: RowLayout | None = None  # set by the framework's build: how a stored batch decodes for batch()

    def __init__(self, **args: Any) -> None:
        self.args = dict(args)

    def prepare(self, data: DataInfo) -> None:
        """Called with the data description before every :meth:`build` (e.g. :class:`Regressor` keeps the target's scale)."""

    def build(self, data: DataInfo, params: dict[str, Any]) -> nn.Module:
        """The untrained module for this data and these hyperparameters."""
        raise NotImplementedError

    def optimizer(self, module: nn.Module, params: dict[str, Any]) -> torch.optim.Optimizer | None:
        """Your own optimizer over ``module``'s parameters (any ``torch.optim`` optimizer, parameter groups with their
        own weight decay or lr), built from the hyperparameters; a group's lr is kept as a multiple of
        ``params["lr"]``, so the batch rescale, warmup and schedule move every group alike. None (the default): the
        framework's SGD or AdamW (``params["optimizer"]``), without weight decay on biases and norm scales."""
        return None

    def lr_schedule(self, step: int, total_steps: int) -> float | None:
        """Your own schedule: the factor of a stage's lr at optimizer ``step`` of its ``total_steps`` (as LambdaLR's
        lr_lambda; warmup and the batch rescale apply on top, and a resume continues from the stage's step).
        None (the default): the stage's ``lr_schedule`` from the config."""
        return None

    def shard_units(self, module: nn.Module) -> list[nn.Module] | None:
        """The sub-modules an ``fsdp`` stage shards as units (e.g. each transformer block): each is all-gathered for its
        own forward and backward only, so the largest unit bounds what a rank holds unsharded. None (the default): every
        direct child of ``module`` that holds parameters. The module itself is always the last unit."""
        return None

    def batch(self, features: torch.Tensor | Features, labels: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """(inputs, targets) from a batch of rows: ``features`` is (rows, num_features) float32, or :class:`Features`
        (by column, variable-length ones padded with a mask) when the data declares typed columns; ``labels`` the label column."""
        return features, labels

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean training loss of a batch (a scalar with a gradient)."""
        raise NotImplementedError

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, Average | MetricState]:
        """Validation/test metrics of a batch as reducible states (:class:`MetricState`, :class:`Average`: sums and
        counts, never per-batch means); the framework sums them over batches and ranks, computes each once, and adds
        ``loss`` itself."""
        raise NotImplementedError

    def predict(self, outputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Prediction columns of a batch: name -> a (rows,) or (rows, k) tensor."""
        raise NotImplementedError


class Classifier(ModelSpec):
    """A ModelSpec for an integer class label whose module outputs one logit per class: cross-entropy (weighted by
    class with the argument ``class_weights``: ``balanced`` or one weight per class), the built-in classification
    metrics (the argument ``metrics`` narrows them), and the predicted class with its probabilities; with two classes
    also the positive class's ``score``, the class predicted at the decision threshold chosen on validation
    (``evaluate.threshold``). Subclasses write only :meth:`build` (and :meth:`batch`)."""

    metric_names: tuple[str, ...] = CLASSIFICATION
    """The built-in metrics :meth:`metrics` reports (stagewise.definitions.metrics.CLASSIFICATION)."""
    threshold: float | None = None
    """A binary model's decision threshold on the positive class's probability (set from its bundle); None: argmax."""
    threshold_rule: tuple[str, float | None] = ("f1", None)
    """How validation chooses the threshold: (rule, target) of ``evaluate.threshold`` (set by the training stage)."""
    _class_weights: torch.Tensor | None = None

    def prepare(self, data: DataInfo) -> None:
        args = getattr(self, "args", {})
        if args.get("metrics") is not None:
            self.metric_names = _known_names(args["metrics"], CLASSIFICATION, type(self).__name__)
        self._class_weights = class_weights(args.get("class_weights"), data, type(self).__name__)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        weights = self._class_weights
        if weights is not None and weights.device != outputs.device:
            weights = self._class_weights = weights.to(outputs.device)
        return torch.nn.functional.cross_entropy(outputs, targets, weight=weights)

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, Average | MetricState]:
        return classification_metrics(outputs, targets, self.metric_names, self.threshold, self.threshold_rule)

    def predict(self, outputs: torch.Tensor) -> dict[str, torch.Tensor]:
        probabilities = torch.softmax(outputs, dim=1)
        predicted = {"prediction": predicted_classes(outputs, self.threshold), "probabilities": probabilities}
        if outputs.shape[1] == 2:
            predicted["score"] = probabilities[:, 1]
        return predicted


def _known_names(names: Any, known: tuple[str, ...], spec: str) -> tuple[str, ...]:
    if isinstance(names, str) or not all(isinstance(name, str) for name in names or ()):
        raise UserError(f"model.args.metrics of {spec} must be a list of metric names, got {names!r}")
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise UserError(f"model.args.metrics of {spec}: unknown metric(s) {unknown}; the built-in ones are {list(known)}")
    return tuple(names)


def class_weights(setting: Any, data: DataInfo, spec: str) -> torch.Tensor | None:
    """The loss's per-class weights: ``balanced`` (rows / (classes × rows of the class), scikit-learn's rule, from the
    data's class counts), a list of one weight per class, or None."""
    if setting is None:
        return None
    classes = data.num_classes
    if setting == "balanced":
        counts = data.class_counts
        if not counts or classes is None or len(counts) != classes:
            raise UserError("model.args.class_weights: balanced needs the data's class counts, which this "
                            "run's preprocess manifest lacks (it predates them): run preprocess again")
        missing = [index for index, count in enumerate(counts) if count == 0]
        if missing:
            raise UserError(f"model.args.class_weights: balanced cannot weight class(es) {missing}: the data has no "
                            f"row of them; give explicit weights or more data")
        total = sum(counts)
        return torch.tensor([total / (classes * count) for count in counts], dtype=torch.float32)
    if isinstance(setting, list) and classes is not None and len(setting) == classes \
            and all(isinstance(value, int | float) and value >= 0 and math.isfinite(value) for value in setting) \
            and any(value > 0 for value in setting):
        return torch.tensor([float(value) for value in setting], dtype=torch.float32)
    raise UserError(f"model.args.class_weights of {spec}: {setting!r} is neither 'balanced' nor a list of "
                    f"{classes} non-negative weights (one per class of dataset.num_classes)")


class Regressor(ModelSpec):
    """A ModelSpec for a float target whose module outputs one value per row: the standardised target, so training
    is well conditioned whatever the target's scale. Loss: MSE on standardised targets; metrics ``rmse``, ``mae`` and
    ``r2`` in the target's own units (the argument ``metrics`` narrows them); prediction: the de-standardised value.
    Subclasses write only :meth:`build` (and :meth:`batch`)."""

    target_mean: float = 0.0
    target_std: float = 1.0
    metric_names: tuple[str, ...] = REGRESSION
    """The built-in metrics :meth:`metrics` reports (stagewise.definitions.metrics.REGRESSION)."""

    def prepare(self, data: DataInfo) -> None:
        if data.target_mean is None or data.target_std is None:
            raise UserError(f"{type(self).__name__} is a Regressor: it needs a float target (leave dataset.num_classes out)")
        if getattr(self, "args", {}).get("metrics") is not None:
            self.metric_names = _known_names(self.args["metrics"], REGRESSION, type(self).__name__)
        self.target_mean, self.target_std = float(data.target_mean), float(data.target_std)

    @staticmethod
    def _column(outputs: torch.Tensor) -> torch.Tensor:
        return outputs.reshape(-1) if outputs.ndim == 2 and outputs.shape[1] == 1 else outputs

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        standardised = (targets.float() - self.target_mean) / self.target_std
        return torch.nn.functional.mse_loss(self._column(outputs), standardised)

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, Average | MetricState]:
        return regression_metrics(self.predict(outputs)["prediction"], targets, self.metric_names, self.target_mean)

    def predict(self, outputs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"prediction": self._column(outputs) * self.target_std + self.target_mean}


def batch_of(spec: ModelSpec, records: torch.Tensor, labels: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """(inputs, targets) of a batch of stored records: decoded as the spec's data is laid out, then ``spec.batch``."""
    layout = spec._row_layout
    return spec.batch(records if layout is None else layout.decode(records), labels)


@dataclass(frozen=True)
class SpecRef:
    """A spec named by import path, with its arguments: what configs and artifacts store."""

    path: str
    """``module:Class``."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the class."""

    def load(self) -> ModelSpec:
        """Import and instantiate; a path that does not import or is no ModelSpec is a user error naming it."""
        module_name, _, class_name = self.path.partition(":")
        if not module_name or not class_name:
            raise UserError(f"model.spec '{self.path}' is not 'module:Class'")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise UserError(f"model.spec '{self.path}': cannot import module '{module_name}' ({exc})") from None
        cls = getattr(module, class_name, None)
        if not (isinstance(cls, type) and issubclass(cls, ModelSpec)):
            raise UserError(f"model.spec '{self.path}': '{class_name}' is not a ModelSpec subclass in {module_name}")
        try:
            return cls(**self.args)
        except TypeError as exc:
            raise UserError(f"model.spec '{self.path}': bad model.args {self.args}: {exc}") from None


# --- a user's error, named once ----------------------------------------------------------------------------------------

HOOKS = ("prepare", "build", "optimizer", "lr_schedule", "shard_units", "batch", "loss", "metrics", "predict")
"""The spec's methods the framework calls; ``forward`` (the built module's call) is the one hook that is not a method."""


class HookError(UserError):
    """An exception raised inside a user's hook: a user error (no retry) naming the spec class, the hook and the user's
    file and line; the user's exception is its ``__cause__``."""

    def __init__(self, message: str, *, spec: str, hook: str, location: str | None) -> None:
        super().__init__(message)
        self.spec, self.hook, self.location = spec, hook, location


class user_hook:  # noqa: N801 - used as a context manager, like contextlib's
    """``with user_hook(spec, "loss"): spec.loss(outputs, targets)``: any exception the user's code raises there becomes
    a :class:`HookError` "DigitsCNN.loss (examples/digits_cnn.py:42): KeyError: 'beta2'", chained from it.

    ``hook`` None guards a stretch of framework code that calls several hooks (a training epoch): the hook is the
    outermost frame of the traceback that runs one of the spec's hook methods or ``module``'s ``forward``, and an
    exception raised outside every hook passes through as it is (a crash, retried). ``shapes`` (label -> value, or a
    callable giving them; :func:`hook_inputs`) say where a hook's inputs came from and their shapes ("the forward
    returned shape (64, 3)"); for a guard they are read from the hook's own arguments. ``context`` says when it failed ("on a first batch of 64 rows"),
    ``hint(exc)`` adds a sentence. A :class:`UserError`, an out-of-memory error and a failed collective pass through:
    the first is named already, the others are no fault of the user's code. Costs nothing until something raises."""

    __slots__ = ("spec", "hook", "module", "shapes", "context", "hint")

    def __init__(self, spec: Any, hook: str | None = None, *, module: Any = None,
                 shapes: dict[str, Any] | Callable[[], dict[str, Any]] | None = None, context: str | None = None,
                 hint: Callable[[BaseException], str] | None = None) -> None:
        self.spec, self.hook, self.module, self.shapes, self.context, self.hint = spec, hook, module, shapes, context, hint

    def __enter__(self) -> user_hook:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, UserError) or not_the_users(exc):
            return False
        error = hook_error(self.spec, exc, self.hook, module=self.module, shapes=self.shapes, context=self.context,
                           hint=self.hint)
        if error is None:
            return False
        raise error from exc


def not_the_users(exc: BaseException) -> bool:
    """Out of memory and failed collectives (a peer died) are the machine's, wherever they surface: not the hook's
    (a training stage names an allocation that failed itself: stagewise.training.strategy.out_of_memory_named)."""
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return True
    if isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc):  # the CPU allocator's
        return True
    import torch.distributed as dist

    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(word in text for word in _MACHINE_FAULTS)


# What a RuntimeError says when the machine or a peer failed under the user's code: left to Airflow's retry.
_MACHINE_FAULTS = ("nccl", "gloo", "connection reset", "connection closed", "broken pipe", "ecc error",
                   "cuda error: unspecified launch failure", "cuda error: an illegal memory access")


def hook_error(spec: Any, exc: BaseException, hook: str | None = None, *, module: Any = None,
               shapes: dict[str, Any] | Callable[[], dict[str, Any]] | None = None, context: str | None = None,
               hint: Callable[[BaseException], str] | None = None) -> HookError | None:
    """The :class:`HookError` naming where ``exc`` was raised in the user's code (see :class:`user_hook`); None when
    ``hook`` is None and no hook's frame is in its traceback."""
    frames = [(frame, line) for frame, line in traceback.walk_tb(exc.__traceback__)]
    start = 1  # frames[0] holds the with-block: the framework's call of the hook
    if hook is None:
        found = _hook_frame(spec, module, frames)
        if found is None:
            return None
        start, hook = found
        if shapes is None:
            shapes = _argument_shapes(spec, hook, frames[start][0], module)
    name = type(spec).__name__
    location = _user_location(spec, module, frames[start:])
    where = ", ".join(part for part in (f"module {type(module).__name__}" if hook == "forward" and module is not None
                                        else None, location) if part)
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    message = f"{name}.{hook}{f' ({where})' if where else ''}{f' failed {context}' if context else ''}: " \
              f"{type(exc).__name__}{f': {text}' if text else ''}"[:1500]
    given = shapes() if callable(shapes) else shapes
    if given:
        message += "; " + ", ".join(label.format(describe_value(value)) if "{}" in label else
                                    f"{label} {describe_value(value)}" for label, value in given.items())
    if hint is not None:
        message += hint(exc)
    return HookError(message, spec=name, hook=hook, location=location)


def describe_value(value: Any) -> str:
    """A hook's argument as a message shows it: a tensor's shape, a sequence's or mapping's tensors' shapes."""
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)) and value:
        return "(" + ", ".join(describe_value(item) for item in value[:4]) + (", ..." if len(value) > 4 else "") + ")"
    if isinstance(value, dict) and value:
        return "{" + ", ".join(f"{key}: {describe_value(item)}" for key, item in list(value.items())[:4]) + "}"
    if hasattr(value, "__dataclass_fields__"):  # e.g. Features: its tensors by field
        fields = {key: getattr(value, key) for key in value.__dataclass_fields__}
        return type(value).__name__ + " " + describe_value({k: v for k, v in fields.items() if v is not None})
    return type(value).__name__


def _codes(cls: type, name: str) -> set[CodeType]:
    """The code of ``name`` on every class of ``cls``'s MRO that defines it (a super() call runs them in turn)."""
    codes = set()
    for klass in cls.__mro__:
        function = inspect.unwrap(klass.__dict__.get(name)) if callable(klass.__dict__.get(name)) else None
        code = getattr(function, "__code__", None)
        if code is not None:
            codes.add(code)
    return codes


def _hook_frame(spec: Any, module: Any, frames: list[tuple[FrameType, int]]) -> tuple[int, str] | None:
    """(index, hook) of the outermost traceback frame that runs one of the spec's hooks or the module's forward."""
    owners: dict[CodeType, str] = {}
    for hook in HOOKS:
        owners.update(dict.fromkeys(_codes(type(spec), hook), hook))
    if module is not None:
        owners.update(dict.fromkeys(_codes(type(module), "forward"), "forward"))
    for index, (frame, _) in enumerate(frames):
        if frame.f_code in owners:
            return index, owners[frame.f_code]
    return None


def _argument_shapes(spec: Any, hook: str, frame: FrameType, module: Any) -> dict[str, Any] | None:
    """What a guarded hook was called with, read from its frame: outputs and targets of loss and metrics, the
    forward's input."""
    try:
        arguments = inspect.getargvalues(frame)
    except (TypeError, ValueError):
        return None
    values = [arguments.locals.get(name) for name in arguments.args[1:]]  # after self
    if hook in ("loss", "metrics") and len(values) >= 2:
        return hook_inputs(spec, hook, module, values[0], values[1])
    if hook == "forward" and values:
        return hook_inputs(spec, hook, module, values[0])
    return None


def hook_inputs(spec: Any, hook: str, module: Any, first: Any, targets: Any = None) -> dict[str, Any]:
    """Where a hook's inputs came from, for its error message: the forward's input from ``batch``; the outputs of
    ``loss``, ``metrics`` and ``predict`` from the forward, their targets from ``batch``."""
    name = type(spec).__name__
    if hook == "forward":
        return {f"its input from {name}.batch has {{}}": first}
    forward = f"the forward ({type(module).__name__})" if module is not None else "the forward"
    labels = {f"{forward} returned {{}}": first}
    if targets is not None:
        labels[f"{name}.batch gave targets of {{}}"] = targets
    return labels


@functools.cache
def _library_roots() -> tuple[str, ...]:
    """Folders of code that is not the user's: torch, Stagewise's own (not its examples), the standard library and
    installed packages."""
    roots = {os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    paths = sysconfig.get_paths()
    roots.update(paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths)
    return tuple(os.path.join(os.path.realpath(root), "") for root in roots)


@functools.cache
def _is_library(filename: str) -> bool:
    if filename.startswith("<"):
        return True
    path = os.path.realpath(filename)
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "examples", "")
    return path.startswith(_library_roots()) and not path.startswith(examples)


def _class_files(*objects: Any) -> set[str]:
    files = set()
    for value in objects:
        if value is None:
            continue
        try:
            files.add(os.path.realpath(inspect.getfile(type(value))))
        except (TypeError, OSError):
            continue
    return files


def _user_location(spec: Any, module: Any, frames: list[tuple[FrameType, int]]) -> str | None:
    """``file:line`` of the innermost frame in the user's code (the spec's or the module's file, or any file outside
    torch, Stagewise and installed packages); else of the innermost Stagewise frame (a built-in spec's own hook)."""
    own = _class_files(spec, module)
    user = [(frame, line) for frame, line in frames
            if os.path.realpath(frame.f_code.co_filename) in own or not _is_library(frame.f_code.co_filename)]
    stagewise_root = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "")
    chosen = user or [(frame, line) for frame, line in frames
                      if os.path.realpath(frame.f_code.co_filename).startswith(stagewise_root)]
    if not chosen:
        return None
    frame, line = chosen[-1]
    return f"{_shown_path(frame.f_code.co_filename)}:{line}"


def _shown_path(filename: str) -> str:
    """A path relative to the working directory when it lies under it (as a user reads it), else as it is."""
    path = os.path.abspath(filename)
    cwd = os.path.join(os.getcwd(), "")
    return os.path.relpath(path) if path.startswith(cwd) else path
