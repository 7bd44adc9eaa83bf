"""The import error of every broken, clashing or deleted pipeline config (airflow dags list-import-errors, the REST
import errors, the UI's banner); it defines no DAG, so stagewise_pipelines.py's DAGs stay active meanwhile.

A team's dags folder holds this file beside the DAG file, naming the same pipelines: ``check_pipelines("/path")``.
"""

from stagewise.airflow.dags import check_pipelines

check_pipelines()
