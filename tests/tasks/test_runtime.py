"""The runtime helper of a user's own script (stagewise.spec.report and friends), against real Optuna studies."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from stagewise import spec
from stagewise.core import contract
from stagewise.core.errors import UserError
from stagewise.definitions.loading import load_config
from stagewise.scripting import runtime
from stagewise.scripting.entrypoint import read_last_report
from stagewise.scripting.stage_contract import byo_environment
from stagewise.study.studies import open_storage
from stagewise.sweep import absolute_storage, trial_contract, trial_environment
from tests.conftest import base_config


@pytest.fixture(autouse=True)
def fresh_runtime(monkeypatch):
    """Each test reads its own environment: the helper's once-per-process caches start empty."""
    for name in [name for name in os.environ if name.startswith("STAGEWISE_")]:
        monkeypatch.delenv(name)
    for cached in (runtime.context, runtime._config, runtime._manifest, runtime._trial):
        cached.cache_clear()
    runtime._latest.clear()
    runtime._built.clear()
    yield
    for cached in (runtime.context, runtime._config, runtime._manifest, runtime._trial):
        cached.cache_clear()


def median_config(write_config, storage_root) -> Path:
    """A config whose pruner must prune a trial below the one completed trial's value from its first epoch on."""
    raw = base_config(storage_root)
    raw["sweep"]["pruner"] = {"type": "median", "n_startup_trials": 1, "n_warmup_steps": 0}
    return write_config(raw)


def stage_env(monkeypatch, path: Path, storage_root: Path, tmp_path: Path) -> dict[str, str]:
    config = load_config(path)
    env = byo_environment(config, str(path), "s2", str(storage_root / "runs" / "t" / "r1"), {"lr": 0.02}, None, {})
    env.update({contract.METRICS_FILE: str(tmp_path / "metrics.json"), contract.ERROR_FILE: str(tmp_path / "error.txt")})
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


def study_with_one_good_trial(path: Path) -> tuple[optuna.Study, str]:
    """A journal study holding one COMPLETE trial that reported accuracy 0.9 at epochs 1 and 2."""
    config = load_config(path)
    name = "runtime_test"
    study = optuna.create_study(study_name=name, storage=open_storage(absolute_storage(config.sweep.storage)),
                                direction="maximize")
    good = study.ask()
    for step in (1, 2):
        good.report(0.9, step)
    study.tell(good, 0.9)
    return study, name


def trial_env(monkeypatch, path: Path, study: optuna.Study, name: str, tmp_path: Path) -> tuple[optuna.trial.Trial, dict]:
    config = load_config(path)
    trial = study.ask()
    values = trial_contract(config, str(path), trial, {"lr": 0.02}, str(tmp_path / "run"), str(tmp_path))
    env = trial_environment(config, name, trial, values, str(tmp_path), {})
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return trial, env


def test_report_in_a_stage_returns_false_and_records_the_metrics(write_config, storage_root, tmp_path, monkeypatch, capsys):
    """A stage has no trial: report never says stop, logs one progress line and records the latest metrics for the framework."""
    env = stage_env(monkeypatch, write_config(), storage_root, tmp_path)
    assert spec.report(0, {"accuracy": 0.5, "loss": 1.5}) is False
    assert spec.report(1, {"accuracy": 0.75, "loss": 0.9}) is False
    recorded = read_last_report(env[contract.METRICS_FILE])
    assert recorded == {"epoch": 2, "metrics": {"accuracy": 0.75, "loss": 0.9}, "pruned": False}
    first, last = capsys.readouterr().out.splitlines()
    assert re.fullmatch(r"s2 epoch 1/2: accuracy 0\.5000, loss 1\.5000, ETA \d+s", first), first
    assert last == "s2 epoch 2/2: accuracy 0.7500, loss 0.9000", "no ETA once the last epoch is done"


