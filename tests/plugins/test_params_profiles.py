"""Trigger-form Params map onto config overrides; profiles map onto Airflow's own knobs."""

from __future__ import annotations

from datetime import timedelta

import pytest

from stagewise_airflow.params import overrides_from_params, pipeline_params
from stagewise_airflow.profiles import task_kwargs
from tasks.config import Profile, load_config


def _defaults(config) -> dict:
    return {name: param.resolve() for name, param in pipeline_params(config).items()}


def test_param_defaults_reproduce_the_config():
    """Triggering with the form's defaults runs exactly the config file."""
    config = load_config()
    assert load_config(overrides=overrides_from_params(config, _defaults(config))) == config


def test_params_override_budget_workers_and_stage_epochs():
    """Values set in the form reach the sweep and each training stage."""
    config = load_config()
    params = {**_defaults(config), "num_trials": 5, "num_sweep_workers": 3, "stage_epochs": {"s2": 4}}
    changed = load_config(overrides=overrides_from_params(config, params))
    assert changed.sweep.num_trials == 5 and changed.sweep.num_workers == 3
    assert changed.stage("s2").epochs == 4 and changed.stage("s1").epochs == config.stage("s1").epochs


@pytest.mark.parametrize("name,value", [("num_trials", 0), ("num_sweep_workers", 100), ("sweep_epochs", -1),
                                        ("min_test_accuracy", 1.5), ("stage_epochs", {"s9": 3})])
def test_out_of_bounds_params_are_refused(name, value):
    """The JSON-schema bounds refuse bad form values before a run starts."""
    from airflow.sdk.definitions.param import ParamsDict
    from airflow.sdk.exceptions import ParamValidationError

    params = ParamsDict(pipeline_params(load_config()))
    with pytest.raises(ParamValidationError, match=f"param {name}"):
        params[name] = value  # assignment validates, as a trigger's conf does
        params.validate()


def test_profile_maps_to_pool_queue_retries_and_timeout():
    """Pool slots bound concurrency, the queue routes, retries back off exponentially with a cap."""
    kwargs = task_kwargs(Profile(pool="gpus", pool_slots=2, queue="gpu", retries=3, retry_delay_s=10,
                                 retry_backoff=2.0, max_retry_delay_s=60, execution_timeout_s=120))
    assert kwargs["pool"] == "gpus" and kwargs["pool_slots"] == 2 and kwargs["queue"] == "gpu"
    assert kwargs["retries"] == 3 and kwargs["retry_delay"] == timedelta(seconds=10)
    assert kwargs["retry_exponential_backoff"] == 2.0 and kwargs["max_retry_delay"] == timedelta(seconds=60)
    assert kwargs["execution_timeout"] == timedelta(seconds=120)
