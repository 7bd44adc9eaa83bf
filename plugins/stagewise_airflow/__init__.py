"""Airflow glue for Stagewise: profiles onto Airflow's knobs, sub-job launch, Params.

Thin by design: the work lives in ``tasks/`` (plain Python, no Airflow), which sits beside
``plugins/`` in the repository; the path is added here so DAG parsing finds it without setup.
"""

import os
import sys

REPO_ROOT = os.environ.get("STAGEWISE_HOME") or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)
