"""Who holds a model name of a storage registry: ``models/<name>/owner.json``, the pipeline that registered there first.

Read: ``stagewise.definitions.pipelines.resolve`` asks it (through ``read``) when two pipelines of one deployment claim
the same storage root and ``registry.model_name``, so the CLI check and the deployment keep the same one. Written: by
the first registration under the name (``stagewise.registry.register_for``); a pipeline renamed in place (its config
file's name unchanged, its ``name:`` changed) takes the record over at its first registration under the new name, and
the old names stay listed in it. No torch here: the DAG file's parse reads it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from stagewise.core import storage

log = logging.getLogger(__name__)
OWNER_FILE = "owner.json"
CLAIM_ATTEMPTS = 5  # each lost attempt means another registration wrote the record in between


@dataclass(frozen=True)
class Owner:
    """The pipeline a model name belongs to, its config file's name (a rename in place keeps it) and its old names."""

    pipeline: str
    file: str = ""
    former: tuple[str, ...] = ()


def owner_uri(storage_root: str, model_name: str) -> str:
    """``models/<name>/owner.json`` (the registry's layout: stagewise.registry.models_prefix)."""
    models = storage.child(storage.join(storage_root, "models"), model_name, "model name (registry.model_name)")
    return storage.join(models, OWNER_FILE)


def _owner(raw: Any) -> Owner | None:
    if not isinstance(raw, dict) or not isinstance(raw.get("pipeline"), str):
        return None
    return Owner(raw["pipeline"], str(raw.get("file") or ""), tuple(str(name) for name in raw.get("former") or ()))


def read(storage_root: str, model_name: str) -> Owner | None:
    """The owner record of ``model_name`` under ``storage_root``; None when there is none or it cannot be read."""
    try:
        raw, _ = storage.read_versioned(owner_uri(storage_root, model_name))
    except Exception as exc:  # a registry out of reach costs the caller its record, never a parse
        log.debug("cannot read the owner of model %s under %s: %s", model_name, storage_root, exc)
        return None
    return _owner(raw)


def file_name(config_source: str | None) -> str:
    """The name of a pipeline's config file (a path or URI): what a rename in place keeps, wherever it is checked out."""
    return PurePosixPath(str(config_source or "")).name


def claim(storage_root: str, model_name: str, pipeline: str, config_source: str | None, source_run: str) -> Owner:
    """Record ``pipeline`` as the owner of ``model_name`` unless another pipeline holds it; returns the owner now.

    Another pipeline's record with this config file's name is this pipeline before a rename: it moves here, the old
    name kept in ``former``. Any other holder keeps it: the name stays with the pipeline that registered first.
    """
    uri, file = owner_uri(storage_root, model_name), file_name(config_source)
    for _ in range(CLAIM_ATTEMPTS):
        raw, token = storage.read_versioned(uri)
        held = _owner(raw)
        if held is not None and (held.pipeline == pipeline or not file or held.file != file):
            return held
        former = (*held.former, held.pipeline) if held is not None else ()
        record = {"pipeline": pipeline, "file": file, "former": list(former), "source_run": source_run,
                  "claimed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        if storage.write_if_unchanged(uri, record, token):
            if held is not None:
                log.info("model %s: owner %s -> %s (renamed in place: %s)", model_name, held.pipeline, pipeline, file)
            return Owner(pipeline, file, former)
    return read(storage_root, model_name) or Owner(pipeline, file)
