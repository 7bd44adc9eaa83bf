"""Adaptive batch growth: the next stage's global batch is the noise scale the stage before measured, clamped between
that stage's batch and train.max_global_batch, reached with gradient accumulation when the per-process batch (a memory
bound) is too small; the lr is rescaled by the rule, the decision is in the result, and a retry decides the same."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from stagewise.core.errors import UserError
from stagewise.definitions.loading import load_config
from stagewise.training.batch_growth import adaptive_batch, handed_noise_scale, previous_noise_scale
from stagewise.training.lr_schedule import scaled_lr
from stagewise.training.noise_scale import NoiseScale


@pytest.mark.parametrize(("noise", "expected"), [
    (612.4, (612, 5, 61, 610)),  # 612 over 2 processes of at most 64: 5 accumulation steps of 61
    (50.0, (128, 1, 64, 128)),  # below this stage's configured batch: never below it
    (5000.0, (1024, 8, 64, 1024)),  # above the ceiling: max_global_batch
    (None, (128, 1, 64, 128)),  # nothing measured: the configured batch
])
def test_the_decision_clamps_the_noise_scale_and_reaches_it_with_accumulation(noise, expected):
    decision = adaptive_batch(noise, min_global_batch=128, max_global_batch=1024, world_size=2, per_process_limit=64)
    assert (decision.target, decision.grad_accum_steps, decision.per_process_batch, decision.global_batch) == expected
    assert decision.global_batch <= decision.target and decision.per_process_batch <= 64


@pytest.mark.parametrize(("noise", "world", "limit", "floor"), [(33.8, 2, 8, 32), (130.0, 3, 16, 96), (97.0, 4, 4, 96)])
def test_an_adaptive_batch_never_falls_below_the_stages_configured_global_batch(noise, world, limit, floor):
    """A target just above the configured batch that the ranks and accumulation do not divide rounds up, not down:
    33.8 over 2 ranks of at most 8 took 3 accumulation steps of 5 (30) below the configured 32."""
    decision = adaptive_batch(noise, min_global_batch=floor, max_global_batch=4096, world_size=world,
                              per_process_limit=limit)
    assert floor <= decision.global_batch == decision.per_process_batch * world * decision.grad_accum_steps
    assert decision.per_process_batch <= limit and decision.global_batch - decision.target < world * decision.grad_accum_steps


@pytest.mark.parametrize("data", ["digits_run", "digits_images_run", "diabetes_run"])
def test_an_adaptive_stage_trains_at_the_batch_the_stage_before_measured(request, monkeypatch, data):
    """s1 measures the noise scale; s2 (adaptive) trains at that batch, clamped, with the lr rescaled for it; the
    built-in MLP, a user's spec (the example CNN) and the regressor (a float target, rmse) alike; run again afresh,
    s2 decides exactly the same."""
    from stagewise import train

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    config_path, out = request.getfixturevalue(data)
    overrides = {"train.batch_growth": "adaptive", "train.max_global_batch": 512, "train.noise_scale_every_steps": 2,
                 "train.stages.1.profile": "ddp1", "train.stages.1.per_process_batch": 64, "train.stages.1.epochs": 1}
    if data == "digits_images_run":
        overrides["model"] = {"spec": "stagewise.examples.digits_cnn:DigitsCNN"}
    config = load_config(config_path, overrides)
    params = {"lr": 0.01 if data == "diabetes_run" else 0.05}
    first = train.run_stage(config, "s1", out, params, None)
    measured = previous_noise_scale(torch.load(first["checkpoint_uri"], weights_only=True))
    assert measured == pytest.approx(first["noise_scale"])
    second = train.run_stage(config, "s2", out, params, first["checkpoint_uri"])
    decision = second["batch_decision"]
    expected = adaptive_batch(measured, 64, 512, 1, 64)  # clamped from s2's own configured batch, as docs/stages.md says
    assert (second["global_batch"], second["per_process_batch"], second["grad_accum_steps"]) == (
        expected.global_batch, expected.per_process_batch, expected.grad_accum_steps)
    assert decision["noise_scale"] == pytest.approx(measured) and decision["min_global_batch"] == 64
    assert second["lr"] == pytest.approx(scaled_lr(params["lr"], second["global_batch"], config.train.base_batch,
                                                   config.train.lr_rule))
    history = json.loads(Path(out, "train", "s2", "metrics.json").read_text())["history"]
    if data == "diabetes_run":  # rmse of a target around 25..346: trained, finite, well below its spread
        assert history and 0 < second["val_metric"] < 80
    else:
        assert history and second["val_metric"] > 0.5
    shutil.rmtree(Path(out, "train", "s2"))
    assert train.run_stage(config, "s2", out, params, first["checkpoint_uri"])["batch_decision"] == decision


@pytest.mark.parametrize(("state", "why"), [
    ({}, "holds no noise-scale state"),
    ({"noise_scale": NoiseScale("cpu").state_dict()}, "took no measured step (0 measurements"),
    ({"noise_scale": "negative |G|²"}, "were not both positive after 1 measurements"),
])
def test_a_handed_on_checkpoint_without_a_noise_scale_says_why(state, why):
    if state.get("noise_scale") == "negative |G|²":
        estimator = NoiseScale("cpu")
        estimator.update(torch.tensor(1.0), torch.tensor(0.2), 8, 16)  # |G|² = (16·0.2 − 8·1)/8 < 0
        state = {"noise_scale": estimator.state_dict()}
    noise_scale, reason = handed_noise_scale(state)
    assert noise_scale is None and why in reason
    decision = adaptive_batch(noise_scale, 128, 1024, 2, 64, no_measurement=reason)
    assert decision.global_batch == 128 and decision.no_measurement == reason


def test_an_adaptive_stage_without_a_measurement_warns_and_says_so_in_its_result_and_mlflow(digits_run, monkeypatch,
                                                                                             caplog):
    """The stage before handed on no noise scale: the adaptive stage logs a WARNING saying why and at what batch it
    trains (the stage before's), its result (so report.json's training entry) holds the reason in batch_decision, and
    its MLflow params name it."""
    from stagewise import train

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    config_path, out = digits_run
    config = load_config(config_path, {"train.batch_growth": "adaptive", "train.max_global_batch": 512,
                                       "train.stages.1.profile": "ddp1", "train.stages.1.epochs": 1})
    params = {"lr": 0.05}
    first = train.run_stage(config, "s1", out, params, None)
    handed = torch.load(first["checkpoint_uri"], weights_only=False)
    handed["noise_scale"] = NoiseScale("cpu").state_dict()  # as if s1 had taken no measured step
    torch.save(handed, first["checkpoint_uri"])
    logged: list[dict] = []

    class Tracked:
        def nested(self, key, name, tags, values):
            logged.append(values)

        def log(self, *args, **kwargs):
            pass

        def end(self, *args):
            pass

        def close(self):
            pass

    monkeypatch.setattr(train.Tracker, "for_run", classmethod(lambda cls, *args: Tracked()))
    with caplog.at_level("WARNING", logger="stagewise.train"):
        second = train.run_stage(config, "s2", out, params, first["checkpoint_uri"])
    warnings = [record for record in caplog.records if record.levelname == "WARNING" and "adaptive" in record.message]
    assert len(warnings) == 1, caplog.text
    message = warnings[0].getMessage()
    assert "received no noise scale" in message and "took no measured step" in message
    configured = config.train.stages[1].global_batch_for(1)  # s2's own batch, as docs/stages.md says
    assert f"configured global batch {configured}" in message and configured != first["global_batch"]
    assert second["global_batch"] == configured
    assert "took no measured step" in second["batch_decision"]["no_measurement"]
    assert "took no measured step" in logged[0]["adaptive_no_measurement"] and logged[0]["noise_scale_before"] is None


@pytest.mark.parametrize(("overrides", "message"), [
    ({"train.batch_growth": "adaptive"}, "needs max_global_batch"),
    ({"train.batch_growth": "adaptive", "train.max_global_batch": 512, "train.noise_scale": False}, "turn noise_scale on"),
])
def test_adaptive_growth_needs_a_ceiling_and_the_noise_scale(write_config, overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(write_config(), overrides)


def test_a_stage_announces_the_steps_it_then_runs(digits_run, monkeypatch, caplog):
    """The stage's first line gives its steps per epoch as the epochs run them (ranks take whole row groups, so the
    count can differ by epoch) and their total, which is the number of optimizer steps the stage then takes."""
    import re

    from stagewise import train

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    config_path, out = digits_run
    config = load_config(config_path, {"train.stages.0.epochs": 3})
    with caplog.at_level("INFO", logger="stagewise.train"):
        result = train.run_stage(config, "s1", out, {"lr": 0.05}, None)
    (line,) = [r.getMessage() for r in caplog.records if re.search(r"epochs of [\d-]+ steps \(\d+ in all\)", r.getMessage())]
    announced = int(re.search(r"\((\d+) in all\)", line).group(1))
    assert announced == result["steps"] > 0
