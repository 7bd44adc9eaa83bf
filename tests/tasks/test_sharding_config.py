"""Keys that strategy fsdp cannot be paired with (stagewise.definitions.sharding): refused when the config loads,
naming the keys, or, where a key would only change nothing, a warning naming it."""

from __future__ import annotations

import logging

import pytest

from stagewise.definitions.config import ConfigError
from stagewise.definitions.loading import load_config
from tests.conftest import base_config


def test_a_sharded_sweep_of_ones_own_trial_script_is_refused_naming_both_keys(write_config, storage_root, tmp_path):
    """sweep.strategy fsdp shards the built-in trial loop's model; with sweep.entrypoint nothing would be sharded, so
    the config is refused at load naming sweep.strategy and sweep.entrypoint (each alone still loads)."""
    (tmp_path / "trial.py").write_text("print('a trial')\n")
    raw = base_config(storage_root)
    raw["sweep"].update({"strategy": "fsdp", "entrypoint": {"script": "trial.py"}})
    with pytest.raises(ConfigError, match=r"sweep: sweep.strategy fsdp with sweep.entrypoint") as caught:
        load_config(write_config(raw))
    assert "drop sweep.strategy" in str(caught.value)
    assert load_config(write_config(raw), {"sweep.strategy": "ddp"}).sweep.entrypoint is not None
    del raw["sweep"]["entrypoint"]
    assert load_config(write_config(raw)).sweep.strategy == "fsdp"


def test_a_cuda_graph_forced_on_an_fsdp_stage_is_refused_naming_the_stage(write_config, storage_root):
    """cuda_graph: on with strategy: fsdp would never capture (the collectives run inside the step): refused naming
    the stage and both keys, where auto (which falls back to eager, logged) still loads."""
    raw = base_config(storage_root)
    raw["train"]["stages"][1].update({"strategy": "fsdp", "cuda_graph": "on"})
    with pytest.raises(ConfigError, match=r"train.stages.1: strategy fsdp with cuda_graph 'on'") as caught:
        load_config(write_config(raw))
    assert "set cuda_graph: auto or off" in str(caught.value)
    raw["train"]["stages"][1]["cuda_graph"] = "auto"
    assert load_config(write_config(raw)).train.stages[1].strategy == "fsdp"


def test_async_checkpoints_without_an_fsdp_stage_warn_and_still_load(write_config, storage_root, caplog):
    """train.async_checkpoints only changes fsdp stages: with none it is a WARNING naming the key (the config loads),
    and with one there is no warning."""
    raw = base_config(storage_root)
    raw["train"]["async_checkpoints"] = True
    with caplog.at_level(logging.WARNING, logger="stagewise.config"):
        assert load_config(write_config(raw)).train.async_checkpoints
    warned = [record for record in caplog.records if "train.async_checkpoints" in record.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert "fsdp stages only" in warned[0].getMessage()

    caplog.clear()
    raw["train"]["stages"][1]["strategy"] = "fsdp"
    with caplog.at_level(logging.WARNING, logger="stagewise.config"):
        load_config(write_config(raw))
    assert not [record for record in caplog.records if "async_checkpoints" in record.getMessage()]