def test_a_scripts_progress_line_reads_like_the_built_in_loops():
    """lr and samples/s, when the script reports them, read as the built-in loop's epoch lines; the ETA is the time
    so far per epoch times the epochs left; a pruned trial says so instead."""
    ctx = runtime.Context(stage="s1", trial=None, epochs=10, warmup_steps=0, per_process_batch=32, grad_accum_steps=1,
                          global_batch=32, lr=0.1, seed=0, objective="accuracy", rank=0, world_size=1)
    line = runtime.progress_line(ctx, 1, {"accuracy": 0.91234, "lr": 0.00125, "samples_per_s": 1234.6}, 20.0, False)
    assert line == "s1 epoch 2/10: accuracy 0.9123, lr 0.00125, 1235 samples/s, ETA 80s"
    assert runtime.progress_line(ctx, 1, {"accuracy": 0.5}, 20.0, True) == "s1 epoch 2/10: accuracy 0.5000 -> pruned"


def test_report_without_the_objective_metric_names_it_and_fails_without_retry(write_config, storage_root, tmp_path,
                                                                              monkeypatch):
    """metrics lacking objective.metric is a user error naming the metric, also left in $STAGEWISE_ERROR_FILE."""
    env = stage_env(monkeypatch, write_config(), storage_root, tmp_path)
    with pytest.raises(UserError, match=r"lack the objective metric 'accuracy' \(objective.metric\)"):
        spec.report(0, {"loss": 0.3})
    assert "'accuracy'" in Path(env[contract.ERROR_FILE]).read_text()
    assert not Path(env[contract.METRICS_FILE]).exists()


def test_stage_values_and_params_come_from_the_contract(write_config, storage_root, tmp_path, monkeypatch):
    """context() and hyperparameters() give the stage's rescaled lr, batches and epochs and the resolved hyperparameters."""
    stage_env(monkeypatch, write_config(), storage_root, tmp_path)
    ctx = spec.context()
    assert (ctx.stage, ctx.trial, ctx.epochs, ctx.per_process_batch, ctx.world_size) == ("s2", None, 2, 64, 1)
    assert ctx.global_batch == 64 * 2 and ctx.lr == pytest.approx(0.02 * 128 / 32) and ctx.objective == "accuracy"
    assert spec.hyperparameters()["lr"] == 0.02 and spec.hyperparameters()["hidden"] == 128
    assert spec.init_from() is None and spec.checkpoint_dir().endswith("train/s2/checkpoints")


def test_report_in_a_trial_prunes_a_bad_trial_through_the_shared_study(write_config, storage_root, tmp_path, monkeypatch):
    """In a sweep trial rank 0 reports the objective to the study's trial and returns the pruner's decision."""
    path = median_config(write_config, storage_root)
    study, name = study_with_one_good_trial(path)
    trial, env = trial_env(monkeypatch, path, study, name, tmp_path)
    assert spec.report(0, {"accuracy": 0.1}) is True
    stored = study._storage.get_trial(trial._trial_id)
    assert stored.intermediate_values == {1: 0.1}
    assert read_last_report(env[contract.METRICS_FILE])["pruned"] is True


def test_report_in_a_trial_keeps_a_good_trial(write_config, storage_root, tmp_path, monkeypatch):
    """A trial at least as good as the median is not pruned."""
    path = median_config(write_config, storage_root)
    study, name = study_with_one_good_trial(path)
    trial_env(monkeypatch, path, study, name, tmp_path)
    assert spec.report(0, {"accuracy": 0.95}) is False


TWO_RANKS = """
import os, sys
import torch.distributed as dist
from stagewise.spec import report
dist.init_process_group("gloo")
stop = report(0, {"accuracy": 0.1})
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as handle:
    handle.write("true" if stop else "false")
dist.destroy_process_group()
"""


