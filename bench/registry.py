"""The benchmarks of `make bench`: name -> ("module:function" under bench/, goal). Each function returns ours and a baseline.

A function returns ``{"ours": float, "baseline": float, "unit": str, "details": dict}``; the ratio
is ours / baseline (for speed-ups defined as time ratios, the function puts the slower run in
"ours", as its docstring says), judged against the goal, e.g. ">= 0.95"; a function whose sides run in
alternating pairs may return ``"ratio"``, the median of the pairs' ratios (drift on a shared machine cancels within a
pair), beside the two sides' medians. A function that cannot run
on this machine (a GPU benchmark without CUDA) raises :class:`bench.harness.BenchmarkSkipped`. A benchmark with a
goal besides its ratio (an absolute time) returns ``"also_met": bool`` too: False makes ``met`` false.

Modules are imported only when their benchmark runs (:func:`load`), so ``python -m bench --only
train_throughput_gpu`` needs what that benchmark needs and nothing the others do (Airflow, optuna).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

Benchmark = Callable[..., dict[str, Any]]

BENCHMARKS: dict[str, tuple[str, str]] = {
    "preprocess_vs_pandas": ("preprocess:preprocess_vs_pandas", ">= 1.5"),
    "preprocess_vs_pyarrow": ("preprocess:preprocess_vs_pyarrow", ">= 0.75"),
    "preprocess_vs_polars": ("engines:preprocess_vs_polars", ">= 1.0"),
    "preprocess_vs_duckdb": ("engines:preprocess_vs_duckdb", ">= 1.0"),
    "dag_parse": ("dag_parse:dag_parse", "<= 1.5"),
    "subjob_exit_cpu": ("process_exit:subjob_exit_cpu", "<= 0.85"),  # a rank-like process's CPU / with the last GC
    "train_throughput": ("training:train_throughput", ">= 0.95"),
    "custom_model_throughput": ("training:custom_model_throughput", ">= 0.95"),
    "variable_length_throughput": ("training:variable_length_throughput", ">= 0.95"),
    "train_bf16": ("training:train_bf16", ">= 1.0"),
    "growing_batch_steps": ("training:growing_batch_steps", "<= 0.5"),
    "adaptive_batch_steps": ("training:adaptive_batch_steps", "<= 0.8"),
    "parquet_loading": ("training:parquet_loading", ">= 0.8"),
    "sweep_pruning_epochs": ("sweep:sweep_pruning_epochs", "<= 0.4"),
    "sweep_pruning_quality": ("sweep:sweep_pruning_quality", ">= 0.99"),
    "sweep_parallel_speedup": ("sweep:sweep_parallel_speedup", ">= 1.6"),
    "sweep_data_budget": ("sweep:sweep_data_budget", "<= 0.3"),
    "sweep_data_budget_quality": ("sweep:sweep_data_budget_quality", ">= 0.99"),
    "pipeline_scale_linearity": ("scale:pipeline_scale_linearity", "<= 1.0"),
    "pipeline_scale_sweep_share": ("scale:pipeline_scale_sweep_share", "<= 0.333"),
    "cache_rerun": ("caching:cache_rerun", "<= 0.25"),
    "inference_throughput": ("inference:inference_throughput", ">= 0.9"),
    "inference_parallel_speedup": ("inference:inference_parallel_speedup", ">= 1.6"),
    "inference_memory_growth": ("inference:inference_memory_growth", "<= 1.5"),
    "s3_pipeline_overhead": ("s3:s3_pipeline_overhead", "<= 1.5"),
    "multinode_overhead": ("multinode:multinode_overhead", "<= 1.3"),
    "slurm_stage_overhead": ("slurm:slurm_stage_overhead", "<= 1.3"),  # a stage through Slurm / launched locally, wall
    "mlflow_overhead": ("tracking:mlflow_overhead", "<= 1.03"),
    "noise_scale_overhead": ("multinode:noise_scale_overhead", "<= 1.02"),
    "fsdp_memory_per_rank": ("sharding:fsdp_memory_per_rank", "<= 0.6"),
    "fsdp_memory_per_rank_4": ("sharding:fsdp_memory_per_rank_4", "<= 0.35"),
    "fsdp_throughput": ("sharding:fsdp_throughput", "info"),  # gloo on 2 cores: the goal is fsdp_throughput_gpu's
    "fsdp_handoff_memory": ("handoff:fsdp_handoff_memory", "<= 1.1"),
    "resume_redo_fraction": ("resume:resume_redo_fraction", "<= 0.1"),  # steps a 2 -> 3 retry redoes / done before
    "epoch_row_coverage": ("coverage:epoch_row_coverage", ">= 0.99"),
    "metric_exactness": ("metrics:metric_exactness", "<= 1e-6"),  # largest |ours - scikit-learn|, counting metrics
    "metric_overhead": ("metrics:metric_overhead", ">= 0.97"),  # f1_macro, auroc, log_loss / accuracy, samples/s
    "study_open_500": ("studies:study_open_500", "<= 0.2"),
    "run_storage_bytes": ("storage:run_storage_bytes", "<= 1"),  # bytes of a finished demo run / 1 MB
    "runs_page_10k": ("ui_pages:runs_page_10k", "<= 5"),  # the runs page with 10,000 reports / with 10; also <= 0.5 s
    "ingest_wait_under_load": ("ingest_wait:ingest_wait_under_load", "<= 3"),  # ingest run wall / its task's time
    "train_throughput_gpu": ("gpu:train_throughput_gpu", ">= 0.97"),
    "train_vs_dataloader_gpu": ("gpu:train_vs_dataloader_gpu", ">= 3"),
    "train_launch_bound_gpu": ("gpu:train_launch_bound_gpu", ">= 1.1"),
    "inference_throughput_gpu": ("gpu:inference_throughput_gpu", ">= 1.0"),
    "inference_vs_script_gpu": ("gpu:inference_vs_script_gpu", ">= 2.5"),
    "custom_model_throughput_gpu": ("gpu:custom_model_throughput_gpu", ">= 0.95"),
    "variable_length_throughput_gpu": ("gpu:variable_length_throughput_gpu", ">= 0.95"),
    "fsdp_throughput_gpu": ("gpu:fsdp_throughput_gpu", ">= 0.9"),
}


def load(name: str) -> Benchmark:
    """The function of benchmark ``name``, importing its module now."""
    module, function = BENCHMARKS[name][0].split(":")
    return getattr(importlib.import_module(f"bench.{module}"), function)
