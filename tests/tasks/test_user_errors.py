"""A user's mistake is named once and never retried: an exception from a spec's hook (optimizer, forward, loss, ...)
fails its trial or stage at once as a user error naming the spec class, the hook and the user's file and line; a shape
error names the hook that made the shape; a stage never silently resumes a checkpoint made from another start."""

from __future__ import annotations

import logging
import re

import optuna
import pytest
import torch

from stagewise import train
from stagewise.core import contract
from stagewise.core.errors import USER_ERROR_EXIT, UserError
from stagewise.definitions.hyperparams import FRAMEWORK_DEFAULTS
from stagewise.definitions.loading import load_config
from stagewise.definitions.spec import DataInfo, HookError, user_hook
from stagewise.models.building import build
from stagewise.study.studies import create, open_storage
from stagewise.sweep import run_worker
from tests.specs import FailsLater, TransposedOutputs

PARAMS = {"lr": 0.05, "hidden": 16}
# The user's file and a line in it, as the message gives them (relative to the working directory when under it).
IN_SPECS = r"\((?:module \w+, )?\S*tests/specs\.py:\d+\)"


@pytest.fixture
def single_process(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", train.FAULT_ENV,
                 "STAGEWISE_FAULT_KILL_TRIAL"):
        monkeypatch.delenv(name, raising=False)


def _config(config_path, spec: str, **overrides):
    return load_config(config_path, {"model.spec": spec, "train.stages.0.epochs": 1, "train.stages.1.epochs": 1,
                                     **overrides})


def test_an_optimizer_hooks_key_error_fails_the_sweep_trial_naming_spec_hook_file_and_line(digits_run, single_process):
    """The sweep: the trial is FAIL with "MissingBeta2.optimizer (tests/specs.py:N): KeyError: 'beta2'", not a bare
    KeyError; the worker goes on."""
    config_path, out = digits_run
    config = _config(config_path, "tests.specs:MissingBeta2", **{"sweep.num_trials": 1, "sweep.num_workers": 1,
                                                                  "sweep.epochs": 1})
    create(config, "beta2")
    assert run_worker(config, "beta2", 0, out)["trials_run"] == 1
    [trial] = optuna.load_study(study_name="beta2", storage=open_storage(config.sweep.storage)).trials
    assert trial.state.name == "FAIL"
    assert trial.user_attrs["error"].startswith("MissingBeta2.optimizer (")
    assert trial.user_attrs["error"].endswith("): KeyError: 'beta2'")
    assert re.search(IN_SPECS, trial.user_attrs["error"])


def test_an_optimizer_hooks_key_error_ends_a_stage_with_the_user_error_exit(digits_run, single_process, monkeypatch,
                                                                             tmp_path):
    """A stage: the sub-job exits USER_ERROR_EXIT (the launcher fails the task without a retry) and its error file,
    which the launcher reads, names the class, the hook, the file and line and the user's exception."""
    config_path, out = digits_run
    error_file = tmp_path / "user_error.txt"
    monkeypatch.setenv(contract.ERROR_FILE, str(error_file))
    with pytest.raises(SystemExit) as exited:
        train.main(["--config", str(config_path), "--stage", "s1", "--out", out, "--params", '{"lr": 0.05}',
                    "--override", "model.spec=tests.specs:MissingBeta2"])
    assert exited.value.code == USER_ERROR_EXIT
    written = error_file.read_text()
    assert "MissingBeta2.optimizer (" in written and "KeyError: 'beta2'" in written
    assert re.search(IN_SPECS, written)


def test_a_forward_that_raises_on_the_batchs_shape_is_named_as_the_forward(digits_run, single_process):
    """The module's forward raising on a shape is the forward's error (not the loss's), with the input's shape."""
    config_path, out = digits_run
    with pytest.raises(HookError) as caught:
        train.run_stage(_config(config_path, "tests.specs:WrongWidth"), "s1", out, PARAMS, None)
    error = caught.value
    assert (error.spec, error.hook) == ("WrongWidth", "forward") and "tests/specs.py:" in error.location
    assert "mat1 and mat2 shapes cannot be multiplied" in str(error)
    assert "its input from WrongWidth.batch has shape (" in str(error)
    assert isinstance(error.__cause__, RuntimeError)


def test_a_forward_returning_the_wrong_shape_is_named_with_the_shapes_it_gave_the_loss(digits_run, single_process):
    """The loss raises on a (3, rows) output: the message names the loss, says the forward returned that shape and
    which targets the batch gave, so the user sees which hook made the shape."""
    config_path, out = digits_run
    with pytest.raises(HookError) as caught:
        train.run_stage(_config(config_path, "tests.specs:TransposedOutputs"), "s1", out, PARAMS, None)
    message = str(caught.value)
    assert caught.value.hook == "loss" and message.startswith("TransposedOutputs.loss (")
    assert "the forward (_Summed) returned shape (3, " in message
    assert "TransposedOutputs.batch gave targets of shape (" in message


def test_a_hook_that_raises_mid_epoch_is_named_from_the_training_step(digits_run, single_process):
    """Past the first-batch check, inside the step itself: the forward that raises on its fourth call is named with
    its file and line and the input's shape; the step path carries no per-step wrapping for it."""
    config_path, out = digits_run
    with pytest.raises(HookError) as caught:
        train.run_stage(_config(config_path, "tests.specs:FailsLater"), "s1", out, PARAMS, None)
    error = caught.value
    assert (error.spec, error.hook) == ("FailsLater", "forward")
    assert "no more batches of shape" in str(error) and "tests/specs.py:" in error.location


