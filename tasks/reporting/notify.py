"""Word of a gate decision through the team's Airflow notifiers (registry.notify: any BaseNotifier by import path).

Each notifier is made from its config arguments and called with the task's context plus ``stagewise``: the
pipeline, the decision, the model, the two metric values, who decided and the links, with a ready ``subject``,
``message`` (plain text) and ``html``; its templated fields may use them (``{{ stagewise.html }}``). A notifier that cannot be imported or
made, or fails to send, never fails the run: one warning, and the result says it was not sent (the report lists it).
"""

from __future__ import annotations

import copy
import html
import importlib
import logging
from typing import Any

from stagewise.definitions.sections.approval import Notifier

log = logging.getLogger("stagewise.notify")
WORDS = {"promoted": "promoted", "refused": "refused (current model kept)", "waiting": "waiting for approval",
         "approved": "approved and promoted", "rejected": "rejected (current model kept)",
         "timed_out": "timed out waiting for approval: rejected", "superseded": "superseded by a newer request",
         "rolled_back": "rolled back"}
MAX_ERROR_CHARS = 300


def _value(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else "none" if value is None else str(value)


def facts(*, pipeline: str, decision: str, model_name: str, version: str | None, metric: str | None,
          candidate_value: Any = None, current_value: Any = None, current: str | None = None, reason: str = "",
          by: str | None = None, note: str = "", report_url: str = "", required_actions_url: str = "") -> dict[str, Any]:
    """What a notifier hears of one decision, with its one-line ``subject`` and a short ``message``."""
    said = WORDS[decision]
    subject = f"[{pipeline}] {model_name} {version or ''}: {said}".replace("  ", " ")
    lines = [f"Pipeline {pipeline}: model {model_name} version {version} {said}.",
             f"{metric}: candidate {_value(candidate_value)}, current model ({current or 'none'}) {_value(current_value)}."]
    if reason:
        lines.append(f"Reason: {reason}.")
    if by:
        lines.append(f"By {by}" + (f": {note}" if note else "."))
    if required_actions_url and decision == "waiting":
        lines.append(f"Decide: {required_actions_url}")
    if report_url:
        lines.append(f"Report: {report_url}")
    return {"pipeline": pipeline, "decision": decision, "model_name": model_name, "version": version, "metric": metric,
            "candidate_value": candidate_value, "current_value": current_value, "current": current, "reason": reason,
            "by": by, "note": note, "report_url": report_url, "required_actions_url": required_actions_url,
            "subject": subject, "message": "\n".join(lines), "html": "<br>\n".join(html.escape(line) for line in lines)}


def _notifier_class(path: str) -> type:
    module, _, name = path.rpartition(".")
    found = getattr(importlib.import_module(module), name, None)
    if not isinstance(found, type) or not callable(getattr(found, "notify", None)):
        raise TypeError(f"{path} is not a notifier class (a BaseNotifier subclass with notify())")
    return found


def send(notifiers: list[Notifier], told: dict[str, Any], context: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Tell each notifier that listens for ``told['decision']``; returns one result per notifier called, ``sent``
    true or false with the error. Never raises."""
    results = []
    for spec in notifiers:
        if told["decision"] not in spec.on:
            continue
        result = {"notifier": spec.notifier, "decision": told["decision"], "subject": told["subject"]}
        try:
            notifier = _notifier_class(spec.notifier)(**copy.deepcopy(spec.args))
            notifier({**(context or {}), "stagewise": told})  # BaseNotifier.__call__ renders its fields, then notify()
            results.append({**result, "sent": True})
            log.info("told %s: %s", spec.notifier, told["subject"])
        except Exception as exc:  # noqa: BLE001 - a notifier's fault is never the run's
            error = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
            log.warning("notifier %s did not send '%s': %s (the run goes on; the report lists the message as unsent)",
                        spec.notifier, told["subject"], error)
            results.append({**result, "sent": False, "error": error})
    return results


def decision_lines(registry: dict[str, Any]) -> list[tuple[str, str]]:
    """The report's lines on a gate's approval and notifications: (label, text), empty when there were none."""
    lines = []
    decided = registry.get("approval") if isinstance(registry.get("approval"), dict) else {}
    if decided.get("decision"):
        lines.append(("approval", f"{str(decided['decision']).replace('_', ' ')} by {decided.get('by') or 'nobody'} at "
                                  f"{decided.get('at')}" + (f": {decided['note']}" if decided.get("note") else "")
                      + f" ({decided.get('effect')})"))
    elif decided:
        lines.append(("approval", f"asked: {decided.get('reason')}"))
    results = [result for result in registry.get("notifications") or [] if isinstance(result, dict)]
    unsent = [result for result in results if not result.get("sent")]
    if results:
        lines.append(("notifications", f"{len(results) - len(unsent)} sent, {len(unsent)} not sent"))
    lines += [("not sent", f"'{result.get('subject')}' to {result.get('notifier')}: {result.get('error')}")
              for result in unsent]
    return lines
