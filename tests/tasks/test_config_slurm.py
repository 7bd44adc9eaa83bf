"""A profile with ``backend: slurm`` and its ``slurm:`` block: what loads, and each refusal naming the setting."""

from __future__ import annotations

import pytest

from stagewise.definitions.config import ConfigError
from stagewise.definitions.loading import load_config
from tests.conftest import base_config


def _slurm(storage_root, *, block: dict | None = None, **profile) -> dict:
    raw = base_config(storage_root)
    raw["profiles"]["ddp2"].update({"backend": "slurm", "nodes": 2, "processes_per_node": 1,
                                    "slurm": {"partition": "debug", **(block or {})}, **profile})
    return raw


def test_a_slurm_profile_loads_with_defaults_and_on_a_shared_folder(write_config, storage_root):
    """Only the partition given: the rest are Slurm's defaults or ours (rendezvous 29400, poll 10 s, deferred)."""
    config = load_config(write_config(_slurm(storage_root, block={"min_nodes": 1, "time_limit": "1-02:00:00",
                                                                  "extra_sbatch_options": ["--exclusive"]})))
    profile = config.profile("ddp2")
    assert profile.backend == "slurm" and profile.world_size == 2
    settings = profile.slurm
    assert (settings.partition, settings.min_nodes, settings.cpus_per_task, settings.gpus_per_node) == ("debug", 1, 1, 0)
    assert (settings.rendezvous_port, settings.poll_s, settings.deferrable, settings.log_dir) == (29400, 10.0, True, "")


@pytest.mark.parametrize("limit", ["30", "30:00", "02:00:00", "1-0", "1-02:00", "7-00:00:00"])
def test_every_time_format_sbatch_takes_is_accepted(write_config, storage_root, limit):
    config = load_config(write_config(_slurm(storage_root, block={"time_limit": limit})))
    assert config.profile("ddp2").slurm.time_limit == limit


@pytest.mark.parametrize("profile, message", [
    ({"slurm": None}, "backend 'slurm' needs a 'slurm:' block"),
    ({"backend": "kubernetes", "kubernetes": {"image": "x"}}, "a 'slurm:' block belongs to backend 'slurm', not 'kubernetes'"),
    ({"slurm": {"min_nodes": 3}}, "slurm.min_nodes 3 exceeds nodes 2"),
    ({"slurm": {"time_limit": "2h"}}, "time_limit"),
    ({"slurm": {"mem_per_cpu": "2 GB"}}, "mem_per_cpu"),
    ({"slurm": {"cpus_per_task": 0}}, "cpus_per_task"),
    ({"slurm": {"extra_sbatch_options": ["exclusive"]}}, r"\['exclusive'\]: each extra sbatch option"),
    ({"slurm": {"partition": "debug", "nodes": 2}}, "nodes"),  # a profile key inside the block: strict
])
def test_a_slurm_profile_that_cannot_run_is_refused_when_the_config_loads(write_config, storage_root, profile, message):
    raw = _slurm(storage_root)
    raw["profiles"]["ddp2"].update(profile)
    with pytest.raises(ConfigError, match=message):
        load_config(write_config(raw))


def test_an_s3_storage_root_needs_a_shared_log_dir(write_config, storage_root):
    """The job's output file lives on a folder every node and this worker see: with an S3 root there is none by default."""
    raw = _slurm(storage_root)
    raw["storage_root"] = "s3://bucket/stagewise"
    with pytest.raises(ConfigError, match="profiles.ddp2.slurm.log_dir: a Slurm job writes its output"):
        load_config(write_config(raw))
    raw["profiles"]["ddp2"]["slurm"]["log_dir"] = str(storage_root / "slurm-logs")
    assert load_config(write_config(raw)).profile("ddp2").slurm.log_dir.endswith("slurm-logs")


def test_inference_shards_and_sweep_workers_may_run_as_slurm_jobs_but_evaluate_stays_local(write_config, storage_root):
    """An inference shard or a sweep worker is a one-node Slurm job (stagewise.airflow.slurm_subjob); evaluate is not."""
    raw = _slurm(storage_root)
    raw["profiles"]["shards"] = {"backend": "slurm", "slurm": {"partition": "debug"}}
    raw["inference"]["profile"] = raw["sweep"]["profile"] = "shards"
    config = load_config(write_config(raw))
    assert config.profile(config.inference.profile).backend == config.profile(config.sweep.profile).backend == "slurm"
    raw["evaluate"]["profile"] = "shards"
    with pytest.raises(ConfigError, match="evaluate.profile: profile 'shards' has backend 'slurm'; only train stages"):
        load_config(write_config(raw))


def test_an_own_entrypoint_may_run_on_a_slurm_profile(write_config, storage_root):
    """The nodes run this install: a stage's own script runs there as on the worker (node_launch slurm)."""
    raw = _slurm(storage_root)
    raw["train"]["stages"][1]["entrypoint"] = {"script": "train.py"}
    assert load_config(write_config(raw)).stage("s2").entrypoint.script.endswith("train.py")
