"""ml_pipeline: sharded preprocessing -> Optuna sweep -> growing-batch DDP stages -> evaluate -> gate -> batch inference.

Wiring only: the config (pipeline.yaml, or $STAGEWISE_CONFIG) decides the stages and each task's
instance profile; the work runs in ``tasks/`` sub-jobs. Run: ``airflow dags test ml_pipeline``.
"""

from __future__ import annotations

from airflow.sdk import dag

from stagewise_airflow import wiring
from stagewise_airflow.params import pipeline_params
from tasks.definitions.loading import config_path, load_config

CONFIG_FILE = str(config_path())  # this DAG's config: every run of it starts from this file
CONFIG = load_config(CONFIG_FILE)


@dag(
    dag_id="ml_pipeline",
    schedule=None,
    params=pipeline_params(CONFIG),
    doc_md=__doc__,
    **wiring.dag_settings(CONFIG, "ml"),
)
def ml_pipeline() -> None:
    run = wiring.start(CONFIG, CONFIG_FILE)
    data = wiring.preprocess(CONFIG, run)
    swept = wiring.sweep(CONFIG, run, data)
    trained = wiring.train_stages(CONFIG, run, swept)
    gated = wiring.evaluate_and_gate(CONFIG, run, swept, trained)
    wiring.report(CONFIG, run, data, swept, trained, gated, wiring.inference_chain(CONFIG, run, gated["gated"]))


ml_pipeline()
