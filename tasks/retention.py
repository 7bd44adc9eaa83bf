"""Apply the pipeline's retention policy (its ``retention:`` section) to its storage root.

Run: ``python -m stagewise.retention --config pipeline.yaml --dry-run`` lists what would go, why and how many bytes,
with totals; without ``--dry-run`` it removes that and logs each step. The ``<name>_maintenance`` DAG runs it on the
policy's schedule. Never removed: the current model and its rollback target, a pinned version, files an MLflow
version or a running run still uses, anything under raw/ (only runs/, models/ and the study storage are looked at).
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
from typing import Any

from stagewise.core import storage
from stagewise.core.cli import common_parser, parse_overrides, run_subjob
from stagewise.definitions.config import PipelineConfig
from stagewise.definitions.loading import config_path, load_config
from stagewise.definitions.pipelines import dag_id, name_of
from stagewise.study.studies import journal_files, storage_kind, storage_url
from stagewise.tracking import registry as mlflow_registry
from stagewise.upkeep import inventory, ledger, policy, removal, studies
from stagewise.upkeep.inventory import RUNNING, Models, Run
from stagewise.upkeep.progress import Progress, heartbeat

log = logging.getLogger("stagewise.retention")

# The DAGs whose runs write run folders (the maintenance DAG's own runs write none).
RUN_KINDS = ("pipeline", "retrain", "batch_inference", "ingest")


def _pointer(root: str, name: str) -> dict[str, Any]:
    """``models/<name>/current.json`` (stagewise.registry's pointer), or an empty one before the first promotion."""
    uri = storage.join(root, "models", name, "current.json")
    return storage.read_json(uri) if storage.exists(uri) else {"version": None, "history": []}


def models_of(config: PipelineConfig, runs: list[Run]) -> Models:
    """The storage registry's versions of the config's model name, with what protects each from removal."""
    name, root = config.registry.model_name, config.storage_root
    models = Models(name)
    if config.registry.backend != "storage":
        return models  # MLflow keeps its versions itself: retention never deletes one
    models.versions = inventory.list_models(root, name)
    state = _pointer(root, name)
    if state.get("version"):
        models.protected[state["version"]] = "the current (champion) model"
    if state.get("history"):
        models.protected.setdefault(state["history"][-1], "the current model's rollback target")
    for version in config.retention.pinned_versions:
        models.protected.setdefault(version, "pinned (retention.pinned_versions)")
    inference = storage.safe_name(dag_id(pipeline_name(config), "batch_inference"))
    if any(run.state == RUNNING and run.dag_folder == inference for run in runs):
        # A running batch inference may score with any version its trigger named.
        models.protected.update({v.version: "a batch inference run is running" for v in models.versions
                                 if v.version not in models.protected})
    return models


def pipeline_name(config: PipelineConfig) -> str:
    return config.name or config.registry.model_name


def protect(config: PipelineConfig, runs: list[Run]) -> None:
    """Mark runs whose files something else still uses: an MLflow version's artifacts, or, while a run of the pipeline
    is running with step caching on, the runs the cache serves outputs from."""
    if config.registry.backend == "mlflow":
        try:
            sources = [v.get("source") or "" for v in mlflow_registry.versions(config)]
        except Exception as exc:  # unknown is never "unused": keep every run's files this time
            log.warning("MLflow registry not listed (%s): no run files are removed this time", exc)
            for run in runs:
                run.protected = run.protected or "the MLflow registry could not be asked which run files it uses"
            return
        inventory.protect_runs(runs, sources, "an MLflow model version's artifacts")
    if any(run.state == RUNNING for run in runs) and any(config.cache.enabled(k) for k in type(config.cache).model_fields):
        served = inventory.cache_sources(config.storage_root, pipeline_name(config))
        for run in runs:
            if run.ref in served:
                run.protected = run.protected or "the step cache serves its outputs while a run is running"


def kept_studies(config: PipelineConfig, runs: list[Run], models: Models) -> set[str] | None:
    """Studies never deleted: running runs' and those the storage registry's versions name in their cards (a retrain
    warm-starts from the current one's); None when a card cannot be read, so that no study is deleted this time."""
    keep = {f"{run.dag_folder}__{run.run_folder}" for run in runs if run.state == RUNNING}
    for version in models.versions:
        card_uri = storage.join(version.prefix, "card.json")
        try:
            keep.add(str(storage.read_json(card_uri).get("study", "")))
        except Exception as exc:
            log.warning("card %s unreadable (%s): no study is deleted this time", card_uri, exc)
            return None
    return keep


def run_dags(config: PipelineConfig) -> list[str]:
    """The pipeline's DAGs that write run folders."""
    return [dag_id(pipeline_name(config), kind) for kind in RUN_KINDS]


def plan(config: PipelineConfig, now: dt.datetime, running: list[str] = (), quiet_dags: list[str] = ()) -> tuple[
        list[policy.Removal], Any]:
    """Everything the config's retention policy removes now, and the study deleter; nothing is touched."""
    rules = config.retention
    dag_ids = run_dags(config)
    runs = inventory.list_runs(config.storage_root, dag_ids, now, rules.idle_hours, running, quiet_dags)
    protect(config, runs)
    for run in runs:
        if run.protected:
            log.info("keeping %s: %s", run.ref, run.protected)
    models = models_of(config, runs)
    for version, why in sorted(models.protected.items()):
        log.info("keeping model %s/%s: %s", models.name, version, why)
    removals = policy.plan_runs(rules, runs, now) + policy.plan_models(rules, models)
    delete = None
    urls = _study_urls(config)
    if urls and rules.studies_days is not None:
        if (keep := kept_studies(config, runs, models)) is not None:
            where: dict[str, str] = {}
            progress = Progress("planning studies", len(urls), "study storages")
            for url in urls:
                found = studies.plan_studies(url, rules.studies_days, now, studies.study_prefixes(dag_ids), keep)
                found = [r for r in found if r.target not in where]  # one name in two files: the first one's
                where.update({r.target: url for r in found})
                removals += found
                progress.add(1)
            progress.done()
            delete = studies.deleter(where)
    return removals, delete


def _study_urls(config: PipelineConfig) -> list[str]:
    """The sweep's study storages: each journal file holding its studies (a file per study by default, and the old
    shared one while it exists), or the database; none where it cannot be reached from here (a connection's URL
    outside Airflow)."""
    try:
        if storage_kind(config.sweep) == "journal":
            return [f"journal://{path}" for path in journal_files(config)]
        return [storage_url(config.sweep)]
    except Exception as exc:
        log.warning("study storage not opened (%s): no study is deleted", exc)
        return []


def run(config: PipelineConfig, dry_run: bool, running: list[str] = (), now: dt.datetime | None = None,
        quiet_dags: list[str] = ()) -> dict[str, Any]:
    """Plan and (unless ``dry_run``) remove; returns the job's result (each removal, totals). ``running`` and
    ``quiet_dags``: what Airflow says (stagewise.upkeep.inventory.list_runs)."""
    now = now or dt.datetime.now(dt.UTC)
    if dry_run:  # removes nothing: no lock, no note
        removals, delete = plan(config, now, running, quiet_dags)
        result = removal.apply(removals, dry_run, now, delete)
    else:
        root, name = config.storage_root, pipeline_name(config)
        lock, holder = ledger.acquire(root, name)
        if lock is None:
            log.warning("another retention pass holds %s's storage (%s): this one removes nothing", name, holder)
            return {**removal.summary([], dry_run), "skipped": f"another retention pass holds it: {holder}"}
        beat = heartbeat.set(lock.refresh)
        try:
            result = _remove(config, now, running, quiet_dags)
        finally:
            heartbeat.reset(beat)
            lock.release()
    verb = "would free" if dry_run else "freed"
    for kind, totals in result["by_kind"].items():
        log.info("%s: %d, %d file(s), %s", kind, totals["count"], totals["files"], removal.human(totals["bytes"]))
    log.info("retention %s %s in %d file(s) under %s", verb, removal.human(result["total_bytes"]), result["total_files"],
             config.storage_root)
    return result


def _remove(config: PipelineConfig, now: dt.datetime, running: list[str], quiet_dags: list[str]) -> dict[str, Any]:
    """A real pass under the lock: finish what stopped passes noted, note this pass's plan, remove, mark it done."""
    root, name = config.storage_root, pipeline_name(config)
    stopped = ledger.unfinished(root, name)
    removals, delete = plan(config, now, running, quiet_dags)
    this_pass = ledger.pass_id(now)
    note = ledger.begin(root, name, this_pass, now.strftime("%Y-%m-%dT%H:%M:%SZ"), removals)  # before anything goes
    result = removal.apply(removals, False, now, delete, this_pass, [n.get("pass") for _, n in stopped])
    ledger.finish(note, result, stopped, this_pass)
    ledger.prune(root, name, now, config.retention.keep_records_days)
    return {**result, "pass": this_pass, "note": note}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Apply the pipeline's retention policy to its storage root.",
                                     parents=[common_parser()])
    parser.add_argument("--dry-run", action="store_true", help="list what would go, why and its bytes; remove nothing")
    parser.add_argument("--running", action="append", default=[], metavar="DAG_ID/RUN_ID",
                        help="a run Airflow reports running: nothing of it goes (repeatable)")
    parser.add_argument("--no-runs-in", action="append", default=[], metavar="DAG_ID",
                        help="Airflow has no queued or running run of this DAG: its unfinished runs failed (repeatable)")
    parser.add_argument("--now", default=None, help="judge ages as of this ISO time (default: now; for what-ifs)")
    args = parser.parse_args(argv)

    def work() -> dict[str, Any]:
        config = load_config(args.config, parse_overrides(args.override))
        if not config.name:
            config = config.model_copy(update={"name": name_of(config_path(args.config))})
        now = dt.datetime.fromisoformat(args.now) if args.now else None
        if now is not None and now.tzinfo is None:
            now = now.replace(tzinfo=dt.UTC)
        try:
            return run(config, args.dry_run, args.running, now, args.no_runs_in)
        except ledger.NoteNotWritten as exc:  # a retry may find space again; nothing unnoted was removed
            log.error("%s", exc)
            raise SystemExit(1) from None

    run_subjob("retention", work, args.result_file)


if __name__ == "__main__":
    main()
