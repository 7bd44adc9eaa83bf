"""Batch arithmetic and the refusals that must happen before any training process launches."""

from __future__ import annotations

import pytest

from stagewise.definitions.config import ConfigError
from stagewise.definitions.loading import load_config


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


def test_entrypoint_args_name_the_stage_values_and_hyperparameters(write_config, storage_root):
    """{epochs}, {lr}, {per_process_batch}, ... and hyperparameter names in entrypoint args become the stage's values.

    {lr} is the rescaled lr (as $STAGEWISE_LR); {{ and }} stay literal braces; a format spec applies.
    """
    from stagewise.scripting.stage_contract import byo_args, byo_contract

    args = ["--epochs", "{epochs}", "--lr", "{lr}", "--batch-size", "{per_process_batch}", "--global={global_batch}",
            "--hidden", "{hidden}", "--wd={weight_decay:.0e}", "--out", "{output_dir}", "--init={init_from}",
            "--json={{\"seed\": {seed}}}", "--stage", "{stage}", "--warmup", "{warmup_steps}", "plain"]
    path = _with_stage(write_config, storage_root, per_process_batch=16, grad_accum_steps=2, warmup_steps=5,
                       entrypoint={"script": "x.py", "args": args})
    config = load_config(path)
    contract = byo_contract(config, str(path), "s2", "/runs/r", {"lr": 0.02, "hidden": 48, "weight_decay": 0.001}, None)
    assert byo_args(config, "s2", contract) == [
        "--epochs", "1", "--lr", repr(0.02 * 64 / 32), "--batch-size", "16", "--global=64", "--hidden", "48",
        "--wd=1e-03", "--out", "/runs/r/train/s2", "--init=", '--json={"seed": 0}', "--stage", "s2", "--warmup", "5",
        "plain"]


@pytest.mark.parametrize("arg, fragment", [
    ("{epoch}", r"unknown placeholder \{epoch\}; known: \['config', 'stage', .*'epochs', 'warmup_steps', 'seed', .*'hidden'"),
    ("{}", r"'\{\}' is not a placeholder name"),
    ("{params.lr}", r"'\{params\.lr\}' is not a placeholder name"),
    ("--json={\"a\": 1}", r"write literal braces as \{\{ and \}\}"),
    ("{lr", r"expected '\}' before end of string; write literal braces"),
])
def test_unknown_or_malformed_placeholder_in_entrypoint_args_is_a_config_error(write_config, storage_root, arg, fragment):
    """An entrypoint arg naming no stage value or hyperparameter is refused when the config loads, naming the arg."""
    path = _with_stage(write_config, storage_root, per_process_batch=16, entrypoint={"script": "x.py", "args": ["--a", arg]})
    with pytest.raises(ConfigError, match=r"train\.stages\[1\] \(s2\): entrypoint\.args\[1\]") as failure:
        load_config(path)
    import re

    assert re.search(fragment, str(failure.value)), str(failure.value)


def test_searched_and_default_hyperparameters_are_placeholders(write_config, storage_root):
    """Every hyperparameter a stage can get (search space, default params) may be named in args."""
    path = _with_stage(write_config, storage_root, per_process_batch=16,
                       entrypoint={"script": "x.py", "args": ["{dropout}", "{momentum}", "{optimizer}"]})
    assert load_config(path).stage("s2").entrypoint.args == ["{dropout}", "{momentum}", "{optimizer}"]


@pytest.mark.parametrize("knob", [{"lr_schedule": {"type": "cosine"}}, {"grad_clip_norm": 1.0}, {"hand_on": "last"},
                                  {"early_stopping": {"patience": 2}}, {"precision": "bf16"},
                                  {"data_placement": "resident"}, {"compile": "default"}])
def test_a_built_in_loop_knob_on_a_script_stage_is_refused_naming_it(write_config, storage_root, knob):
    """A stage running the user's own script never sees the built-in loop's schedule, clipping, epoch choice,
    precision, data placement or compile: setting one there is refused when the config loads, naming it, instead of
    being silently ignored."""
    path = _with_stage(write_config, storage_root, per_process_batch=16, entrypoint={"script": "x.py"}, **knob)
    (name,) = knob
    with pytest.raises(ConfigError, match=rf"train\.stages\.1.*{name}: the built-in loop's, but this stage runs its own"):
        load_config(path)
    assert load_config(_with_stage(write_config, storage_root, per_process_batch=16, **knob)).stage("s2")


def test_a_specs_own_default_params_are_placeholders_read_from_its_source(write_config, storage_root, tmp_path):
    """{heads} of a spec beside the config (default_params = {"heads": 4, ...}, inherited too) is a placeholder; the
    spec is read, not imported (no torch at config load), and a name it does not declare is still refused."""
    import sys

    (tmp_path / "team_transformer.py").write_text(
        "from stagewise.spec import Classifier\n\n\nclass Base(Classifier):\n"
        "    default_params = {'heads': 4, 'layers': 2}\n\n\nclass Tiny(Base):\n    pass\n")
    raw_path = _with_stage(write_config, storage_root, per_process_batch=16,
                           entrypoint={"script": "x.py", "args": ["--heads", "{heads}", "--layers={layers}"]})
    import yaml

    raw = yaml.safe_load(raw_path.read_text())
    raw["model"] = {"spec": "team_transformer:Tiny"}
    raw_path.write_text(yaml.safe_dump(raw))
    config = load_config(raw_path)
    assert {"heads", "layers"} <= set(config.arg_placeholders())
    assert "team_transformer" not in sys.modules, "the spec was read from its source, not imported"
    raw["train"]["stages"][1]["entrypoint"]["args"] = ["{depth}"]
    raw_path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"unknown placeholder \{depth\}; known: .*'heads', 'layers'"):
        load_config(raw_path)
