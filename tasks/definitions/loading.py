"""Loading a pipeline config file: read the YAML, apply dotted overrides (and CI mode: $STAGEWISE_SCRATCH_ROOT, or a
test run's own scratch root), resolve relative paths, validate once.

Every sub-job and the DAG load the same file through :func:`load_config`; an invalid file raises
:class:`ConfigError` naming the file, the key path and the reason (and the override that caused it).
"""

from __future__ import annotations

import os
import re
from pathlib import Path, PurePosixPath
from typing import Any

import yaml
from pydantic import ValidationError

from stagewise.core import storage
from stagewise.definitions.config import ConfigError, PipelineConfig, default_model_name
from stagewise.definitions.hyperparams import BUILTIN_SPEC
from stagewise.definitions.passwords import password_problem
from stagewise.definitions.roots import relative_root_problem
from stagewise.definitions.sharding import warn_unused_sharding_keys
from stagewise.definitions.spec_source import spec_problem


def _checkout_root() -> Path | None:
    """The source checkout this package runs from (``make venv``'s editable install), else None: an installed
    Stagewise has no pipeline of its own and reads only the configs it is given."""
    root = Path(__file__).resolve().parents[2]  # tasks/definitions/loading.py -> the checkout
    return root if (root / "pipeline.yaml").is_file() and (root / "tasks" / "definitions").is_dir() else None


CHECKOUT_ROOT = _checkout_root()

DEFAULT_CONFIG_PATH = CHECKOUT_ROOT / "pipeline.yaml" if CHECKOUT_ROOT else None
"""The checkout's pipeline.yaml (the pipeline ``ml``, what ``make demo`` runs); none when installed."""


CONFIG_ENV_VAR = "STAGEWISE_CONFIG"

SCRATCH_ENV_VAR = "STAGEWISE_SCRATCH_ROOT"
"""CI mode (docs/ci.md): every pipeline's storage under this local folder, no outside registry, a report-only gate."""

TEST_RUNS_WRITE_ENV_VAR = "STAGEWISE_TEST_RUNS_WRITE"
"""The pipelines (names, comma-separated) whose runs started by ``airflow dags test`` may write production storage;
every other pipeline's test run goes into scratch (docs/ci.md)."""

TEST_SCRATCH_FOLDER = "stagewise-scratch"
"""A test run's own scratch root under $AIRFLOW_HOME, when $STAGEWISE_SCRATCH_ROOT does not name one."""

PIPELINE_NAME = r"[A-Za-z][A-Za-z0-9_]{0,63}"
"""What a pipeline's name may be (PipelineConfig.name): it starts its DAG ids."""

# libyaml's safe loader where PyYAML has it (the same YAML, faster: DAG parsing reads every pipeline's file).
_BASE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class SAFE_LOADER(_BASE_LOADER):  # noqa: N801 - the name callers already use
    """The safe loader, refusing a key given twice in one mapping: YAML would keep the last silently, so a pasted
    block or an edit that forgot the first would change the config without a word."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *base': keys given here override the merged ones
                continue
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, list | dict):
                continue  # unhashable: the base constructor names it
            if key in first:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' is given twice in one mapping (first on line {first[key] + 1}); keep "
                                "one", key_node.start_mark)
            first[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


MAX_YAML_VALUES = 100_000
"""Values a config may hold once its YAML aliases are expanded: a pipeline config holds hundreds; an alias bomb
(each alias naming a list of the last) holds billions, built in microseconds as shared references and exhausting
memory only where the config is dumped (its snapshot, ``python -m stagewise.config``)."""

MAX_YAML_DEPTH = 64
"""Levels a config's values may nest (a recursive alias, ``&a [*a]``, nests without end)."""


def read_yaml(text: str, source: Path | str) -> Any:
    """The YAML document in ``text``; ConfigError naming ``source`` when it is not YAML, or when its aliases expand
    to more than MAX_YAML_VALUES values or MAX_YAML_DEPTH levels."""
    try:
        raw = yaml.load(text, Loader=SAFE_LOADER)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    # walk the document as a dump would, each shared reference once per place it is used, and stop at the bound
    pending, seen = [(raw, 1)], 0
    while pending:
        value, depth = pending.pop()
        seen += 1
        if seen > MAX_YAML_VALUES or depth > MAX_YAML_DEPTH:
            what = f"more than {MAX_YAML_VALUES} values" if seen > MAX_YAML_VALUES else f"more than {MAX_YAML_DEPTH} levels deep"
            raise ConfigError(f"{source}: the YAML expands to {what} (YAML aliases, '*name', that repeat an anchor "
                              f"'&name' many times over or inside itself?); a pipeline config holds far fewer: write "
                              f"the repeated values out or drop the aliases")
        if isinstance(value, dict):
            pending.extend((item, depth + 1) for item in value.values())
            seen += len(value)  # the keys
        elif isinstance(value, list):
            pending.extend((item, depth + 1) for item in value)
    return raw


