"""Every pipeline config of the deployment as its family of DAGs; the two calls a dags folder needs.

Two files in the team's dags folder (Airflow parses files that mention ``airflow`` and ``dag``)::

    # stagewise_pipelines.py: one DAG family per pipeline config
    from stagewise.airflow.dags import build_pipelines
    build_pipelines(globals(), "/opt/team/pipelines")

    # stagewise_pipelines_check.py: the pipelines' config errors, as this file's import error
    from stagewise.airflow.dags import check_pipelines
    check_pipelines("/opt/team/pipelines")

Naming, sources and isolation: :mod:`stagewise.definitions.pipelines`. A task's own process builds only the DAG it
runs (Airflow's ``get_parsing_context()``), so a deployment of many pipelines costs each task one config load.

A run is an island: a config that stops loading, clashes with an older pipeline or is deleted keeps its DAGs at their
last valid version (:mod:`stagewise.definitions.last_valid`), so its running runs finish with the tasks they started
with, while a new run fails at its first task naming the file and key; the other pipelines' DAGs are untouched. The
errors are an import error of a second DAG file that defines no DAG (``check_pipelines``): an import error marks every
DAG of its file stale, and Airflow never schedules a stale DAG's running runs again. A config that never loaded gets
DAGs whose only task fails naming the file and key. A deleted pipeline, or the old name of one renamed in place,
retires: its DAGs stay for their running runs on no schedule (tag ``retired``) until ``python -m stagewise.config
--forget NAME``. A contested registry name stays with the pipeline the registry's owner record names
(:mod:`stagewise.models.owners`), as the CLI check decides it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from airflow.sdk import DAG, AssetOrTimeSchedule, CronTriggerTimetable, Param, dag, task

from stagewise.airflow import steps, wiring
from stagewise.airflow.params import inference_params, pipeline_params
from stagewise.core.cli import skip_final_collection
from stagewise.definitions.bookkeeping import BOOKKEEPING
from stagewise.definitions.config import PipelineConfig
from stagewise.definitions.last_valid import LastValid
from stagewise.definitions.pipelines import PipelineFile, Resolved, last_valid, resolve
from stagewise.models import owners

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
MAINTENANCE_DOC = """Apply ``{name}``'s retention policy (``retention:`` in ``{path}``) to its storage root on ``{schedule}``.

One task runs ``python -m stagewise.retention``: old runs, checkpoints, predictions, model versions and studies go as
the policy says; never the current model, a pinned version, what a running run or an MLflow version needs, nor raw/.
Airflow's own metadata and task logs are the deployment's to trim (docs/operations.md).
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


def _training(config: PipelineConfig, config_file: str, mode: str, refusal: str | None) -> None:
    """ml_pipeline's shape; start_run in retrain mode gives the sweep the retrain budget and the warm start."""
    run = _start(config, config_file, mode, refusal)
    data = wiring.preprocess(config, run)
    swept = wiring.sweep(config, run, data)
    trained = wiring.train_stages(config, run, swept)
    gated = wiring.evaluate_and_gate(config, run, swept, trained)
    wiring.report(config, run, data, swept, trained, gated, wiring.inference_chain(config, run, gated["gated"]))


def _doc(text: str, retired: str | None) -> str:
    """A DAG's doc; a retired pipeline's says so first (the UI shows it above the DAG)."""
    if retired is None:
        return text
    return (f"**{retired}.** No schedule: its running runs finish, a new run fails. `python -m stagewise.config "
            f"--forget NAME` drops these DAGs (their runs stay in Airflow, their reports and models in the registry).\n\n"
            + text)


def training_dag(pipeline: PipelineFile, config: PipelineConfig, refusal: str | None = None,
                 retired: str | None = None) -> DAG:
    dag_id, path = pipeline.dag_id("pipeline"), str(pipeline.path)

    @dag(dag_id=dag_id, auto_register=False, schedule=None,
         doc_md=_doc(TRAINING_DOC.format(path=path, dag_id=dag_id), retired), **wiring.dag_settings(config, pipeline.name))
    def training() -> None:
        _training(config, path, "pipeline", refusal)

    return _with_params(training(), pipeline_params(config))


def retrain_dag(pipeline: PipelineFile, config: PipelineConfig, refusal: str | None = None,
                retired: str | None = None) -> DAG:
    dag_id, path, asset = pipeline.dag_id("retrain"), str(pipeline.path), wiring.raw_data_asset(config)
    # A retired pipeline's schedule stops: every interval or data event would only start a run that fails.
    schedule = None if retired else AssetOrTimeSchedule(
        timetable=CronTriggerTimetable(config.retrain.schedule, timezone="UTC"), assets=[asset])

    @dag(dag_id=dag_id, auto_register=False, schedule=schedule,
         doc_md=_doc(RETRAIN_DOC.format(name=pipeline.name, asset=asset.name, path=path), retired),
         **wiring.dag_settings(config, pipeline.name, "retrain", max_active_runs=1))
    def retrain() -> None:
        _training(config, path, "retrain", refusal)

    return _with_params(retrain(), pipeline_params(config))


