"""The pipelines the pages show: the ones the DAG file built, as Airflow's metadata DB holds their serialized DAGs.

Run: imported by the pages (``stagewise.airflow.ui``); ``pipelines()`` needs Airflow's ORM configured (the api-server).
"""

import logging
import threading
from dataclasses import dataclass
from typing import Any

from fastapi import HTTPException

from stagewise.airflow.wiring import PIPELINE_DEFAULT_ARG
from stagewise.definitions.config import PipelineConfig

log = logging.getLogger("stagewise.ui")


@dataclass(frozen=True)
class Pipeline:
    """A pipeline as the DAG file built it: its name, config and the DAGs carrying it."""

    name: str
    config: PipelineConfig
    """The config its DAGs carry: model.args left out (stagewise.airflow.wiring.carried_pipeline), as no page reads them."""
    dag_ids: tuple[str, ...]
    retired: bool = False
    """Every DAG of it is stale (its file deleted, or forgotten): its runs and models stay readable, marked retired."""


# (dag_id, dag_hash) -> (pipeline name, config) the serialized DAG carries, None for none: validated once per version
_carried: dict[tuple[str, str], tuple[str, PipelineConfig] | None] = {}
_carried_lock = threading.Lock()  # pages are served from a thread pool


def pipelines() -> dict[str, Pipeline]:
    """Every pipeline whose DAGs Airflow holds, by name: the latest serialized version of each DAG tagged
    ``stagewise`` (a stale one too: its pipeline is retired, its runs and models still shown) carries its pipeline's
    name and config in default_args (PIPELINE_DEFAULT_ARG, set by stagewise.airflow.wiring.dag_settings), so the
    api-server needs neither the pipelines folder nor a variable.
    A DAG carrying none (a config that never loaded) or one that does not validate here is left out, and named in the
    api-server's log."""
    from airflow.models.dag import DagModel, DagTag
    from airflow.models.dag_version import DagVersion
    from airflow.models.serialized_dag import SerializedDagModel
    from airflow.utils.session import create_session
    from sqlalchemy import func, select
    from sqlalchemy.exc import SQLAlchemyError

    latest = (select(DagVersion.dag_id, func.max(DagVersion.version_number).label("number"))
              .join(SerializedDagModel, SerializedDagModel.dag_version_id == DagVersion.id)
              .group_by(DagVersion.dag_id).subquery())
    query = (select(SerializedDagModel.id, SerializedDagModel.dag_id, SerializedDagModel.dag_hash, DagModel.is_stale)
             .join(DagVersion, SerializedDagModel.dag_version_id == DagVersion.id)
             .join(latest, (DagVersion.dag_id == latest.c.dag_id) & (DagVersion.version_number == latest.c.number))
             .join(DagModel, DagModel.dag_id == SerializedDagModel.dag_id)
             .where(DagModel.dag_id.in_(select(DagTag.dag_id).where(DagTag.name == "stagewise")))
             .order_by(SerializedDagModel.dag_id))
    try:
        with create_session() as session:
            rows = session.execute(query).all()
            with _carried_lock:
                known = {(dag_id, dag_hash): _carried[(dag_id, dag_hash)] for _, dag_id, dag_hash, _ in rows
                         if (dag_id, dag_hash) in _carried}
            stale = {dag_id for _, dag_id, _, is_stale in rows if is_stale}  # gone from the file, or forgotten
            stale |= set(session.scalars(select(DagTag.dag_id).where(DagTag.name == "retired")))  # deleted, kept
            for row_id, dag_id, dag_hash, _ in rows:  # a new version's data only: it is the large column
                if (dag_id, dag_hash) not in known:
                    known[(dag_id, dag_hash)] = _pipeline_of(dag_id, session.get(SerializedDagModel, row_id).data)
    except SQLAlchemyError as exc:
        log.error("the Airflow metadata DB: %s", exc)
        raise HTTPException(503, "the Airflow metadata DB cannot be read: the api-server's log says why") from None
    with _carried_lock:  # older versions leave: the api-server runs for days
        _carried.clear()
        _carried.update(known)
    found: dict[str, Pipeline] = {}
    for key in sorted(known):  # a pipeline's DAGs carry one config; the first DAG's stands for them
        if (carried := known[key]) is not None:
            name, config = carried
            earlier = found.get(name)
            dag_ids = (*(earlier.dag_ids if earlier else ()), key[0])
            found[name] = Pipeline(name, earlier.config if earlier else config, dag_ids, stale.issuperset(dag_ids))
    return found


def _pipeline_of(dag_id: str, data: Any) -> tuple[str, PipelineConfig] | None:
    """The pipeline a serialized DAG carries in its default_args, validated; None when it carries none or a bad one."""
    from airflow.serialization.serialized_objects import BaseSerialization

    encoded = (((data or {}).get("dag") or {}).get("default_args") or {}).get("__var", {}).get(PIPELINE_DEFAULT_ARG)
    if encoded is None:
        return None
    try:
        carried = BaseSerialization.deserialize(encoded)
        return str(carried["name"]), PipelineConfig.model_validate(carried["config"])
    except Exception as exc:  # noqa: BLE001 - a DAG this api-server cannot read hides that DAG, not the pages
        log.error("DAG %s: its Stagewise pipeline config does not load here: %s", dag_id, exc)
        return None
