"""Every pipeline config of the deployment as its family of DAGs; the one call a dags folder needs.

A file in the team's dags folder (Airflow parses files that mention ``airflow`` and ``dag``)::

    from stagewise.airflow.dags import build_pipelines  # airflow: one DAG family per pipeline config
    build_pipelines(globals())  # or build_pipelines(globals(), "/opt/team/pipelines")

Naming, sources and isolation: :mod:`stagewise.definitions.pipelines`. A task's own process builds only the DAG it
runs (Airflow's ``get_parsing_context()``), so a deployment of many pipelines costs each task one config load.
A config that does not load keeps its DAG ids, as DAGs whose only task fails naming the file and the key, and
leaves the other pipelines' DAGs as they are.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from airflow.sdk import DAG, AssetOrTimeSchedule, CronTriggerTimetable, Param, dag, task

from stagewise.airflow import steps, wiring
from stagewise.airflow.params import inference_params, pipeline_params
from stagewise.definitions.config import ConfigError, PipelineConfig
from stagewise.definitions.loading import load_config
from stagewise.definitions.pipelines import PipelineFile, collisions, discover

log = logging.getLogger(__name__)

TRAINING_DOC = """Sharded preprocessing -> Optuna sweep -> growing-batch DDP stages -> evaluate -> gate -> batch inference.

The pipeline config (``{path}``) decides the stages and each task's instance profile; the work runs in
``tasks/`` sub-jobs. Run: ``airflow dags test {dag_id}``.
"""
RETRAIN_DOC = """The pipeline ``{name}`` on a cron schedule and whenever new raw data lands (an Airflow Asset).

The sweep warm-starts from the current model's study with the smaller retrain budget (``retrain.num_trials``);
the new model replaces the current one only if it passes the gate. New data: a ``{name}_ingest`` run, or
``POST /api/v2/assets/events`` for the raw-data asset (``{asset}``). Config: ``{path}``.
"""
INFERENCE_DOC = """Score any Parquet data set with a model registered by ``{name}``, in parallel shards.

Params: ``input_uri`` (raw-schema Parquet file or folder) and ``model_version`` (empty: the current model).
Output: ``runs/{dag_id}/<run_id>/predictions/`` with a manifest, and report.json. Config: ``{path}``.
"""
INGEST_DOC = """Copy new raw Parquet shards into ``{name}``'s data set and announce them (the Asset).

A finished run emits an event on the raw-data asset (``{asset}``), which triggers ``{name}_retrain`` (and the
retrain DAG of every other pipeline reading the same data: Airflow keeps one active asset per URI).
Param ``source_uri``: a Parquet file or folder with the data set's schema. Config: ``{path}``.
"""


def _with_params(built: DAG, params: dict[str, Param]) -> DAG:
    """Give the DAG its trigger-form Params once its tasks exist.

    Airflow deep-copies a DAG's params into each task at every level of the task's constructor, about a third of
    the parse time of a folder of pipelines; a task's run merges the DAG's params under its own (empty) ones anyway
    (``process_params``), so runs, the form and the serialized DAG see the same Params. Assigning converts and
    validates them as the constructor does.
    """
    built.params = params
    return built


def _training(config: PipelineConfig, config_file: str, mode: str) -> None:
    """ml_pipeline's shape; start_run in retrain mode gives the sweep the retrain budget and the warm start."""
    run = wiring.start(config, config_file, mode=mode)
    data = wiring.preprocess(config, run)
    swept = wiring.sweep(config, run, data)
    trained = wiring.train_stages(config, run, swept)
    gated = wiring.evaluate_and_gate(config, run, swept, trained)
    wiring.report(config, run, data, swept, trained, gated, wiring.inference_chain(config, run, gated["gated"]))


def training_dag(pipeline: PipelineFile, config: PipelineConfig) -> DAG:
    dag_id, path = pipeline.dag_id("pipeline"), str(pipeline.path)

    @dag(dag_id=dag_id, auto_register=False, schedule=None,
         doc_md=TRAINING_DOC.format(path=path, dag_id=dag_id), **wiring.dag_settings(config, pipeline.name))
    def training() -> None:
        _training(config, path, "pipeline")

    return _with_params(training(), pipeline_params(config))


def retrain_dag(pipeline: PipelineFile, config: PipelineConfig) -> DAG:
    dag_id, path, asset = pipeline.dag_id("retrain"), str(pipeline.path), wiring.raw_data_asset(config)
    schedule = AssetOrTimeSchedule(timetable=CronTriggerTimetable(config.retrain.schedule, timezone="UTC"),
                                   assets=[asset])

    @dag(dag_id=dag_id, auto_register=False, schedule=schedule,
         doc_md=RETRAIN_DOC.format(name=pipeline.name, asset=asset.name, path=path),
         **wiring.dag_settings(config, pipeline.name, "retrain", max_active_runs=1))
    def retrain() -> None:
        _training(config, path, "retrain")

    return _with_params(retrain(), pipeline_params(config))


