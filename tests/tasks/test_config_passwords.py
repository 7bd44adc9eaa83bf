"""No password in a pipeline config (issue 43): a config is readable by every DAG viewer and copied into every run's
snapshot, report and tracking record, so a URL holding one is refused at load, naming the key and the connection
setting to use instead; the study's database comes from ``sweep.storage_conn_id`` at run time."""

from __future__ import annotations

import pytest
import yaml

from stagewise.core import contract
from stagewise.core.errors import UserError
from stagewise.definitions.loading import load_config
from stagewise.definitions.passwords import has_password
from stagewise.study.studies import storage_kind, storage_url

SECRET = "pl4nted-Pw-9zQ"

# Every URL-valued key of the config, with a password planted, and the connection setting its error must name.
PLANTED = [
    ("storage_root", f"s3://AKIAX:{SECRET}@bucket/root", "storage_conn_id"),
    ("dataset.uri", f"s3://AKIAX:{SECRET}@bucket/raw/digits", "storage_conn_id"),
    ("inference.input_uri", f"s3://AKIAX:{SECRET}@bucket/raw/new", "storage_conn_id"),
    ("sweep.storage", f"postgresql+psycopg2://optuna:{SECRET}@db:5432/optuna", "sweep.storage_conn_id"),
    ("sweep.storage", f"postgresql://optuna@db/optuna?password={SECRET}", "sweep.storage_conn_id"),
    ("tracking.mlflow_uri", f"https://stagewise:{SECRET}@mlflow.example", "tracking.conn_id"),
    ("model.args.weights_url", f"https://u:{SECRET}@weights.example/w.pt", "an Airflow connection"),
]


@pytest.mark.parametrize(("key", "url", "instead"), PLANTED)
def test_a_password_in_any_url_key_is_refused_naming_the_key_and_the_connection(write_config, key, url, instead):
    """Given in the file or as a trigger override, the load fails naming the key and where credentials go; the
    message never repeats the password (it lands in import errors, which every viewer reads)."""
    root = raw = yaml.safe_load(write_config().read_text())
    *parents, field = key.split(".")
    for part in parents:
        raw = raw.setdefault(part, {})
    raw[field] = url
    raw = yaml.safe_load(yaml.safe_dump(root))
    for path, overrides in ((write_config(raw, "planted.yaml"), {}), (write_config(), {key: url})):
        with pytest.raises(UserError) as caught:
            load_config(path, overrides)
        message = str(caught.value)
        assert f"{key}: the URL holds credentials" in message and instead in message and SECRET not in message


def test_the_ci_scratch_mode_still_refuses_a_password_it_would_drop(write_config, tmp_path, monkeypatch):
    """CI mode replaces storage keys, but the file (which the DAG's default_args show) must not load either."""
    raw = yaml.safe_load(write_config().read_text())
    raw["sweep"]["storage"] = f"postgresql://u:{SECRET}@db/optuna"
    monkeypatch.setenv("STAGEWISE_SCRATCH_ROOT", str(tmp_path / "scratch"))
    with pytest.raises(UserError, match=r"sweep\.storage: the URL holds credentials"):
        load_config(write_config(raw))


@pytest.mark.parametrize("url", ["postgresql+psycopg2://optuna@db:5432/optuna", "journal:///tmp/optuna.journal",
                                 "s3://bucket/root", "https://mlflow.example/path?x=1", "postgresql://u:@db/o",
                                 "file:///srv/a:b@c/data"])
def test_urls_without_a_password_are_not_credentials(url):
    """A user name alone, an empty password or an '@' inside a path hold no secret."""
    assert not has_password(url)


def test_the_study_on_a_connection_keeps_storage_empty_and_reads_the_url_from_the_environment(write_config,
                                                                                              monkeypatch):
    """With sweep.storage_conn_id the config (and so every snapshot) names only the connection; the sub-job reads the
    URL the Airflow task resolved into $STAGEWISE_STUDY_STORAGE, and logs and summaries see its scheme alone."""
    config = load_config(write_config(), {"sweep.storage": "", "sweep.storage_conn_id": "optuna_db"})
    assert config.sweep.storage == "" and config.sweep.storage_conn_id == "optuna_db"
    assert SECRET not in config.model_dump_json()
    monkeypatch.delenv(contract.STUDY_STORAGE, raising=False)
    with pytest.raises(UserError, match="sweep.storage_conn_id 'optuna_db': \\$STAGEWISE_STUDY_STORAGE is not set"):
        storage_url(config.sweep)
    monkeypatch.setenv(contract.STUDY_STORAGE, f"postgresql+psycopg2://optuna:{SECRET}@db:5432/optuna")
    assert storage_url(config.sweep).endswith("@db:5432/optuna") and storage_kind(config.sweep) == "postgresql+psycopg2"


def test_a_config_without_the_connection_ignores_the_environment(write_config, monkeypatch):
    """A stray $STAGEWISE_STUDY_STORAGE never moves a pipeline whose config names its own storage."""
    monkeypatch.setenv(contract.STUDY_STORAGE, "postgresql://elsewhere/db")
    config = load_config(write_config())
    assert storage_url(config.sweep) == config.sweep.storage and config.sweep.storage.startswith("journal://")


def test_storage_and_its_connection_together_are_refused(write_config):
    """Two sources for one database would disagree some day: the config gives one."""
    with pytest.raises(UserError, match="both name the study's storage"):
        load_config(write_config(), {"sweep.storage": "postgresql://db/optuna", "sweep.storage_conn_id": "optuna_db"})


def test_ci_mode_moves_a_study_on_a_connection_to_the_scratch_journal(write_config, tmp_path, monkeypatch):
    """CI has no production connections: the study goes to a journal under the scratch root, like the rest."""
    monkeypatch.setenv("STAGEWISE_SCRATCH_ROOT", str(tmp_path / "scratch"))
    config = load_config(write_config(), {"sweep.storage": "", "sweep.storage_conn_id": "optuna_db"})
    assert config.sweep.storage_conn_id == "" and config.sweep.storage.startswith(f"journal://{tmp_path / 'scratch'}")
