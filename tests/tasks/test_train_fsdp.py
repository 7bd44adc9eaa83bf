"""Sharded (fsdp) stages under real torchrun on CPU (gloo): ddp 1 -> fsdp 2 -> fsdp 4 with growing batch and
full-state hand-offs, sharded checkpoints written by every rank, a killed rank resumed exactly, and a model that fits a
per-process memory cap only sharded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import run_cache
from tests.conftest import base_config, preprocess_digits
from tests.tasks.test_train_resume import recorded_history

REPO_ROOT = Path(__file__).resolve().parents[2]
KILL_AT_STEP = 25

pytestmark = pytest.mark.torchrun


def torchrun(nproc: int, config: Path, out: str, env: dict, *args: str, result: str = "result.json",
             check: bool = True, preexec_fn: Any = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m",
               "stagewise.train", "--config", str(config), "--out", out, "--result-file", str(Path(out) / result), *args]
    completed = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
                               preexec_fn=preexec_fn)
    if check:
        assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
        completed.result = json.loads((Path(out) / result).read_text())
    return completed


@pytest.fixture
def sharded_run(storage_root, write_config) -> tuple[Path, str]:
    """The digits with three stages: s1 ddp on 1 process, s2 fsdp on 2 (clipped), s3 fsdp on 4, batch 32 -> 128 -> 256."""
    raw = base_config(storage_root)
    raw["profiles"]["ddp4"] = {**raw["profiles"]["ddp2"], "processes_per_node": 4}
    raw["train"]["stages"][1].update({"strategy": "fsdp", "grad_clip_norm": 5.0})
    raw["train"]["stages"].append({"name": "s3", "profile": "ddp4", "per_process_batch": 64, "epochs": 1,
                                   "strategy": "fsdp", "warmup_steps": 5, "hand_on": "last"})
    config = write_config(raw)
    out = str(storage_root / "runs" / "test" / "sharded")
    preprocess_digits(config, out)
    return config, out


@pytest.mark.slow
def test_ddp_then_fsdp_on_two_then_four_ranks_hands_on_full_states(sharded_run, subprocess_env):
    """s1 (ddp, 1 rank) hands its final.pt to s2 (fsdp, 2 ranks), which hands its own to s3 (fsdp, 4 ranks): each
    sharded stage starts from the stage before's weights at another world size and strategy, every rank writes its
    own checkpoint shard, and the final.pt and model.pt a sharded stage leaves are full states that a ddp stage,
    evaluation and the registry read as before."""
    from stagewise.models.bundle import load_bundle

    config, out = sharded_run
    params = ("--params", json.dumps({"lr": 0.05, "hidden": 64}))
    first = torchrun(1, config, out, subprocess_env, "--stage", "s1", *params, result="s1.json").result
    second_run = torchrun(2, config, out, subprocess_env, "--stage", "s2", *params, "--init-from",
                          first["checkpoint_uri"], result="s2.json")
    second = second_run.result
    assert second["strategy"] == "fsdp" and second["world_size"] == 2 and second["global_batch"] == 128
    assert second["val_metric"] > 0.9, "s2 starts from s1's trained model"
    assert "world size 2 (fsdp over 2 rank(s): 4 units)" in second_run.stdout + second_run.stderr
    history = json.loads(Path(out, "train", "s2", "metrics.json").read_text())["history"]
    assert all(entry["grad_norm"] is not None and entry["grad_norm"] > 0 for entry in history), "clipped on shards"
    assert history[-1]["noise_scale"] is not None and history[-1]["noise_scale"] > 0, "measured over the shards"

    stage_dir = Path(out, "train", "s2")
    pointer = json.loads((stage_dir / "checkpoints" / "latest.json").read_text())
    shards = sorted(path.name for path in Path(pointer["uri"]).iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "checksums.json", "meta.pt"], \
        "each rank wrote its own shard; the checksums of all of them are recorded"
    final = torch.load(stage_dir / "final.pt", weights_only=True)
    bundle = load_bundle(str(stage_dir / "model.pt"))
    plain = dict(bundle.module.state_dict())
    assert set(final["model"]) == set(plain) and all(torch.equal(final["model"][k], plain[k]) for k in plain)
    assert all(isinstance(tensor, torch.Tensor) and type(tensor) is torch.Tensor for tensor in final["model"].values())
    # The optimizer state is never gathered: final.pt names the sharded checkpoint holding it (one of its own).
    kept = Path(final["optimizer"]["sharded_checkpoint"])
    assert kept.parent == stage_dir and kept.name.startswith("final-optimizer-")
    assert {"__0_0.distcp", "__1_0.distcp"} <= {path.name for path in kept.iterdir()}
    assert len(list(stage_dir.glob("final-optimizer-*"))) == 1
    assert final["global_batch"] == 128

    third = torchrun(4, config, out, subprocess_env, "--stage", "s3", *params, "--init-from", second["checkpoint_uri"],
                     result="s3.json").result
    assert (third["world_size"], third["global_batch"], third["strategy"]) == (4, 256, "fsdp")
    assert third["val_metric"] > 0.9, "s3 starts from s2's weights, resharded from 2 ranks to 4"
    last = torch.load(Path(out, "train", "s3", "final.pt"), weights_only=True)
    assert last["previous_global_batch"] == 128

    # A ddp stage after a sharded one loads its full state (model by name, optimizer numbered).
    again = torchrun(1, config, out, subprocess_env, "--stage", "s1", *params, "--init-from",
                     str(Path(out, "train", "s3", "final.pt")), "--override=train.stages.0.epochs=1", result="again.json")
    assert again.result["val_metric"] > 0.9


# The killed-rank tests' stage: the resume tests' reference stage (run_cache.REFERENCE_STAGE_ARGS), sharded.
FSDP_STAGE_ARGS = (*run_cache.REFERENCE_STAGE_ARGS, "--override=train.stages.1.strategy=fsdp")


@pytest.fixture(scope="module")
def uninterrupted_fsdp(tmp_path_factory):
    """``get(env)``: the run prefix and result of FSDP_STAGE_ARGS run uninterrupted on 2 ranks (its checkpoints written
    in the step) over digits preprocessed as digits_run does, made once for the module: both killed-rank tests compare
    with it. The data, its order per rank, the seed and the dropout masks do not depend on which test preprocessed
    the digits (run_cache.reference_stage relies on the same)."""
    made: dict[str, Any] = {}

    def get(env: dict) -> tuple[str, dict]:
        if not made:
            import yaml

            root = tmp_path_factory.mktemp("uninterrupted-fsdp")
            (root / "storage").mkdir()
            config = root / "pipeline.yaml"
            config.write_text(yaml.safe_dump(base_config(root / "storage")))
            out = str(root / "storage" / "runs" / "test" / "clean")
            preprocess_digits(config, out)
            made["run"] = out, torchrun(2, config, out, env, *FSDP_STAGE_ARGS, result="clean.json").result
        return made["run"]

    return get


@pytest.mark.parametrize("background", [False, True], ids=["saved-in-step", "saved-in-background"])
@pytest.mark.slow
def test_killed_fsdp_rank_resumes_from_its_sharded_checkpoint_exactly(digits_run, subprocess_env, uninterrupted_fsdp,
                                                                       background):
    """SIGKILL of rank 1 at step 25 of an fsdp stage: the retry loads every rank's shard of the newest committed
    sharded checkpoint and ends on the weights, noise scale, metric and recorded history (but for samples/s) of an
    uninterrupted fsdp stage (whose checkpoints were written in the step; one run for both tests, uninterrupted_fsdp),
    also where the killed and the retried attempts wrote theirs in the background (train.async_checkpoints)."""
    config, out = digits_run
    attempt_args = (*FSDP_STAGE_ARGS, f"--override=train.async_checkpoints={str(background).lower()}")
    crashed = torchrun(2, config, out, {**subprocess_env, "STAGEWISE_FAULT_KILL_AT": f"1:{KILL_AT_STEP}"},
                       *attempt_args, result="crashed.json", check=False)
    assert crashed.returncode != 0, "a killed rank must fail the stage"
    every = run_cache.REFERENCE_CHECKPOINT_EVERY
    pointer = json.loads(Path(out, "train", "s2", "checkpoints", "latest.json").read_text())
    newest = (KILL_AT_STEP // every) * every
    # In the background the newest save may still be in flight at the kill: then the one before is the newest committed.
    assert pointer["step"] in ((newest - every, newest) if background else (newest,)) and pointer["uri"].endswith(".dcp")

    resumed = torchrun(2, config, out, {**subprocess_env, "STAGEWISE_FAULT_KILL_AT": f"1:{KILL_AT_STEP}"},
                       *attempt_args, result="resumed.json").result
    assert resumed["resumed_from_step"] == pointer["step"]

    reference_out, clean = uninterrupted_fsdp(subprocess_env)
    assert resumed["steps"] == clean["steps"] and resumed["handed_epoch"] == clean["handed_epoch"]
    assert resumed["val_metric"] == pytest.approx(clean["val_metric"], abs=1e-9)
    assert resumed["noise_scale"] > 0 and resumed["noise_scale"] == pytest.approx(clean["noise_scale"], rel=1e-6)
    # Every rank saved the loss and samples of all ranks: the epoch resumed in records the clean run's train loss.
    assert recorded_history(Path(out, "train", "s2")) == recorded_history(Path(reference_out, "train", "s2"))
    resumed_model = torch.load(Path(out, "train", "s2", "final.pt"), weights_only=True)["model"]
    clean_model = torch.load(Path(reference_out, "train", "s2", "final.pt"), weights_only=True)["model"]
    for name, tensor in clean_model.items():
        torch.testing.assert_close(resumed_model[name], tensor, rtol=1e-5, atol=1e-6)


# A 50M-parameter MLP (48 hidden layers of 1024) with AdamW: ~16 bytes a parameter per ddp rank (weights, gradients,
# two moments, DDP's gradient buckets) against ~8 / world per fsdp rank; measured peaks here: ddp ~1350 MB a rank,
# fsdp ~850 MB (rank 0, which gathers the full model at the end), both with ~350 MB of torch and gloo.
MEMORY_CAP_MB = 1100
BIG_MODEL = ("--params", json.dumps({"lr": 0.0005, "hidden": 1024, "optimizer": "adamw"}),
             "--override=model.spec=tests.specs:DeepMLP", '--override=model.args={"extra": 48}',
             "--override=train.stages.1.epochs=1", "--override=train.checkpoint_every_steps=1000000",
             "--override=train.noise_scale=false")


def capped(limit_bytes: int):
    """A preexec_fn capping the process's (and its children's) data segment: what malloc may map."""

    def cap() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_DATA, (limit_bytes, limit_bytes))

    return cap


# The held-out fractions of the digits (1797 rows) for stages of the big model, whose every step costs seconds (more
# under the heap accounting of the memory cap): 15% train (258 rows, 2 steps an epoch at global batch 128) and 5%
# validate (93 rows); the rest is the test split, which training never reads.
FEW_TRAIN_ROWS = {"validation": 0.05, "test": 0.8}


@pytest.fixture
def few_rows_run(storage_root, write_config) -> tuple[Path, str]:
    """Like digits_run, with FEW_TRAIN_ROWS: a run prefix holding a committed preprocess manifest of the digits."""
    raw = base_config(storage_root)
    raw["preprocess"]["split"] = dict(FEW_TRAIN_ROWS)
    config = write_config(raw)
    out = str(storage_root / "runs" / "test" / "few")
    preprocess_digits(config, out)
    return config, out


@pytest.mark.slow
def test_a_model_that_overflows_a_ddp_rank_trains_sharded_under_the_same_memory_cap(few_rows_run, subprocess_env,
                                                                                     tmp_path):
    """Under a per-process memory cap, the ddp stage fails at once on every rank with a user error naming memory and
    strategy fsdp; the same stage with strategy fsdp trains to the end under the same cap (an epoch of 2 steps over
    FEW_TRAIN_ROWS: the parameters, gradients and AdamW state that overflow a ddp rank all exist from the first step)."""
    config, out = few_rows_run
    error_file = tmp_path / "errors.txt"
    # Heap accounting that counts what is used: glibc's fixed mmap threshold and one arena, Arrow on malloc (its
    # own pools reserve address space they never touch).
    env = {**subprocess_env, "STAGEWISE_ERROR_FILE": str(error_file), "MALLOC_ARENA_MAX": "1",
           "MALLOC_MMAP_THRESHOLD_": "65536", "ARROW_DEFAULT_MEMORY_POOL": "system"}

    def stage(strategy: str, result: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                   "stagewise.train", "--config", str(config), "--out", out, "--stage", "s2", *BIG_MODEL,
                   f"--override=train.stages.1.strategy={strategy}", "--result-file", str(Path(out) / result)]
        return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
                              preexec_fn=capped(MEMORY_CAP_MB * 2**20))

    replicated = stage("ddp", "ddp.json")
    assert replicated.returncode != 0
    messages = error_file.read_text().splitlines()
    assert messages and all("ran out of memory" in m and "strategy: fsdp" in m for m in messages), messages
    assert not (Path(out) / "train" / "s2" / "final.pt").exists()

    sharded = stage("fsdp", "fsdp.json")
    assert sharded.returncode == 0, sharded.stdout[-3000:] + sharded.stderr[-3000:]
    result = json.loads((Path(out) / "fsdp.json").read_text())
    assert result["strategy"] == "fsdp" and result["steps"] > 0 and (Path(out) / "train" / "s2" / "model.pt").exists()


@pytest.mark.slow
def test_the_decoder_example_trains_sharded_after_a_replicated_stage(storage_root, subprocess_env):
    """examples/decoder.yaml as shipped (storage moved to the test's, an epoch a stage): its s1 (ddp, 1 process) hands
    the decoder to its s2 (fsdp, 2 processes, one unit a block), which trains on from it and leaves a model evaluation
    loads."""
    import yaml

    from stagewise.models.bundle import load_bundle

    raw = yaml.safe_load((REPO_ROOT / "examples" / "decoder.yaml").read_text())
    raw["storage_root"] = str(storage_root)
    raw["train"]["stages"][0]["epochs"], raw["train"]["stages"][1]["epochs"] = 1, 1
    # One epoch takes s1 to val accuracy ~1.0; an s2 that started from scratch instead would end near 0.73.
    config = storage_root.parent / "decoder.yaml"
    config.write_text(yaml.safe_dump(raw))
    out = str(storage_root / "runs" / "test" / "decoder")
    preprocess_digits(config, out)  # writes the config's demo data: here the token sequences
    params = ("--params", json.dumps({"lr": 0.002}))
    first = torchrun(1, config, out, subprocess_env, "--stage", "s1", *params, result="s1.json").result
    second_run = torchrun(2, config, out, subprocess_env, "--stage", "s2", *params, "--init-from",
                          first["checkpoint_uri"], result="s2.json")
    second = second_run.result
    layers = raw["train"]["default_params"]["layers"]
    assert f"fsdp over 2 rank(s): {layers + 2} units" in second_run.stdout + second_run.stderr, "a unit a block"
    assert second["strategy"] == "fsdp" and second["val_metric"] >= first["val_metric"] - 0.05
    bundle = load_bundle(second["model_uri"])
    assert len(bundle.module.blocks) == layers
