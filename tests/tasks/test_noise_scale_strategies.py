"""One noise scale whatever the strategy: the same two-rank stage under ddp and under fsdp measures the same parts of
the same batches (each rank's batch in two halves, each half's gradient averaged over the ranks), so it ends on the
same noise scale and an adaptive stage after it chooses the same global batch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests import run_cache

pytestmark = pytest.mark.torchrun

# Only float rounding tells them apart (an all-reduce against a reduce-scatter, grown in the estimate's difference of
# two nearly equal squared norms): measured here at most 4.4e-7 relative over the epochs; the two methods before
# (each rank's gradient against the average for ddp, halves for fsdp) ended 2.3x apart on this stage.
RELATIVE_TOLERANCE = 1e-5


@pytest.mark.slow
def test_ddp_and_fsdp_end_on_the_same_noise_scale_and_choose_the_same_next_batch(digits_run, subprocess_env, tmp_path):
    """The reference stage (digits MLP, 2 ranks, clipped, dropout, 4 epochs) measuring every step, run once with ddp
    and once with fsdp: every epoch's noise scale agrees within RELATIVE_TOLERANCE, the two handed-on estimators hold
    as many measurements, and adaptive growth reads the same next global batch from either stage's final.pt."""
    from stagewise.training.batch_growth import adaptive_batch, handed_noise_scale
    from tests.tasks.test_train_fsdp import torchrun

    config, out = digits_run
    histories, handed = {}, {}
    for strategy in ("ddp", "fsdp"):
        run_out = tmp_path / strategy
        shutil.copytree(Path(out) / "preprocess", run_out / "preprocess")
        result = torchrun(2, config, str(run_out), subprocess_env, *run_cache.REFERENCE_STAGE_ARGS,
                          f"--override=train.stages.1.strategy={strategy}",
                          "--override=train.noise_scale_every_steps=1").result
        assert result["strategy"] == strategy and result["world_size"] == 2
        histories[strategy] = json.loads((run_out / "train" / "s2" / "metrics.json").read_text())["history"]
        handed[strategy] = torch.load(run_out / "train" / "s2" / "final.pt", weights_only=False)
    ddp, fsdp = ([entry["noise_scale"] for entry in histories[name]] for name in ("ddp", "fsdp"))
    assert all(value is not None and value > 0 for value in ddp + fsdp), (ddp, fsdp)
    assert fsdp == pytest.approx(ddp, rel=RELATIVE_TOLERANCE), (ddp, fsdp)
    # The same data trained the same weights: the losses agree far tighter than the noise scales need.
    assert [e["train_loss"] for e in histories["fsdp"]] == pytest.approx([e["train_loss"] for e in histories["ddp"]],
                                                                         rel=1e-6)
    assert handed["ddp"]["noise_scale"]["updates"] == handed["fsdp"]["noise_scale"]["updates"] > 10
    # A next stage of 2 ranks x 16 rows (its own global batch 32, below the noise scale): the batch it grows to.
    decisions = {name: adaptive_batch(handed_noise_scale(state)[0], 32, 4096, 2, 16) for name, state in handed.items()}
    chosen = {name: (d.global_batch, d.per_process_batch, d.grad_accum_steps) for name, d in decisions.items()}
    assert chosen["ddp"] == chosen["fsdp"] and decisions["ddp"].global_batch > 32, decisions
