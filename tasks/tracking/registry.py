"""Stagewise's registry on an MLflow server (``registry.backend: mlflow``): the Model Registry the team already reads.

Registered model ``registry.model_name``; each version's artifact is the bundle as a pyfunc model
(stagewise.models.mlflow_pyfunc: MLmodel + weights-only ``model.pt`` + card.json + the spec's source under ``code/``,
stagewise.models.shipping; requirements.txt holds ranges, not this machine's pins), linked to the DAG run's parent
MLflow run. The gate tags the candidate with its decision and metrics, points alias ``challenger`` at it, and moves
``champion`` only when it passes; serving and retraining read ``models:/<name>@champion``. A registered-model tag
keeps the former champions, so a rollback moves ``champion`` back. Unlike tracking, this is not best-effort: a
server that is down fails the task as a transient fault (Airflow retries it); a refused request is named.
MLflow has no compare-and-swap on aliases: two gates of one model name at the same moment are last-writer-wins,
so give a model name one training DAG (pipelines.md). A model name holds one pipeline's versions only: its first
registration tags the model with the pipeline (``stagewise.pipeline``), and a name another pipeline or team holds
(that tag, or versions Stagewise did not make) is refused at the run's first task and at each registration.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import time
import uuid
from collections.abc import Mapping
from typing import Any

from stagewise.core import storage
from stagewise.core.errors import UserError
from stagewise.definitions.config import PipelineConfig
from stagewise.definitions.pipelines import pipeline_of
from stagewise.models import shipping
from stagewise.models.versions import judge
from stagewise.tracking.api import MlflowApi, TrackingError, TrackingUnavailable, model_version_url
from stagewise.tracking.runs import ensure_parent, parent_state

log = logging.getLogger("stagewise.registry")

CHAMPION, CHALLENGER = "champion", "challenger"
VERSION_TAG = "stagewise.version"  # the bundle's hash id (m-...), the same id the storage registry uses
HISTORY_TAG = "stagewise.champion_history"  # registered-model tag: former champions' version numbers, oldest first
OWNER_TAG = "stagewise.pipeline"  # registered-model tag: the pipeline that holds the name (the storage registry's owner.json)
FOREIGN_SHOWN = 3  # versions a refusal names, of those not made by the pipeline
MODEL_FOLDER = "model"
DATA_FILE = "model.pt"  # the bundle, as the MLmodel's pyfunc ``data``
LOADER_MODULE = "stagewise.models.mlflow_pyfunc"  # what mlflow.pyfunc.load_model imports to load the bundle
_CARD_TAGS = ("objective", "direction", "study", "source_run", "data_fingerprint", "code_version", "config_hash",
              "stagewise_version", "source_fingerprint")  # source_fingerprints (a path each) outgrow a tag: one hash of them


def _api(config: PipelineConfig) -> MlflowApi:
    return MlflowApi(config.tracking.mlflow_uri, config.tracking.timeout_s)


def _call(config: PipelineConfig, what: str, work: Any) -> Any:
    """``work()`` against the server: a refusal is the user's to fix (named), an outage a transient fault to retry."""
    try:
        return work()
    except TrackingUnavailable as exc:
        raise RuntimeError(f"MLflow registry at {config.tracking.mlflow_uri}: {what}: {exc}") from None
    except TrackingError as exc:
        if exc.status in (401, 403):
            raise UserError(f"MLflow registry at {config.tracking.mlflow_uri} refused to {what} ({exc}): check the "
                            f"credentials of tracking.conn_id '{config.tracking.conn_id}' or MLFLOW_TRACKING_*") from None
        raise RuntimeError(f"MLflow registry at {config.tracking.mlflow_uri}: {what}: {exc}") from None


def mlmodel_files(run_id: str, requirements: list[str], created: str,
                  code: Mapping[str, bytes] | None = None) -> dict[str, bytes]:
    """The MLmodel, python_env.yaml and requirements.txt beside ``model.pt`` in a registered version's artifact, and
    the spec's source ``code`` under ``code/``, the pyfunc flavor's ``code`` (MLflow puts it on sys.path first)."""
    import yaml

    python = platform.python_version()
    flavor = {"loader_module": LOADER_MODULE, "data": DATA_FILE, **({"code": shipping.CODE_FOLDER} if code else {}),
              "env": {"virtualenv": "python_env.yaml"}, "python_version": python}
    mlmodel = {"artifact_path": "model", "run_id": run_id, "model_uuid": uuid.uuid4().hex, "utc_time_created": created,
               "flavors": {"python_function": flavor}}
    env = {"python": python, "build_dependencies": ["pip"], "dependencies": ["-r requirements.txt"]}
    return {"MLmodel": yaml.safe_dump(mlmodel, sort_keys=False).encode(),
            "python_env.yaml": yaml.safe_dump(env, sort_keys=False).encode(),
            "requirements.txt": ("\n".join(requirements) + "\n").encode(),
            **{f"{shipping.CODE_FOLDER}/{path}": source for path, source in (code or {}).items()}}


