"""The model-spec contract (tasks/spec.py): a user's spec runs in every stage, and each way of breaking the
contract is a user error that names the spec (so Airflow does not retry it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stagewise import train
from stagewise.core import storage
from stagewise.core.errors import UserError
from stagewise.datasets.predictions import plan_inference
from stagewise.definitions.hyperparams import BUILTIN_SPEC_PARAMS
from stagewise.definitions.loading import load_config
from stagewise.evaluate import evaluate
from stagewise.models.building import build
from stagewise.models.bundle import load_bundle
from stagewise.models.mlp import MLPClassifier
from stagewise.spec import DataInfo, Regressor, SpecRef

REPO_ROOT = Path(__file__).resolve().parents[2]
PARAMS = {"lr": 0.05, "hidden": 32}


@pytest.fixture
def single_process(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", train.FAULT_ENV):
        monkeypatch.delenv(name, raising=False)


def _config(config_path: Path, spec: str, args: dict | None = None, **overrides):
    return load_config(config_path, {"model.spec": spec, "model.args": args or {}, **overrides})


def test_builtin_spec_params_match_the_config_check():
    """The built-in spec's hyperparameters and defaults are the declared ones the config checks, names and values."""
    assert MLPClassifier.default_params == {hyper.name: hyper.default for hyper in BUILTIN_SPEC_PARAMS}
    assert all(hyper.admits(hyper.default) for hyper in BUILTIN_SPEC_PARAMS)


@pytest.mark.parametrize("path,message", [
    ("no_such_module:Spec", "no module 'no_such_module' in model.import_paths"),  # refused as the config loads
    ("stagewise.model:NotThere", "defines no class 'NotThere'"),  # its source, read as the config loads
    ("stagewise.model:BUNDLE_FORMAT", "defines no class 'BUNDLE_FORMAT'"),
])
def test_a_spec_that_cannot_be_imported_is_a_user_error_naming_it(digits_run, single_process, path, message):
    """A bad model.spec fails the stage as bad input, naming the path, before anything trains."""
    config_path, out = digits_run
    with pytest.raises(UserError, match=message) as caught:
        train.run_stage(_config(config_path, path), "s1", out, PARAMS, None)
    assert path in str(caught.value)


def test_bad_spec_args_name_the_spec(digits_run, single_process):
    """model.args the class does not take are refused naming the spec and the args."""
    config_path, out = digits_run
    with pytest.raises(UserError, match=r"stagewise.examples.digits_cnn:DigitsCNN.*bad model.args.*colour"):
        train.run_stage(_config(config_path, "stagewise.examples.digits_cnn:DigitsCNN", {"colour": 3}), "s1", out, PARAMS, None)


def test_build_must_return_a_module(digits_run, single_process):
    """A spec whose build() returns no nn.Module is named."""
    config_path, out = digits_run
    with pytest.raises(UserError, match="NoModule.build returned dict"):
        train.run_stage(_config(config_path, "tests.specs:NoModule"), "s1", out, PARAMS, None)


def test_a_metric_that_does_not_reduce_is_refused(digits_run, single_process):
    """A per-batch mean (a float, not a MetricState or Average) cannot be reduced over ranks: refused before the first
    step, naming it."""
    config_path, out = digits_run
    with pytest.raises(UserError, match=r"MeanAccuracy.metrics\(\)\['accuracy'\] is a float, not a MetricState or Average"):
        train.run_stage(_config(config_path, "tests.specs:MeanAccuracy"), "s1", out, PARAMS, None)


@pytest.mark.parametrize("spec, message", [
    ("tests.specs:TooFewClasses", r"TooFewClasses.loss \(\S+:\d+\) failed on a first batch of \d+ rows: \w+: Target \d+ is "
                                  r"out of bounds.*; the forward \(Linear\) returned shape \(\d+, 3\)"),
    ("tests.specs:SummedLoss", r"SummedLoss.loss must return a scalar tensor with a gradient .*, got shape \(\d+,\)"),
])
def test_outputs_that_do_not_fit_the_contract_fail_before_the_first_step(digits_run, single_process, spec, message):
    """Wrong output shapes and a non-scalar loss are named, with the batch's shapes, before any step is taken."""
    config_path, out = digits_run
    with pytest.raises(UserError, match=message):
        train.run_stage(_config(config_path, spec), "s1", out, PARAMS, None)


def test_an_objective_the_spec_does_not_report_is_named(digits_run, single_process):
    """objective.metric must be one of the spec's metrics (or loss): a user spec's is checked on the first batch,
    before any step, and the error lists the metrics it has."""
    config_path, out = digits_run
    config = _config(config_path, "tests.specs:LogLoss", **{"objective.metric": "recall_at_p90"})
    with pytest.raises(UserError, match=r"objective.metric 'recall_at_p90' is not among the metrics LogLoss reports: "
                                        r"\['accuracy', .*'loss', 'nll'"):
        train.run_stage(config, "s1", out, PARAMS, None)
    assert not list(Path(out).glob("train/s1/*.dcp")) and not list(Path(out).glob("train/s1/step-*"))