def batch_inference_dag(pipeline: PipelineFile, config: PipelineConfig) -> DAG:
    dag_id, path = pipeline.dag_id("batch_inference"), str(pipeline.path)

    @dag(dag_id=dag_id, auto_register=False, schedule=None,
         doc_md=INFERENCE_DOC.format(name=pipeline.name, dag_id=dag_id, path=path),
         **wiring.dag_settings(config, pipeline.name, "inference"))
    def batch_inference() -> None:
        run = wiring.start(config, path, mode="inference")
        model = task(steps.resolve_model, task_id="resolve_model",
                     **{**wiring.knobs(config, config.preprocess.profile), "retries": 0})(run)
        inferred = wiring.inference_chain(config, run, model)
        task(steps.write_inference_report, task_id="report", **wiring.knobs(config, config.preprocess.profile))(
            run, model, inferred["scored"], inferred["predictions"])

    return _with_params(batch_inference(), inference_params(config))


def ingest_dag(pipeline: PipelineFile, config: PipelineConfig) -> DAG:
    dag_id, path, asset = pipeline.dag_id("ingest"), str(pipeline.path), wiring.raw_data_asset(config)

    @dag(dag_id=dag_id, auto_register=False, schedule=None, doc_md=INGEST_DOC.format(name=pipeline.name, asset=asset.name, path=path),
         **wiring.dag_settings(config, pipeline.name, "data"))
    def ingest() -> None:
        task(steps.ingest, task_id="ingest", outlets=[asset], **wiring.knobs(config, config.preprocess.profile))(path)

    return _with_params(ingest(), {"source_uri": Param("", type="string", minLength=1,
                                                       description="New raw Parquet file or folder to add.")})


# Every DAG here has auto_register=False: a builder that fails half-way must leave no DAG behind to shadow its
# placeholder; the DAGs reach Airflow through the DAG file's globals (build_pipelines).
FAMILY: dict[str, Callable[[PipelineFile, PipelineConfig], DAG]] = {
    "pipeline": training_dag, "retrain": retrain_dag, "batch_inference": batch_inference_dag, "ingest": ingest_dag}
"""The DAG builder of each kind in stagewise.definitions.pipelines.KINDS."""


def broken_dag(dag_id: str, error: str) -> DAG:
    """A pipeline whose config does not load: its DAG id stays, its doc says why, and its one task fails naming the
    file and key without retry (the config is the user's to fix), so a run never silently uses other values."""
    import pendulum

    def config_error() -> None:
        from airflow.sdk.exceptions import AirflowFailException

        raise AirflowFailException(error)

    with DAG(dag_id, schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False,
             tags=["stagewise", "config error"], doc_md=f"**This pipeline's config does not load:**\n\n```\n{error}\n```",
             is_paused_upon_creation=True, auto_register=False) as broken:
        task(config_error, task_id="config_error", retries=0)()
    return broken


def build_pipelines(namespace: dict[str, Any], setting: str | None = None) -> list[str]:
    """Add every pipeline's DAGs to ``namespace`` (a DAG file's ``globals()``); returns the DAG ids added.

    ``setting``: folders or files of pipeline configs (as $STAGEWISE_PIPELINES); default that variable, else
    $STAGEWISE_CONFIG, else the checkout's pipeline.yaml and examples/.
    """
    from airflow.sdk import get_parsing_context

    wanted = get_parsing_context().dag_id  # set in a task's process: build that DAG only
    pipelines = [pipeline for pipeline in discover(setting) if wanted is None or wanted in pipeline.dag_ids().values()]
    loaded, errors = {}, {}
    for pipeline in pipelines:
        try:
            loaded[pipeline] = load_config(pipeline.path)
        except ConfigError as exc:
            errors[pipeline] = str(exc)
    if wanted is None:  # a full parse sees every pipeline: refuse those that would share a registry
        errors.update(collisions(loaded))
    added: dict[str, DAG] = {}
    for pipeline in pipelines:
        kinds = {kind: dag_id for kind, dag_id in pipeline.dag_ids().items() if wanted in (None, dag_id)}
        family = {}
        if pipeline not in errors:
            try:
                family = {dag_id: FAMILY[kind](pipeline, loaded[pipeline]) for kind, dag_id in kinds.items()}
            except Exception as exc:  # e.g. a team callback that does not import: this pipeline's error only
                errors[pipeline] = f"{pipeline.path}: {type(exc).__name__}: {exc}"
        if pipeline in errors:
            log.error("pipeline %s: %s", pipeline.name, errors[pipeline])
            family = {dag_id: broken_dag(dag_id, errors[pipeline]) for dag_id in kinds.values()}
        added.update(family)
    namespace.update(added)
    return list(added)