def _tags(version: dict[str, Any]) -> dict[str, str]:
    return {tag["key"]: tag["value"] for tag in version.get("tags") or []}


def card_of(version: dict[str, Any]) -> dict[str, Any]:
    """A model version as the gate and the listings read it: its Stagewise id, metrics and lineage tags."""
    tags = _tags(version)
    card: dict[str, Any] = {"version": tags.get(VERSION_TAG, f"v{version['version']}"), "mlflow_version": version["version"],
                            "run_id": version.get("run_id"), "source": version.get("source"),
                            "registered_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                           time.gmtime(int(version.get("creation_timestamp", 0)) / 1000)),
                            "aliases": version.get("aliases") or []}
    for key, value in tags.items():
        if key.startswith(("test_", "val_")):
            try:
                card[key] = float(value)
            except ValueError:  # a tag someone set by hand in MLflow's UI: not a metric
                continue
        elif key.startswith("stagewise.") and key[len("stagewise."):] in _CARD_TAGS:
            card[key[len("stagewise."):]] = value
    return card


def _made_by(version: dict[str, Any]) -> str | None:
    """The pipeline whose run registered ``version``, from its source_run tag (None: the tag names no DAG of one)."""
    source_run = _tags(version).get("stagewise.source_run", "")
    return pipeline_of(source_run.split("/", 1)[0]) if source_run else None


def _describe(version: dict[str, Any]) -> str:
    """A version as MLflow records who made it: Stagewise's source run or not Stagewise, its run, source, user, tags."""
    tags = _tags(version)
    made = f"by Stagewise pipeline '{_made_by(version)}' ({tags.get('stagewise.source_run')})" \
        if VERSION_TAG in tags and _made_by(version) else "not made by Stagewise"
    parts = [f"version {version['version']} {made}", f"run {version.get('run_id') or '(none)'}",
             f"source {version.get('source')}", *([f"user {version['user_id']}"] if version.get("user_id") else [])]
    if theirs := {key: value for key, value in tags.items() if not key.startswith("stagewise.")}:
        parts.append(f"tags {theirs}")
    return ", ".join(parts)


def _ownership(api: MlflowApi, name: str, pipeline: str) -> tuple[str | None, bool]:
    """Why registered model ``name`` is not ``pipeline``'s to add versions to (None: it is, or it does not exist yet),
    and whether its owner tag already names ``pipeline``. Without the tag (a model from before it, or not Stagewise's)
    its versions decide: each must carry Stagewise's version tag and come from no other pipeline's run."""
    model = api.registered_model(name)
    if model is None:
        return None, False
    tags = {tag["key"]: tag["value"] for tag in model.get("tags") or []}
    if holder := tags.get(OWNER_TAG):
        return (None, True) if holder == pipeline else (f"its tag {OWNER_TAG} names pipeline '{holder}'", False)
    foreign = [version for version in api.model_versions(name)
               if VERSION_TAG not in _tags(version) or _made_by(version) not in (None, pipeline)]
    if not foreign:
        return None, False
    more = f"; and {len(foreign) - FOREIGN_SHOWN} more" if len(foreign) > FOREIGN_SHOWN else ""
    theirs = {key: value for key, value in tags.items() if not key.startswith("stagewise.")}
    return (f"{len(foreign)} of its versions are not this pipeline's: "
            + "; ".join(_describe(version) for version in foreign[:FOREIGN_SHOWN]) + more
            + (f"; the model's tags {theirs}" if theirs else "")), False


def _refusal(config: PipelineConfig, pipeline: str, why: str) -> UserError:
    name = config.registry.model_name
    return UserError(f"registry.model_name '{name}': the MLflow registry at {config.tracking.mlflow_uri} holds a model "
                     f"of that name that is not pipeline '{pipeline}''s ({why}); Stagewise adds no version to it (its "
                     f"gate would judge against versions it did not make). Set registry.model_name to a name of this "
                     f"pipeline's own, e.g. '{pipeline}_{name}'; if this pipeline was renamed from the one the tag "
                     f"names, set the model's tag {OWNER_TAG} to '{pipeline}' in MLflow")


