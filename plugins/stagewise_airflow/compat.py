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
import sys
from typing import Any

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


# Airflow reads every distribution's entry points once per process and caches them with the distribution they came
# from (core and task SDK each keep a cache); processes it forks (tasks, DAG parses) inherit the cache.
_ENTRY_POINT_CACHES = ("airflow._shared.module_loading", "airflow.sdk._shared.module_loading")
_OWN_PACKAGE = "stagewise"


def _readable(dist: Any) -> bool:
    return any(dist.read_text(name) is not None for name in ("METADATA", "PKG-INFO"))


def _installed_like(stale: Any, entry_point: Any) -> Any:
    """The installed distribution that now provides ``entry_point`` (the same group and target), or None."""
    metadata = sys.modules.get(type(stale).__module__)  # importlib.metadata or its backport, as Airflow uses
    for candidate in getattr(metadata, "distributions", lambda **_: ())(name=_OWN_PACKAGE):
        if _readable(candidate) and any(found.group == entry_point.group and found.value == entry_point.value
                                        for found in candidate.entry_points):
            return candidate
    return None


def repoint_stale_distributions() -> list[str]:
    """Point Airflow's cached distribution of Stagewise's plugin at the installed one when an in-place upgrade removed
    the one it cached; the versions now installed, one per repaired entry.

    Why: a process that read the entry points before a ``pip install --upgrade`` (a scheduler, its LocalExecutor
    workers, a dag-processor) hands the removed ``stagewise-<old>.dist-info`` to every task it forks, and Airflow,
    having imported the plugin, reads that distribution's name and version (EntryPointSource): ``Failed to import
    plugin stagewise`` (``MetadataNotFound``) in every task until a restart. The plugin reads no metadata at import and
    calls this when Airflow makes it, just before Airflow reads the distribution; only our own entries are touched.
    """
    repaired = []
    for name in _ENTRY_POINT_CACHES:
        grouped = getattr(sys.modules.get(name), "_get_grouped_entry_points", None)
        cache_info = getattr(grouped, "cache_info", None)
        if cache_info is None or not cache_info().currsize:
            continue  # nothing cached: Airflow reads the installed metadata afresh
        for entry_point, dist in list(grouped().get("airflow.plugins", ())):
            if entry_point.module.partition(".")[0] != _OWN_PACKAGE or _readable(dist):
                continue
            if (installed := _installed_like(dist, entry_point)) is not None:
                vars(dist).update(vars(installed))  # the same object Airflow holds: it now reads the installed files
                repaired.append(installed.version)
    if repaired:
        log.info("Stagewise %s was installed after this process read its entry points: restart the scheduler, "
                 "dag-processor, api-server and workers to run it everywhere (docs/pipelines.md, Upgrading)",
                 repaired[0])
    return repaired
