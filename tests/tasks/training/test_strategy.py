"""The strategy seam (stagewise.training.strategy): optimizer states renumbered by name and back, the knobs refused
where they cannot work, and an fsdp stage in one process (a group of one) for a user's CNN, a transformer and a
sweep trial, as the same code runs on many ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stagewise.core.errors import UserError
from stagewise.training.distributed import DistEnv
from stagewise.training.strategy import (
    FSDPStrategy,
    make_strategy,
    memory_advice,
    out_of_memory,
    state_by_name,
    state_by_number,
)

CPU = DistEnv(rank=0, local_rank=0, world_size=1, device="cpu")


def _trained_adamw() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW([{"params": [module[0].weight, module[2].weight]},
                                   {"params": [module[0].bias, module[2].bias], "weight_decay": 0.0}], lr=0.01)
    module(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return module, optimizer


def test_an_optimizer_state_renumbered_by_name_and_back_is_the_same_state():
    """By name: keys are parameter names in each group's order; back: Optimizer.load_state_dict reads it unchanged."""
    module, optimizer = _trained_adamw()
    numbered = optimizer.state_dict()
    named = state_by_name(module, optimizer, numbered)
    assert list(named["state"]) == ["0.weight", "2.weight", "0.bias", "2.bias"]
    assert named["param_groups"][1]["params"] == ["0.bias", "2.bias"]
    again = state_by_number(module, optimizer, named)
    assert again["param_groups"] == numbered["param_groups"]
    for index, entry in numbered["state"].items():
        assert all(torch.equal(entry[key], again["state"][index][key]) for key in ("exp_avg", "exp_avg_sq"))


def test_knobs_that_cannot_work_with_a_strategy_are_refused_naming_the_key(write_config, storage_root):
    """fp16 and compile with fsdp, activation_checkpointing with ddp: config errors naming the stage key."""
    from stagewise.definitions.config import ConfigError
    from stagewise.definitions.loading import load_config
    from tests.conftest import base_config

    for stage_keys, words in (({"strategy": "fsdp", "precision": "fp16"}, "precision bf16"),
                              ({"strategy": "fsdp", "compile": "default"}, "compile: off"),
                              ({"activation_checkpointing": True}, "set strategy: fsdp")):
        raw = base_config(storage_root)
        raw["train"]["stages"][1].update(stage_keys)
        with pytest.raises(ConfigError, match="train.stages.1") as caught:
            load_config(write_config(raw))
        assert words in str(caught.value)
    with pytest.raises(UserError, match="strategy 'zero3' is not one of ddp, fsdp"):
        make_strategy("zero3", CPU, spec=None)


def test_an_allocation_that_fails_is_told_apart_and_the_advice_names_fsdp():
    """CUDA's and the CPU allocator's failures count as out of memory, other runtime errors do not."""
    assert out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"))
    assert not out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert "strategy: fsdp" in memory_advice("ddp", 2) and "activation_checkpointing" in memory_advice("fsdp", 2)


def test_shard_units_that_are_not_sub_modules_are_a_user_error():
    """A spec naming a module outside the built one (or the module itself) is refused with its class named."""
    from stagewise.spec import Classifier

    class Outside(Classifier):
        def shard_units(self, module):
            return [nn.Linear(2, 2)]

    strategy = FSDPStrategy(CPU, spec=Outside(), precision="fp32")
    try:
        with pytest.raises(UserError, match=r"Outside.shard_units\(\) must return sub-modules"):
            strategy.prepare(nn.Sequential(nn.Linear(2, 2)))
    finally:
        strategy.close()


