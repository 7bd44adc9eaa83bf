"""Running a model spec on real batches: its contract checked on a first batch, and its metrics summed over many.

:func:`check_spec` runs before a stage's or trial's first step; :func:`accumulate_metrics` serves validation
(:class:`stagewise.training.loop.Loop`) and the test split (:mod:`stagewise.evaluate`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from stagewise.core.errors import UserError
from stagewise.definitions.spec import Average, ModelSpec, batch_of, hook_inputs, user_hook


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
