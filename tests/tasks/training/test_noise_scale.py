"""The gradient noise scale estimator: on gradients drawn with a known mean G and covariance trace S, both estimators
(two batch sizes across ranks; consecutive steps on one rank) recover |G|², S and B_simple = S/|G|²; its state
round-trips through a checkpoint; an overflowed (non-finite) step is skipped."""

from __future__ import annotations

import math

import pytest
import torch

from stagewise.training.noise_scale import ConsecutiveSteps, NoiseScale

DIM, SIGMA = 200, 0.5  # per-sample noise N(0, SIGMA² I): tr(Σ) = DIM·SIGMA² = 50
TRUE_G = torch.full((DIM,), 0.05, dtype=torch.float64)  # |G|² = 0.5, so B_simple = 100
TRUE_G2, TRUE_S = float(TRUE_G.square().sum()), DIM * SIGMA**2


def _batch_gradient(generator: torch.Generator, batch: int) -> torch.Tensor:
    """The mean gradient of ``batch`` samples: G plus noise of covariance Σ/batch."""
    return TRUE_G + SIGMA / math.sqrt(batch) * torch.randn(DIM, generator=generator, dtype=torch.float64)


def _averaged(estimator: NoiseScale, steps: int, record) -> dict[str, float]:
    """The estimates averaged over the last half of ``steps`` updates (the EMA's own jitter averaged out)."""
    seen = []
    for step in range(steps):
        record()
        if step >= steps // 2:
            seen.append(estimator.estimates())
    return {key: sum(e[key] for e in seen) / len(seen) for key in seen[0]}


def test_across_ranks_the_two_batch_sizes_recover_g_s_and_the_noise_scale():
    """4 ranks of 16 samples: each rank's squared norm (B_small = 16) against the averaged gradient's (B_big = 64)."""
    generator = torch.Generator().manual_seed(0)
    estimator = NoiseScale("cpu", beta=0.99)
    ranks, per_rank = 4, 16

    def record() -> None:
        local = [_batch_gradient(generator, per_rank) for _ in range(ranks)]
        small_sq = torch.stack([g.square().sum() for g in local]).mean()
        big_sq = torch.stack(local).mean(0).square().sum()
        estimator.update(small_sq, big_sq, per_rank, per_rank * ranks)

    found = _averaged(estimator, 4000, record)
    assert found["grad_sq"] == pytest.approx(TRUE_G2, rel=0.1)
    assert found["trace_cov"] == pytest.approx(TRUE_S, rel=0.1)
    assert found["noise_scale"] == pytest.approx(TRUE_S / TRUE_G2, rel=0.15)


def test_on_one_rank_consecutive_steps_recover_the_noise_scale():
    """One rank, batch 32: |g_t|² against g_t·g_(t-1) of independent consecutive batches."""
    generator = torch.Generator().manual_seed(1)
    estimator, pairs = NoiseScale("cpu", beta=0.99), ConsecutiveSteps()

    def record() -> None:
        measured = pairs.measure([_batch_gradient(generator, 32).float()])
        if measured is not None:
            estimator.update_consecutive(*measured, batch=32.0)

    pairs.measure([_batch_gradient(generator, 32).float()])  # the first step only primes the pair
    found = _averaged(estimator, 4000, record)
    assert found["grad_sq"] == pytest.approx(TRUE_G2, rel=0.1)
    assert found["noise_scale"] == pytest.approx(TRUE_S / TRUE_G2, rel=0.15)


def test_state_round_trips_so_a_resumed_stage_continues_the_same_curve():
    """An estimator restored from another's state gives exactly the estimates the original gives on the same steps."""
    generator = torch.Generator().manual_seed(2)
    steps = [(_batch_gradient(generator, 8).square().sum(), _batch_gradient(generator, 16).square().sum()) for _ in range(60)]
    original = NoiseScale("cpu")
    for small, big in steps[:30]:
        original.update(small, big, 8, 16)
    restored = NoiseScale("cpu")
    restored.load_state_dict(original.state_dict())
    for small, big in steps[30:]:
        original.update(small, big, 8, 16)
        restored.update(small, big, 8, 16)
    assert restored.estimates() == original.estimates() and restored.updates == original.updates == 60


def test_no_noise_scale_while_the_smoothed_gradient_is_not_positive_yet():
    """Early, noise can make the unbiased |G|² estimate negative: the scale is then unknown (None), never inf."""
    estimator = NoiseScale("cpu")
    estimator.update(torch.tensor(1.0), torch.tensor(0.2), 8, 16)  # |G|² = (16·0.2 − 8·1)/8 < 0
    assert estimator.estimates()["grad_sq"] < 0 and estimator.estimates()["noise_scale"] is None


def test_a_non_finite_step_is_skipped_and_nothing_is_estimated_before_a_step():
    """An fp16 step whose gradients overflowed (inf) leaves the estimates as they were."""
    estimator = NoiseScale("cpu")
    assert estimator.estimates() is None
    estimator.update(torch.tensor(2.0), torch.tensor(1.0), 8, 32)
    before = estimator.estimates()
    estimator.update(torch.tensor(float("inf")), torch.tensor(1.0), 8, 32)
    assert estimator.estimates() == before
