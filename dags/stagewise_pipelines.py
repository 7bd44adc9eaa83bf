"""Every Stagewise pipeline as its family of DAGs: <name>_pipeline, <name>_retrain, <name>_batch_inference, <name>_ingest.

The pipelines: $STAGEWISE_PIPELINES (folders of configs or config files), else $STAGEWISE_CONFIG, else this
checkout's pipeline.yaml (the pipeline ``ml``) and examples/. This file is the one line a team's dags folder needs.
"""

from stagewise_airflow.dags import build_pipelines

build_pipelines(globals())
