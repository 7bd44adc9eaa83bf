"""Many pipelines in one deployment: which files are pipelines, the one naming rule, and what may not be shared."""

from __future__ import annotations

import os

import pytest
import yaml

from stagewise.definitions.config import ConfigError
from stagewise.definitions.loading import config_path, load_config
from stagewise.definitions.pipelines import dag_id, discover, name_of, resolve, sources
from tests.conftest import base_config, unnamed


def _write(folder, file_name, raw):
    folder.mkdir(exist_ok=True)
    path = folder / file_name
    path.write_text(yaml.safe_dump(raw))
    return path


def test_every_yaml_of_a_folder_is_a_pipeline_named_by_its_name_key_else_its_file(tmp_path, storage_root, monkeypatch):
    """A folder's *.yaml and *.yml files, sorted; `name:` wins over the file name; ids are <name>_<kind>."""
    folder = tmp_path / "pipelines"
    _write(folder, "b_fraud.yaml", unnamed(storage_root))
    _write(folder, "a.yml", {**base_config(storage_root), "name": "churn"})
    (folder / "notes.txt").write_text("not a pipeline")
    monkeypatch.setenv("STAGEWISE_PIPELINES", str(folder))
    found = discover()
    assert [(p.name, p.path.name) for p in found] == [("churn", "a.yml"), ("b_fraud", "b_fraud.yaml")]
    assert found[0].dag_ids() == {"pipeline": "churn_pipeline", "retrain": "churn_retrain",
                                  "batch_inference": "churn_batch_inference", "ingest": "churn_ingest",
                                  "maintenance": "churn_maintenance"}
    with pytest.raises(ValueError, match="unknown DAG kind 'train'"):
        dag_id("churn", "train")


def test_the_setting_wins_then_stagewise_config_then_the_checkouts_pipelines(tmp_path, monkeypatch):
    """$STAGEWISE_PIPELINES (several, PATH-style) over $STAGEWISE_CONFIG (one file) over pipeline.yaml + examples/."""
    monkeypatch.delenv("STAGEWISE_PIPELINES", raising=False)
    monkeypatch.delenv("STAGEWISE_CONFIG", raising=False)
    assert [p.name for p in discover()] == ["ml", "ddp_tutorial", "decoder", "diabetes", "digits_cnn", "imbalanced", "token_transformer"]
    monkeypatch.setenv("STAGEWISE_CONFIG", str(tmp_path / "one.yaml"))
    assert sources() == [tmp_path / "one.yaml"]
    monkeypatch.setenv("STAGEWISE_PIPELINES", os.pathsep.join([str(tmp_path / "a"), str(tmp_path / "b.yaml")]))
    assert sources() == [tmp_path / "a", tmp_path / "b.yaml"]


def test_an_installed_stagewise_has_no_pipeline_of_its_own(monkeypatch):
    """Outside a checkout (a wheel in site-packages) nothing defaults to a file inside the package: the DAG file's
    setting, $STAGEWISE_PIPELINES or $STAGEWISE_CONFIG must name the configs, and saying so is the error."""
    from stagewise.definitions import loading, pipelines

    monkeypatch.delenv("STAGEWISE_PIPELINES", raising=False)
    monkeypatch.delenv("STAGEWISE_CONFIG", raising=False)
    monkeypatch.setattr(pipelines, "DEFAULT_PIPELINES", ())
    monkeypatch.setattr(loading, "DEFAULT_CONFIG_PATH", None)
    with pytest.raises(ConfigError, match=r"no pipelines named: .*build_pipelines\(globals\(\), .*STAGEWISE_PIPELINES"):
        discover()
    with pytest.raises(ConfigError, match=r"no pipeline config: pass --config or set \$STAGEWISE_CONFIG"):
        load_config()


@pytest.mark.parametrize("problem,message", [
    ("same name", "pipeline name 'ml' is taken by"),
    ("bad name", "pipeline name 'my-model' cannot name DAGs"),
    ("missing", "no such pipelines folder or config file"),
])
def test_a_deployment_that_cannot_name_its_dags_apart_is_refused_naming_the_files(tmp_path, storage_root, monkeypatch,
                                                                                problem, message):
    """Two configs of one name (both files named), a name that is no DAG id, a source that is not there."""
    folder = tmp_path / "pipelines"
    if problem == "same name":
        first = _write(folder, "ml.yaml", unnamed(storage_root))
        second = _write(folder, "other.yaml", {**base_config(storage_root), "name": "ml"})
    elif problem == "bad name":
        first = second = _write(folder, "my-model.yaml", unnamed(storage_root))
    else:
        first = second = folder
    monkeypatch.setenv("STAGEWISE_PIPELINES", str(folder))
    with pytest.raises(ConfigError, match=message) as caught:
        discover()
    assert str(first) in str(caught.value) and str(second) in str(caught.value)