def check_owner(config: PipelineConfig, pipeline: str) -> None:
    """Refuse ``registry.model_name`` where MLflow holds it for another pipeline or team: a UserError naming what MLflow
    records of its owner and the setting to change. A server out of reach is a transient fault (RuntimeError)."""
    name = config.registry.model_name
    why, _ = _call(config, f"read model '{name}'", lambda: _ownership(_api(config), name, pipeline))
    if why:
        raise _refusal(config, pipeline, why)


def register(config: PipelineConfig, out: str, model_uri: str, card: dict[str, Any], *, dag_id: str, run_id: str,
             version: str, code: shipping.SpecCode | None = None) -> dict[str, Any]:
    """A new version of ``registry.model_name`` holding the bundle at ``model_uri`` and the spec source ``code``,
    linked to the DAG run's parent run; a retry finds the version it already made (same run, same bundle id) instead
    of adding another. A model of that name that is not this pipeline's is refused (check_owner); the first
    registration tags the model with the pipeline (OWNER_TAG)."""
    name, pipeline = config.registry.model_name, pipeline_of(dag_id) or config.name
    api = _api(config)
    data = storage.read_bytes(model_uri)
    if code is not None:
        card = {**card, shipping.CARD_KEY: code.card_entry()}

    def work() -> dict[str, Any]:
        state = parent_state(out) or {}
        run = api.get_run(state["parent_run_id"]) if state.get("parent_run_id") else \
            ensure_parent(api, config, dag_id=dag_id, run_id=run_id, extra_tags=state.get("pending_parent", {}).get("tags", {}))
        parent, artifacts = run["info"]["run_id"], run["info"]["artifact_uri"]
        why, tagged = _ownership(api, name, pipeline)
        if why:
            raise _refusal(config, pipeline, why)
        api.ensure_registered_model(name, f"Stagewise pipeline '{pipeline}' (dataset {config.dataset.uri})",
                                    {OWNER_TAG: pipeline})
        if not tagged:  # made just now with the tag, or this pipeline's from before the tag: it holds the name now
            api.set_model_tag(name, OWNER_TAG, pipeline)
        for existing in api.model_versions(name, run_id=parent):
            if _tags(existing).get(VERSION_TAG) == version:
                log.info("model %s version %s (%s) is already registered in MLflow", name, existing["version"], version)
                return existing
        created = time.strftime("%Y-%m-%d %H:%M:%S.000000", time.gmtime())
        files = {DATA_FILE: data, **mlmodel_files(parent, shipping.requirements(code.requirements if code else ()),
                                                  created, code.files if code else None),
                 "card.json": json.dumps(card, indent=2, sort_keys=True, default=str).encode()}
        for path, content in files.items():
            api.upload(artifacts, f"{MODEL_FOLDER}/{path}", content)
        tags = {VERSION_TAG: version, "stagewise.sha256": hashlib.sha256(data).hexdigest(),
                **{f"stagewise.{key}": card[key] for key in _CARD_TAGS if card.get(key) is not None},
                **{key: value for key, value in card.items()
                   if key.startswith(("test_", "val_")) and isinstance(value, (int, float))}}
        return api.create_model_version(name, f"{artifacts}/{MODEL_FOLDER}", parent, tags,
                                        f"{card.get('source_run', '')}: {config.gate_metric()} "
                                        f"{card.get(config.gate_metric(), 'n/a')}")

    made = _call(config, f"register a version of model '{name}'", work)
    url = model_version_url(config.tracking.mlflow_uri, name, made["version"])
    log.info("registered model %s version %s (%s) in MLflow: %s", name, made["version"], version, url)
    return {**card, "model_name": name, "version": version, "mlflow_version": made["version"], "model_uri": model_uri,
            "model_version_url": url, "registry": "mlflow"}


def download(config: PipelineConfig, version: dict[str, Any], out: str) -> str:
    """The version's bundle copied into the run (``<run>/model/<id>.pt``), its bytes checked against the version's tag."""
    tags = _tags(version)
    data = _call(config, f"download version {version['version']}",
                 lambda: _api(config).download(version["source"], DATA_FILE))
    if tags.get("stagewise.sha256") and hashlib.sha256(data).hexdigest() != tags["stagewise.sha256"]:
        raise UserError(f"MLflow model {version['name']} version {version['version']}: its {DATA_FILE} does not match "
                        f"the sha256 it was registered with (the artifact was replaced or cut); roll back")
    uri = storage.join(out, "model", f"{tags.get(VERSION_TAG, 'v' + version['version'])}.pt")
    if not storage.exists(uri):
        storage.write_bytes(uri, data)
    return uri


