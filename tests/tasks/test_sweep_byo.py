"""sweep.entrypoint: a user's script runs as each sweep trial, against a real journal study."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import optuna
import pytest

from stagewise import sweep
from stagewise.definitions.config import ConfigError
from stagewise.definitions.loading import load_config
from stagewise.study.studies import best_trial, create, open_storage
from stagewise.study.summary import summarize
from tests.conftest import base_config


def byo_sweep_config(write_config, storage_root, entrypoint: dict) -> str:
    raw = base_config(storage_root)
    raw["sweep"].update({"num_trials": 4, "num_workers": 1, "epochs": 3, "entrypoint": entrypoint,
                         "pruner": {"type": "median", "n_startup_trials": 1, "n_warmup_steps": 0},
                         "sampler": {"type": "random"}})
    return str(write_config(raw))


@pytest.mark.torchrun
@pytest.mark.slow
def test_script_trials_complete_prune_and_fail_and_the_sweep_goes_on(write_config, storage_root, tmp_path, monkeypatch,
                                                                     subprocess_env, caplog):
    """Each trial runs the script under torchrun in its own cwd with its params: a reported value COMPLETEs, a pruned
    report PRUNEs, a nonzero exit or no report FAILs with the reason, and the summary and best params see them."""
    for key, value in subprocess_env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("BYO_TRIAL_LOG", str(tmp_path))
    # Beside its config, named relative to it (as a team's pipelines folder holds its scripts), not to any cwd.
    shutil.copy(Path(__file__).with_name("byo_trial_script.py"), tmp_path / "byo_trial_script.py")
    path = byo_sweep_config(write_config, storage_root, {"script": "byo_trial_script.py",
                                                           "args": ["--hidden", "{hidden}", "--epochs", "{epochs}"]})
    assert Path(path).parent == tmp_path
    config = load_config(path)
    create(config, "byo_study")
    out = str(storage_root / "runs" / "t" / "r1")
    with caplog.at_level("INFO", logger="stagewise.sweep"):
        result = sweep.run_worker(config, "byo_study", 0, out, path, {})
    assert result["trials_run"] == 4
    assert "trial 1 pruned (val_accuracy 0.1000" in caplog.text, "a pruned trial logs its last reported value, not nan"
    study = optuna.load_study(study_name="byo_study", storage=open_storage(config.sweep.storage))
    trials = sorted(study.get_trials(), key=lambda t: t.number)
    assert [t.state.name for t in trials] == ["COMPLETE", "PRUNED", "FAIL", "FAIL"]
    assert trials[0].value == 0.9 and trials[0].user_attrs["epochs"] == 3 and trials[1].user_attrs["epochs"] == 1
    assert "byo_trial_script.py exited with code" in trials[2].user_attrs["error"]  # torchrun: 1 when a rank fails
    assert "ended without reporting a metric" in trials[3].user_attrs["error"]
    seen = [json.loads((tmp_path / f"trial{n}.json").read_text()) for n in range(4)]
    assert len({s["cwd"] for s in seen}) == 4 and all("stagewise-trial" in s["cwd"] for s in seen)
    assert seen[0]["args"] == ["--hidden", str(trials[0].params["hidden"]), "--epochs", "3"]
    assert seen[0]["params"]["lr"] == trials[0].params["lr"] and seen[0]["per_process_batch"] == config.sweep.batch_size
    assert best_trial(study).params == trials[0].params
    summary = summarize(config, "byo_study", out)
    assert (summary["n_complete"], summary["n_pruned"], summary["n_failed"]) == (1, 1, 2)


def test_sweep_entrypoint_with_an_unknown_placeholder_is_a_config_error(write_config, storage_root):
    """A {name} that is neither a stage value nor a hyperparameter fails config validation, naming sweep's arg."""
    path = byo_sweep_config(write_config, storage_root, {"script": "x.py", "args": ["--width", "{widht}"]})
    with pytest.raises(ConfigError, match=r"sweep: entrypoint.args\[1\] '\{widht\}': unknown placeholder \{widht\}"):
        load_config(path)
