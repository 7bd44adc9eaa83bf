"""Many pipelines in one deployment: which config files are pipelines, what each is called, and its DAG ids.

One rule names everything: a pipeline's name is its config's ``name`` key, else the file name without ``.yaml``;
its DAGs are ``<name>_pipeline``, ``<name>_retrain``, ``<name>_batch_inference``, ``<name>_ingest`` and
``<name>_maintenance``. Run prefixes (``runs/<dag id>/``) and study names (from the DAG id) follow from the DAG ids,
so two pipelines never share them; their registry names are checked apart by :func:`resolve`, which also keeps a broken pipeline at its
last valid version.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Protocol

from pydantic import ValidationError

from stagewise.definitions.config import ConfigError, PipelineConfig
from stagewise.definitions.last_valid import LastValid, Record
from stagewise.definitions.loading import (
    CHECKOUT_ROOT,
    CONFIG_ENV_VAR,
    DEFAULT_CONFIG_PATH,
    load_config,
    read_text,
    read_yaml,
    scratch_root,
)

PIPELINES_ENV_VAR = "STAGEWISE_PIPELINES"
"""Folders of pipeline configs (every ``*.yaml`` in each) or single config files, separated like PATH."""

DEFAULT_PIPELINES = (DEFAULT_CONFIG_PATH, CHECKOUT_ROOT / "examples") if CHECKOUT_ROOT else ()
"""Without the setting, in a checkout: its own pipeline.yaml and the shipped examples, side by side. An installed
Stagewise has none: the DAG file or $STAGEWISE_PIPELINES names the team's pipelines."""

KINDS = ("pipeline", "retrain", "batch_inference", "ingest", "maintenance")
"""The family of DAGs every pipeline gets, in the order they are built (maintenance: its retention policy)."""

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


def pipeline_of(dag_id: str) -> str | None:
    """The pipeline name of one of its DAG ids (``fraud_retrain``: ``fraud``); None for a DAG id of no kind."""
    for kind in KINDS:
        if dag_id.endswith(f"_{kind}") and NAME_PATTERN.fullmatch(name := dag_id[:-len(kind) - 1]):
            return name
    return None


def sources(setting: str | None = None) -> list[Path]:
    """The folders and files that hold the pipelines: ``setting``, else $STAGEWISE_PIPELINES, else the one file in
    $STAGEWISE_CONFIG, else :data:`DEFAULT_PIPELINES`."""
    chosen = setting if setting is not None else os.environ.get(PIPELINES_ENV_VAR, "")
    if chosen.strip():
        return [_as_configured(part) for part in chosen.split(os.pathsep) if part.strip()]
    if single := os.environ.get(CONFIG_ENV_VAR, "").strip():
        return [_as_configured(single)]
    if not DEFAULT_PIPELINES:
        raise ConfigError(f"no pipelines named: give the DAG file's build_pipelines(globals(), \"/path/to/pipelines\") "
                          f"a folder of configs, or set ${PIPELINES_ENV_VAR}")
    return [_as_configured(path) for path in DEFAULT_PIPELINES]


def _as_configured(part: str | Path) -> Path:
    """A source made absolute without following symlinks: git-sync swaps a link to each revision's folder, and a path
    resolved through it would change every revision (the pipelines' paths, DAG docs and last valid versions with it)."""
    return Path(os.path.abspath(Path(part).expanduser()))


def last_valid(setting: str | None = None) -> LastValid | None:
    """Where the last valid versions of ``setting``'s pipelines are kept, by the sources as configured (never resolved);
    none in CI mode ($STAGEWISE_SCRATCH_ROOT): a scratch config must never stand in for production's, nor the reverse."""
    return None if scratch_root() else LastValid(sources(setting))


def name_of(path: Path | str) -> str:
    """The pipeline name of the config at ``path`` (a file or a URI): its ``name`` key, else the file name without
    its suffix. Only the YAML is read (no validation), so a broken config still has a name for its DAGs."""
    try:
        raw = read_yaml(read_text(path), path)  # bounded: a file's name must not cost the DAG file its memory
    except (OSError, ConfigError):
        raw = None
    named = raw.get("name") if isinstance(raw, dict) else None
    return named if isinstance(named, str) and named else PurePosixPath(str(path)).stem


def discover(setting: str | None = None) -> list[PipelineFile]:
    """Every pipeline of the deployment, in a stable order; a missing source, a name that cannot be a DAG id, or
    two configs with one name raise :class:`ConfigError` naming the files."""
    errors: dict[str, str] = {}
    found = _scan(setting, errors)
    if errors:
        raise ConfigError("; ".join(errors.values()))
    by_name: dict[str, list[Path]] = {}
    for pipeline in found:
        by_name.setdefault(pipeline.name, []).append(pipeline.path)
    if clashes := {name: paths for name, paths in by_name.items() if len(paths) > 1}:
        raise ConfigError("; ".join(f"pipeline name '{name}' is taken by {' and '.join(map(str, paths))}: "
                                    "set a distinct name key" for name, paths in clashes.items()))
    return found


# -- a deployment's parse: every pipeline, each one's error, and the last valid version in place of a broken one -----

