"""Airflow glue for Stagewise: profiles onto Airflow's knobs, sub-job launch, Params.

Thin by design: the work lives in ``tasks/`` (plain Python, no Airflow). Both are one installed
package (pyproject.toml; ``make venv`` installs it editable), so DAG parsing imports them without
path edits. ``REPO_ROOT`` is the checkout: sub-jobs run there and find pipeline.yaml and user scripts.
"""

import os

REPO_ROOT = os.environ.get("STAGEWISE_HOME") or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
