"""The epoch a stage hands on and when it stops early, read from its history of the objective."""

from __future__ import annotations

import math

import torch

from stagewise.training.selection import EpochSelection, cpu_copy

NAN = math.nan


def test_the_best_epoch_follows_the_objectives_direction_and_the_first_of_equals_wins():
    values = [0.5, 0.9, NAN, 0.9, 0.7]
    assert EpochSelection("maximize").best_index(values) == 1
    assert EpochSelection("minimize").best_index(values) == 0
    assert EpochSelection("maximize").best_index([NAN, NAN]) is None and EpochSelection("minimize").best_index([]) is None


def test_early_stopping_counts_epochs_since_an_improvement_larger_than_min_delta():
    """0.80 -> 0.805 is no improvement with min_delta 0.01, so two epochs pass without one; a NaN epoch counts too."""
    stopping = EpochSelection("maximize", min_delta=0.01, patience=2)
    assert not stopping.should_stop([0.8]) and not stopping.should_stop([0.8, 0.805])
    assert stopping.should_stop([0.8, 0.805, 0.79])
    assert not stopping.should_stop([0.8, 0.805, 0.9]) and stopping.should_stop([0.8, NAN, NAN])
    assert EpochSelection("minimize", patience=1).should_stop([1.0, 0.5, 0.6])
    assert not EpochSelection("maximize").should_stop([0.9, 0.1, 0.1, 0.1]), "no patience: never stops"


def test_a_cpu_copy_does_not_move_with_the_tensors_it_copied():
    weights = {"layer": {"w": torch.ones(2)}, "steps": [torch.zeros(1)], "lr": 0.1}
    copied = cpu_copy(weights)
    weights["layer"]["w"].add_(1)
    weights["steps"][0].add_(1)
    assert torch.equal(copied["layer"]["w"], torch.ones(2)) and torch.equal(copied["steps"][0], torch.zeros(1))
    assert copied["lr"] == 0.1
