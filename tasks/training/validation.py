"""Running a model spec on real batches: its contract checked on a first batch, and its metric states summed over many.

:func:`check_spec` runs before a stage's or trial's first step; :func:`accumulate_metrics` serves validation
(:class:`stagewise.training.loop.Loop`) and the test split (:mod:`stagewise.evaluate`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from stagewise.core.errors import UserError
from stagewise.definitions.metrics import Average, MetricState, as_state
from stagewise.definitions.spec import ModelSpec, batch_of, hook_inputs, user_hook


def _shape(value: Any) -> str:
    return f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def check_spec(spec: ModelSpec, module: nn.Module, features: torch.Tensor, labels: torch.Tensor,
               index_hint: Callable[[torch.Tensor], str] | None = None, objective: str | None = None) -> None:
    """Run the spec once on a real batch before training and name the part that breaks its contract (an ``objective``
    its metrics do not report included).

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
    if objective is not None:
        with user_hook(spec, "metrics", context=first, shapes=hook_inputs(spec, "metrics", module, outputs, targets)):
            with torch.no_grad():
                reported = spec.metrics(outputs.detach(), targets)
        MetricTotals(name).add(reported, rows, loss, features.device)  # states that cannot be summed are named here
        names = sorted([*reported, "loss"])
        if objective not in names:
            raise UserError(f"objective.metric '{objective}' is not among the metrics {name} reports: {names}")


class MetricTotals:
    """A spec's metric states summed over batches, on the device: one flat float64 vector for the one all-reduce of a
    validation, and each metric computed once from it. States the spec shares between metrics (one confusion matrix
    for every F1) are one slot, summed and reduced once."""

    def __init__(self, spec_name: str) -> None:
        self.spec_name = spec_name
        self.slots: list[torch.Tensor] = []
        self.slot_of: dict[str, int] = {}
        self.computes: dict[str, Callable[[torch.Tensor], float]] = {}

    @property
    def empty(self) -> bool:
        return not self.slot_of

    def add(self, reported: Any, rows: int, loss: torch.Tensor, device: Any) -> None:
        """One batch: the spec's ``metrics()`` return value, its row count and its mean loss."""
        if not isinstance(reported, dict):
            raise UserError(f"{self.spec_name}.metrics must return a dict of name -> MetricState or Average, got "
                            f"{type(reported).__name__}")
        states: dict[str, MetricState] = {}
        for name, value in {**reported, "loss": Average(loss.detach().double() * rows, rows)}.items():
            if not isinstance(value, MetricState | Average):
                raise UserError(f"{self.spec_name}.metrics()['{name}'] is a {type(value).__name__}, not a MetricState or "
                                f"Average(total, count): per-batch means cannot be reduced across batches and ranks")
            states[name] = as_state(value, device)
        slots: dict[int, int] = {}
        layout = {name: slots.setdefault(id(state.state), len(slots)) for name, state in states.items()}
        if self.empty:
            self.slot_of, self.computes = layout, {name: state.compute for name, state in states.items()}
            first: dict[int, str] = {}
            for name, slot in layout.items():
                first.setdefault(slot, name)
            self.slots = [torch.zeros_like(states[first[slot]].state, dtype=torch.float64) for slot in range(len(first))]
        elif layout != self.slot_of:
            raise UserError(f"{self.spec_name}.metrics() reported {sorted(layout)} for one batch and "
                            f"{sorted(self.slot_of)} for another: it must report the same metrics every batch")
        for name, slot in layout.items():
            if slots.pop(id(states[name].state), None) is None:
                continue  # a shared state, added already
            state = states[name].state.to(torch.float64)
            if state.shape != self.slots[slot].shape:
                raise UserError(f"{self.spec_name}.metrics()['{name}']: its state has shape {tuple(state.shape)} in one "
                                f"batch and {tuple(self.slots[slot].shape)} in another: a state keeps one shape")
            self.slots[slot] += state  # stays on the device until the end: no sync per batch

    def zero_(self) -> None:
        for slot in self.slots:
            slot.zero_()

    def vector(self) -> torch.Tensor:
        """Every slot, flat, in order: what one all-reduce sums over ranks."""
        return torch.cat([slot.reshape(-1) for slot in self.slots]) if self.slots else torch.zeros(0, dtype=torch.float64)

    def signature(self) -> list[tuple[str, int, tuple[int, ...]]]:
        """(name, slot, slot shape) of each metric: the ranks' must agree before their vectors are summed."""
        return [(name, slot, tuple(self.slots[slot].shape)) for name, slot in sorted(self.slot_of.items())]

    def state(self, name: str, vector: torch.Tensor | None = None) -> torch.Tensor:
        """Metric ``name``'s summed state on the CPU (from ``vector``, the reduced one, when given)."""
        slot = self.slot_of[name]
        if vector is None:
            return self.slots[slot].detach().cpu()
        start = sum(self.slots[index].numel() for index in range(slot))
        return vector[start: start + self.slots[slot].numel()].detach().cpu().reshape(self.slots[slot].shape)

    def values(self, vector: torch.Tensor | None = None) -> dict[str, float]:
        """Each metric computed once from the summed states (``vector``: the states reduced over ranks)."""
        flat = (vector if vector is not None else self.vector()).detach().cpu()
        return {name: float(self.computes[name](self.state(name, flat))) for name in sorted(self.slot_of)}


def accumulate_metrics(spec: ModelSpec, module: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                       device: str, on_outputs: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
                       ) -> MetricTotals:
    """Sum a spec's metric states (and its loss) over batches. Shared by validation and test; ``on_outputs(outputs,
    targets)`` sees each batch's outputs too, so a caller needs no second forward pass."""
    totals = MetricTotals(type(spec).__name__)
    with user_hook(spec, module=module):  # batch, forward, metrics, loss (and predict in on_outputs) name themselves
        for features, labels in batches:
            inputs, targets = batch_of(spec, features.to(device), labels.to(device))
            outputs = module(inputs)
            if on_outputs is not None:
                on_outputs(outputs, targets)
            totals.add(spec.metrics(outputs, targets), len(targets), spec.loss(outputs, targets), device)
    return totals