def batch_inference_dag(pipeline: PipelineFile, config: PipelineConfig, refusal: str | None = None,
                        retired: str | None = None) -> DAG:
    dag_id, path = pipeline.dag_id("batch_inference"), str(pipeline.path)

    @dag(dag_id=dag_id, auto_register=False, schedule=None,
         doc_md=_doc(INFERENCE_DOC.format(name=pipeline.name, dag_id=dag_id, path=path), retired),
         **wiring.dag_settings(config, pipeline.name, "inference"))
    def batch_inference() -> None:
        run = _start(config, path, "inference", refusal)
        model = task(steps.resolve_model, task_id="resolve_model",
                     **{**wiring.knobs(config, BOOKKEEPING), "retries": 0})(run)
        inferred = wiring.inference_chain(config, run, model)
        task(steps.write_inference_report, task_id="report", **wiring.knobs(config, BOOKKEEPING))(
            run, model, inferred["scored"], inferred["predictions"])

    return _with_params(batch_inference(), inference_params(config))


def ingest_dag(pipeline: PipelineFile, config: PipelineConfig, refusal: str | None = None,
               retired: str | None = None) -> DAG:
    dag_id, path, asset = pipeline.dag_id("ingest"), str(pipeline.path), wiring.raw_data_asset(config)

    @dag(dag_id=dag_id, auto_register=False, schedule=None,
         doc_md=_doc(INGEST_DOC.format(name=pipeline.name, asset=asset.name, path=path), retired),
         **wiring.dag_settings(config, pipeline.name, "data"))
    def ingest() -> None:
        knobs = wiring.knobs(config, BOOKKEEPING)
        if refusal is None:
            task(steps.ingest, task_id="ingest", outlets=[asset], **knobs)(path)
        else:
            task(_fail_with, task_id="ingest", **{**knobs, "retries": 0})(refusal)

    return _with_params(ingest(), {"source_uri": Param("", type="string", minLength=1,
                                                       description="New raw Parquet file or folder to add.")})


def maintenance_dag(pipeline: PipelineFile, config: PipelineConfig, refusal: str | None = None,
                    retired: str | None = None) -> DAG:
    dag_id, path = pipeline.dag_id("maintenance"), str(pipeline.path)
    from stagewise.airflow import maintenance

    # A broken or retired pipeline removes nothing: its last valid policy may no longer be what its team wants.
    schedule = None if refusal or retired else CronTriggerTimetable(config.retention.schedule, timezone="UTC")

    @dag(dag_id=dag_id, auto_register=False, schedule=schedule,
         doc_md=_doc(MAINTENANCE_DOC.format(name=pipeline.name, path=path, schedule=config.retention.schedule), retired),
         **wiring.dag_settings(config, pipeline.name, "maintenance", max_active_runs=1))
    def maintenance_run() -> None:
        knobs = {**wiring.knobs(config, BOOKKEEPING), "retries": 0}  # light work; the next scheduled run is the retry
        if refusal is None:
            task(maintenance.apply_retention, task_id="apply_retention", **knobs)(path)
        else:
            task(_fail_with, task_id="apply_retention", **knobs)(refusal)

    return maintenance_run()


# Every DAG here has auto_register=False: a builder that fails half-way must leave no DAG behind to shadow its
# placeholder; the DAGs reach Airflow through the DAG file's globals (build_pipelines).
FAMILY: dict[str, Callable[[PipelineFile, PipelineConfig, str | None, str | None], DAG]] = {
    "pipeline": training_dag, "retrain": retrain_dag, "batch_inference": batch_inference_dag, "ingest": ingest_dag,
    "maintenance": maintenance_dag}
"""The DAG builder of each kind in stagewise.definitions.pipelines.KINDS."""


def broken_dag(dag_id: str, error: str) -> DAG:
    """A pipeline that never loaded (no last valid version): its DAG id stays, its doc says why, and its one task
    fails naming the file and key without retry (the config is the user's to fix)."""
    import pendulum

    with DAG(dag_id, schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False,
             tags=["stagewise", "config error"], doc_md=f"**This pipeline's config does not load:**\n\n```\n{error}\n```",
             is_paused_upon_creation=True, auto_register=False) as broken:
        task(_fail_with, task_id="config_error", retries=0)(error)
    return broken