def test_unknown_hyperparameter_of_a_user_spec_is_checked_against_its_own(digits_images_run, single_process):
    """A user spec declares its hyperparameters: one it does not know fails naming it and the known ones."""
    config_path, out = digits_images_run
    config = _config(config_path, "stagewise.examples.digits_cnn:DigitsCNN")
    with pytest.raises(UserError, match=r"unknown hyperparameter 'hidden'.*'dropout'"):
        train.run_stage(config, "s1", out, PARAMS, None)


def test_a_user_spec_trains_evaluates_and_scores(digits_images_run, single_process, tmp_path):
    """The CNN example (on the declared 1x8x8 image column) through a stage, evaluation and one inference shard
    of raw image rows: its bundle names the spec and args."""
    import pyarrow.parquet as pq

    from stagewise import infer

    config_path, out = digits_images_run
    config = _config(config_path, "stagewise.examples.digits_cnn:DigitsCNN", {"channels": 4})
    result = train.run_stage(config, "s1", out, {"lr": 0.05, "dropout": 0.1}, None)
    assert result["objective"] == "accuracy" and result["val_metric"] > 0.5
    bundle = load_bundle(result["model_uri"])
    assert bundle.ref == SpecRef("stagewise.examples.digits_cnn:DigitsCNN", {"channels": 4})
    assert isinstance(bundle.module[1], torch.nn.Conv2d) and bundle.data.shapes == {"image": [1, 8, 8]}
    evaluation = evaluate(config, result["model_uri"], out)
    assert evaluation["test_objective"] == evaluation["test_accuracy"] > 0.5
    raw = storage.resolve(config.storage_root, config.dataset.uri)
    shard = plan_inference(raw, 10_000)[0]
    scored = infer.score_shard(config, result["model_uri"], shard, str(tmp_path / "scored"))
    table = pq.read_table(scored["uri"])
    assert table.column_names == ["row_id", "prediction", "probabilities", "model_version"]
    assert table.num_rows == shard["rows"]


def test_a_spec_whose_weights_no_longer_fit_is_named_with_the_bundle(digits_run, single_process):
    """Loading a bundle whose spec now builds another shape fails naming the file and the spec, not a raw RuntimeError."""
    config_path, out = digits_run
    result = train.run_stage(_config(config_path, "tests.specs:DeepMLP", {"extra": 0}), "s1", out, PARAMS, None)
    payload = torch.load(result["model_uri"], weights_only=True)
    payload["spec"]["args"] = {"extra": 2}  # as if the user's class had changed under the registered model
    torch.save(payload, result["model_uri"])
    with pytest.raises(UserError, match=r"weights do not fit what tests.specs:DeepMLP builds now") as caught:
        load_bundle(result["model_uri"])
    assert result["model_uri"] in str(caught.value)


def test_a_stage_whose_spec_changed_since_the_previous_one_is_refused(digits_run, single_process):
    """s2 built by another spec shape than s1 cannot start from s1's checkpoint: a user error naming the file."""
    config_path, out = digits_run
    first = train.run_stage(_config(config_path, "tests.specs:DeepMLP", {"extra": 0}), "s1", out, PARAMS, None)
    with pytest.raises(UserError, match="does not fit") as caught:
        train.run_stage(_config(config_path, "tests.specs:DeepMLP", {"extra": 1}), "s2", out, PARAMS,
                        first["checkpoint_uri"])
    assert first["checkpoint_uri"] in str(caught.value)


