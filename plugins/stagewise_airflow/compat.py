"""The Airflow this is, against the minors Stagewise supports (the plugin checks it in every process that loads it).

Stagewise supports and tests Airflow 3.2 and 3.3 (pyproject.toml's apache-airflow range; tests/dags/
test_airflow_versions.py installs the wheel into each and runs a pipeline). It uses nothing that 3.3 has and 3.2
lacks, so no feature is off on 3.2. On an Airflow outside the range (installed with ``--no-deps``, or Airflow
upgraded under an installed Stagewise) every process that loads the plugin logs one line saying so.
"""

from __future__ import annotations

import functools
import logging
import re

log = logging.getLogger(__name__)

# pyproject.toml's apache-airflow requirement, and the minors it admits (tests/dags/test_airflow_versions.py keeps
# the three equal).
SUPPORTED_AIRFLOW = ">=3.2,<3.4"
SUPPORTED_MINORS = ((3, 2), (3, 3))


def airflow_version() -> str:
    """The running Airflow's version: the imported module's, never package metadata (an in-place upgrade removes the
    old dist-info under a running process)."""
    import airflow

    return airflow.__version__


def unsupported(version: str) -> str | None:
    """The one-line warning for an Airflow ``version`` outside the supported minors; None for one of them."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found and (int(found[1]), int(found[2])) in SUPPORTED_MINORS:
        return None
    return (f"Stagewise supports Airflow {SUPPORTED_AIRFLOW} (3.2 and 3.3, both tested); this is Airflow {version}: "
            "pipelines may fail in ways no test has seen")


@functools.cache
def warn_if_unsupported() -> None:
    """Log unsupported()'s line once per process when the installed Airflow is outside the supported minors."""
    if message := unsupported(airflow_version()):
        log.warning("%s", message)