def _format_validation_error(path: Path, error: ValidationError, overrides: dict[str, Any]) -> str:
    lines = [f"{path}: invalid pipeline config"]
    for item in error.errors():
        location = ".".join(str(part) for part in item["loc"])
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown key (typo?)"
        # Cross-field checks name their own keys in the message.
        line = f"  {location}: {message}" if location else f"  {message}"
        culprits = [key for key in overrides if _same_branch(item["loc"], key)]
        lines.append(line + (f" (from override {', '.join(culprits)})" if culprits else ""))
    return "\n".join(lines)


def _same_branch(location: tuple, dotted: str) -> bool:
    """Whether an error at ``location`` lies on an override key's path (one is a prefix of the other)."""
    # A search dimension's location carries its union tag (lr.float.low); override keys do not.
    parts = [str(part) for part in location if part not in ("float", "int", "categorical")]
    keys = dotted.split(".")
    common = min(len(parts), len(keys))
    return common > 0 and parts[:common] == keys[:common]


def config_path(path: str | os.PathLike | None = None) -> Path | str:
    """The config file: the argument, else $STAGEWISE_CONFIG, else the checkout's pipeline.yaml.

    A URI (``s3://``, ``file://``: a run's config snapshot) stays as it is; a local path is made absolute without
    following symlinks, so a pipelines folder that git-sync swaps to each new revision is named as configured.
    """
    chosen = path or os.environ.get(CONFIG_ENV_VAR) or DEFAULT_CONFIG_PATH
    if not chosen:
        raise ConfigError(f"no pipeline config: pass --config or set ${CONFIG_ENV_VAR} (an installed Stagewise has "
                          "no pipeline.yaml of its own)")
    return str(chosen) if "://" in str(chosen) else Path(_through_links(Path.cwd(), os.path.expanduser(str(chosen))))


def _through_links(folder: Path, path: str) -> str:
    """``path`` made absolute against ``folder`` by its text alone: a link stays in it (git-sync's revision link)."""
    return os.path.normpath(os.path.join(folder, path))


def read_text(resolved: Path | str) -> str:
    """A config file's text: a local path, or a URI (a run's snapshot) through storage."""
    return resolved.read_text() if isinstance(resolved, Path) else storage.read_bytes(resolved).decode()


def _apply_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> None:
    """Set each dotted key (``train.stages.1.epochs``); a path that cannot exist raises naming the key."""
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        if "" in parts:
            raise ValueError(f"override '{dotted}': a key path needs names between its dots")
        node: Any = raw
        for depth, part in enumerate(parts):
            where, last = ".".join(parts[:depth]) or "the top level", depth == len(parts) - 1
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ValueError(f"override '{dotted}': {where} is a list of {len(node)} item(s), "
                                     f"so '{part}' is not one of its indexes (0..{len(node) - 1})")
                if last:
                    node[int(part)] = value
                else:
                    node = node[int(part)]
            elif isinstance(node, dict):
                if last:
                    node[part] = value
                else:
                    node = node.setdefault(part, {})
            else:
                raise ValueError(f"override '{dotted}': {where} is {node!r}, not a mapping or list")


def _fill_model_name(raw: dict[str, Any]) -> None:
    """Derive the registry name from the file's dataset.uri, so a run scoring another input_uri keeps its model."""
    dataset, registry = raw.get("dataset"), raw.setdefault("registry", {})
    if isinstance(dataset, dict) and isinstance(dataset.get("uri"), str) and isinstance(registry, dict) \
            and not registry.get("model_name"):
        registry["model_name"] = default_model_name(dataset["uri"])


def scratch_root() -> str | None:
    """$STAGEWISE_SCRATCH_ROOT as an absolute local folder, or None when it is unset."""
    chosen = os.environ.get(SCRATCH_ENV_VAR, "").strip()
    if not chosen:
        return None
    if "://" in chosen and not chosen.startswith("file://"):
        raise ConfigError(f"${SCRATCH_ENV_VAR}={chosen}: give a local folder (the CI runner's scratch disk): each "
                          f"pipeline's runs, sweep journal and registry go under it")
    return os.path.abspath(os.path.expanduser(chosen.removeprefix("file://")))


