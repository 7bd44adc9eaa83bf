"""The GPU benchmarks on a machine without CUDA: each is recorded as skipped (never a number), at once, and their
whole import path needs only the training dependencies (no Airflow, optuna or pandas)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bench.__main__ as bench_main
from bench import gpu, harness, training

REPO_ROOT = Path(__file__).resolve().parents[2]
GPU_BENCHMARKS = ["train_throughput_gpu", "train_vs_dataloader_gpu", "inference_throughput_gpu"]


@pytest.fixture
def no_cuda(monkeypatch):
    """CUDA absent, and any benchmark work beyond the device check fails loudly."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def no_work(*args, **kwargs):
        raise AssertionError("a skipped benchmark must not prepare data")

    monkeypatch.setattr(training, "_prepare", no_work)
    gpu._training_on_cuda.cache_clear()
    yield
    gpu._training_on_cuda.cache_clear()


@pytest.mark.parametrize("name", GPU_BENCHMARKS)
def test_a_gpu_benchmark_without_cuda_is_recorded_as_skipped(no_cuda, name):
    """The entry says 'skipped: no CUDA' with the goal, and carries no ours/baseline/ratio/met."""
    entry = harness.run_one(name)
    assert entry["skipped"] == "no CUDA" and entry["goal"] == harness.BENCHMARKS[name][1]
    assert not {"ours", "baseline", "ratio", "met", "error"} & set(entry), entry


def test_skipped_entries_show_in_the_table_and_count_neither_met_nor_missed(no_cuda, monkeypatch, tmp_path, capsys):
    """python -m bench --only <gpu benchmarks> exits 0, prints the skips, reports no missed goal, merges the skips."""
    results = tmp_path / "latest.json"
    monkeypatch.setattr(bench_main, "merge", lambda entries: harness.merge(entries, results))
    assert bench_main.main(["--only", ",".join(GPU_BENCHMARKS)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("skipped: no CUDA") >= len(GPU_BENCHMARKS) and "goal missed" not in printed
    merged = json.loads(results.read_text())["results"]
    assert [entry["name"] for entry in merged] == GPU_BENCHMARKS
    assert all(entry["skipped"] == "no CUDA" for entry in merged)


_IMPORT_PROBE = """
import importlib.abc, json, sys
BLOCKED = ("airflow", "optuna", "pandas", "sklearn", "stagewise.airflow")

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not installed on a GPU box")

sys.meta_path.insert(0, Block())
from bench.harness import run_one
import bench.gpu, bench.training, bench.inference, stagewise.train, stagewise.infer, stagewise.preprocess, stagewise.data
print(json.dumps([run_one(name) for name in sys.argv[1:]]))
"""


def test_the_gpu_benchmarks_need_only_the_training_dependencies():
    """With Airflow, optuna and pandas unimportable, the GPU benchmarks' modules import and the run records the skips."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, *GPU_BENCHMARKS], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    entries = json.loads(done.stdout.strip().splitlines()[-1])
    assert [entry.get("skipped") for entry in entries] == ["no CUDA"] * len(GPU_BENCHMARKS), entries
