"""ml_pipeline: sharded preprocessing -> Optuna sweep -> growing-batch DDP stages -> evaluate -> batch inference.

Wiring only: the config (pipeline.yaml, or $STAGEWISE_CONFIG) decides the stages and each task's
instance profile; the work runs in ``tasks/`` sub-jobs. Run: ``airflow dags test ml_pipeline``.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import dag, task

from stagewise_airflow import steps
from stagewise_airflow.params import pipeline_params
from stagewise_airflow.profiles import task_kwargs
from tasks.config import load_config

CONFIG = load_config()


def knobs(profile: str) -> dict:
    return task_kwargs(CONFIG.profile(profile))


@dag(
    dag_id="ml_pipeline",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=4,
    params=pipeline_params(CONFIG),
    tags=["stagewise", "ml"],
    doc_md=__doc__,
)
def ml_pipeline() -> None:
    bookkeeping = knobs(CONFIG.preprocess.profile)
    run = task(steps.start_run, task_id="start_run", retries=0)()

    shards = task(steps.plan_shards, task_id="plan_shards", **bookkeeping)(run)
    stats = task(steps.preprocess_stats, task_id="preprocess_stats", **knobs(CONFIG.preprocess.profile)).partial(run=run).expand(shard=shards)
    reduced = task(steps.reduce_stats, task_id="reduce_stats", **bookkeeping)(run, stats)
    transformed = task(steps.preprocess_transform, task_id="preprocess_transform", **knobs(CONFIG.preprocess.profile)).partial(
        run=run, reduced=reduced).expand(shard=shards)
    prepared = task(steps.commit_preprocess, task_id="commit_preprocess", **bookkeeping)(run, reduced, transformed)

    worker_ids = task(steps.create_study, task_id="create_study", **bookkeeping)(run, prepared)
    workers = task(steps.sweep_worker, task_id="sweep_worker", **knobs(CONFIG.sweep.profile)).partial(run=run).expand(worker=worker_ids)
    swept = task(steps.sweep_summary, task_id="sweep_summary", **bookkeeping)(run, workers)

    trained, previous = [], None
    for stage in CONFIG.train.stages:
        previous = task(steps.train_stage, task_id=f"train_{stage.name}", **knobs(stage.profile))(run, stage.name, swept, previous)
        trained.append(previous)

    evaluation = task(steps.evaluate, task_id="evaluate", **knobs(CONFIG.evaluate.profile))(run, previous)
    inference_shards = task(steps.plan_inference, task_id="plan_inference", **bookkeeping)(run, evaluation)
    scored = task(steps.infer_shard, task_id="infer_shard", **knobs(CONFIG.inference.profile)).partial(
        run=run, trained=previous).expand(shard=inference_shards)
    predictions = task(steps.commit_predictions, task_id="commit_predictions", **bookkeeping)(run, previous, scored)

    task(steps.write_report, task_id="report", **bookkeeping)(
        run, stats=stats, reduced=reduced, transformed=transformed, prepared=prepared, workers=workers, swept=swept,
        trained=trained, evaluation=evaluation, scored=scored, predictions=predictions)


ml_pipeline()