def _fail_with(error: str) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    raise AirflowFailException(error)


def _start(config: PipelineConfig, config_file: str, mode: str, refusal: str | None) -> Any:
    """A run's first task; for a pipeline whose file is broken, clashes or is gone (``refusal``) its DAGs keep their
    last valid shape, so running runs finish, and a new run's first task fails naming the file and key, no retry."""
    if refusal is None:
        return wiring.start(config, config_file, mode=mode)
    return task(_fail_with, task_id="start_run", **{**wiring.knobs(config, BOOKKEEPING), "retries": 0})(
        refusal)


def pipeline_state(setting: str | None) -> LastValid | None:
    """Where the last valid versions of ``setting``'s pipelines are kept (:mod:`stagewise.definitions.last_valid`):
    by the pipelines folder as configured, so a git-sync revision keeps them; none in CI mode."""
    return last_valid(setting)


def build_pipelines(namespace: dict[str, Any], setting: str | None = None) -> list[str]:
    """Add every pipeline's DAGs to ``namespace`` (a DAG file's ``globals()``); returns the DAG ids added.

    ``setting``: folders or files of pipeline configs (as $STAGEWISE_PIPELINES); default that variable, else
    $STAGEWISE_CONFIG, else the checkout's pipeline.yaml and examples/. A pipeline whose file is broken, clashes or
    is gone keeps its last valid DAGs (its running runs finish) and never raises here: the errors are
    :func:`check_pipelines`' to show, as an import error of a DAG file of their own.
    """
    from airflow.sdk import get_parsing_context

    skip_final_collection()  # `airflow dags test` (CI's recipe) exits without a last pass over Airflow's whole heap
    context = get_parsing_context()  # set in a task's process: build that DAG only
    wanted = context.dag_id
    # A run's first task checks the clashes again (a new run of a refused pipeline fails); other tasks skip loading
    # every other pipeline.
    first_task = context.task_id in (None, "start_run", "ingest")
    resolved = resolve(setting, wanted=wanted, check_clashes=wanted is None or first_task,
                       state=pipeline_state(setting), remember=True, owner_of=owners.read)
    added = _families(resolved, wanted)
    for error in resolved.errors.values():
        log.error("%s", error)
    namespace.update(added)
    return list(added)


def _families(resolved: Resolved, wanted: str | None) -> dict[str, DAG]:
    """Each resolved pipeline's DAGs (only ``wanted`` where set); one that fails to build (a team callback that does
    not import) becomes that pipeline's error, in ``resolved``."""
    added: dict[str, DAG] = {}
    for pipeline, config in resolved.configs.items():
        kinds = {kind: dag_id for kind, dag_id in pipeline.dag_ids().items() if wanted in (None, dag_id)}
        try:
            refusal, retired = resolved.refused.get(pipeline), resolved.retired.get(pipeline)
            built = {dag_id: FAMILY[kind](pipeline, config, refusal, retired) for kind, dag_id in kinds.items()}
            for retired_dag in built.values() if retired else ():
                retired_dag.tags.add("retired")  # the DAG list's filter finds what --forget may drop
            added.update(built)
        except Exception as exc:
            resolved.broken[pipeline] = resolved.errors[str(pipeline.path)] = f"{pipeline.path}: {type(exc).__name__}: {exc}"
    for pipeline, error in resolved.broken.items():
        added.update({dag_id: broken_dag(dag_id, error) for dag_id in pipeline.dag_ids().values()
                      if wanted in (None, dag_id)})
    return added


class PipelineConfigErrors(Exception):
    """Every broken, clashing or deleted pipeline config of a deployment, each naming its file and key."""


def check_pipelines(setting: str | None = None) -> None:
    """Raise :class:`PipelineConfigErrors` naming every pipeline error of ``setting``; nothing if all load.

    Called from a DAG file of its own that defines no DAG, so the errors are that file's import error (``airflow dags
    list-import-errors``, the REST import errors, the UI's banner) while the DAG file's DAGs stay active: Airflow marks
    stale every DAG of a file that has an import error, and a stale DAG's running runs are never scheduled again.
    """
    from airflow.sdk import get_parsing_context

    if get_parsing_context().dag_id is not None:
        return  # a task's process: not this file's concern
    resolved = resolve(setting, state=pipeline_state(setting), owner_of=owners.read)
    _families(resolved, None)  # what only building the DAGs finds (a team callback that does not import)
    if resolved.errors:
        raise PipelineConfigErrors(f"{len(resolved.errors)} Stagewise pipeline config(s) in error; other pipelines "
                                   "run as usual:\n" + "\n".join(resolved.errors.values()))
