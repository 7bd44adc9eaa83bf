"""The gradient noise scale B_simple = tr(Σ)/|G|² (McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training"), measured as a stage trains: the batch size beyond which a larger batch stops paying.

Two gradient norms at two batch sizes give unbiased estimates of |G|² and S = tr(Σ), because for a gradient
averaged over B samples, E|g_B|² = |G|² + S/B:

- several ranks: each rank's own gradient before the all-reduce (B_small = its samples in the step) and the
  averaged gradient after it (B_big = the global batch). On a measured step the gradients are all-reduced here, with
  the local squared norm appended to them, so the ranks' mean comes back with the gradients (no extra collective);
- one rank: the step's parts against the whole: its micro-batches with gradient accumulation, else the micro-batch run
  as two halves (the same gradient in the end). Each part's backward runs into fresh gradient buffers, so its own
  squared norm is read before the step's gradient so far is added back (:class:`PartNorms`). Every part's norm counts,
  as every rank's does above: with two halves the |G|² estimate is the dot product of the halves' gradients, whose
  noise is far smaller than that of one half's norm against the whole (which left the smoothed |G|² negative, so no
  noise scale at all, on most one-process stages).

A measurement is a few passes over the gradients, which cost a small model's step several percent, so a stage measures
one step in ``train.noise_scale_every_steps``. On one rank without accumulation a measurement also runs a second forward
and backward (the two halves): for a launch-bound model about one more step, so after its first ``MIN_MEMORY``
measurements (the EMA's least memory, filled at the configured rate so the first epochs have a value) such a stage
measures ``SPLIT_SPACING`` times less often (:func:`split_interval`): fewer measurements, each as unbiased. Each
measurement is one
estimate of |G|² and S, each smoothed by a bias-corrected EMA on the device (no host sync) whose memory is about one
epoch of measurements (:func:`epoch_beta`), and B_simple is their
ratio. The state is a few scalars that go into the checkpoint, so a resumed stage continues the same curve.
"""

from __future__ import annotations

from typing import Any

import torch

EMA_BETA = 0.9  # per measurement: about 10 measurements of memory, so the curve follows the loss, not one batch
# The memory a stage's EMA gets, in measurements: about one epoch's, within these bounds.
MIN_MEMORY, MAX_MEMORY = 10, 1000


# One rank without accumulation, past its first MIN_MEMORY measurements, measures one step in this many times the
# configured interval: a measurement there is a second forward and backward (at 8, +1/8 of a launch-bound step's time).
SPLIT_SPACING = 4


def split_interval(every: int, updates: int) -> int:
    """The measuring interval, in optimizer steps, of a one-rank stage whose measurement runs the batch as two halves:
    ``every`` until ``updates`` (measurements so far, restored with a checkpoint) fills the EMA's least memory, then
    ``SPLIT_SPACING`` x ``every``. A function of the estimator's state, so a resumed stage measures the same steps."""
    return every if updates < MIN_MEMORY else every * SPLIT_SPACING


def epoch_beta(measurements_per_epoch: float) -> float:
    """The EMA weight whose memory (1 / (1 - beta) measurements) is about one epoch: each estimate is noisy, and a
    stage's last value (what adaptive batch growth decides on) should average its last epoch, not its last few
    batches; bounded, so a tiny epoch still averages 10 measurements and a huge one still follows the loss."""
    return 1.0 - 1.0 / min(max(measurements_per_epoch, MIN_MEMORY), MAX_MEMORY)