def test_a_minimised_objective_drives_the_sweep_and_the_gate(digits_run, single_process, tmp_path):
    """With objective {nll, minimize}: the study minimises, its best trial has the lowest value, and the gate
    promotes only a model with a lower test nll."""
    import optuna

    from stagewise import registry
    from stagewise.study.studies import create, open_storage
    from stagewise.study.summary import summarize
    from stagewise.sweep import run_worker

    config_path, out = digits_run
    config = _config(config_path, "tests.specs:LogLoss", **{"objective.metric": "nll", "objective.direction": "minimize",
                                                             "sweep.num_trials": 3, "sweep.num_workers": 1,
                                                             "sweep.pruner.type": "none"})
    create(config, "minimise")
    run_worker(config, "minimise", 0, out)
    summary = summarize(config, "minimise", out)
    study = optuna.load_study(study_name="minimise", storage=open_storage(config.sweep.storage))
    assert study.direction.name == "MINIMIZE"
    values = [t.value for t in study.trials if t.state.name == "COMPLETE"]
    assert summary["best_value"] == min(values)

    root = str(tmp_path / "registry")
    uris = {}
    # Three cards differing only in the minimised metric: each lower one wins, a higher one never does.
    model_uri = train.run_stage(config, "s1", out, PARAMS, None)["model_uri"]
    data = Path(model_uri).read_bytes()
    for name, nll in (("a", 0.30), ("b", 0.20), ("c", 0.25)):
        path = tmp_path / f"{name}.pt"
        path.write_bytes(data + name.encode())  # distinct bytes: distinct versions
        uris[name] = registry.register(root, "nll", str(path), {"test_nll": nll, "objective": "nll"})["version"]
    decisions = [registry.gate(root, "nll", uris[name], "test_nll", 0.0, "minimize")["promoted"] for name in ("a", "b", "c")]
    assert decisions == [True, True, False]
    assert registry.pointer(root, "nll")["version"] == uris["b"]


@pytest.mark.torchrun
def test_two_process_ddp_stage_with_the_cnn_spec(digits_images_run, subprocess_env):
    """A real 2-rank torchrun stage trains the CNN example; rank 0 alone writes its bundle, which names the spec."""
    config, out = digits_images_run
    result_file = Path(out) / "cnn.json"
    command = [sys.executable, "-m", "stagewise.training.local_torchrun", "--nproc-per-node=2", "-m", "stagewise.train", "--config",
               str(config), "--stage", "s2", "--out", out, "--params", json.dumps({"lr": 0.02}),
               "--override=model.spec=stagewise.examples.digits_cnn:DigitsCNN", '--override=model.args={"channels": 4}',
               "--result-file", str(result_file)]
    completed = subprocess.run(command, cwd=REPO_ROOT, env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    result = json.loads(result_file.read_text())
    assert result["world_size"] == 2 and result["val_metric"] > 0.5
    assert load_bundle(result["model_uri"]).ref.path == "stagewise.examples.digits_cnn:DigitsCNN"


# --- Regressor ---------------------------------------------------------------------------------------------------


def _regressor(mean: float = 150.0, std: float = 40.0) -> Regressor:
    spec = Regressor()
    spec.prepare(DataInfo(features=["x"], target_mean=mean, target_std=std))
    return spec


def test_regressor_rmse_reduces_over_batches_to_the_rmse_of_the_whole():
    """rmse is kept as summed squared errors and a count: two halves reduce to exactly the whole's RMSE
    (a mean of the halves' RMSEs would not), in the target's own units."""
    from stagewise.training.validation import accumulate_metrics

    torch.manual_seed(0)
    spec, module = _regressor(), torch.nn.Identity()
    outputs = torch.randn(10, 1)  # standardised predictions; the halves have very different errors
    targets = torch.cat([torch.full((3,), 150.0), torch.full((7,), 400.0)])
    whole = accumulate_metrics(spec, module, [(outputs, targets)], "cpu")
    halves = accumulate_metrics(spec, module, [(outputs[:3], targets[:3]), (outputs[3:], targets[3:])], "cpu")
    predictions = outputs.reshape(-1) * 40.0 + 150.0
    expected = torch.sqrt(((predictions - targets) ** 2).mean()).item()
    for totals in (whole, halves):
        assert totals.values()["rmse"] == pytest.approx(expected, rel=1e-6)
    assert halves.values()["mae"] == pytest.approx((predictions - targets).abs().mean().item(), rel=1e-6)


def test_regressor_trains_on_standardised_targets_and_predicts_in_the_targets_units():
    """The module's output is the standardised target: the loss is MSE against (target - mean) / std, and the
    prediction column de-standardises it (output 0 predicts the mean, output 1 the mean plus one std)."""
    spec = _regressor()
    outputs = torch.tensor([[0.0], [1.0], [-0.5]])
    targets = torch.tensor([150.0, 190.0, 130.0])
    assert spec.loss(outputs, targets).item() == pytest.approx(0.0, abs=1e-7)
    assert spec.loss(outputs, targets + 40.0).item() == pytest.approx(1.0)
    assert spec.predict(outputs)["prediction"].tolist() == pytest.approx([150.0, 190.0, 130.0])
    assert spec.predict(outputs)["prediction"].shape == (3,)


def test_a_regressor_on_class_labels_is_a_user_error_naming_it():
    """A Regressor needs a float target: data with num_classes (no target mean/std) fails naming the spec."""
    class Tiny(Regressor):
        def build(self, data, params):
            return torch.nn.Linear(data.num_features, 1)

    with pytest.raises(UserError, match=r"Tiny is a Regressor: it needs a float target"):
        build(Tiny(), DataInfo(features=["x"], num_classes=3), {})
