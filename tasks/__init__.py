"""Stagewise's work itself: plain Python with no Airflow import; every job runs alone as ``python -m tasks.<job>``.

The package reads from ``ls``: libraries live in sub-packages, runnable jobs are the modules at the top, and
``tasks.spec`` is the one public module. Imports only point down :data:`LAYERS` (tests/tasks/test_layers.py
reads every import against it).
"""

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("leaves", ("tasks.core",)),
    ("definitions", ("tasks.definitions",)),
    ("data", ("tasks.datasets",)),
    ("models", ("tasks.models",)),
    ("study", ("tasks.study",)),
    ("training", ("tasks.training",)),
    ("reporting", ("tasks.reporting",)),
    ("runtime helper", ("tasks.scripting",)),
    ("facades", ("tasks.spec", "tasks.model")),
    ("jobs", ("tasks.config", "tasks.contract", "tasks.data", "tasks.preprocess", "tasks.sweep", "tasks.train",
              "tasks.evaluate", "tasks.infer", "tasks.registry", "tasks.report")),
)
"""Lowest first: (layer, the modules and packages in it). A module imports its own package and lower layers only;
jobs never import each other, and nothing inside ``tasks`` imports a facade."""