def test_a_name_key_that_cannot_be_a_dag_id_fails_the_config_naming_the_key(write_config, storage_root):
    with pytest.raises(ConfigError, match="name: String should match pattern"):
        load_config(write_config({**base_config(storage_root), "name": "fraud detection"}))


def test_two_pipelines_on_one_storage_root_may_not_share_a_registry_name(tmp_path, storage_root, monkeypatch):
    """Same root and registry.model_name: the newer file is refused naming the older; another root is apart."""
    folder = tmp_path / "pipelines"
    _write(folder, "mlp.yaml", unnamed(storage_root))
    cnn = _write(folder, "cnn.yaml", unnamed(storage_root))  # both register as 'digits' (from raw/digits)
    os.utime(cnn, (2e9, 2e9))
    _write(folder, "elsewhere.yaml", unnamed(tmp_path / "other_root"))
    resolved = resolve(str(folder))
    assert [pipeline.name for pipeline in resolved.configs] == ["elsewhere", "mlp"]
    assert list(resolved.errors) == [str(cnn)]
    assert "registry.model_name 'digits'" in resolved.errors[str(cnn)] and str(folder / "mlp.yaml") in resolved.errors[str(cnn)]


def test_a_runs_snapshot_uri_is_named_like_a_file(tmp_path, storage_root):
    """A config read by URI (a run's snapshot: stagewise.report latest --config file://...) takes its name key, else its
    file's name, as a path does."""
    named = _write(tmp_path, "snap.yaml", base_config(storage_root))
    plain = _write(tmp_path, "fraud.yaml", unnamed(storage_root))
    assert (name_of(f"file://{named}"), name_of(f"file://{plain}")) == ("ml", "fraud")


@pytest.mark.subprocess
def test_the_ci_check_exits_non_zero_naming_each_broken_or_clashing_file_and_key(tmp_path, storage_root):
    """`python -m stagewise.config --pipelines DIR`, as a team's CI runs it: a typo and a registry clash each named
    with file and key, exit 1; the same folder fixed lists every pipeline with its DAG ids, exit 0."""
    import subprocess
    import sys

    folder = tmp_path / "pipelines"
    _write(folder, "fraud.yaml", unnamed(storage_root))
    typo = unnamed(storage_root / "churn")
    typo["evaluate"]["min_test_acuracy"] = typo["evaluate"].pop("min_test_accuracy")
    _write(folder, "churn.yaml", typo)
    copy = _write(folder, "copy.yaml", unnamed(storage_root))
    os.utime(copy, (2e9, 2e9))  # the newer file introduced the clash

    def check() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "stagewise.config", "--pipelines", str(folder)],
                              capture_output=True, text=True, timeout=120)

    failed = check()
    assert failed.returncode == 1
    assert f"{folder / 'churn.yaml'}: invalid pipeline config" in failed.stderr
    assert "evaluate.min_test_acuracy: unknown key" in failed.stderr
    assert f"{copy}: registry.model_name 'digits'" in failed.stderr and f"{folder / 'fraud.yaml'}'s" in failed.stderr
    assert failed.stdout.split("\t")[0] == "fraud"
    copy.unlink()
    _write(folder, "churn.yaml", unnamed(storage_root / "churn"))
    fixed = check()
    assert fixed.returncode == 0, fixed.stderr
    assert [line.split("\t")[0] for line in fixed.stdout.splitlines()] == ["churn", "fraud"]


def test_a_config_read_through_a_revision_link_keeps_the_link(tmp_path, storage_root):
    """git-sync swaps a link to each new revision: the config's path, its spec folder and its scripts keep the link
    (a run's snapshot then outlives the revision folder, which git-sync removes), never the revision they resolve to."""
    revision = tmp_path / "rev-0001"
    revision.mkdir()
    (revision / "ml.yaml").write_text(yaml.safe_dump(base_config(storage_root)))
    link = tmp_path / "current"
    os.symlink(revision, link)
    path = config_path(str(link / "ml.yaml"))
    assert str(path) == str(link / "ml.yaml")
    assert load_config(path).model.import_paths == [str(link)]
