"""Every Stagewise pipeline as its family of DAGs: <name>_pipeline, <name>_retrain, <name>_batch_inference, <name>_ingest.

The pipelines: $STAGEWISE_PIPELINES (folders of configs or config files), else $STAGEWISE_CONFIG, else this
checkout's pipeline.yaml (the pipeline ``ml``) and examples/. A team's dags folder needs the same one line, naming
its pipelines folder: ``build_pipelines(globals(), "/path/to/pipelines")`` (docs/pipelines.md).
"""

from stagewise.airflow.dags import build_pipelines

build_pipelines(globals())
