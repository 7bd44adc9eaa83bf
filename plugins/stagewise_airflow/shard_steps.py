"""The callables behind the sharded data tasks: preprocess (plan, stats, reduce, transform, commit) and batch
inference (plan, score, commit).

Each shard's plan carries the inputs' fingerprint (stagewise.reuse) and, when committed work already stands for those
inputs (this run's own after a clear, or another run's with ``cache``), the run it comes from: then every mapped task
returns at once instead of launching its sub-job.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from stagewise.airflow.steps import all_results, inline, launch_subjob, reused_from, run_config, run_ref

NO_MODEL = "no current model: the gate's only candidate was not approved, so there is nothing to score with"


def plan_shards(run: dict[str, Any]) -> list[dict[str, Any]]:
    """One mapped shard per raw file (past sharding.MAX_SHARDS files, several files each), each carrying the inputs'
    fingerprint; when committed work already stands for them (stagewise.preprocess.plan_run), one shard naming the
    run it comes from, whose tasks return at once."""
    from stagewise import preprocess
    from stagewise.core import storage

    config = run_config(run)
    planned = inline(config, lambda: preprocess.plan_run(config, storage.resolve(config.storage_root, config.dataset.uri),
                                                          run["out"], run_ref(run)))
    shards = [{**shard, "fingerprint": planned["fingerprint"], "reused_from": planned["reused_from"]}
              for shard in planned["shards"]]
    return shards[:1] if planned["reused_from"] else shards  # nothing to do per shard: one mapped task stands for all


def _files_arg(shard: dict[str, Any]) -> str:
    """A preprocess shard for the sub-job's --shard: its pinned files as JSON (a shard planned before pins: its URI)."""
    return json.dumps(shard["files"]) if shard.get("files") else shard["uri"]


def preprocess_stats(run: dict[str, Any], shard: dict[str, Any]) -> dict[str, Any]:
    if reused := reused_from(shard):
        return {"reused_from": reused, "fingerprint": shard.get("fingerprint")}
    result = launch_subjob(run, "stagewise.preprocess", ["stats", "--shard", _files_arg(shard), "--index", str(shard["index"]),
                                                         "--out", run["out"]], run_config(run).preprocess.profile)
    return {**result, "fingerprint": shard.get("fingerprint")}


def reduce_stats(run: dict[str, Any], stats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    from stagewise import preprocess

    config = run_config(run)
    parts = all_results(stats)
    fingerprint = parts[0].get("fingerprint") if parts else None
    if reused := reused_from(*parts):
        return {"reused_from": reused, "fingerprint": fingerprint}
    reduced = inline(config, lambda: preprocess.reduce_stats(config, run["out"], [s["stats_uri"] for s in parts]))
    return {**reduced, "fingerprint": fingerprint}


def preprocess_transform(run: dict[str, Any], reduced: dict[str, Any], shard: dict[str, Any]) -> dict[str, Any]:
    if reused := reused_from(reduced):
        return {"reused_from": reused}
    return launch_subjob(run, "stagewise.preprocess", ["transform", "--shard", _files_arg(shard), "--index", str(shard["index"]),
                                                       "--out", run["out"], "--stats", reduced["stats_uri"]],
                         run_config(run).preprocess.profile)


def commit_preprocess(run: dict[str, Any], reduced: dict[str, Any], transformed: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Commit the manifest under the inputs' fingerprint (and remember it for the cache), or hand on the committed
    manifest that stands for these inputs."""
    from stagewise import preprocess
    from stagewise.core import storage
    from stagewise.reuse import cache

    config = run_config(run)
    if reused_from(reduced):
        return inline(config, lambda: preprocess.committed_result(storage.join(run["out"], "preprocess", "manifest.json")))

    def work() -> dict[str, Any]:
        committed = preprocess.commit(config, run["out"], reduced["stats_uri"], all_results(transformed), reduced.get("fingerprint"))
        if committed["fingerprint"]:
            cache.remember(config, "preprocess", committed["fingerprint"], run_ref(run), committed)
        return committed

    return inline(config, work)


def plan_inference(run: dict[str, Any], model: dict[str, Any]) -> list[dict[str, Any]]:
    """The shards to score, each carrying the inputs' fingerprint (model version, input bytes, settings, code) and,
    with ``cache.inference`` and another run's committed predictions for them, that run: then every shard returns
    at once."""
    from stagewise.core import storage
    from stagewise.reuse.planning import inference_plan

    if not model.get("model_uri"):  # the first model was rejected or is waiting: nothing is current to score with
        return [{"index": 0, "no_model": NO_MODEL}]
    config = run_config(run)
    source = storage.resolve(config.storage_root, config.inference.input_uri or config.dataset.uri)
    planned = inline(config, lambda: inference_plan(config, source, model.get("current"), run["out"], run_ref(run)))
    shards = [{**shard, "fingerprint": planned["fingerprint"], "reused_from": planned["reused_from"]}
              for shard in planned["shards"]]
    return shards[:1] if planned["reused_from"] else shards  # nothing to score: one mapped task stands for all


def infer_shard(run: dict[str, Any], model: dict[str, Any], shard: dict[str, Any]) -> dict[str, Any]:
    if shard.get("no_model"):
        return {"index": shard["index"], "no_model": shard["no_model"]}
    if reused := reused_from(shard):
        return {"index": shard["index"], "reused_from": reused, "fingerprint": shard.get("fingerprint")}
    args = ["shard", "--model", model["model_uri"], "--shard", json.dumps(shard), "--out", run["out"]]
    # On a Slurm profile each shard is one Slurm job of its own (stagewise.airflow.slurm_subjob).
    result = launch_subjob(run, "stagewise.infer", args, run_config(run).inference.profile, label=f"infer-{shard['index']}")
    return {**result, "fingerprint": shard.get("fingerprint")} if isinstance(result, dict) else result


def commit_predictions(run: dict[str, Any], model: dict[str, Any], scored: Sequence[dict[str, Any]]) -> dict[str, Any]:
    from stagewise.core import storage
    from stagewise.datasets import predictions
    from stagewise.reuse import cache

    if not model.get("model_uri"):
        logging.getLogger("stagewise.inference").warning("nothing scored: %s", NO_MODEL)
        return {"rows": 0, "uri": None, "model_version": None, "skipped": NO_MODEL}
    config = run_config(run)
    results = all_results(scored)
    fingerprint = results[0].get("fingerprint") if results else None

    def work() -> dict[str, Any]:
        if reused := reused_from(*results):
            committed = predictions.committed_result(storage.join(run["out"], "predictions", "manifest.json"))
            return {**committed, "reused_from": reused, "model_version": model["current"]}
        committed = predictions.commit_predictions(run["out"], model["model_uri"], results, fingerprint)
        if fingerprint:
            cache.remember(config, "inference", fingerprint, run_ref(run), committed)
        return {**committed, "model_version": model["current"]}

    return inline(config, work)
