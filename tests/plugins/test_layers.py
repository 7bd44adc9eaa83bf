"""The Airflow layer (plugins/stagewise_airflow, imported as stagewise.airflow) has no import circle either, counting
the imports inside functions: a stage's launch goes down from the step to its job and one backend (issue 45)."""

from __future__ import annotations

from pathlib import Path

from tests.tasks.test_layers import Import, circles, project_imports

PLUGINS_DIR = Path(__file__).resolve().parents[2] / "plugins" / "stagewise_airflow"
PACKAGE = "stagewise.airflow"


def test_the_airflow_layer_has_no_import_circle():
    imports = project_imports(PLUGINS_DIR, PACKAGE)
    assert any(item.imported == "stagewise.airflow.stage_job" for item in imports)  # the walk sees this tree
    assert circles(imports) == []


def test_the_check_sees_a_circle_through_a_function_level_import():
    made_up = [Import("stagewise.airflow.a", "stagewise.airflow.b", 1, True),
               Import("stagewise.airflow.b", "stagewise.airflow.a", 9, False)]
    assert circles(made_up) == [["stagewise.airflow.a", "stagewise.airflow.b"]]


def test_the_backends_never_import_the_step_that_calls_them():
    """backends/* and stage_job sit under steps.py: nothing there imports steps, operators or the DAG factory."""
    upward = [f"{item.importer}:{item.line} imports {item.imported}" for item in project_imports(PLUGINS_DIR, PACKAGE)
              if item.importer.startswith(("stagewise.airflow.backends", "stagewise.airflow.stage_job",
                                           "stagewise.airflow.launch"))
              and item.imported in ("stagewise.airflow.steps", "stagewise.airflow.operators", "stagewise.airflow.dags")]
    assert upward == []
