"""What a sub-job read, as one hash: the data's content, the config sections it uses, the upstream artifacts it
starts from and the code. Work done under one fingerprint is reused only under the same fingerprint.

Nothing to run: the Airflow steps and the jobs call these. A fingerprint is a function of inputs alone (never of file
names, attempts or run folders), so a cleared task whose inputs are unchanged finds its work again, and one whose
inputs changed starts over.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from stagewise.core.content import content_id, content_ids  # noqa: F401 -- what a fingerprint reads of a file
from stagewise.definitions.config import PipelineConfig
from stagewise.reporting import lineage

log = logging.getLogger("stagewise.reuse")

FINGERPRINT_CHARS = 24
# Keys of a section that place work (which pool, queue or profile runs it) but never change what it computes.
_PLACEMENT_KEYS = frozenset({"profile"})
# train keys a stage's fingerprint leaves out: the stages (each its own) and whether unrecorded checkpoints load
# (trusting them must resume them, not start over).
_NOT_TRAINING_KEYS = frozenset({"stages", "trust_unrecorded_checkpoints"})


def digest(value: Any) -> str:
    """A short SHA-256 of ``value`` as canonical JSON (sorted keys): equal values, equal digests."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:FINGERPRINT_CHARS]


def section(config: PipelineConfig, name: str) -> Any:
    """A config section as JSON values, without the keys that only place the work."""
    values = getattr(config, name).model_dump(mode="json")
    return {key: value for key, value in values.items() if key not in _PLACEMENT_KEYS} if isinstance(values, dict) else values


@functools.lru_cache(maxsize=1)
def package_fingerprint() -> str:
    """A hash of Stagewise's own source as this process imports it: a commit that changes no code (docs, tests)
    keeps every cached result, one that changes any module of the package invalidates them all."""
    package = Path(__file__).resolve().parent.parent
    found = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        found.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return found.hexdigest()[:FINGERPRINT_CHARS]


def code_identity(config: PipelineConfig) -> dict[str, Any]:
    """The code that runs now: Stagewise's version and own source, and the user's source files (spec, scripts)."""
    recorded = lineage.record(config)
    return {"stagewise_version": recorded.get("stagewise_version"), "stagewise_source": package_fingerprint(),
            "source_fingerprint": recorded.get("source_fingerprint")}


def _placement(config: PipelineConfig, profile: str) -> dict[str, Any]:
    """What of a profile changes a result: how many processes train and on which device."""
    chosen = config.profile(profile)
    return {"world_size": chosen.world_size, "device": chosen.device}


def preprocess_inputs(config: PipelineConfig, shard_ids: list[str], code: dict[str, Any]) -> str:
    """Preprocess: the raw shards' contents in plan order, the data set's schema and the split and cleaning rules."""
    return digest({"kind": "preprocess", "shards": shard_ids, "dataset": section(config, "dataset"),
                   "preprocess": section(config, "preprocess"), "code": code})


def sweep_inputs(config: PipelineConfig, data: str, code: dict[str, Any]) -> str:
    """The sweep's study: the data, the model, the objective, the whole search and the defaults every trial takes."""
    train = config.train
    return digest({"kind": "sweep", "data": data, "model": section(config, "model"),
                   "objective": section(config, "objective"), "sweep": section(config, "sweep"),
                   "trial": {"default_params": train.default_params, "seed": train.seed},
                   "placement": _placement(config, config.sweep.profile), "code": code})


def stage_resume_inputs(config: PipelineConfig, stage: str, data: str, params: dict[str, Any], upstream: str | None,
                        code: dict[str, Any]) -> str:
    """What a stage's checkpoints are made from, whatever number of processes runs it: the data, the params it trains
    with, the stage before's output (its fingerprint), the training settings every stage shares, this stage's own but
    its profile's name, the device and the rule its validation chooses a binary model's decision threshold by (the
    bundle keeps that threshold). A retry on more or fewer processes resumes under it (stagewise.training.handoff)."""
    shared = {key: value for key, value in section(config, "train").items() if key not in _NOT_TRAINING_KEYS}
    spec = config.stage(stage)
    own = {key: value for key, value in spec.model_dump(mode="json").items() if key not in _PLACEMENT_KEYS}
    return digest({"kind": "stage", "data": data, "params": params, "upstream": upstream, "train": shared,
                   "stage": own, "model": section(config, "model"), "objective": section(config, "objective"),
                   "device": config.profile(spec.profile).device,
                   "threshold": config.evaluate.threshold.model_dump(mode="json"), "code": code})


def stage_inputs(config: PipelineConfig, stage: str, data: str, params: dict[str, Any], upstream: str | None,
                 code: dict[str, Any]) -> str:
    """A training stage's result, as the step cache keys it: its :func:`stage_resume_inputs` and how many processes run
    it (another count trains on other shards of each batch: another result)."""
    spec = config.stage(stage)
    return digest({"kind": "stage", "resume": stage_resume_inputs(config, stage, data, params, upstream, code),
                   "placement": _placement(config, spec.profile)})


def evaluation_inputs(config: PipelineConfig, model: str, data: str, code: dict[str, Any]) -> str:
    """Evaluation: the trained model (its stage's fingerprint), the test split's data and the evaluation settings."""
    return digest({"kind": "evaluate", "model": model, "data": data, "evaluate": section(config, "evaluate"),
                   "objective": section(config, "objective"), "code": code})


def inference_inputs(config: PipelineConfig, model_version: str, shard_ids: list[str], code: dict[str, Any]) -> str:
    """Batch inference: the model's version (a hash of its bytes), the input's contents and the scoring settings."""
    return digest({"kind": "inference", "model": model_version, "shards": shard_ids,
                   "inference": section(config, "inference"), "dataset": section(config, "dataset"), "code": code})


def manifest_fingerprint(manifest: dict[str, Any]) -> str | None:
    """The fingerprint a committed manifest was made under (None: written before manifests recorded one)."""
    found = manifest.get("fingerprint")
    return found if isinstance(found, str) else None
