"""retrain: the ML pipeline on a cron schedule and whenever new raw data lands (an Airflow Asset).

The sweep warm-starts from the current model's study with the smaller retrain budget
(``retrain.num_trials``); the new model replaces the current one only if it passes the gate.
New data: an ``ingest`` run, or ``POST /api/v2/assets/events`` for the raw-data asset
(``stagewise_raw_data-<hash of dataset.uri>``).
"""

from __future__ import annotations

from airflow.sdk import AssetOrTimeSchedule, CronTriggerTimetable, dag

from stagewise_airflow import wiring
from stagewise_airflow.params import pipeline_params
from tasks.definitions.loading import config_path, load_config

CONFIG_FILE = str(config_path())  # this DAG's config: every run of it starts from this file
CONFIG = load_config(CONFIG_FILE)


@dag(
    dag_id="retrain",
    schedule=AssetOrTimeSchedule(timetable=CronTriggerTimetable(CONFIG.retrain.schedule, timezone="UTC"),
                                 assets=[wiring.raw_data_asset(CONFIG)]),
    params=pipeline_params(CONFIG),
    doc_md=__doc__,
    **wiring.dag_settings(CONFIG, "ml", "retrain", max_active_runs=1),
)
def retrain() -> None:
    # ml_pipeline's shape; start_run in retrain mode gives the sweep the retrain budget and the warm start.
    run = wiring.start(CONFIG, CONFIG_FILE, mode="retrain")
    data = wiring.preprocess(CONFIG, run)
    swept = wiring.sweep(CONFIG, run, data)
    trained = wiring.train_stages(CONFIG, run, swept)
    gated = wiring.evaluate_and_gate(CONFIG, run, swept, trained)
    wiring.report(CONFIG, run, data, swept, trained, gated, wiring.inference_chain(CONFIG, run, gated["gated"]))


retrain()
