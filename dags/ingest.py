"""ingest: copy new raw Parquet shards into the data set's location and announce them (the Asset).

A finished ingest run emits an event on the raw-data asset (``stagewise_raw_data-<hash of dataset.uri>``), which triggers ``retrain``.
Param ``source_uri``: a Parquet file or folder with the data set's schema.
"""

from __future__ import annotations

from airflow.sdk import Param, dag, task

from stagewise_airflow import steps, wiring
from tasks.definitions.loading import config_path, load_config

CONFIG_FILE = str(config_path())  # this DAG's config: every run of it starts from this file
CONFIG = load_config(CONFIG_FILE)


@dag(
    dag_id="ingest",
    schedule=None,
    params={"source_uri": Param("", type="string", minLength=1, description="New raw Parquet file or folder to add.")},
    doc_md=__doc__,
    **wiring.dag_settings(CONFIG, "data"),
)
def ingest() -> None:
    task(steps.ingest, task_id="ingest", outlets=[wiring.raw_data_asset(CONFIG)],
         **wiring.knobs(CONFIG, CONFIG.preprocess.profile))(CONFIG_FILE)


ingest()
