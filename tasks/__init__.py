"""Stagewise: the work itself, plain Python with no Airflow import; every job runs alone as
``python -m stagewise.<job>``.

The repository's ``tasks/`` folder is this package, installed as ``stagewise`` (the Airflow glue is
``stagewise.airflow``, from ``plugins/stagewise_airflow/``). It reads from ``ls``: libraries live in sub-packages,
runnable jobs are the modules at the top, and ``stagewise.spec`` is the one public module. Imports only point
down :data:`LAYERS` (tests/tasks/test_layers.py reads every import against it).
"""

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("leaves", ("stagewise.core",)),
    ("definitions", ("stagewise.definitions",)),
    ("data", ("stagewise.datasets",)),
    ("models", ("stagewise.models",)),
    ("study", ("stagewise.study",)),
    ("training", ("stagewise.training",)),
    ("reporting", ("stagewise.reporting",)),
    ("reuse", ("stagewise.reuse",)),
    ("tracking", ("stagewise.tracking",)),
    ("upkeep", ("stagewise.upkeep",)),
    ("runtime helper", ("stagewise.scripting",)),
    ("facades", ("stagewise.spec", "stagewise.model")),
    ("jobs", ("stagewise.config", "stagewise.contract", "stagewise.data", "stagewise.preprocess", "stagewise.sweep", "stagewise.train",
              "stagewise.evaluate", "stagewise.infer", "stagewise.registry", "stagewise.report",
              "stagewise.retention")),
    ("gate with a person", ("stagewise.gatekeeper",)),  # the registry's gate, approval and notifications together
)
"""Lowest first: (layer, the modules and packages in it). A module imports its own package and lower layers only;
jobs never import each other, and nothing inside ``tasks/`` imports a facade."""
