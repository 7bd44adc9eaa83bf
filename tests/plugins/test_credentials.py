"""S3 credentials from an Airflow connection become the standard AWS variables of sub-jobs."""

from __future__ import annotations

import json
import os

import pytest

from stagewise.airflow import credentials


def test_login_password_and_extras_map_onto_aws_variables():
    """login/password are the key pair; the endpoint is S3-only, so other AWS services keep theirs."""
    env = credentials.environment_from("AKIAEXAMPLE", "s3cr3t-value", {"endpoint_url": "http://127.0.0.1:9000",
                                                                      "region_name": "eu-west-1",
                                                                      "aws_session_token": "tok"})
    assert env == {"AWS_ACCESS_KEY_ID": "AKIAEXAMPLE", "AWS_SECRET_ACCESS_KEY": "s3cr3t-value",
                   "AWS_ENDPOINT_URL_S3": "http://127.0.0.1:9000", "AWS_DEFAULT_REGION": "eu-west-1",
                   "AWS_SESSION_TOKEN": "tok"}


def test_amazon_provider_extra_keys_are_accepted():
    """Keys in the extra (the Amazon provider's older form) and a service_config endpoint work too."""
    env = credentials.environment_from(None, None, {"aws_access_key_id": "AK1", "aws_secret_access_key": "SK1",
                                                    "service_config": {"s3": {"endpoint_url": "http://s3.local"}}})
    assert env == {"AWS_ACCESS_KEY_ID": "AK1", "AWS_SECRET_ACCESS_KEY": "SK1", "AWS_ENDPOINT_URL_S3": "http://s3.local"}


def test_a_connection_without_keys_leaves_the_worker_credentials_in_charge():
    """No keys in the connection: no key variables, so an instance role or the worker's env applies."""
    assert credentials.environment_from("", "", {"region_name": "us-east-1"}) == {"AWS_DEFAULT_REGION": "us-east-1"}


def test_half_a_key_pair_is_refused():
    """An access key without its secret is a config mistake, not something to half-apply."""
    with pytest.raises(ValueError, match="secret access key"):
        credentials.environment_from("AKIAONLY", None, {})


def test_connection_from_airflow_secrets_and_clear_errors(monkeypatch):
    """A real Airflow connection (env-var secrets backend) resolves; a missing or wrong-type one fails naming it."""
    from airflow.sdk.exceptions import AirflowFailException

    monkeypatch.setenv("AIRFLOW_CONN_STAGEWISE_TEST_S3", json.dumps(
        {"conn_type": "aws", "login": "AKIATEST", "password": "secret-for-test", "extra": {"endpoint_url": "http://e:1"}}))
    monkeypatch.setenv("AIRFLOW_CONN_STAGEWISE_TEST_PG", json.dumps({"conn_type": "postgres", "host": "db"}))
    assert credentials.aws_environment("stagewise_test_s3") == {
        "AWS_ACCESS_KEY_ID": "AKIATEST", "AWS_SECRET_ACCESS_KEY": "secret-for-test", "AWS_ENDPOINT_URL_S3": "http://e:1"}
    assert credentials.aws_environment("") == {}
    with pytest.raises(AirflowFailException, match="'stagewise_missing' does not exist"):
        credentials.aws_environment("stagewise_missing")
    with pytest.raises(AirflowFailException, match="type 'postgres'"):
        credentials.aws_environment("stagewise_test_pg")


def test_a_generic_connection_is_read_like_an_aws_one(monkeypatch):
    """Without the Amazon provider, `airflow connections add --conn-type aws` stores a generic connection: its
    login, password and extra are the same credentials, for the tasks and for the api-server's pages alike."""
    monkeypatch.setenv("AIRFLOW_CONN_STAGEWISE_TEST_GENERIC", json.dumps(
        {"conn_type": "generic", "login": "AKIAGEN", "password": "generic-secret",
         "extra": {"endpoint_url": "http://e:2", "region_name": "eu-west-1"}}))
    assert credentials.aws_environment("stagewise_test_generic") == {
        "AWS_ACCESS_KEY_ID": "AKIAGEN", "AWS_SECRET_ACCESS_KEY": "generic-secret", "AWS_ENDPOINT_URL_S3": "http://e:2",
        "AWS_DEFAULT_REGION": "eu-west-1"}
    assert credentials.storage_options("stagewise_test_generic") == {
        "key": "AKIAGEN", "secret": "generic-secret", "endpoint_url": "http://e:2",
        "client_kwargs": {"region_name": "eu-west-1"}}


