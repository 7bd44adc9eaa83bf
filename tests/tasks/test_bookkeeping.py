"""The bookkeeping profile (stagewise.definitions.bookkeeping): light tasks get their own pool and a fixed weight,
filled in when a config names none, overridable key by key in profiles.bookkeeping."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from stagewise.definitions.bookkeeping import BOOKKEEPING, BOOKKEEPING_POOL, BOOKKEEPING_WEIGHT, DEFAULT_POOL
from stagewise.definitions.config import PipelineConfig
from tests.conftest import base_config


def test_a_config_without_one_gets_the_default_profile_and_its_pool(storage_root):
    """No profiles.bookkeeping: the default one, in its own pool (declared, so make airflow-init creates it), with an
    absolute weight above any downstream sum, routed to the preprocess profile's queue."""
    raw = base_config(storage_root)
    raw["profiles"]["small"]["queue"] = "cpu"
    config = PipelineConfig(**raw)
    profile = config.profile(BOOKKEEPING)
    assert (profile.pool, profile.weight_rule, profile.priority_weight) == (BOOKKEEPING_POOL, "absolute", BOOKKEEPING_WEIGHT)
    assert profile.queue == "cpu"
    assert config.pools[BOOKKEEPING_POOL].slots == DEFAULT_POOL["slots"]
    assert config.pools["cpu_cores"].slots == 2, "the config's own pools stay"


def test_the_users_keys_win_and_the_rest_keep_the_defaults(storage_root):
    """profiles.bookkeeping overrides only the keys it names; a pool of the user's own needs no bookkeeping pool."""
    raw = base_config(storage_root)
    raw["profiles"][BOOKKEEPING] = {"pool": "cpu_cores", "priority_weight": 50, "retries": 3}
    config = PipelineConfig(**raw)
    profile = config.profile(BOOKKEEPING)
    assert (profile.pool, profile.priority_weight, profile.retries, profile.weight_rule) == ("cpu_cores", 50, 3, "absolute")
    assert BOOKKEEPING_POOL not in config.pools
    # The resolved config (a run's snapshot) loads back to the same profile.
    assert PipelineConfig(**config.model_dump(mode="json")).profile(BOOKKEEPING) == profile


def test_a_bookkeeping_profile_that_cannot_run_light_tasks_is_refused(storage_root):
    """Light tasks run in the task process: several processes per node, or an undeclared pool, are named errors."""
    raw = base_config(storage_root)
    raw["profiles"][BOOKKEEPING] = {"processes_per_node": 2}
    with pytest.raises(ValidationError, match="bookkeeping tasks: profile 'bookkeeping' has processes_per_node > 1"):
        PipelineConfig(**raw)
    raw["profiles"][BOOKKEEPING] = {"pool": "nowhere"}
    with pytest.raises(ValidationError, match="profiles.bookkeeping.pool: pool 'nowhere' is not defined"):
        PipelineConfig(**raw)