@dataclass
class Resolved:
    """What a parse of the pipelines builds: the config of each pipeline that has DAGs, and each error."""

    configs: dict[PipelineFile, PipelineConfig] = field(default_factory=dict)
    """Each pipeline's config to build its DAGs from: its file's, else its last valid one."""
    errors: dict[str, str] = field(default_factory=dict)
    """Each broken, clashing or deleted pipeline's error, by its config file, naming the file and the key."""
    refused: dict[PipelineFile, str] = field(default_factory=dict)
    """Pipelines that keep DAGs but whose new runs must fail with this error (their file is not what they run)."""
    broken: dict[PipelineFile, str] = field(default_factory=dict)
    """Pipelines with no valid version at all: DAGs whose only task fails with this error."""
    retired: dict[PipelineFile, str] = field(default_factory=dict)
    """Pipelines whose file is gone or renamed: DAGs kept for their running runs, on no schedule, with this note."""


class RegistryOwner(Protocol):
    """A registry's record of who holds a model name (stagewise.models.owners.Owner)."""

    pipeline: str
    file: str


OwnerOf = Callable[[str, str], "RegistryOwner | None"]
"""(storage root, model name) -> the registry's owner record, or None when it has none (or cannot be read)."""


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return float("inf")


def _incumbent(sharing: list[PipelineFile], owns) -> PipelineFile:
    """Of pipelines that clash, the one that was there first: the one whose last valid version already held what
    they share (``owns``), else the oldest file; the others introduced the clash."""
    holders = [pipeline for pipeline in sharing if owns(pipeline)]
    return min(holders or sharing, key=lambda pipeline: (_mtime(pipeline.path), str(pipeline.path)))


def _registry_holder(sharing: list[PipelineFile], owner: RegistryOwner | None,
                     renamed: dict[PipelineFile, PipelineFile]) -> PipelineFile | None:
    """Of pipelines sharing a model name, the one the registry's owner record names: by its name, else the one it
    was renamed to (its file kept, its name changed), else the one in the recorded config file's name; None if none."""
    if owner is None:
        return None
    for pipeline in sharing:
        if pipeline.name == owner.pipeline:
            return pipeline
    for old, new in renamed.items():
        if old.name == owner.pipeline and new in sharing:
            return new
    in_file = [pipeline for pipeline in sharing if owner.file and pipeline.path.name == owner.file]
    return in_file[0] if len(in_file) == 1 else None


def _scan(setting: str | None, errors: dict[str, str]) -> list[PipelineFile]:
    """Every config file of the setting with its name; a missing source or an unusable name is that source's or
    file's error (in ``errors``), never the others'."""
    found: list[PipelineFile] = []
    for source in sources(setting):
        if source.is_dir():
            files = sorted(path for pattern in ("*.yaml", "*.yml") for path in source.glob(pattern))
        elif source.is_file():
            files = [source]
        else:
            errors[str(source)] = f"{source}: no such pipelines folder or config file (${PIPELINES_ENV_VAR})"
            continue
        for path in files:
            name = name_of(path)
            if NAME_PATTERN.fullmatch(name):
                found.append(PipelineFile(name, path))
            else:
                errors[str(path)] = (f"{path}: name: pipeline name '{name}' cannot name DAGs: a letter, then letters, "
                                     "digits or _ (64 at most); set the config's name key")
    return found


