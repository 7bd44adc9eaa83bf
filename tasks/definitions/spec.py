"""Your own model in every stage: subclass :class:`ModelSpec` and name it in the pipeline config.

Use::

    model:
      spec: "stagewise.examples.digits_cnn:DigitsCNN"      # module:Class, importable from the repo or installed
      args: {channels: 16}                         # passed to the class as keyword arguments
    objective: {metric: accuracy, direction: maximize}

A spec answers only what the framework cannot know: how to build the ``nn.Module`` from the
hyperparameters and the data's description, how a batch of rows becomes (inputs, targets), the
loss, metrics that reduce across ranks (sums and counts, never per-rank means) and what a
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

import importlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from stagewise.core.errors import UserError
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


@dataclass(frozen=True)
class Average:
    """A metric as ``total / count`` (square-rooted when ``root``), summed over batches and ranks before dividing."""

    total: torch.Tensor | float
    """Sum of the per-row values of this batch."""
    count: torch.Tensor | float
    """Rows (or items) the total covers."""
    root: bool = False
    """Report the square root of the mean (e.g. RMSE from squared errors)."""


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

    def batch(self, features: torch.Tensor | Features, labels: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """(inputs, targets) from a batch of rows: ``features`` is (rows, num_features) float32, or :class:`Features`
        (by column, variable-length ones padded with a mask) when the data declares typed columns; ``labels`` the label column."""
        return features, labels

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean training loss of a batch (a scalar with a gradient)."""
        raise NotImplementedError

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, Average]:
        """Validation/test metrics of a batch as sums and counts; the framework adds ``loss`` itself."""
        raise NotImplementedError

    def predict(self, outputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """Prediction columns of a batch: name -> a (rows,) or (rows, k) tensor."""
        raise NotImplementedError


class Classifier(ModelSpec):
    """A ModelSpec for an integer class label whose module outputs one logit per class: cross-entropy,
    accuracy, and the predicted class with its probabilities. Subclasses write only :meth:`build` (and :meth:`batch`)."""

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(outputs, targets)

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, Average]:
        return {"accuracy": Average((outputs.argmax(dim=1) == targets).sum(), len(targets))}

    def predict(self, outputs: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"prediction": outputs.argmax(dim=1), "probabilities": torch.softmax(outputs, dim=1)}


class Regressor(ModelSpec):
    """A ModelSpec for a float target whose module outputs one value per row: the standardised target, so training
    is well conditioned whatever the target's scale. Loss: MSE on standardised targets; metrics ``rmse`` and ``mae``
    in the target's own units; prediction: the de-standardised value. Subclasses write only :meth:`build` (and :meth:`batch`)."""

    target_mean: float = 0.0
    target_std: float = 1.0

    def prepare(self, data: DataInfo) -> None:
        if data.target_mean is None or data.target_std is None:
            raise UserError(f"{type(self).__name__} is a Regressor: it needs a float target (leave dataset.num_classes out)")
        self.target_mean, self.target_std = float(data.target_mean), float(data.target_std)

    @staticmethod
    def _column(outputs: torch.Tensor) -> torch.Tensor:
        return outputs.reshape(-1) if outputs.ndim == 2 and outputs.shape[1] == 1 else outputs

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        standardised = (targets.float() - self.target_mean) / self.target_std
        return torch.nn.functional.mse_loss(self._column(outputs), standardised)

    def metrics(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, Average]:
        error = self.predict(outputs)["prediction"] - targets.float()
        return {"rmse": Average((error**2).sum(), len(targets), root=True), "mae": Average(error.abs().sum(), len(targets))}

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
