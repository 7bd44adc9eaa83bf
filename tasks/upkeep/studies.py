"""Old studies in the pipeline's Optuna storage (the journal, or a database): which are past ``studies_days`` and
how to delete one. Only studies of the pipeline's own DAGs (``<dag_id>__<run_id>``) are ever considered, and never
one a kept model version or a running run names: a retrain warm-starts from the current model's study.

Optuna's journal is append-only: a deleted study is one more line in it, and the file shrinks only when compacted
(docs/operations.md); the bytes a study's lines take are counted as what it frees there. A study in a journal file of
its own (the default layout, stagewise.study.studies) goes with its file.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
from collections.abc import Iterable
from typing import Any

from stagewise.core import storage
from stagewise.study.studies import open_storage
from stagewise.upkeep.policy import STUDY, Removal

log = logging.getLogger("stagewise.retention")


def _journal_bytes(url: str) -> dict[int, int]:
    """Bytes of the journal's lines by study id (their ops name study_id; a trial's ops are counted to its study)."""
    if not url.startswith("journal://"):
        return {}
    sizes: dict[int, int] = {}
    trial_study: dict[int, int] = {}
    next_trial = next_study = 0
    try:
        with open(url[len("journal://"):], "rb") as handle:
            for line in handle:
                try:
                    op = json.loads(line)
                except ValueError:
                    continue
                study = op.get("study_id")
                if op.get("op_code") == 0:  # CREATE_STUDY names no id: ids are handed out in order
                    study, next_study = next_study, next_study + 1
                if op.get("op_code") == 4 and study is not None:  # CREATE_TRIAL: trial ids are handed out in order
                    trial_study[next_trial] = study
                    next_trial += 1
                if study is None and "trial_id" in op:
                    study = trial_study.get(op["trial_id"])
                if study is not None:
                    sizes[study] = sizes.get(study, 0) + len(line)
    except OSError:
        return {}
    return sizes


def plan_studies(url: str, days: int | None, now: dt.datetime, prefixes: Iterable[str], keep: set[str]) -> list[Removal]:
    """Studies whose name starts with one of ``prefixes`` (``<dag folder>__``) and whose last trial started or ended
    more than ``days`` ago, except those in ``keep``; a study with no trial is kept (it has no time to judge by)."""
    path = url[len("journal://"):] if url.startswith("journal://") else None
    if days is None or (path is not None and not os.path.exists(path)):
        return []  # opening a missing journal would create it: a dry run changes nothing
    prefixes = tuple(prefixes)
    if path is not None and os.path.basename(path).startswith(prefixes) and (
            now - dt.datetime.fromtimestamp(os.stat(path).st_mtime, dt.UTC) <= dt.timedelta(days=days)):
        return []  # a study's own file written within `days`: nothing in it is older, and no replay is needed
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    backend = open_storage(url)
    sizes = _journal_bytes(url)
    every = backend.get_all_studies()
    plan = []
    for study in every:
        name = study.study_name
        if not name.startswith(prefixes) or name in keep:
            continue
        trials = backend.get_all_trials(study._study_id, deepcopy=False)
        stamps = [t for trial in trials for t in (trial.datetime_start, trial.datetime_complete) if t is not None]
        if not stamps:
            continue
        last = max(stamp if stamp.tzinfo else stamp.astimezone(dt.UTC) for stamp in stamps)
        if now - last > dt.timedelta(days=days):
            # a journal file holding this study alone goes whole (deleter): one file, as the dry run counts it
            own_file = (url,) if path is not None and len(every) == 1 else ()
            plan.append(Removal(STUDY, name, f"no trial for {(now - last).days} days, past studies_days {days}",
                                files=own_file, bytes=sizes.get(study._study_id, 0)))
    return plan


def deleter(where: dict[str, str]) -> Any:
    """``delete(name)``: remove one study from the storage ``where[name]`` names. A journal file that holds that study
    alone (the default layout, a file per study) is removed whole: deleting the study inside would keep its lines."""
    def delete(name: str) -> None:
        import optuna

        url = where[name]
        if url.startswith("journal://") and not os.path.exists(url[len("journal://"):]):
            return  # another pass removed its file (opening it would create it again)
        backend = open_storage(url)
        if url.startswith("journal://") and [s.study_name for s in backend.get_all_studies()] == [name]:
            try:
                os.remove(url[len("journal://"):])
            except FileNotFoundError:
                pass
            return
        try:
            optuna.delete_study(study_name=name, storage=backend)
        except KeyError:  # deleted meanwhile (another pass): what this pass meant is done
            log.info("study %s was deleted already", name)
    return delete


def study_prefixes(dag_ids: Iterable[str]) -> list[str]:
    """The name prefix of each DAG's studies (stagewise.study.studies.study_name)."""
    return [f"{storage.safe_name(dag_id)}__" for dag_id in dag_ids]