def resolve(setting: str | None = None, *, wanted: str | None = None, check_clashes: bool = True,
            state: LastValid | None = None, remember: bool = False, owner_of: OwnerOf | None = None) -> Resolved:
    """Every pipeline of ``setting`` as a parse builds it (``wanted``: only the pipeline owning that DAG id).

    A file that does not load, clashes with an older pipeline (a name or a registry), or is gone keeps its DAGs at
    its last valid version from ``state`` (so its running runs finish) and gets an error naming the file and key;
    a clash refuses the file that introduced it, never both. Who keeps a contested registry name: the pipeline the
    registry's owner record names (``owner_of``: the one that registered there first), else the one whose last valid
    version held it, else the older file. A pipeline renamed in place (its file now names another pipeline) is no
    clash: the new name keeps the registry and the old name's DAGs retire. ``check_clashes`` off (a task's own parse
    past its first task) skips loading the other pipelines. ``remember``: record each pipeline that loads as its
    last valid version.
    """
    resolved = Resolved()
    records = state.all() if state else {}
    found = _scan(setting, resolved.errors)

    by_name: dict[str, list[PipelineFile]] = {}
    for pipeline in found:
        by_name.setdefault(pipeline.name, []).append(pipeline)
    pipelines: list[PipelineFile] = []
    for name, sharing in by_name.items():
        first = _incumbent(sharing, lambda p, name=name: name in records and records[name].path == str(p.path))
        pipelines.append(first)
        for other in sharing:
            if other is not first:
                resolved.errors[str(other.path)] = (f"{other.path}: name: pipeline name '{name}' is taken by "
                                                    f"{first.path}: set a distinct name key")
    # A recorded pipeline whose name is gone: renamed when its file now holds another pipeline (paths are as
    # configured, so a git-sync revision keeps them), else deleted.
    by_path = {str(pipeline.path): pipeline for pipeline in pipelines}
    gone: list[PipelineFile] = []
    renamed: dict[PipelineFile, PipelineFile] = {}
    for name, record in records.items():
        if name not in by_name:
            old = PipelineFile(name, Path(record.path))
            if record.path in by_path:
                renamed[old] = by_path[record.path]
            else:
                gone.append(old)

    def mine(pipeline: PipelineFile) -> bool:
        return wanted is None or wanted in pipeline.dag_ids().values()

    loaded: dict[PipelineFile, PipelineConfig] = {}
    failed: dict[PipelineFile, str] = {}
    # A run's first task judges clashes as the full parse does: it loads every pipeline, yet builds only its own.
    for pipeline in pipelines if check_clashes else filter(mine, pipelines):
        try:
            loaded[pipeline] = load_config(pipeline.path)
        except ConfigError as exc:
            failed[pipeline] = str(exc)
    for pipeline in gone:
        failed[pipeline] = (f"{pipeline.path}: the config file of pipeline '{pipeline.name}' is gone; its DAGs are "
                            f"retired (no schedule; running runs finish) until `python -m stagewise.config --forget "
                            f"{pipeline.name}`")
    if check_clashes:
        _refuse_registry_clashes(loaded, failed, records, owner_of, renamed)

    for pipeline, config in loaded.items():
        if mine(pipeline):
            resolved.configs[pipeline] = config
            if remember and state is not None:
                state.save(pipeline.name, pipeline.path, config.model_dump(mode="json"))
    for pipeline, error in failed.items():
        if mine(pipeline):
            _fall_back(resolved, pipeline, error, records, retired=pipeline in gone)
    for old, new in renamed.items():
        if mine(old):
            _keep_renamed(resolved, old, new, records)
    return resolved


def _refuse_registry_clashes(loaded: dict[PipelineFile, PipelineConfig], failed: dict[PipelineFile, str],
                             records: dict[str, Record], owner_of: OwnerOf | None,
                             renamed: dict[PipelineFile, PipelineFile]) -> None:
    """Move every loaded pipeline that shares a storage root and registry name with its holder into ``failed``."""
    def key_of(pipeline: PipelineFile) -> tuple[str, str] | None:
        if pipeline in loaded:
            return loaded[pipeline].storage_root.rstrip("/"), loaded[pipeline].registry.model_name
        return records[pipeline.name].registry_key if pipeline.name in records else None

    sharers: dict[tuple[str, str], list[PipelineFile]] = {}
    for pipeline in [*loaded, *failed]:
        if (key := key_of(pipeline)) is not None:
            sharers.setdefault(key, []).append(pipeline)
    for (root, model_name), sharing in sharers.items():
        if len(sharing) < 2:
            continue
        first = _registry_holder(sharing, owner_of(root, model_name) if owner_of else None, renamed)
        why = " (it registered there first: models/<name>/owner.json)" if first is not None else ""
        first = first or _incumbent(sharing, lambda p, key=(root, model_name): p.name in records
                                    and records[p.name].registry_key == key)
        for other in sharing:
            if other is not first and other in loaded:
                del loaded[other]
                failed[other] = (f"{other.path}: registry.model_name '{model_name}' under {root} is already "
                                 f"{first.path}'s{why}: each pipeline registers under its own name")


def _recorded(records: dict[str, Record], name: str) -> PipelineConfig | None:
    record = records.get(name)
    if record is None:
        return None
    try:
        return PipelineConfig.model_validate(record.config)
    except ValidationError:
        return None  # recorded by another Stagewise version whose schema differs


def _fall_back(resolved: Resolved, pipeline: PipelineFile, error: str, records: dict[str, Record], *,
               retired: bool) -> None:
    """A broken, clashing or deleted pipeline: its last valid DAGs refusing new runs, else failing DAGs."""
    resolved.errors[str(pipeline.path)] = error
    fallback = _recorded(records, pipeline.name)
    if fallback is None:
        resolved.broken[pipeline] = error
        return
    if not retired:
        resolved.errors[str(pipeline.path)] = (f"{error}\n  (its DAGs keep their last valid version, so running "
                                               "runs finish; a new run fails with this error)")
    resolved.configs[pipeline] = fallback
    resolved.refused[pipeline] = error
    if retired:
        resolved.retired[pipeline] = f"retired: its config file {pipeline.path} is deleted"


def _keep_renamed(resolved: Resolved, old: PipelineFile, new: PipelineFile, records: dict[str, Record]) -> None:
    """A pipeline renamed in place: its old name's DAGs stay for their running runs, retired; no error (the rename
    is valid), and a new run of an old DAG fails naming the new one."""
    fallback = _recorded(records, old.name)
    if fallback is None:
        return
    resolved.configs[old] = fallback
    resolved.refused[old] = (f"{old.path}: pipeline '{old.name}' is now '{new.name}': run {new.name}'s DAGs "
                             f"(`python -m stagewise.config --forget {old.name}` drops these once no run is running)")
    resolved.retired[old] = f"retired: renamed to '{new.name}' in {new.path}"
