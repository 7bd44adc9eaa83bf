"""The Airflow plugin that puts Stagewise in the UI: a *Stagewise* nav entry and a *Stagewise report* tab on each DAG run.

Airflow finds it through the package's ``airflow.plugins`` entry point (pyproject.toml) and imports it in every
process that loads plugins (the dag-processor too), so it imports nothing heavy: the pages (stagewise.airflow.ui,
FastAPI) are built on the api-server's first request to /stagewise.
"""

from __future__ import annotations

import logging
from typing import Any

from airflow.plugins_manager import AirflowPlugin

from stagewise.airflow.compat import repoint_stale_distributions, warn_if_unsupported
from stagewise.airflow.sqlite import WriteQueue
from stagewise.airflow.trigger_check import TriggerConfCheck
from stagewise.core.cli import skip_final_collection

URL_PREFIX = "/stagewise"  # stagewise.airflow.ui.URL_PREFIX; repeated so this file imports nothing else


class LazyStagewiseApp:
    """An ASGI app that builds stagewise.airflow.ui's FastAPI app on its first request and hands every request to it."""

    def __init__(self) -> None:
        self._app: Any = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if self._app is None:
            from stagewise.airflow.ui import create_app

            self._app = create_app()
        await self._app(scope, receive, send)


warn_if_unsupported()  # every Airflow process loads the plugin: one line in its log on an untested Airflow
skip_final_collection()  # and each exits without a last collection over its heap (a live stack: 2.3 CPU-s less)


class StagewiseUIPlugin(AirflowPlugin):
    name = "stagewise_ui"
    fastapi_apps = [{"app": LazyStagewiseApp(), "url_prefix": URL_PREFIX, "name": "Stagewise"}]
    # On SQLite, write requests one at a time (stagewise.airflow.sqlite: a burst of triggers deadlocked the DB)
    fastapi_root_middlewares = [{"middleware": WriteQueue, "name": "Stagewise SQLite write queue"},
                                # a trigger conf with a key the DAG has no Param for never reaches the metadata DB
                                {"middleware": TriggerConfCheck, "name": "Stagewise trigger conf check"}]
    # hrefs without a leading slash resolve against the UI's <base href>, so a base_url with a path works too.
    external_views = [
        {"name": "Stagewise", "href": "stagewise/", "destination": "nav", "url_route": "stagewise",
         "nav_top_level": True},
        {"name": "Stagewise report", "href": "stagewise/runs/{DAG_ID}/{RUN_ID}", "destination": "dag_run",
         "url_route": "stagewise-report"},
    ]

    def __init__(self) -> None:
        # Airflow makes the plugin, then reads its distribution (the module may have been imported before an
        # upgrade, by a parent process): repair a stale one first, so an upgrade under a running scheduler is no
        # plugin error. Airflow's caches are its own: a change there must never cost the plugin its load.
        super().__init__()
        try:
            repoint_stale_distributions()
        except Exception as exc:
            logging.getLogger(__name__).debug("could not check Airflow's entry point cache: %s", exc)
