"""The gradient noise scale B_simple = tr(Σ)/|G|² (McCandlish et al. 2018, "An Empirical Model of Large-Batch
Training"), measured as a stage trains: the batch size beyond which a larger batch stops paying.

Two gradient norms at two batch sizes give unbiased estimates of |G|² and S = tr(Σ), because for a gradient
averaged over B samples, E|g_B|² = |G|² + S/B:

- several ranks: each rank's own gradient before DDP's all-reduce (B_small = its samples in the step) and the
  averaged gradient after it (B_big = the global batch). A DDP communication hook sums each bucket's squares before
  it goes out, and one scalar all-reduce per step averages them over ranks;
- one rank: consecutive steps' gradients g_t, g_{t-1} (independent batches of B samples, G drifting slowly):
  E[g_t·g_{t-1}] ≈ |G|² and |g_t|² − g_t·g_{t-1} estimates S/B.

Each estimate is noisy step to step; |G|² and S are each smoothed by a bias-corrected EMA and B_simple is their
ratio. All of it stays on the device (no host sync per step); the state is a few scalars that go into the
checkpoint, so a resumed stage continues the same curve.
"""

from __future__ import annotations

from typing import Any

import torch

EMA_BETA = 0.95  # about 20 steps of memory: a stage's curve moves with the loss, not with one batch


class NoiseScale:
    """The smoothed estimates of |G|² and S on ``device``; :meth:`value` is B_simple = S / |G|²."""

    def __init__(self, device: Any, beta: float = EMA_BETA) -> None:
        self.beta = beta
        self._ema = torch.zeros(2, dtype=torch.float64, device=device)  # EMAs of (|G|², S)
        self._weight = torch.zeros((), dtype=torch.float64, device=device)  # 1 - beta^t: the bias correction
        self.updates = 0

    def update(self, small_sq: torch.Tensor, big_sq: torch.Tensor, b_small: float, b_big: float) -> None:
        """One step's squared norms at batch sizes ``b_small`` < ``b_big``, folded into the EMAs."""
        g2 = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
        s = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
        self._fold(torch.stack([g2.double(), s.double()]))

    def update_consecutive(self, sq: torch.Tensor, dot_previous: torch.Tensor, batch: float) -> None:
        """One step's squared norm at ``batch`` and its dot product with the previous step's gradient."""
        self._fold(torch.stack([dot_previous.double(), (batch * (sq - dot_previous)).double()]))

    def _fold(self, estimate: torch.Tensor) -> None:
        finite = torch.isfinite(estimate).all()  # an fp16 step that overflowed is skipped, as the optimizer skips it
        self._ema.copy_(torch.where(finite, self.beta * self._ema + (1 - self.beta) * estimate, self._ema))
        self._weight.copy_(torch.where(finite, self.beta * self._weight + (1 - self.beta), self._weight))
        self.updates += 1

    def estimates(self) -> dict[str, Any] | None:
        """``{"noise_scale", "grad_sq", "trace_cov"}`` now (one host read), or None before the first step.

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


class LocalNormHook:
    """A DDP communication hook (:meth:`hook`) that adds each bucket's local squared norm (before the all-reduce) to ``total``, then
    all-reduces the bucket as DDP's default hook does (sum, divided by the world size)."""

    def __init__(self, device: Any) -> None:
        self.total = torch.zeros((), dtype=torch.float64, device=device)

    def hook(self, process_group, bucket):  # unannotated: DDP refuses a hook whose annotations are not its own types
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.total += torch.linalg.vector_norm(bucket.buffer(), dtype=torch.float64).square()
        return allreduce_hook(process_group, bucket)

    def take(self) -> torch.Tensor:
        """The squared norm summed since the last take (this rank's, for one step), and a fresh zero to sum into."""
        total, self.total = self.total, torch.zeros_like(self.total)
        return total


def squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """Σ |g|² over ``grads``, as a float64 device scalar (one fused norm per device)."""
    return torch.nn.utils.get_total_norm(grads, norm_type=2.0).double().square()


class ConsecutiveSteps:
    """One rank's estimator input: each step's flattened gradient beside the previous step's."""

    def __init__(self) -> None:
        self.previous: torch.Tensor | None = None

    def measure(self, grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(|g_t|², g_t·g_{t-1}) of this step, or None on the first step (nothing to pair it with yet)."""
        flat = torch.cat([g.reshape(-1) for g in grads])
        previous, self.previous = self.previous, flat
        if previous is None or previous.numel() != flat.numel():
            return None
        return torch.dot(flat, flat).double(), torch.dot(flat, previous).double()