def opted_in_test_runs() -> frozenset[str]:
    """The pipelines $STAGEWISE_TEST_RUNS_WRITE names; ConfigError on an entry that is no pipeline name (``*`` too:
    a deployment opts each pipeline in by its name, so no new pipeline's test runs reach production unasked)."""
    value = os.environ.get(TEST_RUNS_WRITE_ENV_VAR, "")
    names = [entry.strip() for entry in value.split(",") if entry.strip()]
    if wrong := [name for name in names if not re.fullmatch(PIPELINE_NAME, name)]:
        raise ConfigError(f"${TEST_RUNS_WRITE_ENV_VAR}={value!r}: {', '.join(map(repr, wrong))} is no pipeline name; "
                          f"name each pipeline whose `airflow dags test` runs may write its production storage, "
                          f"comma-separated (e.g. ml,diabetes), or leave it unset")
    return frozenset(names)


def scratch_for_test_run(name: str) -> str | None:
    """The scratch root of a run of pipeline ``name`` started by ``airflow dags test``: ``$AIRFLOW_HOME/stagewise-scratch``
    (``~/airflow`` without AIRFLOW_HOME); None when $STAGEWISE_SCRATCH_ROOT already puts every config in scratch, or
    when $STAGEWISE_TEST_RUNS_WRITE names the pipeline (its test runs write production)."""
    if scratch_root() or name in opted_in_test_runs():
        return None
    home = os.environ.get("AIRFLOW_HOME", "").strip() or "~/airflow"  # Airflow's own default, as last_valid reads it
    return os.path.join(os.path.abspath(os.path.expanduser(home)), TEST_SCRATCH_FOLDER)


def _read_input_in_place(raw: dict[str, Any], resolved: Path | str) -> None:
    """A relative dataset.uri or inference.input_uri becomes absolute under the config's own storage root, so a test
    run in scratch still reads the input production reads (the pipeline DAG never writes its input)."""
    root = raw.get("storage_root")
    if not isinstance(root, str) or not root:
        return  # validation names the missing root
    if "://" not in root and not os.path.isabs(root) and isinstance(resolved, Path):
        root = str((resolved.parent / root).resolve())
    for section, key in (("dataset", "uri"), ("inference", "input_uri")):
        block = raw.get(section)
        if isinstance(block, dict) and isinstance(block.get(key), str) and block[key]:
            block[key] = storage.resolve(root, block[key])


def _apply_scratch(raw: dict[str, Any], resolved: Path | str, scratch: str, keep_input: bool = False) -> None:
    """CI mode: storage_root becomes ``<scratch>/<pipeline name>``, read with the CI's own environment; the sweep
    journal follows it; MLflow tracking is off; the registry is the scratch root's, its gate report-only.
    ``keep_input`` (a test run's own scratch) reads the input where the config says rather than under the scratch root.

    Idempotent, so a run's snapshot (written in this mode, naming its pipeline) loads back unchanged.
    """
    if keep_input:
        _read_input_in_place(raw, resolved)
    named = raw.get("name")
    name = named if isinstance(named, str) and named else PurePosixPath(str(resolved)).stem
    if re.fullmatch(PIPELINE_NAME, name):
        raw["name"] = name  # the snapshot keeps it: a snapshot's file stem ('config') must not pick another folder
    raw["storage_root"] = os.path.join(scratch, storage.safe_name(name))
    raw["storage_conn_id"] = ""
    if isinstance(raw.get("sweep"), dict):
        raw["sweep"].update(storage="", storage_conn_id="")  # the default: a journal under the (scratch) storage root
    if isinstance(raw.get("tracking", {}), dict):
        raw["tracking"] = {**raw.get("tracking", {}), "mlflow_uri": "", "conn_id": ""}
    if isinstance(raw.get("registry"), dict):
        raw["registry"].update(backend="storage", report_only=True)


def _resolve_relative_paths(raw: dict[str, Any], path: Path) -> None:
    """A relative storage root, spec folder or script is relative to the config file, not to a worker's cwd; a
    relative storage root inside an installed package (a shipped example used where pip put it) is refused."""
    folder = path.parent
    for entrypoint in _entrypoints(raw):
        if isinstance(entrypoint.get("script"), str) and not os.path.isabs(entrypoint["script"]):
            entrypoint["script"] = _through_links(folder, entrypoint["script"])
    model = raw.get("model")
    if isinstance(model, dict) and isinstance(model.get("import_paths", []), list | None):
        model["import_paths"] = [_through_links(folder, path) for path in model.get("import_paths") or ["."]]
    root = raw.get("storage_root")
    if isinstance(root, str) and "://" not in root and not os.path.isabs(root):
        if problem := relative_root_problem(root, folder):
            raise ConfigError(f"{path}: {problem}")
        absolute = (folder / root).resolve()
        if {"site-packages", "dist-packages"} & set(absolute.parts):
            raise ConfigError(f"{path}: storage_root '{root}' is relative to the config's folder, which is inside an "
                              f"installed package: runs and models would land in {absolute}; set storage_root to a "
                              f"folder or s3:// URI of your own (or copy the config into your pipelines folder)")
        raw["storage_root"] = str(absolute)


