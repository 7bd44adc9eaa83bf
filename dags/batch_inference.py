"""batch_inference: score any Parquet data set with a registered model, in parallel shards.

Params: ``input_uri`` (raw-schema Parquet file or folder) and ``model_version`` (empty: the current
model). Output: ``runs/batch_inference/<run_id>/predictions/`` with a manifest, and report.json.
"""

from __future__ import annotations

from airflow.sdk import dag, task

from stagewise_airflow import steps, wiring
from stagewise_airflow.params import inference_params
from tasks.definitions.loading import config_path, load_config

CONFIG_FILE = str(config_path())  # this DAG's config: every run of it starts from this file
CONFIG = load_config(CONFIG_FILE)


@dag(
    dag_id="batch_inference",
    schedule=None,
    params=inference_params(CONFIG),
    doc_md=__doc__,
    **wiring.dag_settings(CONFIG, "ml", "inference"),
)
def batch_inference() -> None:
    run = wiring.start(CONFIG, CONFIG_FILE, mode="inference")
    model = task(steps.resolve_model, task_id="resolve_model",
                 **{**wiring.knobs(CONFIG, CONFIG.preprocess.profile), "retries": 0})(run)
    inferred = wiring.inference_chain(CONFIG, run, model)
    task(steps.write_inference_report, task_id="report", **wiring.knobs(CONFIG, CONFIG.preprocess.profile))(
        run, model, inferred["scored"], inferred["predictions"])


batch_inference()
