"""stagewise.training.device_data: resident and streamed batches are the same sequence, cover each rank's rows once, are
fixed by (seed, epoch, rank), resume exactly; the placement choice and the stage knobs (placement, bf16, compile).

CPU tensors stand in for the device (streams are no-ops there); tests/tasks/test_train_cuda.py runs the same on a GPU.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from stagewise import train
from stagewise.core.errors import UserError
from stagewise.datasets.loader import ParquetBatches
from stagewise.definitions.config import ConfigError
from stagewise.definitions.loading import load_config
from stagewise.models.building import build
from stagewise.models.mlp import MLPClassifier
from stagewise.spec import DataInfo
from stagewise.training import device_data
from stagewise.training.device_data import DeviceBatches, choose_placement
from stagewise.training.distributed import DistEnv
from tests.tasks.test_loader import FEATURES, _write

# Uneven files and row groups: chunks mix files, and batches of 4 span chunks of 3 row groups.
LAYOUT = [(24, 4), (16, 4), (40, 4)]  # 80 rows, 20 row groups of 4
ROW_BYTES = 4 * len(FEATURES) + 8  # float32 features, int64 label
CHUNK_BYTES = 10 * ROW_BYTES  # chunks of >= 10 rows: 3 row groups (12 rows)


@pytest.fixture
def split(tmp_path: Path) -> list[str]:
    return _write(lambda name: (str(tmp_path / name), open(tmp_path / name, "wb")), LAYOUT)[0]


def _source(uris: list[str], **kwargs) -> ParquetBatches:
    options = {"rank": 0, "world_size": 1, "batch_size": 4, "seed": 3} | kwargs
    return ParquetBatches(uris, FEATURES, "label", **options)


def _device(uris: list[str], resident: bool, **kwargs) -> DeviceBatches:
    return DeviceBatches(_source(uris, **kwargs), "cpu", resident=resident, chunk_bytes=CHUNK_BYTES)


def _batches(batches, epoch: int, skip_steps: int = 0) -> list[tuple[list[list[float]], list[int]]]:
    return [(inputs.tolist(), labels.tolist()) for inputs, labels in batches.epoch(epoch, skip_steps=skip_steps)]


def _ids(batches, epoch: int) -> list[int]:
    return [int(row[0]) for inputs, _ in _batches(batches, epoch) for row in inputs]


@pytest.mark.parametrize("world_size", [1, 2])
def test_resident_and_streamed_batches_are_identical_in_content_and_order(split, world_size):
    """For every rank and epoch both placements yield the same batches, features and labels, in the same order."""
    for rank in range(world_size):
        resident = _device(split, True, rank=rank, world_size=world_size)
        streamed = _device(split, False, rank=rank, world_size=world_size)
        assert len(resident.chunks(0)) > 1, "the split must span several chunks"
        for epoch in range(3):
            expected = _batches(resident, epoch)
            assert expected, "an epoch yields batches"
            assert _batches(streamed, epoch) == expected


def test_unshuffled_device_batches_equal_the_host_loaders(split):
    """Validation (unshuffled) reads every row in file order with the last partial batch, as stagewise.datasets.loader does."""
    host = _source(split, batch_size=7, shuffle=False)
    for resident in (True, False):
        device = DeviceBatches(host, "cpu", resident=resident, chunk_bytes=CHUNK_BYTES)
        assert _batches(device, 0) == _batches(host, 0)


@pytest.mark.parametrize("resident", [True, False])
def test_rows_arrive_whole_once_per_epoch_and_ranks_are_disjoint(split, resident):
    """Each rank gets exactly the rows of its assigned row groups (features and label together); two ranks never
    share a row and together cover the split; both take the same number of steps."""
    ranks = [_device(split, resident, rank=r, world_size=2) for r in range(2)]
    for epoch in range(3):
        seen = []
        for batches in ranks:
            rows = [(inputs, labels) for inputs, labels in _batches(batches, epoch)]
            assert len(rows) == batches.steps_per_epoch(epoch) == ranks[0].steps_per_epoch(epoch)
            ids = []
            for inputs, labels in rows:
                for features, label in zip(inputs, labels):
                    assert features == [features[0], 2 * features[0], -features[0]] and label == int(features[0]) % 5
                    ids.append(int(features[0]))
            offsets = {uri: sum(r for r, _ in LAYOUT[:i]) for i, uri in enumerate(split)}
            assigned = {offsets[g.uri] + 4 * g.index + k for g in batches.assignment(epoch) for k in range(4)}
            assert len(ids) == len(set(ids)) == len(assigned) and set(ids) == assigned, "each assigned row exactly once"
            seen += ids
        assert sorted(seen) == list(range(80)), "the ranks are disjoint and cover the split"


def test_order_is_fixed_by_seed_epoch_and_rank(split):
    """The same seed, epoch and rank repeat the order (what exact resume needs); another of any of them changes it."""
    first, again = _device(split, True, seed=5), _device(split, False, seed=5)
    assert _ids(first, 1) == _ids(again, 1)
    assert _ids(first, 1) != _ids(first, 2)
    assert _ids(first, 1) != _ids(_device(split, True, seed=6), 1)
    other_rank = _device(split, True, seed=5, rank=1, world_size=2)
    same_rank = _device(split, True, seed=5, rank=0, world_size=2)
    order = [g.index for g in same_rank.assignment(1)]
    assert order == [g.index for g in _source(split, seed=5, rank=0, world_size=2).assignment(1)], "loader's assignment"
    assert _ids(other_rank, 1) != _ids(same_rank, 1)


@pytest.mark.parametrize("resident", [True, False])
def test_skip_steps_resumes_mid_epoch_at_the_same_batch(split, resident):
    """epoch(e, skip_steps=k) yields exactly the batches after the first k, for k inside a chunk and across chunks."""
    batches = _device(split, resident)
    full = _batches(batches, 2)
    for skip in range(len(full) + 1):
        assert _batches(batches, 2, skip_steps=skip) == full[skip:], f"skip_steps={skip}"


def test_streamed_resume_reads_no_chunk_before_the_resume_point(split, monkeypatch):
    """A streamed resume starts reading at the chunk holding its first batch: the skipped part costs no read."""
    read: list[int] = []
    original = device_data.read_row_groups
    monkeypatch.setattr(device_data, "read_row_groups",
                        lambda groups, *args: read.append(len(groups)) or original(groups, *args))
    batches = _device(split, False)
    list(batches.epoch(0, skip_steps=10))  # rows 40..: chunks from the fourth on (12 rows each)
    assert sum(4 * n for n in read) <= 80 - 36


def test_placement_choice_on_cpu_is_the_host_loader_unless_forced():
    """auto on CPU keeps today's stagewise.datasets.loader path; a forced placement is kept on any device."""
    assert choose_placement("auto", 0.5, "cpu", 10**12)[0] == "host"
    for forced in ("host", "resident", "streamed"):
        assert choose_placement(forced, 0.5, "cpu", 10**12)[0] == forced


