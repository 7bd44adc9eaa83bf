"""The approval task: Airflow's own Human-in-the-loop task between the gate and the rest of the run.

``approve_model`` exists where ``registry.approval`` is not ``none``. When the gate opened a request
(stagewise.gatekeeper.decide), the task writes a HITL detail (Approve / Reject, a note) whose body sets the
candidate's metrics beside the current model's, and waits: on Airflow 3.3 in the ``awaiting_input`` state, on 3.2
deferred to the HITL trigger. It shows under Required Actions and is answered there or over the REST API
(``PATCH .../taskInstances/approve_model/-1/hitlDetails``) by a user Airflow lets act on the DAG's tasks (a viewer
may read it, not answer it; ``registry.approval.respondents`` narrows it to those users). No answer within
``registry.approval.timeout_minutes`` takes the default, Reject, recorded as timed out. The answer is applied by
stagewise.gatekeeper.answer; the task returns the model inference then scores with.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.providers.standard.operators.hitl import HITLOperator

from stagewise.airflow.required_actions import TASK_ID
from stagewise.gatekeeper import APPROVE, REJECT

__all__ = ["TASK_ID", "GateApprovalOperator", "body"]

MAX_NOTE_CHARS = 2000


def _number(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"  # a count, such as test_rows
    return f"{value:.4f}" if isinstance(value, float) else "–"


def body(gated: dict[str, Any]) -> str:
    """The reviewer's page (Markdown): why it waits, the metrics side by side, the data, the sweep, the report."""
    approval = gated["approval"]
    review = approval["review"]
    lines = [f"**Why it waits:** {approval['reason']}.", "", f"**Gate:** {gated.get('reason', '')}", "",
             f"| metric | candidate `{gated['version']}` | current `{approval['compared'] or 'none'}` |",
             "|---|---|---|"]
    lines += [f"| {name} | {_number(pair['candidate'])} | {_number(pair['current'])} |"
              for name, pair in review["metrics"].items()]
    objective = review["objective"]
    lines += [f"| {objective['name']} (sweep's best) | {_number(objective['candidate'])} | {_number(objective['current'])} |", ""]
    interval = review.get("data_interval") or {}
    rows = review.get("rows") or {}
    counted = ", ".join(f"{count:,} {split}" for split, count in rows.items()) if isinstance(rows, dict) else ""
    lines.append(f"**Trained on:** {counted or 'its'} rows (data `{review.get('data_fingerprint')}`"
                 + (f", interval {interval['start']} to {interval['end']})" if interval.get("start") else ")"))
    lines += ["", f"**Sweep:** study `{review.get('study')}`, run `{review.get('source_run')}`"]
    if approval.get("superseded"):
        lines += ["", f"**Supersedes** the pending request of {approval['superseded']['run']}."]
    if approval.get("report_url"):
        lines += ["", f"**Report:** [the run's Stagewise page]({approval['report_url']})"]
    return "\n".join(lines)


class GateApprovalOperator(HITLOperator):
    """Approve or reject the promotion the gate asked about; a no-op when the gate asked nothing."""

    template_fields = (*HITLOperator.template_fields, "run", "gated")

    def __init__(self, *, run: Any, gated: Any, timeout_minutes: float, respondents: list[str], **kwargs: Any) -> None:
        from airflow.sdk import Param

        super().__init__(subject="Promote the new model?", options=[APPROVE, REJECT], defaults=[REJECT], multiple=False,
                         params={"note": Param(None, type=["null", "string"], maxLength=MAX_NOTE_CHARS,
                                               description="Why (optional): kept with the decision on the model card.")},
                         response_timeout=timedelta(minutes=timeout_minutes),
                         assigned_users=[{"id": user, "name": user} for user in respondents] or None, **kwargs)
        self.run, self.gated = run, gated

    def execute(self, context: Any) -> Any:
        from stagewise import gatekeeper
        from stagewise.airflow.steps import inline, run_config

        if not self.gated.get("awaiting_approval"):
            self.log.info("no approval asked: %s", self.gated.get("reason"))
            return self.gated
        config = run_config(self.run)
        settled = inline(config, lambda: gatekeeper.settled(config, self.gated, self.run["out"]))
        if settled is not None:  # a clear after the answer, or superseded: the request is no longer open
            self.log.info("nobody is asked: %s", settled["reason"])
            return settled
        self.subject = f"{self.gated['model_name']}: promote {self.gated['version']}?"
        self.body = body(self.gated)
        self.log.info("waiting for a person: %s", self.gated["approval"]["required_actions_url"])
        return super().execute(context)

    def execute_complete(self, context: Any, event: dict[str, Any]) -> Any:
        from stagewise import gatekeeper
        from stagewise.airflow.steps import inline, run_config

        answered = super().execute_complete(context, event)
        responder = answered["responded_by_user"] or {}
        response = {"chosen": answered["chosen_options"][0], "by": responder.get("name"),
                    "at": answered["responded_at"].isoformat(), "note": (answered["params_input"] or {}).get("note") or "",
                    "timed_out": bool(event.get("timedout")) or not responder}
        config = run_config(self.run)
        return inline(config, lambda: gatekeeper.answer(config, self.gated, response, self.run["out"], context=context))
