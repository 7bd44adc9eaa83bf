"""What a mapped sub-job plans when committed work may already stand for its inputs: batch inference's shards with
their fingerprint, and the run whose predictions stand for them (preprocess plans in stagewise.preprocess.plan_run).
"""

from __future__ import annotations

from typing import Any

from stagewise.core import storage
from stagewise.datasets.predictions import plan_inference
from stagewise.datasets.sharding import file_contents
from stagewise.definitions.config import PipelineConfig
from stagewise.reuse import cache
from stagewise.reuse.fingerprints import code_identity, inference_inputs


def inference_plan(config: PipelineConfig, input_uri: str, model_version: str | None, out: str, this_run: str) -> dict[str, Any]:
    """The shards of ``input_uri`` and the fingerprint of what scoring them reads (the model's version, the input's
    bytes, the settings, the code); ``reused_from`` names the run whose committed predictions stand for these inputs
    (with ``cache.inference``; copied into this run's manifest), else None: score them."""
    shards = plan_inference(input_uri, config.inference.rows_per_shard, config.storage_root)
    if model_version is None:  # nothing names the model's bytes: never reused
        return {"shards": shards, "fingerprint": None, "reused_from": None}
    # the content ids the plan pinned each file by: the fingerprint reads no byte again
    fingerprint = inference_inputs(config, model_version, file_contents(shards), code_identity(config))
    hit = cache.lookup(config, "inference", fingerprint, this_run,
                       lambda result: cache.manifest_problem(result.get("uri"), fingerprint))
    if hit is not None:
        manifest = storage.read_json(hit["uri"])
        storage.write_json(storage.join(out, "predictions", "manifest.json"), {**manifest, "reused_from": hit["reused_from"]})
    return {"shards": shards, "fingerprint": fingerprint, "reused_from": hit["reused_from"] if hit else None}