def test_auto_on_cuda_is_resident_when_it_fits_the_fraction(monkeypatch):
    """auto on CUDA: resident when the data fits in the fraction of the device memory (and in what is free), else
    streamed; the reason names both sizes (mem_get_info is faked: no GPU needed)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * 2**30, 80 * 2**30))
    placement, why = choose_placement("auto", 0.5, "cuda:0", 39 * 2**30)
    assert placement == "resident" and why == "resident (39 GiB of 40 GiB allowed)"
    assert choose_placement("auto", 0.5, "cuda:0", 41 * 2**30)[0] == "streamed"
    assert choose_placement("auto", 0.9, "cuda:0", 61 * 2**30)[0] == "streamed", "never more than is free"
    assert choose_placement("host", 0.5, "cuda:0", 1)[0] == "host"


@pytest.mark.parametrize("setting, fraction, message", [
    ("gpu", 0.5, "data_placement 'gpu' is not one of auto, host, resident, streamed"),
    ("auto", 0.0, r"resident_memory_fraction 0.0 must be in \(0, 1\]"),
    ("auto", 1.5, r"resident_memory_fraction 1.5 must be in \(0, 1\]"),
])
def test_bad_placement_arguments_are_user_errors(setting, fraction, message):
    """Called without the config (stagewise.sweep, a user's code), bad values are refused naming the setting."""
    with pytest.raises(UserError, match=message):
        choose_placement(setting, fraction, "cpu", 1)


@pytest.mark.parametrize("key, value, message", [
    ("data_placement", "gpu", "Input should be 'auto', 'host', 'resident' or 'streamed'"),
    ("resident_memory_fraction", 0, "Input should be greater than 0"),
    ("resident_memory_fraction", 1.5, "Input should be less than or equal to 1"),
    ("precision", "fp8", "Input should be 'fp32', 'bf16' or 'fp16'"),
    ("compile", "fast", "Input should be 'off', 'default', 'reduce-overhead' or 'max-autotune'"),
])
def test_bad_stage_knobs_are_config_errors_naming_the_key(write_config, key, value, message):
    """Each knob is validated when the config loads; the error names the stage's key path and the allowed values."""
    with pytest.raises(ConfigError, match=rf"train\.stages\.1\.{key}: {message}"):
        load_config(write_config(), {f"train.stages.1.{key}": value})


def test_stage_knobs_default_to_today(write_config):
    """Off by default: auto placement (host on CPU), fp32, no compile, half the device memory for resident data."""
    stage = load_config(write_config()).stage("s1")
    assert (stage.data_placement, stage.resident_memory_fraction, stage.precision, stage.compile) == (
        "auto", 0.5, "fp32", "off")


CPU = DistEnv(rank=0, local_rank=0, world_size=1, device="cpu")


@pytest.mark.parametrize("placement, kind", [("auto", ParquetBatches), ("host", ParquetBatches),
                                             ("resident", DeviceBatches), ("streamed", DeviceBatches)])
def test_rank_batches_follow_the_placement(digits_run, placement, kind, caplog):
    """rank_batches (stages and sweep trials) builds the chosen kind for train and validation and logs the choice once."""
    import logging

    from stagewise.core import storage
    from stagewise.datasets.manifest import read_manifest
    from stagewise.training.loop import rank_batches

    manifest = read_manifest(storage.join(digits_run[1], "preprocess", "manifest.json"))
    with caplog.at_level(logging.INFO, logger="stagewise.train"):
        found = rank_batches(manifest, CPU, batch_size=32, seed=0, too_few_rows=str, placement=placement)
    assert all(type(batches) is kind for batches in found)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data placement: ")]
    expected = "host" if placement == "auto" else placement
    assert len(lines) == 1 and lines[0].startswith(f"data placement: {expected} "), lines


def test_a_stages_shuffle_block_rows_reaches_the_host_loader_and_is_validated(digits_run, caplog):
    """train.stages[].shuffle_block_rows is the host loader's coarse shuffle (train split only); a device placement says
    it does not apply; a value below 1 is refused at load, naming the key."""
    import logging

    from stagewise.core import storage
    from stagewise.datasets.manifest import read_manifest
    from stagewise.definitions.config import TrainStage
    from stagewise.training.loop import rank_batches

    manifest = read_manifest(storage.join(digits_run[1], "preprocess", "manifest.json"))
    train_batches, validation = rank_batches(manifest, CPU, batch_size=32, seed=0, too_few_rows=str, shuffle_block_rows=16)
    assert (train_batches.shuffle_block_rows, validation.shuffle_block_rows) == (16, 1)
    with caplog.at_level(logging.WARNING, logger="stagewise.train"):
        rank_batches(manifest, CPU, batch_size=32, seed=0, too_few_rows=str, placement="resident", shuffle_block_rows=16)
    assert any("applies to the host loader only" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="shuffle_block_rows"):
        TrainStage(name="s1", profile="cpu", per_process_batch=8, epochs=1, shuffle_block_rows=0)


PARAMS = {"lr": 0.05, "hidden": 32}


@pytest.fixture
def single_process(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", train.FAULT_ENV):
        monkeypatch.delenv(name, raising=False)


def _plain_model_loads(checkpoint_uri: str) -> None:
    """The checkpoint's model state loads strictly into a freshly built, uncompiled model."""
    state = torch.load(checkpoint_uri, weights_only=True)["model"]
    assert not [key for key in state if "_orig_mod" in key], "keys of the plain module, not of a compiled wrapper"
    model = build(MLPClassifier(), DataInfo(features=[f"f{i}" for i in range(64)], num_classes=10), {"hidden": 32,
                                                                                                     "dropout": 0.0})
    model.load_state_dict(state, strict=True)
    assert all(tensor.dtype == torch.float32 for tensor in state.values()), "weights stay fp32"


@pytest.mark.parametrize("placement", ["resident", "streamed"])
def test_a_stage_trains_on_device_batches_and_resumes_the_same(digits_run, single_process, placement):
    """A stage forced onto device batches learns; re-running it resumes from its checkpoint and ends where it was."""
    config_path, out = digits_run
    config = load_config(config_path, {"train.stages.0.data_placement": placement, "train.checkpoint_every_steps": 1})
    first = train.run_stage(config, "s1", out, PARAMS, None)
    assert first["val_metric"] > 0.8
    second = train.run_stage(config, "s1", out, PARAMS, None)
    assert second["resumed_from_step"] == first["steps"] and second["val_metric"] == first["val_metric"]


def test_bf16_stage_trains_and_its_checkpoint_loads_into_a_plain_model(digits_run, single_process):
    """precision bf16 (autocast on CPU too) still learns, and final.pt holds the plain fp32 model's state."""
    config_path, out = digits_run
    config = load_config(config_path, {"train.stages.0.precision": "bf16"})
    result = train.run_stage(config, "s1", out, PARAMS, None)
    assert result["val_metric"] > 0.8
    _plain_model_loads(result["checkpoint_uri"])


def test_bf16_changes_the_numerics(digits_run, single_process):
    """The knob is live: the same stage in bf16 ends with other weights than in fp32."""
    config_path, out = digits_run
    weights = {}
    for precision in ("fp32", "bf16"):
        config = load_config(config_path, {"train.stages.0.precision": precision})
        result = train.run_stage(config, "s1", out, PARAMS, None)
        weights[precision] = torch.load(result["checkpoint_uri"], weights_only=True)["model"]
        # A second precision must not resume the first's checkpoint: the knob is part of the config hash.
        assert result["resumed_from_step"] is None
    assert any(not torch.equal(weights["fp32"][k], weights["bf16"][k]) for k in weights["fp32"])


# The one CPU test that runs inductor end to end (dynamo, AOT autograd, inductor's C++ codegen, gcc, the loaded kernels),
# at its cheapest: scalar C++ kernels (cpp.vec_isa_ok off skips the vector-ISA probes, a gcc build and a Python process
# each, and the at::vec headers), and one compile: without the noise scale's half batches every step has the same
# shape, so no recompile for a second, dynamic shape. On 2 cores: ~10 CPU-s, from ~28. GPU compile: test_train_cuda.py.
@pytest.mark.torchrun
@pytest.mark.slow
def test_compiled_stage_trains_and_its_checkpoint_loads_into_a_plain_model(digits_run, single_process, monkeypatch):
    """compile default: the stage trains through torch.compile (mode None, inductor compiles or loads from its cache
    the forward and the backward), and final.pt has no _orig_mod. keys (saved from the plain module) so it loads into
    an uncompiled model; validation runs on the plain module."""
    import shutil

    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config

    if shutil.which("g++") is None and shutil.which("gcc") is None:
        pytest.fail("torch.compile on CPU needs a C++ compiler (gcc/g++); none is on PATH")
    monkeypatch.setattr(inductor_config.cpp, "vec_isa_ok", False)
    modes = []
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: modes.append(kwargs) or compile_(model, **kwargs))
    before = dict(counters["inductor"])
    config_path, out = digits_run
    config = load_config(config_path, {"train.stages.0.compile": "default", "train.stages.0.epochs": 1,
                                       "train.noise_scale": False})
    started = time.monotonic()
    result = train.run_stage(config, "s1", out, PARAMS, None)
    print(f"compiled stage: {time.monotonic() - started:.1f}s")
    assert modes == [{"mode": None}]
    graphs = sum(counters["inductor"][key] - before.get(key, 0) for key in ("fxgraph_cache_miss", "fxgraph_cache_hit"))
    assert graphs >= 2, f"inductor built the forward and the backward: {dict(counters['inductor'])}"
    assert result["val_metric"] > 0.5
    _plain_model_loads(result["checkpoint_uri"])


def test_chunks_hold_whole_row_groups_of_at_least_the_chunk_rows(split):
    """Chunks cut the rank's row groups in reading order, each at least chunk_bytes big but the last."""
    batches = _device(split, False)
    chunks = batches.chunks(0)
    assert [g for c in chunks for g in c.groups] == batches.assignment(0)
    assert all(c.end - c.start >= batches.chunk_rows for c in chunks[:-1])
    assert batches.chunk_rows == CHUNK_BYTES // ROW_BYTES < device_data.CHUNK_BYTES // ROW_BYTES


@pytest.mark.torchrun
@pytest.mark.slow
def test_ddp_stage_gives_the_same_model_resident_or_streamed(digits_run, subprocess_env, tmp_path):
    """A 2-process torchrun stage (gloo) trains on device batches; resident and streamed runs end with the same
    weights, since both placements feed every rank the same batches in the same order."""
    import shutil

    from tests.tasks.test_train_ddp import torchrun

    config, out = digits_run
    weights = {}
    for placement in ("resident", "streamed"):
        run_out = str(tmp_path / placement)
        shutil.copytree(Path(out) / "preprocess", Path(run_out) / "preprocess")
        result = torchrun(2, config, "s2", run_out, subprocess_env,
                          f"--override=train.stages.1.data_placement={placement}").result
        assert result["world_size"] == 2 and result["val_metric"] > 0.8
        weights[placement] = torch.load(result["checkpoint_uri"], weights_only=True)["model"]
    for name, tensor in weights["resident"].items():
        torch.testing.assert_close(weights["streamed"][name], tensor, rtol=1e-6, atol=1e-7)