def test_exported_restores_the_environment(monkeypatch):
    """Variables are set only inside the block: earlier values come back and new ones go away."""
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    with credentials.exported({"AWS_DEFAULT_REGION": "eu-west-1", "AWS_SESSION_TOKEN": "t"}):
        assert os.environ["AWS_DEFAULT_REGION"] == "eu-west-1" and os.environ["AWS_SESSION_TOKEN"] == "t"
    assert os.environ["AWS_DEFAULT_REGION"] == "us-east-1" and "AWS_SESSION_TOKEN" not in os.environ


def test_a_postgres_connection_becomes_the_study_url_in_the_sub_job_environment(monkeypatch):
    """sweep.storage_conn_id: the connection's fields make one SQLAlchemy URL (a password with URL characters
    escaped) in $STAGEWISE_STUDY_STORAGE; the config never holds it. A missing or wrong connection fails naming it."""
    from airflow.sdk.exceptions import AirflowFailException
    from sqlalchemy.engine import make_url

    password = "p@ss:w/rd%"
    monkeypatch.setenv("AIRFLOW_CONN_STAGEWISE_TEST_OPTUNA", json.dumps(
        {"conn_type": "postgres", "host": "db.internal", "port": 5433, "login": "optuna", "password": password,
         "schema": "studies"}))
    monkeypatch.setenv("AIRFLOW_CONN_STAGEWISE_TEST_NODB", json.dumps({"conn_type": "postgres", "host": "db"}))
    monkeypatch.setenv("AIRFLOW_CONN_STAGEWISE_TEST_HTTP", json.dumps({"conn_type": "http", "host": "db"}))
    env = credentials.study_environment("stagewise_test_optuna")
    url = make_url(env["STAGEWISE_STUDY_STORAGE"])
    assert (url.drivername, url.username, url.password, url.host, url.port, url.database) == (
        "postgresql+psycopg2", "optuna", password, "db.internal", 5433, "studies")
    assert credentials.study_environment("") == {}
    with pytest.raises(AirflowFailException, match="sweep.storage_conn_id: Airflow connection 'nope' does not exist"):
        credentials.study_environment("nope")
    with pytest.raises(AirflowFailException, match="needs a host and a schema"):
        credentials.study_environment("stagewise_test_nodb")
    with pytest.raises(AirflowFailException, match="type 'http', expected 'postgres'"):
        credentials.study_environment("stagewise_test_http")


def test_the_study_connection_docs_services_md_adds_without_the_postgres_provider_is_read(monkeypatch):
    """docs/services.md's `airflow connections add optuna_db --conn-type postgres ...` stores a `generic` connection
    where the Postgres provider is not installed (as here): it makes the same study URL; a connection of another type
    is refused naming the connection, its type and the command that makes a right one."""
    from airflow.sdk.exceptions import AirflowFailException

    monkeypatch.setenv("AIRFLOW_CONN_STAGEWISE_TEST_OPTUNA_GENERIC", json.dumps(
        {"conn_type": "generic", "host": "db.internal", "port": 5432, "login": "optuna", "password": "pg-secret",
         "schema": "optuna"}))
    monkeypatch.setenv("AIRFLOW_CONN_STAGEWISE_TEST_HTTP", json.dumps({"conn_type": "http", "host": "db"}))
    env = credentials.study_environment("stagewise_test_optuna_generic")
    assert env == {"STAGEWISE_STUDY_STORAGE": "postgresql+psycopg2://optuna:pg-secret@db.internal:5432/optuna"}
    with pytest.raises(AirflowFailException) as refused:
        credentials.study_environment("stagewise_test_http")
    assert str(refused.value) == (
        "sweep.storage_conn_id: connection 'stagewise_test_http' has type 'http', expected 'postgres' (or 'generic', "
        "as Airflow stores it without the Postgres provider); create it: airflow connections add stagewise_test_http "
        "--conn-type postgres --conn-host HOST --conn-port PORT --conn-login USER --conn-password PASSWORD "
        "--conn-schema DATABASE (docs/services.md)")


def test_the_task_environment_carries_the_study_url_only_for_a_pipeline_that_names_a_connection(monkeypatch):
    """Every sub-job of a pipeline with sweep.storage_conn_id gets the study URL; one without gets no such variable."""
    from types import SimpleNamespace

    monkeypatch.setenv("AIRFLOW_CONN_STAGEWISE_TEST_OPTUNA", "postgresql://optuna:pw@db:5432/studies")
    config = SimpleNamespace(storage_conn_id="", tracking=SimpleNamespace(conn_id=""),
                             sweep=SimpleNamespace(storage_conn_id="stagewise_test_optuna"))
    assert credentials.task_environment(config) == {
        "STAGEWISE_STUDY_STORAGE": "postgresql+psycopg2://optuna:pw@db:5432/studies"}
    config.sweep.storage_conn_id = ""
    assert credentials.task_environment(config) == {}
