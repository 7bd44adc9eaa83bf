"""Model registry on the storage root: versioned folders and a ``current`` pointer moved by a gate.

Run: ``python -m stagewise.registry list``            versions, newest first, the current one marked
     ``python -m stagewise.registry show [VERSION]``  one version's card (default: current)
     ``python -m stagewise.registry rollback``        point ``current`` back at the previous version
     ``python -m stagewise.registry promote VERSION`` point ``current`` at VERSION (no gate)
Each takes ``--model NAME`` (default: the config's ``registry.model_name``).

Layout, one registry per model name: ``models/<name>/<version>/model.pt``, ``card.json``
(metrics, params, data fingerprint, the code the run started with, source run) and ``code/`` (the spec's own source,
listed in the card's ``spec_source``: stagewise.models.shipping); ``models/<name>/current.json`` names
the current version and keeps the history of promotions. Models of different names never meet: the
gate compares only within a name and inference resolves only within it. A version id is the hash of
the model's bytes, so registering the same model again is a no-op. The pointer file is replaced by
compare-and-swap (storage.write_if_unchanged: a lock file beside it locally, a conditional PUT on S3):
a gate, promotion or rollback that loses a race re-reads the pointer and decides again against the winner.
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import hashlib
import logging
import math
import time
from collections.abc import Callable
from typing import Any, TypeVar

from stagewise.core import storage
from stagewise.core.cli import common_parser, parse_overrides, setup_logging
from stagewise.core.errors import DataError, UserError
from stagewise.definitions.config import PipelineConfig
from stagewise.definitions.hyperparams import ran_params
from stagewise.definitions.loading import load_config
from stagewise.definitions.pipelines import pipeline_of
from stagewise.models import approval as approvals
from stagewise.models import owners, shipping
from stagewise.models.versions import CARD_CHECKSUM, judge, version_of
from stagewise.reporting import lineage, listing, notify
from stagewise.scripting.entrypoint import card_params
from stagewise.tracking import registry as mlflow_registry
from stagewise.tracking.runs import log_gate

log = logging.getLogger("stagewise.registry")
POINTER_SWAP_ATTEMPTS = 20  # each lost attempt means another writer moved the pointer; 20 in a row is a stampede
T = TypeVar("T")


def models_prefix(storage_root: str, name: str) -> str:
    """The registry of one model name: ``models/<name>``."""
    return storage.child(storage.join(storage_root, "models"), name, "model name (registry.model_name)")


def version_folder(storage_root: str, name: str, version: str) -> str:
    """``models/<name>/<version>``; a version that is not one path segment (``../other/m-...``) is refused."""
    return storage.child(models_prefix(storage_root, name), version, "model version")


def pointer_uri(storage_root: str, name: str) -> str:
    return storage.join(models_prefix(storage_root, name), "current.json")


def code_version() -> str:
    """This process's code: the git commit of a checkout, else the installed package's version. A card names the code
    its run started with instead (stagewise.reporting.lineage, recorded by start_run)."""
    return lineage.code_version()


def data_fingerprint(manifest_uri: str) -> str:
    """A hash of the committed preprocess manifest: which files, rows and statistics trained the model."""
    return hashlib.sha256(storage.read_bytes(manifest_uri)).hexdigest()[:16]


def register(storage_root: str, name: str, model_uri: str, card: dict[str, Any],
             code: shipping.SpecCode | None = None) -> dict[str, Any]:
    """Copy the model into ``models/<name>/<version>/`` with its card and the spec source ``code`` (under ``code/``,
    listed in the card's ``spec_source``); idempotent per model bytes."""
    data = storage.read_bytes(model_uri)
    version = version_of(data)  # every load of the registered file checks its bytes against this id (read_checked)
    _refuse_nonfinite(card, model_uri, version)
    folder = version_folder(storage_root, name, version)
    card_uri = storage.join(folder, "card.json")
    if storage.exists(card_uri):
        log.info("model %s/%s is already registered", name, version)
        return _card_at(folder)
    storage.write_bytes(storage.join(folder, "model.pt"), data)
    for path, source in (code.files if code else {}).items():
        storage.write_bytes(storage.join(folder, shipping.CODE_FOLDER, path), source)
    if code is not None:
        card = {**card, shipping.CARD_KEY: code.card_entry()}
    full_card = {**card, "model_name": name, "version": version, "model_uri": storage.join(folder, "model.pt"),
                 "sha256": hashlib.sha256(data).hexdigest(),
                 "registered_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    card_bytes = storage.json_bytes(full_card)
    # Its checksum first: the gate trusts an incumbent's metric only while the card is as it was registered.
    storage.write_bytes(storage.join(folder, CARD_CHECKSUM), hashlib.sha256(card_bytes).hexdigest().encode())
    storage.write_bytes(card_uri, card_bytes)  # the card, written last, is what makes a version exist
    log.info("registered model %s/%s (%s)", name, version, {k: v for k, v in card.items() if k.startswith("test_") or k == "source_run"})
    return full_card


def _refuse_nonfinite(card: dict[str, Any], model_uri: str, version: str) -> None:
    nonfinite = {key: value for key, value in card.items() if isinstance(value, float) and not math.isfinite(value)}
    if nonfinite:
        raise UserError(f"refusing to register {model_uri} (version {version}): its metric(s) {nonfinite} are not finite; "
                        f"a model whose training or evaluation diverged is never registered")


def register_for(config: PipelineConfig, out: str, model_uri: str, card: dict[str, Any], *, dag_id: str,
                 run_id: str) -> dict[str, Any]:
    """Register the run's model in the config's registry backend: storage (default) or the MLflow Model Registry.
    Either way the storage root records which pipeline holds the model name (stagewise.models.owners)."""
    # The config's spec is the bundle's: every bundle a run writes names config.model.spec (train, the runtime helper).
    code = shipping.spec_code(config.model.spec, config.model.import_paths or ())
    if changed := shipping.changed_since_start(code, card.get("source_fingerprints")):
        log.warning("model.spec '%s': %s changed since the run started; the model carries the source as it is now",
                    config.model.spec, ", ".join(changed))
    if config.registry.backend == "storage":
        registered = register(config.storage_root, config.registry.model_name, model_uri, card, code)
    else:
        version = version_of(storage.read_bytes(model_uri))
        _refuse_nonfinite(card, model_uri, version)
        registered = mlflow_registry.register(config, out, model_uri, card, dag_id=dag_id, run_id=run_id, version=version,
                                              code=code)
    # After the version exists: a retry registers again (a no-op) and claims again, so a lost claim is never final.
    pipeline = pipeline_of(dag_id) or config.name  # a config without a name key takes its file's: the DAG id has it
    owners.claim(config.storage_root, config.registry.model_name, pipeline, card.get("config_source"), f"{dag_id}/{run_id}")
    return registered


def gate_registered(config: PipelineConfig, registered: dict[str, Any], out: str) -> dict[str, Any]:
    """The config's gate on a version just registered, in its backend; the test metrics and the decision also go on
    the run's parent MLflow run when tracking is on."""
    if config.registry.report_only:
        decision = report_gate(config, registered["version"])
    elif config.registry.backend == "storage":
        decision = gate_new_version(config, registered["version"])
    else:

        decision = mlflow_registry.gate(config, registered, out)
    log_gate(config, out, registered, decision)
    return decision


def _card_at(folder: str) -> dict[str, Any]:
    """A version's card, checked against the checksum recorded when it was registered."""
    card_uri, checksum_uri = storage.join(folder, "card.json"), storage.join(folder, CARD_CHECKSUM)
    data = storage.read_bytes(card_uri)
    card = storage.parse_json(card_uri, data)  # a torn card is named as such first
    if storage.exists(checksum_uri):
        recorded, found = storage.read_bytes(checksum_uri).decode(errors="replace").strip(), hashlib.sha256(data).hexdigest()
        if found != recorded:
            raise DataError(f"{card_uri}: the card was changed after its version was registered (sha256 {found[:12]}…, "
                            f"recorded {recorded[:12]}…): its metrics cannot be trusted; restore the card or register "
                            f"the model again")
    # The folder, not the stored URI, locates the model: a registry moved as a whole stays usable.
    return {**card, "model_uri": storage.join(folder, "model.pt")}


def _warn_if_unscoped(storage_root: str, name: str) -> None:
    legacy = storage.join(storage_root, "models", "current.json")
    if storage.exists(legacy):
        log.warning("%s is an unscoped registry from before model names and is ignored; move its versions into "
                    "models/%s/ (see docs/pipelines.md)", legacy, name)


def _read_pointer(storage_root: str, name: str) -> tuple[dict[str, Any], str | None]:
    """Model ``name``'s pointer and the token of this version of it (None before the first promotion)."""
    state, token = storage.read_versioned(pointer_uri(storage_root, name))
    if state is None:
        _warn_if_unscoped(storage_root, name)
        return {"version": None, "history": []}, None
    return state, token


def pointer(storage_root: str, name: str) -> dict[str, Any]:
    return _read_pointer(storage_root, name)[0]


def card(storage_root: str, name: str, version: str) -> dict[str, Any]:
    folder = version_folder(storage_root, name, version)
    if not storage.exists(storage.join(folder, "card.json")):
        raise UserError(f"model version '{version}' is not registered under {models_prefix(storage_root, name)} "
                        f"(model name '{name}', registry.model_name)")
    return _card_at(folder)


def current(storage_root: str, name: str) -> dict[str, Any] | None:
    """The current version's card of model ``name``, or None before its first promotion."""
    version = pointer(storage_root, name)["version"]
    return card(storage_root, name, version) if version else None


def _moved(name: str, version: str | None, history: list[str], reason: str) -> dict[str, Any]:
    return {"model_name": name, "version": version, "history": history, "reason": reason,
            "moved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _history_after(state: dict[str, Any]) -> list[str]:
    """The history once ``state``'s current version is replaced: that version appended."""
    return [*state["history"], state["version"]] if state["version"] else list(state["history"])


def _swap_pointer(storage_root: str, name: str,
                  decide: Callable[[dict[str, Any]], tuple[dict[str, Any] | None, T]]) -> tuple[dict[str, Any], T]:
    """Move model ``name``'s pointer by compare-and-swap; returns the pointer as it now stands and ``decide``'s answer.

    ``decide`` gets the pointer as read and gives its next state (None: leave it) and an answer. When another
    writer moved the pointer in between, the write is refused and ``decide`` runs again on the winner's pointer.
    """
    uri = pointer_uri(storage_root, name)
    for attempt in range(1, POINTER_SWAP_ATTEMPTS + 1):
        state, token = _read_pointer(storage_root, name)
        moved, answer = decide(state)
        if moved is None:
            return state, answer
        if storage.write_if_unchanged(uri, moved, token):
            log.info("current %s model: %s -> %s (%s)", name, state["version"], moved["version"], moved["reason"])
            return moved, answer
        log.info("%s moved while deciding (attempt %d of %d); deciding again against the new current model", uri,
                 attempt, POINTER_SWAP_ATTEMPTS)
    raise RuntimeError(f"{uri}: other writers moved the pointer {POINTER_SWAP_ATTEMPTS} times in a row; a retry decides again")


def promote(storage_root: str, name: str, version: str, reason: str = "manual") -> dict[str, Any]:
    card(storage_root, name, version)  # must exist under this name

    def decide(state: dict[str, Any]) -> tuple[dict[str, Any] | None, None]:
        return (None if state["version"] == version else _moved(name, version, _history_after(state), reason)), None

    return _swap_pointer(storage_root, name, decide)[0]


def _judge(storage_root: str, name: str, candidate: dict[str, Any], incumbent_version: str | None, metric: str,
           margin: float, direction: str) -> dict[str, Any]:
    """The gate's decision on ``candidate`` against the version current now (None: no current model)."""
    incumbent = card(storage_root, name, incumbent_version) if incumbent_version not in (None, candidate["version"]) else None
    return judge(candidate, incumbent_version, incumbent, metric, margin, direction,
                 promote_hint=f"python -m stagewise.registry promote {candidate['version']}")


def gate(storage_root: str, name: str, version: str, metric: str, margin: float, direction: str = "maximize") -> dict[str, Any]:
    """Promote ``version`` only if it beats model ``name``'s current ``metric`` by ``margin`` in ``direction`` (or none is current).

    The comparison and the promotion are one compare-and-swap: a gate that loses a race to another compares again
    against the model that won.
    """
    candidate = card(storage_root, name, version)
    if metric not in candidate:
        raise UserError(f"model {name}/{version} has no metric '{metric}' (registry.gate_metric) in its card")

    def decide(state: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        decision = _judge(storage_root, name, candidate, state["version"], metric, margin, direction)
        moved = _moved(name, version, _history_after(state), f"gate: {decision['reason']}") if decision["promoted"] else None
        return moved, decision

    state, decision = _swap_pointer(storage_root, name, decide)
    log.info("gate for %s/%s: %s (%s)", name, version, "promoted" if decision["promoted"] else "refused", decision["reason"])
    return {"model_name": name, "version": version, "current": state["version"], "metric": metric,
            "direction": direction, "margin": margin, "candidate_value": candidate[metric], **decision}


def model_card(config: PipelineConfig, *, trained: dict[str, Any], evaluation: dict[str, Any],
               best_params: dict[str, Any] | None, study: str, source_run: str, manifest_uri: str,
               run_out: str | None = None) -> dict[str, Any]:
    """What a registered version records: its test metrics, the objective and its validation value, the params
    it trained with, the data fingerprint, the study and the run that made it, and the code as the run at ``run_out``
    started with it (Stagewise version, code version, the user's source fingerprints: lineage.json)."""
    metric = config.objective.metric
    params = card_params(trained, best_params)
    if isinstance(params["params"], dict):  # beside a spec's own optimizer the framework's choice of one says nothing
        params["params"] = ran_params(params["params"], trained)
    # What trained it, read off the live optimizer and schedule (stagewise.training.recipe); a user's script reports none.
    recipe = {key: trained[key] for key in ("optimizer", "lr_schedule") if trained.get(key) is not None}
    return {**{k: v for k, v in evaluation.items() if k.startswith("test_") and k != "test_objective"},
            "objective": metric, "direction": config.objective.direction, f"val_{metric}": trained.get("val_metric"),
            **params, **recipe, "study": study, "source_run": source_run,
            "data_fingerprint": data_fingerprint(manifest_uri), **lineage.for_card(run_out), "stages": [trained.get("stage")]}


def gate_new_version(config: PipelineConfig, version: str) -> dict[str, Any]:
    """The config's gate (metric, margin, direction) on a newly registered version, plus the model inference should use."""
    name = config.registry.model_name
    decision = gate(config.storage_root, name, version, config.gate_metric(), config.registry.margin, config.objective.direction)
    return {**decision, "model_uri": card(config.storage_root, name, decision["current"])["model_uri"]}


def report_gate(config: PipelineConfig, version: str) -> dict[str, Any]:
    """The config's gate on a newly registered version in report-only mode (registry.report_only, CI): the decision it
    would take against the current model, logged and returned as ``decision``, with no pointer moved. ``current`` and
    ``model_uri`` are the model that would be current, which inference scores with."""
    name, root, metric = config.registry.model_name, config.storage_root, config.gate_metric()
    preview = preview_gate(config, version)
    candidate, incumbent, decision = preview["candidate"], preview["incumbent_version"], dict(preview["decision"])
    would = decision.pop("promoted")
    said = f"would {'promote' if would else 'refuse'} {version}: {decision['reason']}"
    log.info("gate for %s/%s, report only (registry.report_only: nothing promoted): %s", name, version, said)
    serving = version if would else incumbent
    return {"model_name": name, "version": version, "current": serving, "metric": metric,
            "direction": config.objective.direction, "margin": config.registry.margin,
            "candidate_value": candidate[metric], **decision, "promoted": False, "would_promote": would,
            "report_only": True, "decision": said, "model_uri": card(root, name, serving)["model_uri"]}


def preview_gate(config: PipelineConfig, version: str) -> dict[str, Any]:
    """The gate's decision on ``version`` against the current model, with nothing moved: the candidate's card, the
    current version and its card (None before the first promotion) and the decision (promoted: whether it would)."""
    name, root, metric = config.registry.model_name, config.storage_root, config.gate_metric()
    candidate = card(root, name, version)
    if metric not in candidate:
        raise UserError(f"model {name}/{version} has no metric '{metric}' (registry.gate_metric) in its card")
    incumbent = pointer(root, name)["version"]
    decision = _judge(root, name, candidate, incumbent, metric, config.registry.margin, config.objective.direction)
    return {"candidate": candidate, "incumbent_version": incumbent, "decision": decision,
            "incumbent": card(root, name, incumbent) if incumbent not in (None, version) else None}


def promote_if_current(storage_root: str, name: str, version: str, expected: str | None, reason: str,
                       by: str | None = None) -> tuple[bool, str | None]:
    """Point ``current`` at ``version`` only while ``expected`` is still current (an approval decided against it);
    returns (moved, the current version now)."""
    card(storage_root, name, version)

    def decide(state: dict[str, Any]) -> tuple[dict[str, Any] | None, bool]:
        if state["version"] != expected or state["version"] == version:
            return None, False
        return {**_moved(name, version, _history_after(state), reason), "by": by}, True

    state, moved = _swap_pointer(storage_root, name, decide)
    return moved, state["version"]


def serving_model(config: PipelineConfig, version: str | None, out: str = "") -> dict[str, Any]:
    """The registered model batch inference scores with: ``version`` when given, else the current one (in MLflow:
    ``models:/<name>@champion``, copied under the run ``out``)."""
    if config.registry.backend == "mlflow":

        return mlflow_registry.serving_model(config, version, out)
    name = config.registry.model_name
    chosen = card(config.storage_root, name, version) if version else current(config.storage_root, name)
    if chosen is None:
        raise UserError(f"no current '{name}' model (registry.model_name) under {models_prefix(config.storage_root, name)}: "
                        f"run ml_pipeline first or name a model_version")
    return {"current": chosen["version"], "model_uri": chosen["model_uri"]}


def retrain_overrides(config: PipelineConfig) -> dict[str, Any]:
    """A retrain's sweep: the retrain budget, warm-started from the study of the current model (cold without one)."""
    if config.registry.backend == "mlflow":

        study = mlflow_registry.champion_study(config)
    else:
        study = (current(config.storage_root, config.registry.model_name) or {}).get("study", "")
    return {"sweep.num_trials": config.retrain.num_trials, "sweep.warm_start_from": study}


def rollback(storage_root: str, name: str, by: str | None = None) -> dict[str, Any]:
    """Point model ``name``'s ``current`` back at the version before it; ``by``: who did it (kept in the pointer)."""

    def decide(state: dict[str, Any]) -> tuple[dict[str, Any], None]:
        if not state["history"]:
            raise UserError(f"nothing to roll back to: {pointer_uri(storage_root, name)} has no earlier version")
        *earlier, previous = state["history"]
        reason = f"rollback from {state['version']}" + (f" by {by}" if by else "")
        return {**_moved(name, previous, earlier, reason), "by": by, "rolled_back_from": state["version"]}, None

    return _swap_pointer(storage_root, name, decide)[0]


def rollback_by_hand(config: PipelineConfig, by: str | None) -> dict[str, Any]:
    """A person's rollback (the CLI): the current model (MLflow's champion) back to the one before, recorded in the
    version's decisions with who did it and told to the config's notifiers. Returns the pointer as it now stands."""
    name, metric, values = config.registry.model_name, config.gate_metric(), {}
    if config.registry.backend == "mlflow":
        before = mlflow_registry.card_of(mlflow_registry.resolve(config, None))  # the champion, read once
        moved = {"version": mlflow_registry.rollback(config)["version"], "rolled_back_from": before["version"], "by": by}
        values["current_value"] = before.get(metric)
    else:
        moved = rollback(config.storage_root, name, by=by)
    for key, version in (("candidate_value", moved["version"]), ("current_value", moved["rolled_back_from"])):
        with contextlib.suppress(UserError):  # a version whose card is gone still rolls back
            if key not in values:
                values[key] = (card(config.storage_root, name, version) if config.registry.backend == "storage" else
                               mlflow_registry.card_of(mlflow_registry.resolve(config, version))).get(metric)
    approvals.record(models_prefix(config.storage_root, name), moved["version"], {
        "decision": "rolled_back", "run": f"by hand {approvals.now_text()}", "by": by, "from": moved["rolled_back_from"]})
    told = notify.facts(pipeline=config.name or name, decision="rolled_back", model_name=name, version=moved["version"],
                        metric=metric, current=moved["rolled_back_from"], by=by,
                        reason=f"rolled back from {moved['rolled_back_from']} by hand", **values)
    return {**moved, "notifications": notify.send(config.registry.notify, told)}


def versions(storage_root: str, name: str) -> list[dict[str, Any]]:
    """Model ``name``'s registered versions, newest first (each card read once per version of its file)."""
    listed = _CARDS.read(models_prefix(storage_root, name), 1, "card.json")
    return sorted((dict(card) for _, card in listed), key=lambda c: c["registered_at"], reverse=True)


def _listed_card(folder: str) -> dict[str, Any]:
    """A version's card for a listing; an unreadable card is listed with its error, so one torn file hides no other."""
    try:
        return _card_at(folder)
    except DataError as exc:
        log.warning("%s", exc)
        return {"version": folder.rsplit("/", 1)[1], "registered_at": "", "card_error": str(exc)}


# A model's cards, each read again only when its file changed: the registry page lists 1,000 versions on each request.
_CARDS = listing.Index(lambda item: _listed_card(item.uri.rsplit("/", 1)[0]))


def model_names(storage_root: str) -> list[str]:
    """The registry's model names: folders under models/ holding a current.json or a version's card."""
    models = storage.join(storage_root, "models")
    found = [*listing.scan(models, 1, "current.json"), *listing.scan(models, 2, "card.json")]
    return sorted({item.parts[0] for item in found})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="The model registry.")
    common = common_parser()
    common.add_argument("--model", default=None, help="model name (default: the config's registry.model_name)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", parents=[common], help="versions, newest first")
    show = sub.add_parser("show", parents=[common], help="one version's card")
    show.add_argument("version", nargs="?")
    undo = sub.add_parser("rollback", parents=[common], help="current -> the previous version")
    undo.add_argument("--by", default=None, help="who rolls back, kept with the decision (default: this OS user)")
    promote_cmd = sub.add_parser("promote", parents=[common], help="current -> VERSION, without the gate")
    promote_cmd.add_argument("version")
    args = parser.parse_args(argv)
    setup_logging(quiet=True)
    config = load_config(args.config, parse_overrides(args.override))
    root, name = config.storage_root, args.model or config.registry.model_name
    try:
        if args.command == "rollback":
            scoped = config.model_copy(update={"registry": config.registry.model_copy(update={"model_name": name})})
            print(f"current {name}: {rollback_by_hand(scoped, args.by or getpass.getuser())['version']}")
        elif config.registry.backend == "mlflow":
            _mlflow_command(config.model_copy(update={"registry": config.registry.model_copy(update={"model_name": name})}),
                            args.command, getattr(args, "version", None))
        elif args.command == "list":
            now = pointer(root, name)["version"]
            for entry in versions(root, name):
                mark = "*" if entry["version"] == now else " "
                objective = entry.get("objective", "accuracy")
                print(f"{mark} {entry['version']}  {entry['registered_at']}  {objective}={entry.get('test_' + objective)}  "
                      f"run={entry.get('source_run')}")
        elif args.command == "show":
            import json

            shown = card(root, name, args.version) if args.version else current(root, name)
            if shown:  # who approved or rejected it, when, and their note
                shown["decisions"] = approvals.history(models_prefix(root, name), shown["version"])
            print(json.dumps(shown, indent=2))
        else:
            print(f"current {name}: {promote(root, name, args.version)['version']}")
    except UserError as exc:
        raise SystemExit(str(exc)) from None


def _mlflow_command(config: PipelineConfig, command: str, version: str | None) -> None:
    import json


    name = config.registry.model_name
    if command == "list":
        for entry in mlflow_registry.versions(config):
            mark = "*" if mlflow_registry.CHAMPION in entry["aliases"] else " "
            objective = entry.get("objective", "accuracy")
            print(f"{mark} {entry['mlflow_version']:>4} {entry['version']}  {entry['registered_at']}  "
                  f"{objective}={entry.get('test_' + objective)}  aliases={','.join(entry['aliases'])}  run={entry.get('source_run')}")
    elif command == "show":
        print(json.dumps(mlflow_registry.card_of(mlflow_registry.resolve(config, version)), indent=2))
    else:
        print(f"{name}@{mlflow_registry.CHAMPION}: version {mlflow_registry.promote(config, version)['mlflow_version']}")


if __name__ == "__main__":
    main()
