"""The benchmarks of `make bench`: name -> (function, goal). Each function returns ours and a baseline.

A function returns ``{"ours": float, "baseline": float, "unit": str, "details": dict}``; the ratio
is ours / baseline (for speed-ups defined as time ratios, the function puts the slower run in
"ours", as its docstring says), judged against the goal, e.g. ">= 0.95".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench import dag_parse, inference, multinode, preprocess, s3, sweep, training

Benchmark = Callable[..., dict[str, Any]]

BENCHMARKS: dict[str, tuple[Benchmark, str]] = {
    "preprocess_vs_pandas": (preprocess.preprocess_vs_pandas, ">= 1.5"),
    "preprocess_vs_pyarrow": (preprocess.preprocess_vs_pyarrow, ">= 0.75"),
    "dag_parse": (dag_parse.dag_parse, "<= 1.5"),
    "train_throughput": (training.train_throughput, ">= 0.95"),
    "custom_model_throughput": (training.custom_model_throughput, ">= 0.95"),
    "growing_batch_steps": (training.growing_batch_steps, "<= 0.5"),
    "parquet_loading": (training.parquet_loading, ">= 0.8"),
    "sweep_pruning_epochs": (sweep.sweep_pruning_epochs, "<= 0.4"),
    "sweep_pruning_quality": (sweep.sweep_pruning_quality, ">= 0.99"),
    "sweep_parallel_speedup": (sweep.sweep_parallel_speedup, ">= 1.6"),
    "inference_throughput": (inference.inference_throughput, ">= 0.9"),
    "inference_parallel_speedup": (inference.inference_parallel_speedup, ">= 1.6"),
    "inference_memory_growth": (inference.inference_memory_growth, "<= 1.5"),
    "s3_pipeline_overhead": (s3.s3_pipeline_overhead, "<= 1.5"),
    "multinode_overhead": (multinode.multinode_overhead, "<= 1.3"),
}