def test_a_guard_names_the_hook_that_raised_and_lets_framework_errors_through():
    """user_hook without a hook finds it in the traceback (here the loss, with the forward's shape read off the loss's
    arguments); an exception outside every hook passes as it is, and so does a user error."""
    data = DataInfo(features=[f"x{i}" for i in range(4)], num_classes=3)
    params = {**FRAMEWORK_DEFAULTS, **PARAMS}
    spec = TransposedOutputs()
    module = build(spec, data, params)
    features, labels = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with pytest.raises(HookError, match=r"TransposedOutputs.loss \(.*\): ValueError: .*the forward \(_Summed\) "
                                        r"returned shape \(3, 8\), TransposedOutputs.batch gave targets of shape \(8,\)"):
        with user_hook(spec, module=module):
            spec.loss(module(features), labels)
    with pytest.raises(ZeroDivisionError):  # the framework's own fault: a crash, retried
        with user_hook(spec, module=module):
            _ = 1 / 0
    with pytest.raises(UserError, match="already named") as caught:
        with user_hook(spec, "loss"):
            raise UserError("already named")
    assert type(caught.value) is UserError
    spec = FailsLater()
    module = build(spec, data, params)
    with pytest.raises(HookError, match=r"FailsLater.forward \(module _FailsLater, \S*tests/specs.py:\d+\)"):
        with user_hook(spec, module=module):
            for _ in range(5):
                module(features)


def test_a_stage_run_alone_without_init_from_says_loudly_it_starts_from_scratch(digits_run, single_process, caplog):
    """s2 run alone without --init-from: a WARNING naming s1 and that s2 starts from scratch (not a quiet INFO)."""
    config_path, out = digits_run
    config = _config(config_path, "stagewise.model:MLPClassifier")
    with caplog.at_level(logging.WARNING, logger="stagewise.train"):
        result = train.run_stage(config, "s2", out, PARAMS, None)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "FROM SCRATCH" in r.getMessage()]
    assert len(warned) == 1 and "stage s2 STARTS FROM SCRATCH" in warned[0] and "stage s1" in warned[0]
    assert "--init-from" in warned[0] and result["init_from"] == "scratch"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="stagewise.train"):
        train.run_stage(config, "s1", out, PARAMS, None)  # the first stage has nothing before it
    assert not [r for r in caplog.records if "FROM SCRATCH" in r.getMessage()]


def test_a_checkpoint_made_from_another_start_is_never_resumed(digits_run, single_process, caplog):
    """s2 trained from scratch leaves checkpoints; s2 then run with --init-from s1 must not resume them: its inputs
    (the stage before) differ, so it starts over from s1 and says why. The same start resumes as before, and a
    start from scratch again does not resume the checkpoints made from s1."""
    config_path, out = digits_run
    config = _config(config_path, "stagewise.model:MLPClassifier")
    first = train.run_stage(config, "s1", out, PARAMS, None)
    scratch = train.run_stage(config, "s2", out, PARAMS, None)
    state = torch.load(scratch["checkpoint_uri"], weights_only=True)
    assert state["init_source"] == "scratch" and state["inputs_fingerprint"] == scratch["fingerprint"]
    with caplog.at_level(logging.WARNING, logger="stagewise.train"):
        continued = train.run_stage(config, "s2", out, PARAMS, first["checkpoint_uri"])
    assert continued["init_from"] == first["checkpoint_uri"] and continued["resumed_from_step"] is None
    assert continued["fingerprint"] != scratch["fingerprint"]
    assert "stage s2 starts over: its checkpoint" in caplog.text and "other inputs" in caplog.text
    again = train.run_stage(config, "s2", out, PARAMS, first["checkpoint_uri"])  # the same start: resumed as before
    assert again["resumed_from_step"] == continued["steps"] and again["fingerprint"] == continued["fingerprint"]
    fresh = train.run_stage(config, "s2", out, PARAMS, None)
    assert fresh["resumed_from_step"] is None and fresh["fingerprint"] == scratch["fingerprint"]



@pytest.mark.parametrize(("raised", "named"), [
    (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4194304 bytes"),
     "stage s2: rank 0 ran out of memory on cpu"),
    (RuntimeError("Error(s) in loading state_dict: size mismatch for net.0.weight"),
     "the previous stage's model does not fit this stage's: Error(s) in loading state_dict: size mismatch")],
    ids=["out-of-memory", "other-shape"])
def test_a_hand_off_that_runs_out_of_memory_is_named_as_memory_not_as_another_model(digits_run, single_process,
                                                                                  monkeypatch, raised, named):
    """Loading the stage before's model can fail two ways: the rank's memory gives out (named as memory, with what to
    change: strategy fsdp for a ddp stage), or the weights do not fit this stage's model (named as such)."""
    from stagewise.training import strategy

    config_path, out = digits_run
    config = _config(config_path, "stagewise.model:MLPClassifier")
    first = train.run_stage(config, "s1", out, PARAMS, None)

    def fails(*args, **kwargs):
        raise raised

    monkeypatch.setattr(strategy.DDPStrategy, "load_full_state", fails)  # the ddp stage s2 takes the hand-off
    with pytest.raises(UserError) as failed:
        train.run_stage(config, "s2", out, PARAMS, first["checkpoint_uri"])
    assert named in str(failed.value)
    if "memory" in named:
        assert "strategy: fsdp" in str(failed.value)
