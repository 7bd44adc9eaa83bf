"""The default study storage is a journal file per study (stagewise.study.studies): a sweep worker replays its own
study's log alone, however many studies the storage root holds; studies made before the move, in the one shared
journal of earlier releases, are still found for a warm start (and so for a retrain's)."""

from __future__ import annotations

import optuna
import pytest
import yaml

from stagewise.definitions.config import ConfigError
from stagewise.definitions.loading import load_config
from stagewise.study.studies import create, journal_file, journal_files, open_storage, storage_url
from tests.conftest import base_config


def _default_storage_config(write_config, storage_root, **sweep):
    """A config with sweep.storage unset: the default per-study journal under the storage root."""
    raw = base_config(storage_root)
    del raw["sweep"]["storage"]
    raw["sweep"].update(sweep)
    return load_config(write_config(raw))


def _finished_study(uri: str, name: str, lr: float) -> None:
    """A study in ``uri`` with one completed trial whose params are {lr, hidden}, as an earlier sweep leaves it."""
    study = optuna.create_study(study_name=name, storage=open_storage(uri), direction="maximize")
    study.add_trial(optuna.trial.create_trial(
        params={"lr": lr, "hidden": 64}, value=0.9,
        distributions={"lr": optuna.distributions.FloatDistribution(1e-4, 1.0, log=True),
                       "hidden": optuna.distributions.CategoricalDistribution([32, 64, 128])}))


def _study_names(path) -> list[str]:
    return optuna.get_all_study_names(storage=open_storage(f"journal://{path}"))


def test_each_study_gets_its_own_journal_file(write_config, storage_root):
    """Two runs' studies land in two files under <storage_root>/optuna/studies/, each holding its study alone."""
    config = _default_storage_config(write_config, storage_root)
    create(config, "ml_pipeline__run_1")
    create(config, "ml_pipeline__run:2")
    first, second = (journal_file(config.sweep, name) for name in ("ml_pipeline__run_1", "ml_pipeline__run:2"))
    assert first == str(storage_root / "optuna" / "studies" / "ml_pipeline__run_1.journal")
    assert second != first and "{study}" not in second and ":" not in second.rsplit("/", 1)[1]
    assert _study_names(first) == ["ml_pipeline__run_1"] and _study_names(second) == ["ml_pipeline__run:2"]
    assert not (storage_root / "optuna" / "optuna.journal").exists(), "nothing goes to the old shared file"


def test_a_warm_start_reads_a_study_of_the_old_shared_journal(write_config, storage_root):
    """An existing deployment: the study to warm-start from (a retrain's is the current model's) is only in
    <storage_root>/optuna/optuna.journal; it is found there, its best params are enqueued first, and no empty
    file is left for it under optuna/studies/."""
    legacy = storage_root / "optuna" / "optuna.journal"
    legacy.parent.mkdir(parents=True)
    _finished_study(f"journal://{legacy}", "ml_pipeline__before", lr=0.02)
    config = _default_storage_config(write_config, storage_root, warm_start_from="ml_pipeline__before")
    create(config, "ml_retrain__after")
    study = optuna.load_study(study_name="ml_retrain__after",
                              storage=open_storage(storage_url(config.sweep, "ml_retrain__after")))
    [waiting] = study.get_trials(deepcopy=False)
    assert waiting.system_attrs["fixed_params"]["lr"] == 0.02 and waiting.user_attrs["warm_start_of"] == "ml_pipeline__before#0"
    assert not (storage_root / "optuna" / "studies" / "ml_pipeline__before.journal").exists()
    assert _study_names(legacy) == ["ml_pipeline__before"], "the old file is read, never written"


def test_a_warm_start_prefers_the_study_s_own_file(write_config, storage_root):
    """A study in both places (a study made again after the move) is read from its own file, the newer one."""
    legacy = storage_root / "optuna" / "optuna.journal"
    legacy.parent.mkdir(parents=True)
    _finished_study(f"journal://{legacy}", "ml_pipeline__both", lr=0.5)
    config = _default_storage_config(write_config, storage_root, warm_start_from="ml_pipeline__both")
    _finished_study(storage_url(config.sweep, "ml_pipeline__both"), "ml_pipeline__both", lr=0.003)
    create(config, "ml_pipeline__next")
    study = optuna.load_study(study_name="ml_pipeline__next",
                              storage=open_storage(storage_url(config.sweep, "ml_pipeline__next")))
    assert study.get_trials(deepcopy=False)[0].system_attrs["fixed_params"]["lr"] == 0.003


