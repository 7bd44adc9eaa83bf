"""Batch arithmetic and the refusals that must happen before any training process launches."""

from __future__ import annotations

import pytest

from tasks.config import ConfigError, load_config


def _with_stage(write_config, storage_root, **stage) -> object:
    from tests.conftest import base_config

    raw = base_config(storage_root)
    raw["train"]["stages"][1] = {"name": "s2", "profile": "ddp2", "epochs": 1, **stage}
    return write_config(raw)


def test_global_batch_derives_the_per_process_batch(write_config, storage_root):
    """global batch = per-process batch x processes x accumulation steps."""
    config = load_config(_with_stage(write_config, storage_root, global_batch=192, grad_accum_steps=3))
    assert config.stage("s2").micro_batch(world_size=2) == 32


def test_global_batch_that_does_not_divide_is_refused_naming_the_numbers(write_config, storage_root):
    """100 samples cannot split over 2 processes x 3 accumulation steps: refused at load, with the arithmetic."""
    with pytest.raises(ConfigError, match=r"train\.stages\[1\] \(s2\): global_batch 100 does not divide into 2 process"):
        load_config(_with_stage(write_config, storage_root, global_batch=100, grad_accum_steps=3))


def test_exactly_one_batch_size_is_given(write_config, storage_root):
    """Giving both per_process_batch and global_batch (or neither) is ambiguous and refused."""
    with pytest.raises(ConfigError, match="exactly one of per_process_batch and global_batch"):
        load_config(_with_stage(write_config, storage_root, global_batch=128, per_process_batch=64))
    with pytest.raises(ConfigError, match="exactly one of per_process_batch and global_batch"):
        load_config(_with_stage(write_config, storage_root))


def test_pool_slots_beyond_the_pool_are_refused(write_config, storage_root):
    """A profile taking more slots than its pool has could never be scheduled."""
    from tests.conftest import base_config

    raw = base_config(storage_root)
    raw["profiles"]["ddp2"]["pool_slots"] = 3
    with pytest.raises(ConfigError, match=r"profiles\.ddp2\.pool_slots: 3 exceeds the 2 slot"):
        load_config(write_config(raw))


def test_undeclared_pool_is_refused(write_config, storage_root):
    """A profile naming a pool the config does not declare fails at load, not as a stuck task."""
    from tests.conftest import base_config

    raw = base_config(storage_root)
    raw["profiles"]["small"]["pool"] = "gpus"
    with pytest.raises(ConfigError, match=r"profiles\.small\.pool: pool 'gpus' is not defined"):
        load_config(write_config(raw))