@pytest.mark.torchrun
def test_every_rank_of_a_torchrun_trial_gets_rank_0s_prune_decision(write_config, storage_root, tmp_path, monkeypatch,
                                                                     subprocess_env):
    """Under a real 2-process gloo torchrun only rank 0 asks the study; both ranks return its decision (prune)."""
    path = median_config(write_config, storage_root)
    study, name = study_with_one_good_trial(path)
    trial, env = trial_env(monkeypatch, path, study, name, tmp_path)
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS)
    answers = tmp_path / "answers"
    answers.mkdir()
    done = subprocess.run([sys.executable, "-m", "stagewise.training.local_torchrun", "--nproc-per-node=2", str(script), str(answers)],
                          env={**subprocess_env, **env}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert {p.name: json.loads(p.read_text()) for p in answers.iterdir()} == {"rank0.json": True, "rank1.json": True}
    assert study._storage.get_trial(trial._trial_id).intermediate_values == {1: 0.1}  # reported once, by rank 0
    assert done.stdout.count("epoch 1/") == 1  # one progress line, rank 0's


def test_a_stage_scripts_outputs_are_what_the_next_stage_and_evaluation_accept(digits_run, tmp_path, monkeypatch):
    """read_split, build_model and save_model give the committed data, the config's model and final.pt + model.pt that
    check_byo_outputs, load_bundle and the next stage take; the last report becomes the stage's val_metric."""
    import torch

    from stagewise.models.bundle import load_bundle
    from stagewise.models.torch_io import load_torch
    from stagewise.scripting.entrypoint import LAST_REPORT
    from stagewise.scripting.stage_contract import byo_contract, byo_result, check_byo_outputs

    config_path, out = digits_run
    config = load_config(config_path)
    env = byo_environment(config, str(config_path), "s1", out, {"lr": 0.02, "hidden": 16}, None, {})
    env[contract.METRICS_FILE] = str(tmp_path / "metrics.json")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    train = spec.read_split("train")
    features, labels = train.tensors
    assert features.dtype == torch.float32 and labels.dtype == torch.int64 and features.shape[1] == 64
    model = spec.build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=spec.context().lr)
    spec.report(0, {"accuracy": 0.5})
    spec.save_model(model, optimizer=optimizer)
    outputs = check_byo_outputs(config, "s1", out)
    final = load_torch(outputs["final.pt"])
    assert final["global_batch"] == 32 and "optimizer" in final and set(final["model"]) == set(model.state_dict())
    bundle = load_bundle(outputs["model.pt"])
    assert bundle.params["hidden"] == 16 and bundle.extra["val_metric"] == 0.5
    assert torch.equal(bundle.module(features[:4]), model.eval()(features[:4]))
    contract_values = byo_contract(config, str(config_path), "s1", out, {"lr": 0.02, "hidden": 16}, None)
    last = read_last_report(env[contract.METRICS_FILE])
    assert byo_result(config, "s1", out, contract_values, {LAST_REPORT: last})["val_metric"] == 0.5


def test_load_optimizer_reads_a_built_in_stages_sharded_hand_off_and_a_scripts_inline_one(tmp_path):
    """A script continues the optimizer of the stage before: from a built-in stage's final.pt (the state in a sharded
    checkpoint beside it) and from a script's (inline) alike, to the same moments; a hand-off without any says so."""
    import torch

    from stagewise.training.distributed import DistEnv
    from stagewise.training.strategy import DDPStrategy

    def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        optimizer = torch.optim.AdamW(module.parameters(), lr=0.01)
        module(torch.randn(8, 4)).square().mean().backward()
        optimizer.step()
        return module, optimizer

    import warnings

    module, optimizer = trained()
    built_in = DDPStrategy(DistEnv(rank=0, local_rank=0, world_size=1, device="cpu"))
    with warnings.catch_warnings(record=True) as caught:  # one process on purpose: no warning in every task log
        warnings.simplefilter("always")
        handed = built_in.full_state(module, optimizer, str(tmp_path / "s1"))
        spec.load_optimizer(module, torch.optim.AdamW(module.parameters(), lr=0.01), handed)
    assert not [str(w.message) for w in caught if "torch.distributed is disabled" in str(w.message)]
    assert set(handed["optimizer"]) == {"sharded_checkpoint"}
    inline = {"model": module.state_dict(), "optimizer": optimizer.state_dict()}
    expected = optimizer.state_dict()["state"][0]["exp_avg_sq"]
    for state in (handed, inline):
        fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        fresh.load_state_dict(state["model"])
        continued = torch.optim.AdamW(fresh.parameters(), lr=0.01)
        assert spec.load_optimizer(fresh, continued, state) is True
        assert torch.equal(continued.state_dict()["state"][0]["exp_avg_sq"], expected)
    assert spec.load_optimizer(module, optimizer, {"model": inline["model"]}) is False