class NoiseScale:
    """The smoothed estimates of |G|² and S on ``device``; :meth:`estimates` gives B_simple = S / |G|²."""

    def __init__(self, device: Any, beta: float = EMA_BETA) -> None:
        self.beta = beta
        self._ema = torch.zeros(2, dtype=torch.float64, device=device)  # EMAs of (|G|², S)
        self._weight = torch.zeros((), dtype=torch.float64, device=device)  # 1 - beta^t: the bias correction
        self.updates = 0

    def update(self, small_sq: torch.Tensor, big_sq: torch.Tensor, b_small: float, b_big: float) -> None:
        """One step's squared norms at batch sizes ``b_small`` < ``b_big``, folded into the EMAs."""
        g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
        s = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
        self._fold(torch.stack((g2, s)))

    def _fold(self, estimate: torch.Tensor) -> None:
        finite = torch.isfinite(estimate).all()  # an fp16 step that overflowed is dropped, as the optimizer skips it
        self._ema.copy_(torch.where(finite, self.beta * self._ema + (1 - self.beta) * estimate, self._ema))
        self._weight.copy_(torch.where(finite, self.beta * self._weight + (1 - self.beta), self._weight))
        self.updates += 1

    def estimates(self) -> dict[str, Any] | None:
        """``{"noise_scale", "grad_sq", "trace_cov"}`` now (one host read), or None before the first measurement.

        ``noise_scale`` is None while the smoothed |G|² or S is not positive yet: both estimates are unbiased but
        noisy, and early on, or with B_small close to B_big, the noise can outweigh the signal."""
        weight = float(self._weight)
        if weight <= 0:
            return None
        g2, s = (self._ema / weight).tolist()
        return {"noise_scale": s / g2 if g2 > 0 and s > 0 else None, "grad_sq": g2, "trace_cov": s}

    def state_dict(self) -> dict[str, Any]:
        return {"ema": self._ema.tolist(), "weight": float(self._weight), "updates": self.updates, "beta": self.beta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            return
        self._ema.copy_(torch.tensor(state["ema"], dtype=torch.float64))
        self._weight.fill_(state["weight"])
        self.updates, self.beta = state["updates"], state["beta"]


class PartNorms:
    """A measured step on one rank, part by part: each part's squared gradient norm (the gradient of its own mean loss),
    its rows and the weight its loss had in the step. :meth:`fold` turns them and the step's accumulated gradient into one
    estimator update: B_small is the parts' harmonic mean size, B_big the step's rows; with m equal parts of b rows,
    |G|² comes out as the mean dot product of distinct parts' gradients and S as b × their spread, both unbiased."""

    def __init__(self) -> None:
        self.parts = 0
        self.rows = 0
        self.weight = 0.0  # the parts' loss weights summed: the accumulated gradient is this times the step's mean one
        self.inverse_rows = 0.0
        self.squared: torch.Tensor | None = None  # Σ of the parts' squared norms, on the device

    def add(self, weighted_sq: torch.Tensor, rows: int, weight: float) -> None:
        """One part whose backward ran ``weight`` × its mean loss: ``weighted_sq`` is that gradient's squared norm."""
        part_sq = weighted_sq / weight**2
        self.squared = part_sq if self.squared is None else self.squared + part_sq
        self.parts += 1
        self.rows += rows
        self.weight += weight
        self.inverse_rows += 1.0 / rows

    def fold(self, noise: NoiseScale, accumulated_sq: torch.Tensor) -> bool:
        """Update ``noise`` from the parts and the step's accumulated gradient's squared norm; False (nothing folded)
        with fewer than two parts (an epoch's last step may hold one micro-batch: no second batch size)."""
        if self.parts < 2 or self.squared is None:
            return False
        b_small = self.parts / self.inverse_rows
        noise.update(self.squared / self.parts, accumulated_sq / self.weight**2, b_small, float(self.rows))
        return True


class MeasuredAllReduce:
    """The all-reduce of a measured step, made here instead of by DDP: the step's backward ran under ``no_sync`` (each
    rank's gradient is its own), so this rank's squared norm is taken, appended to the flattened gradients, and one
    all-reduce of that buffer averages both; the averaged gradient's squared norm follows. The buffer is made once.
    Every other step keeps DDP's own all-reduce, overlapped with the backward (a Python comm hook on every step costs
    a small model's step several percent)."""

    def __init__(self) -> None:
        self._flat: torch.Tensor | None = None

    def __call__(self, parameters: list[torch.Tensor], world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the ranks' mean squared norm of their local gradients, the averaged gradient's), with every parameter's
        gradient replaced by the average, as DDP would have left it."""
        import torch.distributed as dist

        grads = []
        for parameter in parameters:
            if parameter.grad is None:  # unused this step on this rank: DDP would all-reduce zeros for it too
                parameter.grad = torch.zeros_like(parameter)
            grads.append(parameter.grad)
        size = sum(g.numel() for g in grads)
        if self._flat is None or self._flat.numel() != size + 1 or self._flat.dtype != grads[0].dtype:
            self._flat = grads[0].new_empty(size + 1)
        flat, body = self._flat, self._flat[:-1]
        torch.cat([g.reshape(-1) for g in grads], out=body)
        flat[-1] = torch.linalg.vector_norm(body).square()
        flat.div_(world_size)
        dist.all_reduce(flat)
        offset = 0
        for grad in grads:
            grad.copy_(body[offset: offset + grad.numel()].view_as(grad))
            offset += grad.numel()
        return flat[-1].double(), torch.linalg.vector_norm(body).double().square()