def test_a_missing_warm_start_study_is_named_in_neither_place(write_config, storage_root):
    """A study that neither its own file nor the old journal holds is a user error naming it, as before."""
    from stagewise.core.errors import UserError

    config = _default_storage_config(write_config, storage_root, warm_start_from="nope")
    with pytest.raises(UserError, match="sweep.warm_start_from: study 'nope'"):
        create(config, "ml_pipeline__x")
    assert not (storage_root / "optuna" / "studies" / "nope.journal").exists()


def test_a_shared_file_set_in_the_config_stays_one_file(write_config, storage_root):
    """sweep.storage naming one journal file (an in-flight run's snapshot of the old default too) keeps every study
    in it: the per-study layout is the default's, or a path holding {study}."""
    config = load_config(write_config())
    create(config, "a")
    create(config, "b")
    assert storage_url(config.sweep, "a") == storage_url(config.sweep, "b") == config.sweep.storage
    assert sorted(_study_names(storage_root / "optuna.journal")) == ["a", "b"]


def test_study_placeholder_only_in_a_journal_path(write_config, storage_root):
    """{study} names a file; in a database URL it is a typo, refused at load naming sweep.storage."""
    raw = base_config(storage_root)
    raw["sweep"]["storage"] = "postgresql+psycopg2://optuna@db/{study}"
    with pytest.raises(ConfigError, match=r"sweep\.storage"):
        load_config(write_config(raw))
    raw["sweep"]["storage"] = "journal://team/{study}.journal"
    config = load_config(write_config(raw))
    assert storage_url(config.sweep, "s") == f"journal://{storage_root / 'team' / 's.journal'}"


def test_a_template_is_never_opened_as_a_file(write_config, storage_root):
    """Opening the per-study template itself (a caller that forgot the study) fails instead of creating a file
    literally named {study}.journal."""
    config = _default_storage_config(write_config, storage_root)
    with pytest.raises(ValueError, match="per study"):
        open_storage(config.sweep.storage)
    with pytest.raises(ValueError, match="name the study"):
        storage_url(config.sweep)


def test_journal_files_lists_each_study_s_file_and_the_old_one(write_config, storage_root):
    """What a tool that walks every study (retention) opens: each study's own file, the old shared journal while it
    exists; a config naming one file lists that file alone."""
    legacy = storage_root / "optuna" / "optuna.journal"
    legacy.parent.mkdir(parents=True)
    _finished_study(f"journal://{legacy}", "old", lr=0.1)
    config = _default_storage_config(write_config, storage_root)
    create(config, "a")
    create(config, "b")
    assert journal_files(config) == [journal_file(config.sweep, "a"), journal_file(config.sweep, "b"), str(legacy)]
    shared = load_config(write_config())
    create(shared, "c")
    assert journal_files(shared) == [str(storage_root / "optuna.journal")]


def test_a_sweep_on_the_default_layout_writes_and_reads_its_own_file(write_config, storage_root, digits_run):
    """create, a worker and the summary of one sweep all use the study's own file; nothing else appears under
    optuna/ (no shared file, no file named after the template)."""
    from stagewise.study.summary import summarize
    from stagewise.sweep import run_worker

    config_path, out = digits_run
    raw = yaml.safe_load(config_path.read_text())
    del raw["sweep"]["storage"]
    raw["sweep"].update({"epochs": 1, "num_trials": 2, "num_workers": 1})
    config_path.write_text(yaml.safe_dump(raw))
    config = load_config(config_path)
    create(config, "ml_pipeline__swept")
    run_worker(config, "ml_pipeline__swept", 0, out)
    summary = summarize(config, "ml_pipeline__swept", out)
    assert summary["n_trials"] == 2 and summary["storage_kind"] == "journal"
    files = sorted(str(p.relative_to(storage_root)) for p in (storage_root / "optuna").rglob("*") if p.is_file())
    assert files == ["optuna/studies/ml_pipeline__swept.journal"]
