"""Many pipelines in one deployment: which config files are pipelines, what each is called, and its DAG ids.

One rule names everything: a pipeline's name is its config's ``name`` key, else the file name without ``.yaml``;
its DAGs are ``<name>_pipeline``, ``<name>_retrain``, ``<name>_batch_inference`` and ``<name>_ingest``. Run
prefixes (``runs/<dag id>/``) and study names (from the DAG id) follow from the DAG ids, so two pipelines never
share them; their registry names are checked apart by :func:`collisions`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import yaml

from stagewise.definitions.config import ConfigError, PipelineConfig
from stagewise.definitions.loading import CHECKOUT_ROOT, CONFIG_ENV_VAR, DEFAULT_CONFIG_PATH, SAFE_LOADER, read_text

PIPELINES_ENV_VAR = "STAGEWISE_PIPELINES"
"""Folders of pipeline configs (every ``*.yaml`` in each) or single config files, separated like PATH."""

DEFAULT_PIPELINES = (DEFAULT_CONFIG_PATH, CHECKOUT_ROOT / "examples") if CHECKOUT_ROOT else ()
"""Without the setting, in a checkout: its own pipeline.yaml and the shipped examples, side by side. An installed
Stagewise has none: the DAG file or $STAGEWISE_PIPELINES names the team's pipelines."""

KINDS = ("pipeline", "retrain", "batch_inference", "ingest")
"""The family of DAGs every pipeline gets, in the order they are built."""

NAME_PATTERN = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")


@dataclass(frozen=True)
class PipelineFile:
    """One pipeline of the deployment: its config file and the name its DAG ids come from."""

    name: str
    path: Path

    def dag_id(self, kind: str) -> str:
        return dag_id(self.name, kind)

    def dag_ids(self) -> dict[str, str]:
        return {kind: self.dag_id(kind) for kind in KINDS}


def dag_id(name: str, kind: str) -> str:
    """The DAG id of pipeline ``name``'s ``kind`` DAG (one of :data:`KINDS`)."""
    if kind not in KINDS:
        raise ValueError(f"unknown DAG kind '{kind}': one of {', '.join(KINDS)}")
    return f"{name}_{kind}"


def sources(setting: str | None = None) -> list[Path]:
    """The folders and files that hold the pipelines: ``setting``, else $STAGEWISE_PIPELINES, else the one file in
    $STAGEWISE_CONFIG, else :data:`DEFAULT_PIPELINES`."""
    chosen = setting if setting is not None else os.environ.get(PIPELINES_ENV_VAR, "")
    if chosen.strip():
        return [Path(part).expanduser().resolve() for part in chosen.split(os.pathsep) if part.strip()]
    if single := os.environ.get(CONFIG_ENV_VAR, "").strip():
        return [Path(single).expanduser().resolve()]
    if not DEFAULT_PIPELINES:
        raise ConfigError(f"no pipelines named: give the DAG file's build_pipelines(globals(), \"/path/to/pipelines\") "
                          f"a folder of configs, or set ${PIPELINES_ENV_VAR}")
    return [path.resolve() for path in DEFAULT_PIPELINES]


def name_of(path: Path | str) -> str:
    """The pipeline name of the config at ``path`` (a file or a URI): its ``name`` key, else the file name without
    its suffix. Only the YAML is read (no validation), so a broken config still has a name for its DAGs."""
    try:
        raw = yaml.load(read_text(path), Loader=SAFE_LOADER)
    except (OSError, yaml.YAMLError):
        raw = None
    named = raw.get("name") if isinstance(raw, dict) else None
    return named if isinstance(named, str) and named else PurePosixPath(str(path)).stem


def discover(setting: str | None = None) -> list[PipelineFile]:
    """Every pipeline of the deployment, in a stable order; a missing source, a name that cannot be a DAG id, or
    two configs with one name raise :class:`ConfigError` naming the files."""
    found: list[PipelineFile] = []
    for source in sources(setting):
        if source.is_dir():
            files = sorted(path for pattern in ("*.yaml", "*.yml") for path in source.glob(pattern))
        elif source.is_file():
            files = [source]
        else:
            raise ConfigError(f"{source}: no such pipelines folder or config file (${PIPELINES_ENV_VAR})")
        for path in files:
            name = name_of(path)
            if not NAME_PATTERN.fullmatch(name):
                raise ConfigError(f"{path}: pipeline name '{name}' cannot name DAGs: a letter, then letters, digits "
                                  "or _ (64 at most); set the config's name key")
            found.append(PipelineFile(name, path))
    by_name: dict[str, list[Path]] = {}
    for pipeline in found:
        by_name.setdefault(pipeline.name, []).append(pipeline.path)
    if clashes := {name: paths for name, paths in by_name.items() if len(paths) > 1}:
        raise ConfigError("; ".join(f"pipeline name '{name}' is taken by {' and '.join(map(str, paths))}: "
                                    "set a distinct name key" for name, paths in clashes.items()))
    return found


def collisions(loaded: dict[PipelineFile, PipelineConfig]) -> dict[PipelineFile, str]:
    """Pipelines that would share a model registry (one storage root and ``registry.model_name``): each one's
    error, naming the other files; such pipelines would gate their models against each other."""
    owners: dict[tuple[str, str], list[PipelineFile]] = {}
    for pipeline, config in loaded.items():
        owners.setdefault((config.storage_root.rstrip("/"), config.registry.model_name), []).append(pipeline)
    errors = {}
    for (root, model_name), sharing in owners.items():
        if len(sharing) > 1:
            for pipeline in sharing:
                others = " and ".join(str(other.path) for other in sharing if other is not pipeline)
                errors[pipeline] = (f"{pipeline.path}: registry.model_name '{model_name}' under {root} is also "
                                    f"{others}'s: each pipeline registers under its own name")
    return errors
