"""S3 and MLflow credentials from Airflow connections, handed to sub-jobs as the standard AWS and MLflow environment.

The pipeline config's ``storage_conn_id`` names a connection of type ``aws``, the same shape the
Amazon provider reads: login = access key id, password = secret access key, and in its extra
``endpoint_url`` (an S3-compatible store), ``region_name`` and ``aws_session_token``. The provider is not needed:
without it ``airflow connections add --conn-type aws`` stores the connection as ``generic`` (Airflow knows no
``aws`` type then), and a ``generic`` connection is read the same way (its fields, never its hook). Sub-jobs stay
free of Airflow: they get ``AWS_*`` variables, which every AWS SDK (and s3fs) reads. Airflow masks
the connection's password in task logs; nothing here logs or stores a value. The api-server's Stagewise pages read
each pipeline's storage with the same connection, as s3fs arguments (``storage_options``), never exported.

The config's ``tracking.conn_id`` names any connection (type http or generic) for the MLflow server: login and
password become ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD`` (basic auth), a password alone
``MLFLOW_TRACKING_TOKEN`` (bearer), which MLflow's clients and stagewise.tracking read.

The config's ``sweep.storage_conn_id`` names a connection of type ``postgres`` for the Optuna study: host, port,
login, password and schema (the database; extra ``driver``, default psycopg2) become one SQLAlchemy URL in
``STAGEWISE_STUDY_STORAGE``, which stagewise.study reads; the config itself never holds the password. Without the
Postgres provider ``airflow connections add --conn-type postgres`` stores a ``generic`` connection, read the same way.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

# The storage connection's types: the Amazon provider's ``aws`` (``s3``: its old name), and ``generic``, what Airflow
# stores `airflow connections add --conn-type aws` as where the provider is not installed (docs/services.md).
STORAGE_CONN_TYPES = ("aws", "s3", "generic")

# connection extra key -> environment variable; the S3-only endpoint leaves other AWS services alone.
_EXTRA_TO_ENV = {"endpoint_url": "AWS_ENDPOINT_URL_S3", "region_name": "AWS_DEFAULT_REGION",
                 "aws_session_token": "AWS_SESSION_TOKEN"}


def environment_from(login: str | None, password: str | None, extra: dict[str, Any]) -> dict[str, str]:
    """The AWS variables a connection's fields stand for (the Amazon provider's extra keys are accepted too)."""
    env = {}
    access_key = login or extra.get("aws_access_key_id")
    secret_key = password or extra.get("aws_secret_access_key")
    if bool(access_key) != bool(secret_key):
        raise ValueError("has an access key id without a secret access key, or the other way round; "
                         "set both (login and password) or neither (to use the worker's own AWS credentials)")
    if access_key:
        env.update({"AWS_ACCESS_KEY_ID": str(access_key), "AWS_SECRET_ACCESS_KEY": str(secret_key)})
    endpoint = extra.get("endpoint_url") or (extra.get("service_config") or {}).get("s3", {}).get("endpoint_url")
    values = {**extra, "endpoint_url": endpoint}
    for key, variable in _EXTRA_TO_ENV.items():
        if values.get(key):
            env[variable] = str(values[key])
    return env


def _connection(setting: str, conn_id: str, create: str, types: tuple[str, ...] = (), expected: str = "") -> Any:
    """Airflow connection ``conn_id`` that config key ``setting`` names; a missing one (``create``: how to make it) or
    one of a type not in ``types`` (when given; ``expected`` says which) fails the task without retry."""
    from airflow.sdk import Connection
    from airflow.sdk.exceptions import AirflowFailException, AirflowNotFoundException

    try:
        connection = Connection.get(conn_id)
    except AirflowNotFoundException:
        raise AirflowFailException(f"{setting}: Airflow connection '{conn_id}' does not exist; {create}") from None
    if types and connection.conn_type not in types:
        raise AirflowFailException(f"{setting}: connection '{conn_id}' has type '{connection.conn_type}', "
                                   f"expected {expected}; {create}")
    return connection


def aws_environment(conn_id: str) -> dict[str, str]:
    """The AWS variables of connection ``conn_id`` (empty id: none, the worker's own AWS setup applies)."""
    if not conn_id:
        return {}
    from airflow.sdk.exceptions import AirflowFailException

    connection = _connection("storage_conn_id", conn_id, "create it (type aws) or empty the key to use the worker's "
                             "AWS environment", STORAGE_CONN_TYPES, "'aws' (or 'generic')")
    try:
        return environment_from(connection.login, connection.password, connection.extra_dejson)
    except ValueError as exc:
        raise AirflowFailException(f"storage_conn_id: connection '{conn_id}' {exc}") from None


class StorageConnectionError(ValueError):
    """A pipeline's ``storage_conn_id`` that names no usable connection (the message names the id, never a value)."""


# AWS variable -> s3fs argument, for a process that must not export them (the api-server reads many pipelines' storage).
_ENV_TO_S3FS = {"AWS_ACCESS_KEY_ID": "key", "AWS_SECRET_ACCESS_KEY": "secret", "AWS_SESSION_TOKEN": "token",
                "AWS_ENDPOINT_URL_S3": "endpoint_url"}


def storage_options(conn_id: str) -> dict[str, Any]:
    """s3fs arguments reaching storage as connection ``conn_id`` does (empty id: none, the process's own AWS setup).

    For the api-server, which has no task context: the connection comes from Airflow's server-side lookup (secrets
    backends, ``AIRFLOW_CONN_*``, the metadata DB), and its values go to the caller, never into ``os.environ``
    (see ``stagewise.core.storage.using_options``). Raises StorageConnectionError naming the id.
    """
    if not conn_id:
        return {}
    from airflow.exceptions import AirflowNotFoundException
    from airflow.models.connection import Connection

    try:
        connection = Connection.get_connection_from_secrets(conn_id)
    except AirflowNotFoundException:
        raise StorageConnectionError(f"storage connection '{conn_id}' does not exist") from None
    if connection.conn_type not in STORAGE_CONN_TYPES:
        raise StorageConnectionError(f"storage connection '{conn_id}' has type '{connection.conn_type}', "
                                     f"expected 'aws' (or 'generic')")
    try:
        env = environment_from(connection.login, connection.password, connection.extra_dejson)
    except ValueError as exc:
        raise StorageConnectionError(f"storage connection '{conn_id}' {exc.args[0].split(';')[0]}") from None
    options: dict[str, Any] = {argument: env[variable] for variable, argument in _ENV_TO_S3FS.items() if variable in env}
    if region := env.get("AWS_DEFAULT_REGION"):
        options["client_kwargs"] = {"region_name": region}
    return options


def mlflow_environment(conn_id: str) -> dict[str, str]:
    """The MLFLOW_TRACKING_* variables of connection ``conn_id`` (empty id: none, the worker's own apply)."""
    if not conn_id:
        return {}
    from airflow.sdk.exceptions import AirflowFailException

    connection = _connection("tracking.conn_id", conn_id, "create it (login and password, or a password alone as a "
                             "token) or empty the key")
    if connection.login and connection.password:
        return {"MLFLOW_TRACKING_USERNAME": str(connection.login), "MLFLOW_TRACKING_PASSWORD": str(connection.password)}
    if connection.password:
        return {"MLFLOW_TRACKING_TOKEN": str(connection.password)}
    raise AirflowFailException(f"tracking.conn_id: connection '{conn_id}' has no password (nor token); set login and "
                               f"password for basic auth, or a password alone as a bearer token")


# The study connection's types: the Postgres provider's ``postgres`` (a ``postgresql://`` URI is stored as it), and
# ``generic``, what Airflow stores `airflow connections add --conn-type postgres` as without that provider.
STUDY_CONN_TYPES = ("postgres", "postgresql", "generic")


def study_url(login: str | None, password: str | None, host: str | None, port: int | None, schema: str | None,
              extra: dict[str, Any]) -> str:
    """The SQLAlchemy URL of a postgres connection's fields, its password escaped (ValueError naming a missing field)."""
    from sqlalchemy.engine import URL

    if not host or not schema:
        raise ValueError("needs a host and a schema (the database's name)")
    driver = str(extra.get("driver") or "psycopg2")
    url = URL.create(f"postgresql+{driver}", username=login or None, password=password or None, host=host,
                     port=port or None, database=schema)
    return url.render_as_string(hide_password=False)


def study_environment(conn_id: str) -> dict[str, str]:
    """``STAGEWISE_STUDY_STORAGE`` from connection ``conn_id`` (empty id: none, sweep.storage applies)."""
    if not conn_id:
        return {}
    from airflow.sdk.exceptions import AirflowFailException

    from stagewise.core.contract import STUDY_STORAGE

    connection = _connection("sweep.storage_conn_id", conn_id, f"create it: airflow connections add {conn_id} "
                             "--conn-type postgres --conn-host HOST --conn-port PORT --conn-login USER --conn-password "
                             "PASSWORD --conn-schema DATABASE (docs/services.md)", STUDY_CONN_TYPES,
                             "'postgres' (or 'generic', as Airflow stores it without the Postgres provider)")
    try:
        return {STUDY_STORAGE: study_url(connection.login, connection.password, connection.host, connection.port,
                                         connection.schema, connection.extra_dejson)}
    except ValueError as exc:
        raise AirflowFailException(f"sweep.storage_conn_id: connection '{conn_id}' {exc}") from None


def task_environment(config: Any) -> dict[str, str]:
    """Everything a task of ``config``'s pipeline hands its sub-jobs: the storage, tracking and study credentials."""
    return {**aws_environment(config.storage_conn_id), **mlflow_environment(config.tracking.conn_id),
            **study_environment(config.sweep.storage_conn_id)}


@contextlib.contextmanager
def exported(env: dict[str, str]) -> Iterator[None]:
    """``env`` in this process's environment for the block (storage calls made in the task process)."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
