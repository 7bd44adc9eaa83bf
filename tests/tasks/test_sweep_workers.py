"""Sweep workers as separate processes: exact budget under races, recovery of a killed worker, DDP trials."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import yaml

from stagewise.definitions.loading import load_config
from stagewise.study.studies import create, open_storage
from stagewise.study.summary import summarize

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.torchrun


def _sweep_config(config_path: Path, **sweep) -> Path:
    raw = yaml.safe_load(config_path.read_text())
    raw["sweep"].update({"epochs": 2, **sweep})
    config_path.write_text(yaml.safe_dump(raw))
    return config_path


def _worker(config: Path, study: str, worker: int, out: str, env: dict, nproc: int = 1) -> subprocess.Popen:
    entry = [sys.executable, "-m", "stagewise.sweep"] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "stagewise.sweep"]
    return subprocess.Popen([*entry, "worker", "--config", str(config), "--study", study, "--worker", str(worker),
                             "--out", out], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _counted(study) -> list:
    return [t for t in study.get_trials() if t.state.name in ("COMPLETE", "PRUNED", "FAIL") and not t.user_attrs.get("abandoned")]


@pytest.mark.slow
def test_racing_workers_spend_exactly_the_budget(digits_run, subprocess_env):
    """Three workers started together on a budget of 7 leave exactly 7 trials, split 3/2/2."""
    config_path, out = digits_run
    config_path = _sweep_config(config_path, num_trials=7, num_workers=3)
    config = load_config(config_path)
    create(config, "race")
    workers = [_worker(config_path, "race", w, out, subprocess_env) for w in range(3)]
    for process in workers:
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, output[-3000:]
    study = optuna.load_study(study_name="race", storage=open_storage(config.sweep.storage))
    trials = _counted(study)
    assert len(trials) == len(study.trials) == 7
    assert sorted(sum(1 for t in trials if t.user_attrs["worker"] == w) for w in range(3)) == [2, 2, 3]


def test_killed_worker_trial_is_failed_and_retried_once_with_the_same_params(digits_run, subprocess_env):
    """A worker SIGKILLed mid-trial leaves it RUNNING; its retry marks it failed, reruns its params, keeps the budget."""
    config_path, out = digits_run
    config_path = _sweep_config(config_path, num_trials=3, num_workers=1)
    config = load_config(config_path)
    create(config, "crash")
    crashed = _worker(config_path, "crash", 0, out, {**subprocess_env, "STAGEWISE_FAULT_KILL_TRIAL": "1"})
    crashed.communicate(timeout=300)
    assert crashed.returncode != 0
    study = optuna.load_study(study_name="crash", storage=open_storage(config.sweep.storage))
    assert study.trials[1].state.name == "RUNNING", "the killed attempt left its trial running"

    retry = _worker(config_path, "crash", 0, out, {**subprocess_env, "STAGEWISE_FAULT_KILL_TRIAL": "1"})
    output, _ = retry.communicate(timeout=300)
    assert retry.returncode == 0, output[-3000:]
    study = optuna.load_study(study_name="crash", storage=open_storage(config.sweep.storage))
    abandoned = study.trials[1]
    assert abandoned.state.name == "FAIL" and abandoned.user_attrs["abandoned"]
    retried = [t for t in study.trials if t.user_attrs.get("retry_of") == 1]
    assert len(retried) == 1 and retried[0].params == abandoned.params and retried[0].state.name != "RUNNING"
    assert len(_counted(study)) == 3, "the abandoned attempt does not count against the budget"
    summary = summarize(config, "crash", out)
    assert summary["n_trials"] == 3 and summary["n_abandoned"] == 1


def test_ddp_trial_reports_each_epoch_once(digits_run, subprocess_env):
    """With a 2-process trial profile, rank 0 alone owns the trial: one intermediate value per epoch."""
    config_path, out = digits_run
    config_path = _sweep_config(config_path, num_trials=2, num_workers=1, profile="ddp2",
                                pruner={"type": "none"})
    config = load_config(config_path)
    create(config, "ddp")
    process = _worker(config_path, "ddp", 0, out, subprocess_env, nproc=2)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output[-3000:]
    journal = Path(config.sweep.storage.removeprefix("journal://"))
    operations = [json.loads(line) for line in journal.read_text().splitlines() if line.strip()]
    reports = [op for op in operations if "intermediate_value" in op and "step" in op]
    assert len(reports) == 2 * config.sweep.epochs, "each epoch of each trial is reported exactly once"
    assert sum("trial 0" in line for line in output.splitlines() if "worker 0: trial" in line) == 1, "only rank 0 logs"


def test_ddp_worker_with_a_batch_beyond_a_ranks_rows_fails_on_every_rank_before_a_trial(digits_run, subprocess_env,
                                                                                         tmp_path):
    """A 2-process worker whose sweep.batch_size exceeds a rank's train rows fails on both ranks as a user error
    naming sweep.batch_size and the process count (no rank left waiting), and starts no trial."""
    config_path, out = digits_run
    config_path = _sweep_config(config_path, num_trials=2, num_workers=1, profile="ddp2", batch_size=5000)
    config = load_config(config_path)
    create(config, "ddp_big")
    error_file = tmp_path / "errors.txt"
    process = _worker(config_path, "ddp_big", 0, out, {**subprocess_env, "STAGEWISE_ERROR_FILE": str(error_file)}, nproc=2)
    output, _ = process.communicate(timeout=300)
    assert process.returncode != 0, output[-3000:]
    messages = error_file.read_text().splitlines()
    assert len(messages) == 2 and all("sweep.batch_size 5000 exceeds" in m and "2 process(es)" in m for m in messages)
    study = optuna.load_study(study_name="ddp_big", storage=open_storage(config.sweep.storage))
    assert study.trials == []
