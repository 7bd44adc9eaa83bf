"""Fingerprints depend on what a sub-job reads (bytes, the config it uses, upstream, code), never on names or runs."""

from __future__ import annotations

import shutil

from stagewise.definitions.loading import load_config
from stagewise.reuse import fingerprints
from tests.conftest import base_config

CODE = {"stagewise_version": "1", "stagewise_source": "abc", "source_fingerprint": None}


def test_content_id_follows_the_bytes_not_the_name(tmp_path):
    """Two files with the same bytes share an id; one changed byte changes it."""
    first, second = tmp_path / "a.parquet", tmp_path / "b.parquet"
    first.write_bytes(b"PAR1 rows PAR1")
    shutil.copy(first, second)
    assert fingerprints.content_id(str(first)) == fingerprints.content_id(str(second))
    second.write_bytes(b"PAR1 rowz PAR1")
    assert fingerprints.content_id(str(first)) != fingerprints.content_id(str(second))


def test_preprocess_inputs_change_with_data_and_rules_not_with_placement(write_config, storage_root):
    """Other shard bytes or another split changes the fingerprint; another profile for the same work does not."""
    raw = base_config(storage_root)
    config = load_config(write_config(raw))
    same = fingerprints.preprocess_inputs(config, ["sha256:1", "sha256:2"], CODE)
    assert same == fingerprints.preprocess_inputs(config, ["sha256:1", "sha256:2"], CODE)
    assert same != fingerprints.preprocess_inputs(config, ["sha256:1", "sha256:3"], CODE)
    assert same != fingerprints.preprocess_inputs(config, ["sha256:1", "sha256:2"], {**CODE, "stagewise_source": "x"})
    raw["preprocess"]["split"]["salt"] = "other"
    assert same != fingerprints.preprocess_inputs(load_config(write_config(raw)), ["sha256:1", "sha256:2"], CODE)
    raw = base_config(storage_root)
    raw["profiles"]["placed"] = dict(raw["profiles"]["small"], pool_slots=1, retries=5)
    raw["preprocess"]["profile"] = "placed"
    assert same == fingerprints.preprocess_inputs(load_config(write_config(raw)), ["sha256:1", "sha256:2"], CODE)


def test_stage_inputs_chain_the_stage_before_and_the_data(write_config):
    """A stage's fingerprint moves with its data, its params, the stage before's fingerprint and its own settings."""
    config = load_config(write_config())
    key = fingerprints.stage_inputs(config, "s2", "data1", {"lr": 0.1}, "s1-fp", CODE)
    assert key == fingerprints.stage_inputs(config, "s2", "data1", {"lr": 0.1}, "s1-fp", CODE)
    for other in (fingerprints.stage_inputs(config, "s2", "data2", {"lr": 0.1}, "s1-fp", CODE),
                  fingerprints.stage_inputs(config, "s2", "data1", {"lr": 0.2}, "s1-fp", CODE),
                  fingerprints.stage_inputs(config, "s2", "data1", {"lr": 0.1}, "s1-other", CODE),
                  fingerprints.stage_inputs(config, "s1", "data1", {"lr": 0.1}, "s1-fp", CODE)):
        assert other != key


def test_a_stage_is_not_reused_under_another_threshold_rule(write_config, storage_root):
    """A stage's bundle holds the decision threshold its validation chose by evaluate.threshold: another rule is
    another stage (served from the cache, the old threshold would label inference's rows)."""
    raw = base_config(storage_root)
    key = fingerprints.stage_inputs(load_config(write_config(raw)), "s1", "data1", {"lr": 0.1}, None, CODE)
    raw["evaluate"]["threshold"] = {"rule": "precision", "target": 0.9}
    assert fingerprints.stage_inputs(load_config(write_config(raw)), "s1", "data1", {"lr": 0.1}, None, CODE) != key


def test_package_fingerprint_is_stable_in_a_process():
    """Stagewise's own source hashes the same twice (a cached value, not a timestamp)."""
    assert fingerprints.package_fingerprint() == fingerprints.package_fingerprint()
    assert len(fingerprints.package_fingerprint()) == fingerprints.FINGERPRINT_CHARS


def test_a_stage_resumes_under_another_process_count_but_is_cached_under_its_own(write_config, storage_root):
    """A stage moved to another profile, or its profile's processes_per_node edited, keeps the fingerprint its
    checkpoints are keyed by (a retry resumes them) while the step cache's key moves with the count; another batch
    moves both."""
    raw = base_config(storage_root)

    def keys(changed: dict) -> tuple[str, str]:
        config = load_config(write_config(changed))
        args = (config, "s2", "data1", {"lr": 0.1}, "s1-fp", CODE)
        return fingerprints.stage_resume_inputs(*args), fingerprints.stage_inputs(*args)

    resume, cached = keys(raw)
    raw["profiles"]["ddp2"]["processes_per_node"] = 3
    assert keys(raw)[0] == resume and keys(raw)[1] != cached
    raw["profiles"]["ddp2"]["processes_per_node"] = 2
    raw["profiles"]["three"] = {**raw["profiles"]["ddp2"], "processes_per_node": 3}
    raw["train"]["stages"][1]["profile"] = "three"
    assert keys(raw)[0] == resume and keys(raw)[1] != cached
    raw["profiles"]["three"]["processes_per_node"] = 2
    assert keys(raw) == (resume, cached), "the profile's name alone places the work: it changes neither"
    raw["train"]["stages"][1]["per_process_batch"] = 48
    assert keys(raw)[0] != resume