def gate(config: PipelineConfig, registered: dict[str, Any], out: str) -> dict[str, Any]:
    """Judge the registered candidate against ``@champion``: tag it with the decision, point ``challenger`` at it, and
    move ``champion`` only when it passes. Tags come first, so a retry after a crash decides the same again."""
    name, metric, margin, direction = (config.registry.model_name, config.gate_metric(), config.registry.margin,
                                       config.objective.direction)
    api = _api(config)
    number = registered["mlflow_version"]

    def work() -> dict[str, Any]:
        judged = _judged(config, api, number)
        candidate, champion, incumbent, decision = (judged[key] for key in ("candidate", "champion", "incumbent", "decision"))
        if champion and champion["version"] == number:  # a retry after the alias moved: decided already
            return {"decision": {"promoted": True, "reason": _tags(champion).get("stagewise.gate_reason", "champion")},
                    "candidate": candidate, "incumbent": None}
        api.set_version_tags(name, number, {
            "stagewise.gate": "promoted" if decision["promoted"] else "refused", "stagewise.gate_reason": decision["reason"],
            "stagewise.gate_metric": metric, "stagewise.gate_margin": margin,
            **({"stagewise.gate_incumbent": incumbent["mlflow_version"]} if incumbent else {})})
        api.set_alias(name, CHALLENGER, number)
        if decision["promoted"]:
            _move_champion(api, name, number, champion["version"] if champion else None)
        return {"decision": decision, "candidate": candidate, "incumbent": incumbent}

    judged = _call(config, f"gate version {number} of model '{name}'", work)
    decision, candidate, incumbent = judged["decision"], judged["candidate"], judged["incumbent"]
    if decision["promoted"] or incumbent is None:
        current, model_uri = candidate, registered["model_uri"]
    else:
        current = incumbent
        model_uri = download(config, _call(config, "read the champion", lambda: api.model_version(name, incumbent["mlflow_version"])), out)
    log.info("gate for %s version %s: %s (%s); champion is version %s", name, number,
             "promoted" if decision["promoted"] else "refused", decision["reason"], current["mlflow_version"])
    return {"model_name": name, "version": registered["version"], "mlflow_version": number, "current": current["version"],
            "current_mlflow_version": current["mlflow_version"], "metric": metric, "direction": direction, "margin": margin,
            "candidate_value": candidate[metric], "model_uri": model_uri,
            "model_version_url": model_version_url(config.tracking.mlflow_uri, name, number),
            **{key: value for key, value in decision.items() if key != "previous"},
            **({"previous": incumbent["version"]} if incumbent else {})}


def _judged(config: PipelineConfig, api: MlflowApi, number: str) -> dict[str, Any]:
    """Version ``number`` judged against ``@champion``: its card, the champion's version record, the champion's card
    when it is another version (None: none, or this one) and the decision."""
    name, metric = config.registry.model_name, config.gate_metric()
    candidate = card_of(api.model_version(name, number))
    if metric not in candidate:
        raise UserError(f"MLflow model {name} version {number} has no metric '{metric}' (registry.gate_metric)")
    champion = api.alias_version(name, CHAMPION)
    incumbent = card_of(champion) if champion and champion["version"] != number else None
    # the champion already: judge says "nothing changed"; no champion: "no current model"
    incumbent_version = incumbent["version"] if incumbent else (candidate["version"] if champion else None)
    decision = judge(candidate, incumbent_version, incumbent, metric, config.registry.margin, config.objective.direction,
                     promote_hint=f"python -m stagewise.registry promote {number}")
    return {"candidate": candidate, "champion": champion, "incumbent": incumbent, "decision": decision,
            "incumbent_version": incumbent_version}


def preview(config: PipelineConfig, registered: dict[str, Any]) -> dict[str, Any]:
    """The gate's decision on the registered candidate against ``@champion``, with no tag or alias moved: the
    candidate's card, the champion's (None: none yet) and the decision (promoted: whether it would)."""
    number = registered["mlflow_version"]
    return _call(config, f"judge version {number} of model '{config.registry.model_name}'",
                 lambda: _judged(config, _api(config), number))


