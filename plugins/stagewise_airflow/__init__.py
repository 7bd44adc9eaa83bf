"""Airflow glue for Stagewise: profiles onto Airflow's knobs, sub-job launch, Params, the UI plugin.

Thin by design: the work lives in ``stagewise`` (the repository's ``tasks/``: plain Python, no Airflow). This
package is ``stagewise.airflow`` (the repository's ``plugins/stagewise_airflow/``); both are one installed
package (pyproject.toml; ``make venv`` installs it editable), so DAG parsing and every sub-job import them
without path edits.
"""