# The transformer at 128 rows a step: 20 steps an epoch, not 80 (about 2 CPU-s less); what is checked (it trains under
# fsdp with activation checkpointing and bf16, hands on full tensors, releases its group) needs no more.
@pytest.mark.parametrize("data, spec, params, extra", [
    ("digits_images_run", "stagewise.examples.digits_cnn:DigitsCNN", {"lr": 0.02}, {}),
    ("tokens_run", "stagewise.examples.token_transformer:TokenTransformer", {"lr": 0.003},
     {"activation_checkpointing": True, "precision": "bf16", "per_process_batch": 128}),
])
def test_a_users_spec_trains_sharded_in_one_process(request, data, spec, params, extra):
    """fsdp on one process (a group of one): a user's CNN, and a transformer with activation checkpointing and bf16
    parameters, train, hand on a full model the bundle holds, and leave no process group behind."""
    import torch.distributed as dist

    from stagewise import train
    from stagewise.definitions.loading import load_config
    from stagewise.models.bundle import load_bundle

    config_path, out = request.getfixturevalue(data)
    overrides = {"model.spec": spec, "train.stages.0.strategy": "fsdp", "train.stages.0.epochs": 1,
                 **{f"train.stages.0.{key}": value for key, value in extra.items()}}
    result = train.run_stage(load_config(config_path, overrides), "s1", out, params, None)
    assert result["strategy"] == "fsdp" and result["val_metric"] > 0.2
    assert not dist.is_initialized(), "the group of one is released with the stage"
    bundle = load_bundle(result["model_uri"])
    assert all(type(tensor) is torch.Tensor for tensor in bundle.module.state_dict().values())


def test_a_sweep_trial_runs_sharded_in_its_process(digits_run):
    """sweep.strategy fsdp: each trial shards its model in a group of one (released after it) and completes with its
    objective, as a ddp trial does."""
    import optuna
    import torch.distributed as dist

    from stagewise.definitions.loading import load_config
    from stagewise.study.studies import create, open_storage
    from stagewise.sweep import run_worker

    config_path, out = digits_run
    config = load_config(config_path, {"sweep.strategy": "fsdp", "sweep.epochs": 2, "sweep.num_trials": 2,
                                       "sweep.num_workers": 1})
    create(config, "sharded")
    assert run_worker(config, "sharded", 0, out)["trials_run"] == 2
    assert not dist.is_initialized()
    study = optuna.load_study(study_name="sharded", storage=open_storage(config.sweep.storage))
    assert [trial.state.name for trial in study.trials] == ["COMPLETE", "COMPLETE"], [t.user_attrs for t in study.trials]
    assert all(0.3 < trial.value <= 1.0 for trial in study.trials)


@pytest.fixture
def tokens_run(write_config, storage_root):
    """The token sequences of examples/token_transformer.yaml (its dataset block), preprocessed."""
    import yaml

    from tests.conftest import REPO_ROOT, base_config, preprocess_digits

    raw = base_config(storage_root)
    raw["dataset"] = yaml.safe_load((REPO_ROOT / "examples" / "token_transformer.yaml").read_text())["dataset"]
    raw["model"] = {"spec": "stagewise.examples.token_transformer:TokenTransformer", "args": {"column": "tokens"}}
    config_path = write_config(raw)
    out = str(storage_root / "runs" / "test" / "tokens")
    preprocess_digits(config_path, out)
    return config_path, out


def test_the_best_epoch_kept_sharded_is_what_a_later_epoch_hands_on(tmp_path):
    """hand_on best under fsdp: the best epoch's shards are saved as a checkpoint of their own (no full copy kept),
    and loading them puts that epoch's weights and optimizer state back after later epochs moved both."""
    from stagewise.spec import Classifier
    from stagewise.training.selection import BestEpoch

    module, _ = _trained_adamw()
    strategy = FSDPStrategy(CPU, spec=Classifier(), precision="fp32")
    try:
        strategy.prepare(module)
        optimizer = torch.optim.AdamW(module.parameters(), lr=0.01)

        def step() -> None:
            module(torch.randn(3, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()
        best = BestEpoch(strategy, str(tmp_path / "s2"), master=True)
        best.keep(0, module, optimizer)
        kept = {name: strategy.local(p).detach().clone() for name, p in module.named_parameters()}
        moments = [strategy.local(state["exp_avg"]).clone() for state in optimizer.state.values()]
        step()
        assert any(not torch.equal(strategy.local(p), kept[name]) for name, p in module.named_parameters())
        assert best.record()["uri"].endswith("best/step-000000000.dcp")
        best.load_into(module, optimizer)
        assert all(torch.equal(strategy.local(p), kept[name]) for name, p in module.named_parameters())
        assert all(torch.equal(strategy.local(state["exp_avg"]), moment)
                   for state, moment in zip(optimizer.state.values(), moments))
    finally:
        strategy.close()