def promote_if_champion(config: PipelineConfig, registered: dict[str, Any], expected: str | None,
                        reason: str) -> tuple[bool, dict[str, Any] | None]:
    """Move ``champion`` to the registered candidate only while the champion is still the version ``expected``
    (Stagewise id; None: no champion), as an approval decided; returns (moved, the champion's card now)."""
    name, api, number = config.registry.model_name, _api(config), registered["mlflow_version"]

    def work() -> tuple[bool, dict[str, Any] | None]:
        champion = api.alias_version(name, CHAMPION)
        now = card_of(champion)["version"] if champion else None
        if now != expected or (champion and champion["version"] == number):
            return False, card_of(champion) if champion else None
        api.set_version_tags(name, number, {"stagewise.gate": "promoted", "stagewise.gate_reason": reason})
        api.set_alias(name, CHALLENGER, number)
        _move_champion(api, name, number, champion["version"] if champion else None)
        return True, card_of(api.model_version(name, number))

    return _call(config, f"promote version {number} of model '{name}' on approval", work)


def _history(api: MlflowApi, name: str) -> list[str]:
    model = api.registered_model(name) or {}
    tags = {tag["key"]: tag["value"] for tag in model.get("tags") or []}
    return json.loads(tags.get(HISTORY_TAG, "[]"))


def _move_champion(api: MlflowApi, name: str, number: str, former: str | None) -> None:
    if former is not None:
        api.set_model_tag(name, HISTORY_TAG, json.dumps([*_history(api, name), former][-100:]))
    api.set_alias(name, CHAMPION, number)


def _resolve(api: MlflowApi, name: str, version: str | None) -> dict[str, Any] | None:
    """A version by MLflow number, by Stagewise id (m-...), or the champion (None)."""
    if not version:
        return api.alias_version(name, CHAMPION)
    if version.isdigit():
        return api.model_version(name, version)
    for candidate in api.model_versions(name):
        if _tags(candidate).get(VERSION_TAG) == version:
            return candidate
    raise UserError(f"MLflow model '{name}' has no version {version!r} (give its number or its m-... id)")


def resolve(config: PipelineConfig, version: str | None) -> dict[str, Any]:
    """Version ``version`` (its number or m-... id) of the config's model, or ``@champion`` when None."""
    name = config.registry.model_name
    chosen = _call(config, f"resolve model '{name}'", lambda: _resolve(_api(config), name, version))
    if chosen is None:
        raise UserError(f"MLflow model '{name}' (registry.model_name) has no @{CHAMPION} at {config.tracking.mlflow_uri}: "
                        f"run the training pipeline first or name a model_version")
    return chosen


def serving_model(config: PipelineConfig, version: str | None, out: str) -> dict[str, Any]:
    """The model batch inference scores with: ``models:/<name>@champion`` (or the version given), copied into the run."""
    name = config.registry.model_name
    chosen = resolve(config, version)
    card = card_of(chosen)
    log.info("scoring with MLflow model %s version %s (%s)%s", name, chosen["version"], card["version"],
             f", @{CHAMPION}" if not version else "")
    return {"current": card["version"], "mlflow_version": chosen["version"], "model_uri": download(config, chosen, out),
            "model_version_url": model_version_url(config.tracking.mlflow_uri, name, chosen["version"])}


def champion_study(config: PipelineConfig) -> str:
    """The study of ``@champion``, which a retrain warm-starts from ("" without a champion)."""
    champion = _call(config, "read the champion", lambda: _api(config).alias_version(config.registry.model_name, CHAMPION))
    return card_of(champion).get("study", "") if champion else ""


def rollback(config: PipelineConfig) -> dict[str, Any]:
    """Move ``champion`` back to the version it pointed at before."""
    name = config.registry.model_name
    api = _api(config)

    def work() -> dict[str, Any]:
        history = _history(api, name)
        if not history:
            raise UserError(f"nothing to roll back to: MLflow model '{name}' has no former {CHAMPION}")
        *earlier, previous = history
        api.set_alias(name, CHAMPION, previous)
        api.set_model_tag(name, HISTORY_TAG, json.dumps(earlier))
        return api.model_version(name, previous)

    return card_of(_call(config, f"roll back model '{name}'", work))


def promote(config: PipelineConfig, version: str) -> dict[str, Any]:
    """Point ``champion`` at ``version`` without the gate."""
    name = config.registry.model_name
    api = _api(config)

    def work() -> dict[str, Any]:
        chosen = _resolve(api, name, version)
        champion = api.alias_version(name, CHAMPION)
        if not champion or champion["version"] != chosen["version"]:
            _move_champion(api, name, chosen["version"], champion["version"] if champion else None)
        return chosen

    return card_of(_call(config, f"promote version {version} of model '{name}'", work))


def versions(config: PipelineConfig) -> list[dict[str, Any]]:
    return [card_of(v) for v in _call(config, "list versions", lambda: _api(config).model_versions(config.registry.model_name))]
