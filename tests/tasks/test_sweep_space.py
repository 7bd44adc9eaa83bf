"""Search space, samplers and pruners from the config: conditional params, grid, CMA-ES, median, none."""

from __future__ import annotations

import optuna
import pytest

from stagewise.definitions.config import ConfigError
from stagewise.definitions.loading import load_config
from stagewise.study.studies import make_pruner, make_sampler, suggest


def _space_config(write_config, storage_root, space: dict, **sweep):
    from tests.conftest import base_config

    raw = base_config(storage_root)
    raw["sweep"]["search_space"] = space
    raw["sweep"].update(sweep)
    return load_config(write_config(raw))


CONDITIONAL = {
    "lr": {"type": "float", "low": 0.001, "high": 0.1, "log": True},
    "optimizer": {"type": "categorical", "choices": ["sgd", "adamw"]},
    "momentum": {"type": "float", "low": 0.5, "high": 0.99, "when": {"optimizer": ["sgd"]}},
}


def test_conditional_param_is_searched_only_when_its_parent_matches(write_config, storage_root):
    """momentum exists in a trial exactly when optimizer == sgd."""
    config = _space_config(write_config, storage_root, CONDITIONAL)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(20):
        trial = study.ask()
        params = suggest(trial, config.sweep)
        assert ("momentum" in params) == (params["optimizer"] == "sgd")
        study.tell(trial, 0.5)


def test_condition_on_an_unknown_value_is_refused(write_config, storage_root):
    """A 'when' naming a value the parent cannot take is a config error naming the param."""
    space = {**CONDITIONAL, "momentum": {**CONDITIONAL["momentum"], "when": {"optimizer": ["adam"]}}}
    with pytest.raises(ConfigError, match=r"momentum\.when: \['adam'\] are not among optimizer's choices"):
        _space_config(write_config, storage_root, space)


def test_grid_sampler_needs_values_for_numeric_params(write_config, storage_root):
    """The grid sampler refuses a float param without grid values, and runs the full grid when given."""
    space = {"lr": {"type": "float", "low": 0.01, "high": 0.1}, "hidden": {"type": "categorical", "choices": [32, 64]}}
    with pytest.raises(ConfigError, match=r"search_space\.lr: the grid sampler needs 'grid: \[values\]'"):
        _space_config(write_config, storage_root, space, sampler={"type": "grid"})
    space["lr"]["grid"] = [0.01, 0.1]
    with pytest.raises(ConfigError, match="num_trials 5 exceeds the grid's 4 points"):
        _space_config(write_config, storage_root, space, sampler={"type": "grid"}, num_trials=5)
    config = _space_config(write_config, storage_root, space, sampler={"type": "grid"}, num_trials=4)
    study = optuna.create_study(sampler=make_sampler(config.sweep, 0))
    seen = set()
    for _ in range(4):
        trial = study.ask()
        seen.add(tuple(sorted(suggest(trial, config.sweep).items())))
        study.tell(trial, 0.0)
    assert len(seen) == 4


@pytest.mark.parametrize("kind,expected", [("tpe", optuna.samplers.TPESampler), ("random", optuna.samplers.RandomSampler),
                                           ("cmaes", optuna.samplers.CmaEsSampler)])
def test_sampler_kind_comes_from_the_config(write_config, storage_root, kind, expected):
    """sweep.sampler.type picks the Optuna sampler."""
    config = _space_config(write_config, storage_root, {"lr": CONDITIONAL["lr"]}, sampler={"type": kind})
    assert isinstance(make_sampler(config.sweep, 0), expected)


@pytest.mark.parametrize("kind,expected", [("hyperband", optuna.pruners.HyperbandPruner),
                                           ("median", optuna.pruners.MedianPruner), ("none", optuna.pruners.NopPruner)])
def test_pruner_kind_comes_from_the_config(write_config, storage_root, kind, expected):
    """sweep.pruner.type picks the Optuna pruner."""
    config = _space_config(write_config, storage_root, {"lr": CONDITIONAL["lr"]}, pruner={"type": kind})
    assert isinstance(make_pruner(config.sweep), expected)
