"""The gate with a person in it: a promotion that needs approval waits, and every decision is told and recorded.

Run: ``python -m stagewise.gatekeeper pending``          the request waiting for an answer, if any
     ``python -m stagewise.gatekeeper history VERSION``  every decision on a version: who, when, the note

``decide`` is the gate step: with ``registry.approval`` at ``none`` (or a report-only gate) it is the gate as before;
otherwise a promotion the gate would make, where the policy asks for a person, opens a request
(stagewise.models.approval) instead of moving the current model, and the run's approval task (an Airflow HITL task,
stagewise.airflow.approval) waits for the answer. ``answer`` applies it: approve moves the current model (MLflow's
``champion``) only while the model it was compared with is still current; reject and a timeout keep it. Each
decision goes to the config's notifiers (stagewise.reporting.notify) and into the version's decision history.
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from stagewise import registry
from stagewise.core.cli import common_parser, parse_overrides, setup_logging
from stagewise.core.errors import UserError
from stagewise.definitions.config import PipelineConfig
from stagewise.definitions.loading import load_config
from stagewise.models import approval as records
from stagewise.reporting import notify
from stagewise.tracking import registry as mlflow_registry

log = logging.getLogger("stagewise.gatekeeper")
APPROVE, REJECT = "Approve", "Reject"  # the approval task's two options, as Airflow's ApprovalOperator names them
ANSWERS = ("approved", "rejected", "timed_out")  # the decisions that close a request


def _prefix(config: PipelineConfig) -> str:
    return registry.models_prefix(config.storage_root, config.registry.model_name)


def told(config: PipelineConfig, decision: dict[str, Any], kind: str, links: dict[str, str], context: Any,
          version: str | None = None, **extra: Any) -> dict[str, Any]:
    """``decision`` with the notifications of ``kind`` sent (each notifier's result under ``notifications``), about
    ``version`` where given (else the decision's own)."""
    told = notify.facts(pipeline=config.name or config.registry.model_name, decision=kind,
                        model_name=config.registry.model_name, version=version or decision.get("version"),
                        metric=decision.get("metric"), candidate_value=decision.get("candidate_value"),
                        current_value=decision.get("incumbent_value"), current=decision.get("previous"),
                        reason=decision.get("reason", ""), report_url=links.get("report_url", ""),
                        required_actions_url=links.get("required_actions_url", ""), **extra)
    sent = notify.send(config.registry.notify, told, context)
    return {**decision, "notifications": [*decision.get("notifications", []), *sent]}


def _preview(config: PipelineConfig, registered: dict[str, Any]) -> dict[str, Any]:
    if config.registry.backend == "mlflow":
        return mlflow_registry.preview(config, registered)
    return registry.preview_gate(config, registered["version"])


def review(config: PipelineConfig, preview: dict[str, Any], registered: dict[str, Any]) -> dict[str, Any]:
    """What a reviewer decides on: each test metric of the candidate beside the current model's, the validation
    objective the sweep reached, and the data it trained on."""
    candidate, incumbent = preview["candidate"], preview["incumbent"] or {}
    metrics = sorted(key for key in candidate if key.startswith("test_") and isinstance(candidate[key], (int, float))
                     and not isinstance(candidate[key], bool))
    objective = f"val_{config.objective.metric}"
    return {"metrics": {key: {"candidate": candidate[key], "current": incumbent.get(key)} for key in metrics},
            "objective": {"name": objective, "candidate": candidate.get(objective), "current": incumbent.get(objective)},
            "data_interval": candidate.get("data_interval"), "data_fingerprint": candidate.get("data_fingerprint"),
            "rows": registered.get("rows"), "study": candidate.get("study"), "source_run": candidate.get("source_run")}


def decide(config: PipelineConfig, registered: dict[str, Any], out: str, *, run: str, links: dict[str, str],
           context: Any = None) -> dict[str, Any]:
    """The gate step: the gate's decision, or (the policy asking a person) a request opened in its place."""
    policy = config.registry.approval
    if config.registry.report_only:  # CI: nothing moves, nobody is asked or told
        return registry.gate_registered(config, registered, out)
    if policy.mode == "none":
        decision = registry.gate_registered(config, registered, out)
        return told(config, decision, "promoted" if decision["promoted"] else "refused", links, context)
    preview = _preview(config, registered)
    why = records.waits_because(policy, preview["candidate"], preview["incumbent"]) if preview["decision"]["promoted"] else None
    if why is None:  # a refusal, or a promotion the policy lets through: the gate as without approval
        decision = registry.gate_registered(config, registered, out)
        return told(config, decision, "promoted" if decision["promoted"] else "refused", links, context)
    metric = config.gate_metric()
    compared = preview["incumbent_version"]
    superseded = records.ask(_prefix(config), {"version": registered["version"], "run": run, "compared": compared,
                                               "reason": why, **links})
    if superseded is not None:
        log.warning("a newer request supersedes %s's pending approval of version %s: answering that one now moves "
                    "nothing", superseded["run"], superseded["version"])
    current = _current(config, out)
    log.info("gate for %s/%s: %s; waiting for approval (%s)", config.registry.model_name, registered["version"],
             preview["decision"]["reason"], why)
    decision = {"model_name": config.registry.model_name, "version": registered["version"], "metric": metric,
                "direction": config.objective.direction, "margin": config.registry.margin,
                "candidate_value": preview["candidate"][metric], **preview["decision"], "promoted": False,
                "awaiting_approval": True, "previous": compared,
                "incumbent_value": (preview["incumbent"] or {}).get(metric), **current,
                "approval": {"reason": why, "compared": compared, "run": run, **links,
                             "superseded": superseded and {"run": superseded["run"], "version": superseded["version"]},
                             "review": review(config, preview, registered),
                             "timeout_minutes": policy.timeout_minutes, "respondents": policy.respondents}}
    if registered.get("mlflow_version"):
        decision["mlflow_version"] = registered["mlflow_version"]
    decision = told(config, decision, "waiting", links, context)
    if superseded is not None:
        decision = told(config, decision, "superseded", links, context, version=superseded["version"],
                        note=f"superseded by {run}")
    return decision


def _current(config: PipelineConfig, out: str) -> dict[str, Any]:
    """The model current now and the file inference scores with ({"current": None, "model_uri": None}: none)."""
    if config.registry.backend == "mlflow":
        try:
            served = mlflow_registry.serving_model(config, None, out)
        except UserError:  # no champion yet
            return {"current": None, "model_uri": None}
        return {"current": served["current"], "model_uri": served["model_uri"],
                "current_mlflow_version": served.get("mlflow_version")}
    card = registry.current(config.storage_root, config.registry.model_name)
    return {"current": card["version"] if card else None, "model_uri": card["model_uri"] if card else None}


def answer(config: PipelineConfig, gated: dict[str, Any], response: dict[str, Any], out: str, *,
           links: dict[str, str] | None = None, context: Any = None) -> dict[str, Any]:
    """Apply a person's answer (``response``: chosen, by, at, note, timed_out) to the request ``gated`` opened."""
    links = {key: gated["approval"].get(key, "") for key in ("report_url", "required_actions_url")} | (links or {})
    run, version, compared = gated["approval"]["run"], gated["version"], gated["approval"]["compared"]
    kind = "timed_out" if response.get("timed_out") else "approved" if response["chosen"] == APPROVE else "rejected"
    by, note = response.get("by"), response.get("note") or ""
    closed = records.close(_prefix(config), run) or _closed_by(config, run)
    moved = False
    if closed is None:
        effect = "nothing moved: a newer request superseded this one (python -m stagewise.gatekeeper pending)"
    elif kind != "approved":
        effect = "current model kept" + (f": no answer within {config.registry.approval.timeout_minutes:g} min"
                                         if kind == "timed_out" else "")
    elif config.registry.backend == "mlflow":
        moved, _ = mlflow_registry.promote_if_champion(config, gated, compared, f"approved by {by}")
        effect = "champion moved" if moved else "nothing moved: the champion changed since the review was asked"
    else:
        moved, now = registry.promote_if_current(config.storage_root, config.registry.model_name, version, compared,
                                                 f"gate: approved by {by}", by=by)
        effect = "current model moved" if moved else (f"nothing moved: the current model became {now} since the "
                                                      f"review was asked (compared with {compared}); run again")
    entry = records.record(_prefix(config), version, {"decision": kind, "run": run, "by": by, "note": note,
                                                      "at": response.get("at") or records.now_text(), "effect": effect,
                                                      "moved": moved})
    log.info("approval of %s/%s: %s by %s (%s)", config.registry.model_name, version, kind, by or "nobody", effect)
    result = _outcome(config, gated, out, kind, by, note, entry["at"], effect, moved)
    return told(config, result, kind if closed is not None else "superseded", links, context, by=by, note=note)


def _closed_by(config: PipelineConfig, run: str) -> dict[str, Any] | None:
    """``run``'s request when this run's own answer closed it but a crash cut off the record: the retry's answer is
    still this run's to apply, not a superseded one's."""
    closed = records.last_closed(_prefix(config))
    return closed if closed and closed.get("run") == run else None


def _outcome(config: PipelineConfig, gated: dict[str, Any], out: str, kind: str, by: str | None, note: str,
             at: str | None, effect: str, moved: bool) -> dict[str, Any]:
    return {**gated, **_current(config, out), "promoted": moved, "awaiting_approval": False,
            "reason": f"{kind.replace('_', ' ')}" + (f" by {by}" if by else "") + f": {effect}",
            "approval": {**gated["approval"], "decision": kind, "by": by, "at": at, "note": note, "effect": effect}}


def settled(config: PipelineConfig, gated: dict[str, Any], out: str) -> dict[str, Any] | None:
    """What the run's request came to once it is no longer open, so nobody is asked again (approve_model cleared
    after its answer, or its request superseded before anyone answered); None while it is open, or while its own
    answer closed it and a crash cut off the record (the retry asks again, and applies that answer). Nothing is told
    or recorded anew."""
    run, version, prefix = gated["approval"]["run"], gated["version"], _prefix(config)
    pending = records.open_request(prefix)
    if pending is not None and pending["run"] == run:
        return None
    given = next((entry for entry in reversed(records.history(prefix, version))
                  if entry.get("run") == run and entry["decision"] in ANSWERS), None)
    if given is None and _closed_by(config, run) is not None:
        return None
    if given is None:
        return _outcome(config, gated, out, "superseded", None, "", None, "nothing moved: a newer request superseded "
                        "this one before it was answered (python -m stagewise.gatekeeper pending)", False)
    log.info("the request of %s was answered before (%s by %s): that answer stands, nobody is asked again; clear "
             "gate_model too to decide again", run, given["decision"], given.get("by") or "nobody")
    return _outcome(config, gated, out, given["decision"], given.get("by"), given.get("note") or "", given.get("at"),
                    f"answered before: {given.get('effect', '')}", bool(given.get("moved")))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Approval requests and decisions of a model name.")
    common = common_parser()
    common.add_argument("--model", default=None, help="model name (default: the config's registry.model_name)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("pending", parents=[common], help="the request waiting for an answer")
    shown = sub.add_parser("history", parents=[common], help="every decision on VERSION")
    shown.add_argument("version")
    args = parser.parse_args(argv)
    setup_logging(quiet=True)
    config = load_config(args.config, parse_overrides(args.override))
    prefix = registry.models_prefix(config.storage_root, args.model or config.registry.model_name)
    if args.command == "pending":
        print(json.dumps(records.open_request(prefix), indent=2))
    else:
        print(json.dumps(records.history(prefix, args.version), indent=2))


if __name__ == "__main__":
    main()
