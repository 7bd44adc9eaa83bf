"""The noise-scale measurement inside training steps (McCandlish et al. 2018, Appendix A): some optimizer steps run
in parts (two halves of the micro-batch, or its accumulated micro-batches) whose own squared gradient norms, beside the
whole step's, feed :class:`stagewise.training.noise_scale.NoiseScale`.

A mixin of :class:`stagewise.training.loop.Loop`, which owns the step; these methods only measure on the way.
"""

from __future__ import annotations

from typing import Any

import torch

from stagewise.training.noise_scale import NoiseScale, PartNorms, split_interval


class NoiseMeasurement:
    """The measured steps of a loop; the loop sets the attributes below and calls ``_backward`` for each part."""

    noise: NoiseScale | None
    noise_every: int
    grad_accum_steps: int
    _parts: PartNorms | None
    _halves_spaced: bool
    _graphs: Any
    _trainable: list[torch.nn.Parameter]
    module: torch.nn.Module
    strategy: Any
    scaler: Any

    def _backward(self, inputs: torch.Tensor, targets: torch.Tensor, weight: float) -> torch.Tensor:
        raise NotImplementedError

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
        # Read before the fold counts this measurement: the interval this step was chosen at.
        parts.fold(self.noise, self._grad_sq(), spans=self._split_every() // self.noise_every)

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
