"""The gradient noise scale B_simple = tr(Σ)/|G|² (McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training", Appendix A), measured as a stage trains: an estimate of the critical batch, beyond which a larger batch stops
paying. It approximates it twice over: the paper's B_crit ≈ B_noise = tr(HΣ)/(GᵀHG), which B_simple equals only when
the Hessian H is a multiple of the identity.

Two gradient norms at two batch sizes give unbiased estimates of |G|² and S = tr(Σ), because for a gradient
averaged over B samples, E|g_B|² = |G|² + S/B. A measured step is split into parts, one way for every strategy and world
size: its micro-batches with gradient accumulation, else each rank's micro-batch run as two halves. Each part's backward
is synced, so its gradient averages that part of every rank's batch (B_small = the part's rows x world size: DDP's
all-reduce and fsdp's reduce-scatter alike, as fsdp never shows a rank its own whole gradient) and the parts add up to the
step's gradient (B_big = the global batch). Each part's backward runs into fresh gradient buffers, so its own squared
norm is read before the step's gradient so far is added back (:class:`PartNorms`). Every part's norm counts: with two
halves the |G|² estimate is the dot product of the halves' gradients, whose noise is far smaller than that of one half's
norm against the whole (which left the smoothed |G|² negative, so no noise scale at all, on most one-process stages).
(ddp on several ranks once measured each rank's own gradient against the average: as unbiased, but on other rows and
other steps, so a stage ended on another value by strategy, 2.3x apart on the digits, and grew another next batch.)

A measurement is a few passes over the gradients, which cost a small model's step several percent, so a stage measures
one step in ``train.noise_scale_every_steps``. Without accumulation a measurement also runs a second forward and backward
(the two halves): for a launch-bound model about one more step, so after its first ``MIN_MEMORY``
measurements (the EMA's least memory, filled at the configured rate so the first epochs have a value) such a stage
measures ``SPLIT_SPACING`` times less often (:func:`split_interval`): fewer measurements, each as unbiased. Each
measurement is one
estimate of |G|² and S, each smoothed by a bias-corrected EMA on the device (no host sync) whose memory is about one
epoch of steps (:func:`epoch_beta`, counted at the configured interval), and B_simple is their ratio. A spaced
measurement weighs as the SPLIT_SPACING ones it stands for (β^SPLIT_SPACING). Weighed as one, the least memory of
10 spanned 640 steps at the default interval, so a stage of fewer steps an epoch handed on mostly what its first steps
measured, where |G|² is largest (the digits' 4-epoch first stage at batch 32: 66, where weighed by steps it reads 194). The state is a few scalars
that go into the checkpoint, so a resumed stage continues the same curve.
"""

from __future__ import annotations

from typing import Any

import torch

EMA_BETA = 0.9  # per measurement: about 10 measurements of memory, so the curve follows the loss, not one batch
# The memory a stage's EMA gets, in measurements: about one epoch's, within these bounds.
MIN_MEMORY, MAX_MEMORY = 10, 1000


# A stage without accumulation, past its first MIN_MEMORY measurements, measures one step in this many times the
# configured interval: a measurement there is a second forward and backward (at 8, +1/8 of a launch-bound step's time;
# spaced 8 times further, +1/64: at 4 times the 2-rank noise_scale_overhead read 1.026 against its goal of 1.02).
SPLIT_SPACING = 8


def split_interval(every: int, updates: int) -> int:
    """The measuring interval, in optimizer steps, of a stage whose measurement runs each rank's batch as two halves:
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

    def update(self, small_sq: torch.Tensor, big_sq: torch.Tensor, b_small: float, b_big: float,
               spans: int = 1) -> None:
        """One step's squared norms at batch sizes ``b_small`` < ``b_big``, folded into the EMAs. ``spans``: how many
        configured intervals this measurement stands for (SPLIT_SPACING once the halves are spaced out), so it weighs
        as that many measurements would and the EMA's memory stays the same number of steps."""
        g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
        s = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
        self._fold(torch.stack((g2, s)), spans)

    def _fold(self, estimate: torch.Tensor, spans: int = 1) -> None:
        finite = torch.isfinite(estimate).all()  # an fp16 step that overflowed is dropped, as the optimizer skips it
        decay = self.beta**spans
        self._ema.copy_(torch.where(finite, decay * self._ema + (1 - decay) * estimate, self._ema))
        self._weight.copy_(torch.where(finite, decay * self._weight + (1 - decay), self._weight))
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
    """A measured step on this rank, part by part: each part's squared gradient norm (the gradient of its own mean loss),
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

    def fold(self, noise: NoiseScale, accumulated_sq: torch.Tensor, spans: int = 1) -> bool:
        """Update ``noise`` from the parts and the step's accumulated gradient's squared norm (weighing as ``spans``
        measurements, :meth:`NoiseScale.update`); False (nothing folded) with fewer than two parts (an epoch's last step
        may hold one micro-batch: no second batch size)."""
        if self.parts < 2 or self.squared is None:
            return False
        b_small = self.parts / self.inverse_rows
        noise.update(self.squared / self.parts, accumulated_sq / self.weight**2, b_small, float(self.rows), spans)
        return True
