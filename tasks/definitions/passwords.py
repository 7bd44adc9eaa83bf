"""No password in a pipeline config: every URL-valued key is read for one at load, and the study's database may come
from an Airflow connection instead (``sweep.storage_conn_id``). Used by ``stagewise.definitions.config``.

A config is readable by everyone who may read its DAGs (Airflow returns ``default_args`` over REST) and is copied
into each run's snapshot, report and MLflow artifacts, so credentials live in Airflow connections, read at task run
time on the worker (stagewise.airflow.credentials). The messages name keys and connections, never a value.
"""

from __future__ import annotations

import re
import urllib.parse
from typing import Any

# Where the credentials of a URL-valued key go instead, by dotted key; any other key: an Airflow connection.
CONNECTION_FOR = {
    "sweep.storage": "sweep.storage_conn_id (an Airflow connection of type postgres; leave sweep.storage empty)",
    "tracking.mlflow_uri": "tracking.conn_id (an Airflow connection with login and password)",
    "storage_root": "storage_conn_id (an Airflow connection of type aws)",
    "dataset.uri": "storage_conn_id (an Airflow connection of type aws)",
    "inference.input_uri": "storage_conn_id (an Airflow connection of type aws)",
}
# Query parameters that carry a secret in database and HTTP URLs (libpq's password=, a token in the query).
_SECRET_PARAMS = frozenset({"password", "passwd", "pwd", "sslpassword", "secret", "token", "access_token", "api_key",
                            "apikey", "aws_secret_access_key"})
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def has_password(value: str) -> bool:
    """Whether URL ``value`` holds a password: ``user:password@`` in its authority or a secret query parameter."""
    if not _URL.match(value):
        return False
    rest = value.split("://", 1)[1]
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if "@" in authority and authority.rsplit("@", 1)[0].partition(":")[2]:
        return True
    query = urllib.parse.urlsplit(value).query
    return any(key.lower() in _SECRET_PARAMS and val for key, val in urllib.parse.parse_qsl(query))


def _strings(value: Any, key: str) -> list[tuple[str, str]]:
    """Every string leaf of ``value`` with its dotted key (list items as ``key[i]``)."""
    if isinstance(value, str):
        return [(key, value)]
    if isinstance(value, dict):
        return [found for name, item in value.items() for found in _strings(item, f"{key}.{name}" if key else str(name))]
    if isinstance(value, list):
        return [found for index, item in enumerate(value) for found in _strings(item, f"{key}[{index}]")]
    return []


def password_problem(raw: Any) -> str | None:
    """Why raw config ``raw`` is refused (a URL with a password: the first key that has one), or None."""
    for key, value in _strings(raw, ""):
        if has_password(value):
            instead = CONNECTION_FOR.get(key, "an Airflow connection that the setting's *_conn_id names")
            return (f"{key}: the URL holds credentials (a password), which every viewer of the DAG and every run's "
                    f"snapshot, report and tracking record would show; remove them and give them through {instead} "
                    f"(docs/services.md)")
    return None


def study_storage_problem(storage: str, conn_id: str) -> str | None:
    """Why the study's storage is unclear: both or neither of sweep.storage and sweep.storage_conn_id given."""
    if conn_id and storage:
        return ("sweep.storage and sweep.storage_conn_id both name the study's storage; with a connection the database "
                "is the connection's (host, port, login, password, schema): leave sweep.storage empty")
    if not conn_id and not storage:
        return "sweep.storage: '' is neither journal://<file> nor postgresql://..."
    return None