def _entrypoints(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """The raw config's entrypoint mappings (the sweep's and each stage's), as written."""
    sweep, train = raw.get("sweep"), raw.get("train")
    found = [sweep.get("entrypoint")] if isinstance(sweep, dict) else []
    stages = train.get("stages") if isinstance(train, dict) else None
    if isinstance(stages, list):
        found += [stage.get("entrypoint") for stage in stages if isinstance(stage, dict)]
    return [entry for entry in found if isinstance(entry, dict)]


def load_config(path: str | os.PathLike | None = None, overrides: dict[str, Any] | None = None,
                test_scratch: str | None = None) -> PipelineConfig:
    """Read, override (dotted keys such as ``sweep.num_trials``) and validate the pipeline config; ``test_scratch``
    (:func:`scratch_for_test_run`) puts it in CI mode under that root, its input still read where the file says."""
    resolved = config_path(path)
    try:
        text = read_text(resolved)
    except OSError as exc:
        if isinstance(resolved, str) and not isinstance(exc, FileNotFoundError):
            raise  # a storage fault while reading a run's snapshot: retried, not the user's to fix
        raise ConfigError(f"{resolved}: cannot read pipeline config ({exc.strerror or exc})") from None
    raw = read_yaml(text, resolved)
    if not isinstance(raw, dict):
        raise ConfigError(f"{resolved}: the top level must be a mapping of keys, got {type(raw).__name__}")
    _fill_model_name(raw)
    try:
        _apply_overrides(raw, overrides or {})
    except ValueError as exc:
        raise ConfigError(f"{resolved}: cannot apply {exc}") from None
    if problem := password_problem(raw):  # before CI mode drops the keys: the file itself must not hold one
        raise ConfigError(f"{resolved}: invalid pipeline config\n  {problem}")
    if scratch := scratch_root():  # after the overrides: no trigger value moves storage out of the scratch root
        _apply_scratch(raw, resolved, scratch)
    elif test_scratch:
        _apply_scratch(raw, resolved, test_scratch, keep_input=True)
    if isinstance(resolved, Path):  # a snapshot (a URI) holds absolute paths only
        _resolve_relative_paths(raw, resolved)
    try:
        config = PipelineConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(resolved, exc, overrides or {})) from None
    warn_unused_sharding_keys(config.train, resolved)
    _make_spec_importable(resolved, config)
    return config


def _make_spec_importable(resolved: Path | str, config: PipelineConfig) -> None:
    """Put model.import_paths on this process's path (every process that loads the config can import the spec: the
    Airflow task, each sub-job, a user's script) and refuse a spec module found neither there nor installed."""
    import importlib.util
    import sys

    paths = [path for path in config.model.import_paths or [] if path not in sys.path]
    sys.path.extend(paths)
    module = config.model.spec.partition(":")[0]
    try:
        found = importlib.util.find_spec(module.split(".")[0]) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(f"{resolved}: model.spec '{config.model.spec}': no module '{module}' in model.import_paths "
                          f"{config.model.import_paths} nor installed; put it beside the config or name its folder there")
    check_spec_source(resolved, config)


def check_spec_source(resolved: Path | str, config: PipelineConfig, may_import: bool = False) -> None:
    """Refuse a model.spec whose source shows it is no ModelSpec subclass (``os:system``, a function, a plain class),
    read without running it; ``may_import`` lets the lookup import the spec's parent packages (the CLI's check)."""
    if config.model.spec == BUILTIN_SPEC:
        return
    problem = spec_problem(config.model.spec, config.model.import_paths or (), may_import=may_import)
    if problem:
        raise ConfigError(f"{resolved}: model.spec '{config.model.spec}': {problem}")


def snapshot(config: PipelineConfig) -> tuple[str, str]:
    """The resolved config as YAML (every default and override written out, paths absolute) and its hash.

    A run writes this once, at its start, and every later task and sub-job reads only it: editing the file
    mid-run changes later runs, never a running one. The hash names the config in reports and model cards.
    """
    import hashlib
    import json

    values = config.model_dump(mode="json")
    digest = hashlib.sha256(json.dumps(values, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]
    return yaml.safe_dump(values, sort_keys=False), digest
