"""What a retention policy removes from an inventory, and why: a pure function of the runs, the model versions, the
policy and the time, so a dry run and the real run list the same files and a simulation can run it for a year.

Ages of a run count from its start as it recorded it (stagewise.reporting.run_dates, set by the inventory; never a
file's time where the run recorded one, and never later than now): a report updated by retention keeps its run's age.
A failed run's idle time counts from its last recorded activity.

A finished run goes in steps: its checkpoints (all but each stage's model.pt and JSON records) and its predictions
after their ages, everything but its record (the run folder's top-level files: report.json, report.html,
config.yaml, lineage.json) once it is past ``keep_runs`` or ``keep_runs_days``, and the record after
``keep_records_days``. A failed run keeps its record and loses the rest after ``failed_days`` idle.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from stagewise.core import storage
from stagewise.definitions.retention import Retention
from stagewise.reporting.run_dates import RunDates
from stagewise.upkeep.inventory import FAILED, FINISHED, Entry, Models, Run

RUN, RUN_FILES, CHECKPOINTS, PREDICTIONS, PENDING, MODEL, STUDY = (
    "run", "run files", "checkpoints", "predictions", "pending tracking", "model version", "study")


@dataclass(frozen=True)
class Removal:
    """One thing that goes: what kind, which run/version/study, why, its files (URIs) and their bytes."""

    what: str
    target: str
    reason: str
    files: tuple[str, ...] = ()
    bytes: int = 0
    prefix: str = ""  # the folder it belongs to: a whole run or version goes with its folder
    dates: RunDates | None = field(default=None, compare=False)  # its run's recorded dates: its note pins them

    @property
    def whole(self) -> bool:
        return self.what in (RUN, MODEL)


def is_record(entry: Entry) -> bool:
    """A run's record, kept while the rest goes: the run folder's own files (report, config snapshot, lineage)."""
    return "/" not in entry.path


def is_checkpoint(entry: Entry) -> bool:
    """A training stage's resumable state: everything under ``train/<stage>/`` but model.pt and its JSON records."""
    parts = entry.path.split("/")
    if len(parts) < 3 or parts[0] != "train":
        return False
    rest = "/".join(parts[2:])
    return rest != "model.pt" and not ("/" not in rest and rest.endswith(".json"))


def is_prediction(entry: Entry) -> bool:
    return entry.path.startswith("predictions/")


def is_pending(entry: Entry) -> bool:
    return entry.path.startswith("tracking/pending/")


def started(run: Run) -> dt.datetime:
    """When the run began, as it recorded it (stagewise.upkeep.inventory.date)."""
    return run.started


def _days(delta: dt.timedelta) -> str:
    return f"{delta.total_seconds() / 86_400:.1f} days"


def _removal(what: str, run: Run, reason: str, entries: Iterable[Entry]) -> Removal | None:
    chosen = list(entries)
    if not chosen:
        return None
    return Removal(what, run.ref, reason, tuple(storage.join(run.prefix, e.path) for e in chosen),
                   sum(e.size for e in chosen), run.prefix, run.dates)


def _older(now: dt.datetime, when: dt.datetime, days: int | None) -> bool:
    return days is not None and now - when > dt.timedelta(days=days)


def plan_runs(policy: Retention, runs: list[Run], now: dt.datetime) -> list[Removal]:
    """What goes of ``runs`` (running and protected runs: nothing), oldest first within each DAG."""
    plan: list[Removal] = []
    finished: dict[str, list[Run]] = {}
    for run in runs:
        if run.state == FINISHED and not run.protected:
            finished.setdefault(run.dag_folder, []).append(run)
    for group in finished.values():
        began = {run.ref: started(run) for run in group}
        group.sort(key=lambda run: began[run.ref], reverse=True)
        for rank, run in enumerate(group):
            plan.extend(_finished(policy, run, rank, began[run.ref], now))
    for run in runs:
        if run.state == FAILED and not run.protected:
            plan.extend(_failed(policy, run, now))
    return plan


def _finished(policy: Retention, run: Run, rank: int, began: dt.datetime, now: dt.datetime) -> list[Removal]:
    began = min(began, now)  # a start later than now (a skewed clock) makes the run new, never old
    age = now - began
    if _older(now, began, policy.keep_records_days):
        return [_whole(run, f"finished run started {_days(age)} ago, past keep_records_days {policy.keep_records_days}")]
    beyond_count = policy.keep_runs is not None and rank >= policy.keep_runs
    if beyond_count or _older(now, began, policy.keep_runs_days):
        reason = (f"finished run beyond the newest keep_runs {policy.keep_runs} of its DAG (number {rank + 1})"
                  if beyond_count else f"finished run started {_days(age)} ago, past keep_runs_days {policy.keep_runs_days}")
        found = _removal(RUN_FILES, run, reason + "; its record stays", (e for e in run.files if not is_record(e)))
        return [found] if found else []
    steps: list[tuple[str, Callable[[Entry], bool], int | None, str]] = [
        (CHECKPOINTS, is_checkpoint, policy.checkpoints_days, "checkpoints_days"),
        (PREDICTIONS, is_prediction, policy.predictions_days, "predictions_days")]
    plan = [found for what, test, days, key in steps if _older(now, began, days)
            and (found := _removal(what, run, f"finished run started {_days(age)} ago, past {key} {days}",
                                   (e for e in run.files if test(e))))]
    pending = [e for e in run.files if is_pending(e) and _older(now, e.modified, policy.pending_tracking_days)]
    if found := _removal(PENDING, run, f"unsent tracking records past pending_tracking_days {policy.pending_tracking_days}",
                         pending):
        plan.append(found)
    return plan


def _failed(policy: Retention, run: Run, now: dt.datetime) -> list[Removal]:
    last = min(run.last_activity, now)
    idle = now - last
    if _older(now, last, policy.keep_records_days):
        return [_whole(run, f"failed run idle {_days(idle)}, past keep_records_days {policy.keep_records_days}")]
    if _older(now, last, policy.failed_days):
        found = _removal(RUN_FILES, run, f"failed run idle {_days(idle)}, past failed_days {policy.failed_days}; its "
                                         f"record stays", (e for e in run.files if not is_record(e)))
        return [found] if found else []
    return []


def _whole(run: Run, reason: str) -> Removal:
    # the record last and report.json very last: a pass stopped midway leaves a run that still reads as what it was
    ordered = sorted(run.files, key=lambda e: (is_record(e), e.path == "report.json", e.path))
    return Removal(RUN, run.ref, reason, tuple(storage.join(run.prefix, e.path) for e in ordered),
                   sum(e.size for e in run.files), run.prefix, run.dates)


def plan_models(policy: Retention, models: Models) -> list[Removal]:
    """Registered versions past the newest ``keep_model_versions`` that nothing protects."""
    if policy.keep_model_versions is None:
        return []
    newest_first = sorted(models.versions, key=lambda v: v.registered_at, reverse=True)
    plan = []
    for rank, version in enumerate(newest_first):
        if rank < policy.keep_model_versions or version.version in models.protected:
            continue
        plan.append(Removal(MODEL, f"{models.name}/{version.version}",
                            f"registered version number {rank + 1}, beyond keep_model_versions {policy.keep_model_versions}",
                            tuple(storage.join(version.prefix, e.path) for e in version.files),
                            sum(e.size for e in version.files), version.prefix))
    return plan
