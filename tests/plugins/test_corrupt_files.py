"""Files that exist but cannot be read fail their Airflow task once, naming the file, with nothing committed.

Each case runs the real sub-job through the launcher, as the task does: AirflowFailException is Airflow's
"fail, do not retry"; a RuntimeError would be retried as an infrastructure fault.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from airflow.sdk.exceptions import AirflowFailException

from stagewise import registry
from stagewise.airflow import launch
from stagewise.definitions.config import Profile
from stagewise.models.torch_io import save_torch


def _cut(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


@pytest.mark.torchrun
def test_a_cut_model_of_the_previous_stage_fails_the_next_stage_once_naming_it(digits_run, tmp_path):
    """train_s2 starting from a cut s1/final.pt: a data error naming that file, not 'stagewise.train exited with code 1'."""
    import torch

    config, out = digits_run
    final = Path(out) / "train" / "s1" / "final.pt"
    save_torch(str(final), {"model": {"w": torch.zeros(4)}})
    _cut(final)
    with pytest.raises(AirflowFailException, match=rf"{final}: cannot be loaded as a torch file .*cut or corrupt"):
        launch.run("stagewise.train", ["--stage", "s2", "--out", out, "--params", json.dumps({"lr": 0.05}),
                                   "--init-from", str(final), "--config", str(config)],
                   Profile(processes_per_node=1), distributed=True)
    assert _files_under(Path(out) / "train" / "s2") == [], "nothing of s2 may be written"


@pytest.mark.subprocess
def test_a_cut_registered_model_fails_each_inference_shard_once_naming_it(digits_run, storage_root, tmp_path):
    """An inference shard scoring with a registered model.pt cut after registration names it and writes no part file."""
    config, out = digits_run
    source = tmp_path / "model.pt"
    source.write_bytes(b"weights" * 100)
    card = registry.register(str(storage_root), "digits", str(source), {"test_accuracy": 0.9})
    _cut(Path(card["model_uri"]))
    shard = {"index": 0, "files": [], "rows": 0}
    with pytest.raises(AirflowFailException, match=rf"{card['version']}/model.pt: its 350 bytes hash to .*not to its registered"):
        launch.run("stagewise.infer", ["shard", "--model", card["model_uri"], "--out", out, "--shard", json.dumps(shard),
                                   "--config", str(config)], Profile())
    assert _files_under(Path(out) / "predictions") == []


@pytest.mark.subprocess
def test_a_torn_preprocess_manifest_fails_evaluation_once_naming_it(digits_run, tmp_path):
    """A manifest.json cut mid-write by a foreign tool is a data error naming it, not a bare JSONDecodeError."""
    config, out = digits_run
    manifest = Path(out) / "preprocess" / "manifest.json"
    _cut(manifest)
    with pytest.raises(AirflowFailException, match=rf"{manifest}: is not valid JSON"):
        launch.run("stagewise.evaluate", ["--model", str(tmp_path / "unused.pt"), "--out", out, "--config", str(config)],
                   Profile())
    assert not (Path(out) / "evaluate").exists()
