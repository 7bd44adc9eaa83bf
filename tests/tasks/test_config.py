"""The pipeline config: the repo's file loads; every bad file fails with a ConfigError naming the key and the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from stagewise.definitions.config import ConfigError, PipelineConfig
from stagewise.definitions.loading import load_config
from tests.conftest import REPO_ROOT, base_config


def _load_error(write_config, raw: dict) -> str:
    """Write ``raw``, load it, and return the ConfigError's message (failing if it loads)."""
    path = write_config(raw)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert str(path) in message, "the message names the file"
    return message


def test_repo_pipeline_yaml_loads():
    """The shipped pipeline.yaml is valid and every stage references a defined profile."""
    config = load_config(REPO_ROOT / "pipeline.yaml")
    assert isinstance(config, PipelineConfig)
    assert config.train.stages, "at least one training stage"
    for stage in config.train.stages:
        assert stage.profile in config.profiles


def test_base_config_fixture_is_valid(write_config, storage_root):
    """The tests' small config loads and keeps the absolute storage root it was given."""
    config = load_config(write_config())
    assert config.storage_root == str(storage_root)
    assert config.sweep.num_trials == 4


def test_unknown_key_is_refused_as_a_typo(write_config, storage_root):
    """A misspelt key never silently falls back to a default: it names the key path and says 'unknown key'."""
    raw = base_config(storage_root)
    raw["sweep"]["num_trails"] = 3
    message = _load_error(write_config, raw)
    assert "sweep.num_trails" in message and "unknown key" in message


def test_missing_required_key(write_config, storage_root):
    """A required key left out is named with its full path."""
    raw = base_config(storage_root)
    del raw["dataset"]["key"]
    message = _load_error(write_config, raw)
    assert "dataset.key" in message and "required" in message.lower()


def test_undefined_profile_in_a_stage_names_the_stage_index(write_config, storage_root):
    """A stage referencing a missing profile names train.stages[i].profile and the profile."""
    raw = base_config(storage_root)
    raw["train"]["stages"][1]["profile"] = "no_such_profile"
    message = _load_error(write_config, raw)
    assert "train.stages[1].profile" in message and "no_such_profile" in message and "not defined" in message


@pytest.mark.parametrize("section", ["preprocess", "evaluate", "inference"])
def test_non_train_stage_with_a_multiprocess_profile_is_refused(write_config, storage_root, section):
    """Only DDP stages may use processes_per_node > 1; a shard/eval task on such a profile is refused by name."""
    raw = base_config(storage_root)
    raw["profiles"]["wide"] = {"processes_per_node": 2, "pool": "default_pool"}
    raw[section]["profile"] = "wide"
    message = _load_error(write_config, raw)
    assert f"{section}.profile" in message and "processes_per_node" in message


def test_float_search_param_low_not_below_high(write_config, storage_root):
    """A float dimension with low >= high names the parameter and the bounds."""
    raw = base_config(storage_root)
    raw["sweep"]["search_space"]["lr"] = {"type": "float", "low": 0.3, "high": 0.1}
    message = _load_error(write_config, raw)
    assert "sweep.search_space.lr" in message and "must be below high" in message


def test_log_scale_needs_a_positive_low(write_config, storage_root):
    """log: true with low <= 0 is refused (log of zero is undefined)."""
    raw = base_config(storage_root)
    raw["sweep"]["search_space"]["lr"] = {"type": "float", "low": 0.0, "high": 0.1, "log": True}
    message = _load_error(write_config, raw)
    assert "sweep.search_space.lr" in message and "log scale needs low > 0" in message


def test_unknown_hyperparameter_in_search_space(write_config, storage_root):
    """Searching a parameter training cannot use is refused, naming it."""
    raw = base_config(storage_root)
    raw["sweep"]["search_space"]["beta2"] = {"type": "float", "low": 0.9, "high": 0.999}
    message = _load_error(write_config, raw)
    assert "sweep.search_space" in message and "beta2" in message and "unknown hyperparameter" in message


def test_lr_must_be_searched(write_config, storage_root):
    """lr is required in the search space because stages rescale it by batch size."""
    raw = base_config(storage_root)
    del raw["sweep"]["search_space"]["lr"]
    message = _load_error(write_config, raw)
    assert "sweep.search_space" in message and "'lr' must be searched" in message


def test_duplicate_stage_names(write_config, storage_root):
    """Stage names key paths and task ids, so they must be unique."""
    raw = base_config(storage_root)
    raw["train"]["stages"][1]["name"] = raw["train"]["stages"][0]["name"]
    message = _load_error(write_config, raw)
    assert "train.stages" in message and "repeat" in message


@pytest.mark.parametrize("validation,test", [(0.5, 0.4), (0.45, 0.5)])
def test_held_out_fractions_must_leave_training_rows(write_config, storage_root, validation, test):
    """validation + test >= 0.9 leaves too little to train on and is refused."""
    raw = base_config(storage_root)
    raw["preprocess"]["split"].update(validation=validation, test=test)
    message = _load_error(write_config, raw)
    assert "preprocess.split" in message and "validation + test" in message


@pytest.mark.parametrize("uri", ["redis://localhost/0", "optuna.journal", "sqlite:///"])
def test_bad_sweep_storage_scheme(write_config, storage_root, uri):
    """Only journal://<file> and database URLs are accepted as Optuna storage."""
    raw = base_config(storage_root)
    raw["sweep"]["storage"] = uri
    message = _load_error(write_config, raw)
    assert "sweep.storage" in message


def test_journal_without_a_file_is_refused(write_config, storage_root):
    """journal:// with no file path is refused rather than pointing the study at a folder."""
    raw = base_config(storage_root)
    raw["sweep"]["storage"] = "journal://"
    message = _load_error(write_config, raw)
    assert "sweep.storage" in message


@pytest.mark.parametrize("section,key,value", [
    ("pools", "slots", 10**18), ("sweep", "num_trials", 10**9), ("sweep", "batch_size", 10**12),
    ("inference", "rows_per_shard", 10**15), ("inference", "batch_size", 1e18), ("train", "keep_checkpoints", 10**6),
    ("train", "seed", 2**40), ("sweep", "seed", -1)])
def test_absurd_counts_are_config_errors_naming_the_key(write_config, storage_root, section, key, value):
    """Every count has an upper bound no real deployment reaches (stated in the field's description): a typo such
    as 1e18 pool slots fails at load naming the key, not later in Airflow, a loader or an allocation."""
    raw = base_config(storage_root)
    if section == "pools":
        raw["pools"] = {"big": {"slots": value}}
    else:
        raw[section][key] = value
    message = _load_error(write_config, raw)
    assert f"{section}.{'big.' if section == 'pools' else ''}{key}:" in message
    assert "less than or equal" in message or "greater than or equal" in message


@pytest.mark.parametrize("section,key,value", [("evaluate", "objective_limit", float("nan")),
                                               ("evaluate", "min_test_accuracy", float("nan")),
                                               ("registry", "margin", float("inf")), ("preprocess", "max_null_fraction", float("nan"))])
def test_non_finite_limits_are_config_errors_naming_the_key(write_config, storage_root, section, key, value):
    """YAML's .nan and .inf are refused by every float field: a NaN limit is never exceeded, so it would mean none."""
    raw = base_config(storage_root)
    raw[section][key] = value
    assert f"{section}.{key}: Input should be a finite number" in _load_error(write_config, raw)


def test_every_count_of_the_config_has_an_upper_bound_in_its_description():
    """Each int field of the schema has an upper bound, and its description states it (ports and seeds: a range)."""
    import typing

    import annotated_types
    from pydantic import BaseModel

    from stagewise.definitions import config as schema

    missing = []
    for model in [value for value in vars(schema).values() if isinstance(value, type) and issubclass(value, BaseModel)]:
        for name, field in model.model_fields.items():
            if model is schema.IntParam or int not in {field.annotation, *typing.get_args(field.annotation)}:
                continue  # a search dimension's bounds are values to try, not counts
            bounded = any(isinstance(item, annotated_types.Le | annotated_types.Lt) for item in field.metadata)
            described = any(words in (field.description or "") for words in ("at most", " to ", "Port"))
            if not (bounded and described):
                missing.append(f"{model.__name__}.{name}")
    assert not missing, missing


SPEC_SOURCES = {
    "a-function": "def Candidate(**args):\n    return None\n",
    "a-plain-class": "class Candidate:\n    pass\n",
    "a-class-of-another-base": "import json\n\n\nclass Candidate(json.JSONDecoder):\n    pass\n",
    "no-such-class": "X = 1\n",
}


@pytest.mark.parametrize("spec", ["os:system", "json:JSONDecoder", *SPEC_SOURCES])
def test_a_spec_that_is_no_model_spec_subclass_is_refused_at_load_and_by_the_cli(tmp_path, storage_root, spec):
    """model.spec must name a ModelSpec subclass: its source (read, never run) shows a function, a plain class or
    nothing of that name, and load_config and `python -m stagewise.config` refuse it naming model.spec."""
    from stagewise.config import main

    if spec in SPEC_SOURCES:
        (tmp_path / "my_spec.py").write_text(SPEC_SOURCES[spec])
        spec = "my_spec:Candidate"
    raw = base_config(storage_root)
    raw["model"] = {"spec": spec, "args": {}}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=rf"model.spec '{spec}': .*(defines no class|is a function|no ModelSpec subclass)"):
        load_config(path)
    with pytest.raises(SystemExit, match="model.spec"):
        main([str(path)])


@pytest.mark.parametrize("source", [
    "from stagewise.spec import Classifier\n\n\nclass Candidate(Classifier):\n    pass\n",
    "import stagewise.spec as spec\n\n\nclass Base(spec.ModelSpec):\n    pass\n\n\nclass Candidate(Base):\n    pass\n",
    "from base_spec import Shared as Candidate\n",
    "from base_spec import make\n\nCandidate = make()\n",
], ids=["subclass", "through-a-local-base", "re-exported-from-a-module-beside-it", "made-at-run-time"])
def test_a_model_spec_subclass_passes_the_source_check(tmp_path, storage_root, source, capsys):
    """ModelSpec subclasses pass, through local bases, aliases and modules beside the config; a name bound at run time
    passes too (the source cannot tell: the import at the first stage checks it)."""
    from stagewise.config import main

    (tmp_path / "base_spec.py").write_text("from stagewise.spec import Regressor\n\n\nclass Shared(Regressor):\n    pass\n")
    (tmp_path / "my_spec.py").write_text(source)
    raw = base_config(storage_root)
    raw["model"] = {"spec": "my_spec:Candidate", "args": {}}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert load_config(path).model.spec == "my_spec:Candidate"
    main([str(path)])
    assert "my_spec:Candidate" in capsys.readouterr().out


def test_the_config_check_takes_config_and_override_as_every_job_does(write_config, storage_root, capsys):
    """`python -m stagewise.config --config FILE` checks FILE as the positional form does, --override changes a key
    before the check (a bad one is refused naming it), and two different files are refused."""
    from stagewise.config import main

    path = write_config(base_config(storage_root))
    main([str(path)])
    positional = capsys.readouterr().out
    main(["--config", str(path)])
    assert capsys.readouterr().out == positional and "num_trials: 4" in positional
    main(["--config", str(path), "--override", "sweep.num_trials=7"])
    assert "num_trials: 7" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="sweep.num_trials"):
        main(["--config", str(path), "--override", "sweep.num_trials=0"])
    assert main(["--config", str(path), "--dag-id", "pipeline"]) is None and capsys.readouterr().out == "ml_pipeline\n"
    with pytest.raises(SystemExit):
        main([str(path), "--config", str(path.with_name("other.yaml"))])
    assert "two configs" in capsys.readouterr().err


def test_invalid_yaml(tmp_path):
    """A file that is not YAML fails as a ConfigError naming the file, not a raw parser exception."""
    path = tmp_path / "broken.yaml"
    path.write_text("dataset: [1, 2\nsweep: {")
    with pytest.raises(ConfigError, match="not valid YAML") as caught:
        load_config(path)
    assert str(path) in str(caught.value)


def _alias_bomb(levels: int = 20) -> str:
    """model.args whose last key, through aliases each naming ten of the one before, holds 10**levels strings."""
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def _with_model_args(storage_root: Path, path: Path, args_yaml: str) -> Path:
    """base_config with ``model.args`` written as the given YAML block (indented under it), as a file at ``path``."""
    raw = base_config(storage_root)
    spec = raw.pop("model")["spec"]
    indented = "\n".join("    " + line for line in args_yaml.splitlines())
    path.write_text(yaml.safe_dump(raw) + f"model:\n  spec: '{spec}'\n  args:\n{indented}\n")
    return path


@pytest.mark.parametrize("args", [_alias_bomb(), "loop: &loop [*loop]"], ids=["exponential", "recursive"])
def test_a_yaml_alias_bomb_is_refused_at_load_naming_the_file(tmp_path, storage_root, args):
    """Aliases expanding to billions of values (or without end) under model.args are refused as a ConfigError (a user
    error: no retry) naming the file, before anything dumps the config; the name of the file's DAGs still resolves."""
    from stagewise.definitions.pipelines import name_of

    path = _with_model_args(storage_root, tmp_path / "bomb.yaml", args)
    with pytest.raises(ConfigError, match="YAML expands to more than") as caught:
        load_config(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert name_of(path) == "bomb"  # 'name: ml' is not read from a file that does not load: the file name stands


def test_yaml_aliases_of_a_sane_size_still_load(tmp_path, storage_root):
    """An anchor reused a few times is plain YAML and loads."""
    path = _with_model_args(storage_root, tmp_path / "anchors.yaml", "hidden: &width 32\nwidths: [*width, *width]")
    assert load_config(path).model.args["widths"] == [32, 32]


@pytest.mark.parametrize("text,kind", [("- a\n- b\n", "list"), ("just a string\n", "str"), ("", "NoneType")])
def test_top_level_must_be_a_mapping(tmp_path, text, kind):
    """A list, scalar or empty document is refused with the type it got."""
    path = tmp_path / "flat.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="must be a mapping") as caught:
        load_config(path)
    assert kind in str(caught.value)


def test_missing_file(tmp_path):
    """A config path that does not exist fails as a ConfigError naming the path."""
    path = tmp_path / "absent.yaml"
    with pytest.raises(ConfigError, match="cannot read") as caught:
        load_config(path)
    assert str(path) in str(caught.value)


@pytest.mark.parametrize("value", ["fast", [1, 2]])
def test_non_mapping_section_is_a_config_error(write_config, storage_root, value):
    """A section given as a scalar or list is a ConfigError naming the section, not a crash."""
    raw = base_config(storage_root)
    raw["sweep"] = value
    message = _load_error(write_config, raw)
    assert "sweep" in message


def test_dotted_overrides_apply(write_config):
    """Overrides with dotted keys reach nested mappings and list items; untouched keys keep their values."""
    path = write_config()
    plain = load_config(path)
    changed = load_config(path, overrides={"sweep.num_trials": 7, "train.stages.1.epochs": 5})
    assert changed.sweep.num_trials == 7
    assert changed.train.stages[1].epochs == 5
    assert changed.train.stages[0].epochs == plain.train.stages[0].epochs
    assert changed.sweep.num_workers == plain.sweep.num_workers


@pytest.mark.parametrize("overrides,key", [({"sweep.num_trials": 0}, "sweep.num_trials"),
                                           ({"train.stages.1.epochs": -1}, "train.stages.1.epochs"),
                                           ({"sweep.num_trails": 3}, "sweep.num_trails")])
def test_overrides_are_validated(write_config, overrides, key):
    """An override is validated like the file: a bad value or unknown key names its path."""
    with pytest.raises(ConfigError) as caught:
        load_config(write_config(), overrides=overrides)
    assert key in str(caught.value)


def test_override_of_a_missing_list_item_is_a_config_error(write_config):
    """An override indexing past the stage list fails as a ConfigError, not an IndexError."""
    with pytest.raises(ConfigError, match="override"):
        load_config(write_config(), overrides={"train.stages.9.epochs": 2})


def test_relative_storage_root_resolves_against_the_config_file(tmp_path, storage_root, monkeypatch):
    """A relative storage_root and entrypoint script are under the config file's folder, whatever the cwd (an
    installed Stagewise has no repo root to fall back on), and a relative journal file under the storage root (a
    read-only pipelines folder never holds one); an absolute script stays as it is."""
    raw = base_config(storage_root)
    raw["storage_root"] = "data"
    raw["sweep"]["storage"] = "journal://state/optuna.journal"
    raw["sweep"]["entrypoint"] = {"script": "scripts/trial.py"}
    raw["train"]["stages"][0]["entrypoint"] = {"script": "/opt/team/stage.py"}
    raw["train"]["stages"][1]["entrypoint"] = {"module": "team.stage"}
    folder = tmp_path / "project"
    folder.mkdir()
    path = folder / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config(path)
    assert Path(config.storage_root) == folder.resolve() / "data"
    assert config.sweep.storage == f"journal://{folder.resolve() / 'data' / 'state' / 'optuna.journal'}"
    assert config.sweep.entrypoint.script == str(folder.resolve() / "scripts" / "trial.py")
    first, second = (stage.entrypoint for stage in config.train.stages)
    assert first.script == "/opt/team/stage.py" and (second.script, second.module) == (None, "team.stage")


@pytest.mark.parametrize("root", ["local", "file"])
def test_the_sweep_journal_defaults_to_a_file_under_the_storage_root(write_config, storage_root, root):
    """Unset sweep.storage: a journal file per study, <storage_root>/optuna/studies/{study}.journal (a plain local path
    for a file:// root), never beside the config file nor in the worker's cwd."""
    raw = base_config(storage_root)
    del raw["sweep"]["storage"]
    raw["storage_root"] = str(storage_root) if root == "local" else f"file://{storage_root}"
    config = load_config(write_config(raw))
    assert config.sweep.storage == f"journal://{storage_root / 'optuna' / 'studies' / '{study}.journal'}"


def test_an_s3_storage_root_needs_sweep_storage_set(write_config, storage_root):
    """A journal file cannot live on S3: with an s3:// root and no sweep.storage the load fails naming the key and
    the choices; a database (or an absolute shared journal file) is taken as given."""
    raw = base_config(storage_root)
    del raw["sweep"]["storage"]
    raw["storage_root"] = "s3://team-bucket/stagewise"
    message = _load_error(write_config, raw)
    assert "sweep.storage" in message and "postgresql" in message and "s3://team-bucket/stagewise" in message
    raw["sweep"]["storage"] = "postgresql+psycopg2://optuna@db/optuna"
    assert load_config(write_config(raw)).sweep.storage == raw["sweep"]["storage"]


@pytest.mark.parametrize("packages", ["site-packages", "dist-packages"])
def test_a_relative_storage_root_inside_an_installed_package_is_refused(tmp_path, storage_root, monkeypatch, packages):
    """A shipped example used where pip installed it (storage_root: ../storage) would put runs and models in the
    environment: refused at load, naming the file and telling the user to set storage_root. Under the CI's scratch
    root the same file loads, its storage there."""
    installed = tmp_path / "venv" / "lib" / "python3.11" / packages / "stagewise" / "examples"
    installed.mkdir(parents=True)
    raw = base_config(storage_root)
    raw["storage_root"] = "../storage"
    path = installed / "digits.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(path) in str(caught.value) and "set storage_root" in str(caught.value)
    monkeypatch.setenv("STAGEWISE_SCRATCH_ROOT", str(tmp_path / "ci"))
    assert load_config(path).storage_root == str(tmp_path / "ci" / "ml")


def test_config_env_var_picks_the_file(write_config, monkeypatch, storage_root):
    """With no path given, $STAGEWISE_CONFIG names the file every sub-job loads."""
    path = write_config()
    monkeypatch.setenv("STAGEWISE_CONFIG", str(path))
    assert load_config().storage_root == str(storage_root)


# --- obvious domains of hyperparameters (issue 10) ----------------------------------------------------------------


@pytest.mark.parametrize("name,value", [("lr", -0.1), ("lr", 0), ("hidden", 0), ("hidden", 2.5), ("momentum", 5),
                                        ("dropout", 1.0), ("weight_decay", -0.01), ("optimizer", "lion")])
def test_default_param_outside_its_domain_is_refused(write_config, storage_root, name, value):
    """train.default_params values outside their obvious domain fail at load, naming the section and the key."""
    raw = base_config(storage_root)
    raw["train"]["default_params"] = {name: value}
    message = _load_error(write_config, raw)
    assert "train.default_params" in message and f"{name}={value!r} is out of range" in message


def test_default_params_inside_their_domains_load(write_config, storage_root):
    """Edge values of each domain (momentum 0, dropout 0, weight_decay 0, an adamw optimizer) are accepted."""
    raw = base_config(storage_root)
    raw["train"]["default_params"] = {"lr": 1e-6, "momentum": 0.0, "dropout": 0.0, "weight_decay": 0.0, "hidden": 1,
                                      "optimizer": "adamw"}
    assert load_config(write_config(raw)).train.default_params["optimizer"] == "adamw"


@pytest.mark.parametrize("name,space,fragment", [
    ("lr", {"type": "float", "low": -0.1, "high": 0.1}, "lr.low -0.1 is out of range"),
    ("weight_decay", {"type": "float", "low": -1.0, "high": 0.1}, "weight_decay.low -1.0 is out of range"),
    ("hidden", {"type": "int", "low": 0, "high": 64}, "hidden.low 0 is out of range"),
    ("hidden", {"type": "categorical", "choices": [0, 64]}, "hidden.choices 0 is out of range"),
    ("hidden", {"type": "float", "low": 8, "high": 64}, "fractional widths"),
    ("momentum", {"type": "float", "low": 0.5, "high": 5.0}, "momentum.high 5.0 is out of range"),
    ("optimizer", {"type": "categorical", "choices": ["sgd", "lion"]}, "optimizer.choices 'lion' is out of range"),
    ("lr", {"type": "float", "low": 0.01, "high": 0.1, "grid": [0.01, -0.1]}, "lr.grid -0.1 is out of range"),
])
def test_search_space_reaching_outside_a_domain_is_refused(write_config, storage_root, name, space, fragment):
    """A search dimension that could sample a value outside its hyperparameter's domain fails at load, naming it."""
    raw = base_config(storage_root)
    raw["sweep"]["search_space"][name] = space
    message = _load_error(write_config, raw)
    assert "sweep.search_space" in message and fragment in message


def test_int_log_param_needs_a_low_of_at_least_one(write_config, storage_root):
    """An int dimension on a log scale with low 0 is refused at load (Optuna would raise inside suggest())."""
    raw = base_config(storage_root)
    raw["sweep"]["search_space"]["hidden"] = {"type": "int", "low": 0, "high": 64, "log": True}
    message = _load_error(write_config, raw)
    assert "sweep.search_space.hidden" in message and "log scale needs low >= 1" in message


# --- URIs, schedule and overrides (issue 10) -------------------------------------------------------------------


@pytest.mark.parametrize("key,uri,package", [("storage_root", "gs://bucket/stagewise", "gcsfs"),
                                             ("storage_root", "abfs://container/stagewise", "adlfs"),
                                             ("dataset.uri", "gs://bucket/raw/digits", "gcsfs")])
def test_uri_whose_filesystem_is_not_installed_is_refused(write_config, storage_root, key, uri, package):
    """A URI scheme whose fsspec filesystem is missing fails at load naming the key, the scheme and what to install."""
    raw = base_config(storage_root)
    section, _, leaf = key.rpartition(".")
    (raw[section] if section else raw)[leaf] = uri
    message = _load_error(write_config, raw)
    scheme = uri.split("://")[0]
    assert f"{key}: scheme '{scheme}://'" in message and f"pip install {package}" in message


def test_uri_with_an_unknown_scheme_is_refused(write_config, storage_root):
    """A scheme fsspec does not know at all is named with the schemes that work."""
    raw = base_config(storage_root)
    raw["storage_root"] = "nosuch://bucket/x"
    message = _load_error(write_config, raw)
    assert "storage_root: scheme 'nosuch://' has no fsspec filesystem" in message


@pytest.mark.parametrize("schedule", ["every sunday", "61 * * * *", "0 3 * *"])
def test_bad_retrain_schedule_is_refused(write_config, storage_root, schedule):
    """retrain.schedule must be a cron expression; anything else fails at load naming the key and the value."""
    raw = base_config(storage_root)
    raw["retrain"] = {"schedule": schedule}
    message = _load_error(write_config, raw)
    assert f"retrain.schedule: '{schedule}' is not a cron expression" in message


@pytest.mark.parametrize("schedule", ["0 3 * * 0", "*/15 * * * 1-5", "@daily"])
def test_cron_schedules_and_presets_load(write_config, storage_root, schedule):
    """Valid cron expressions and presets pass as they are."""
    raw = base_config(storage_root)
    raw["retrain"] = {"schedule": schedule}
    assert load_config(write_config(raw)).retrain.schedule == schedule


@pytest.mark.parametrize("key,fragment", [
    ("train.stages.5.epochs", "train.stages is a list of 2 item(s)"),
    ("train.stages.x.epochs", "'x' is not one of its indexes"),
    ("sweep.num_trials.x", "sweep.num_trials is 4, not a mapping"),
    ("sweep..epochs", "names between its dots"),
])
def test_override_that_cannot_be_applied_names_its_key(write_config, key, fragment):
    """An override whose path cannot exist fails as a ConfigError naming the override key and why."""
    with pytest.raises(ConfigError) as caught:
        load_config(write_config(), overrides={key: 3})
    assert f"override '{key}'" in str(caught.value) and fragment in str(caught.value)


def test_override_creating_an_unknown_key_is_traced_to_the_override(write_config):
    """An override that invents a key fails validation naming the key and the override that set it."""
    with pytest.raises(ConfigError) as caught:
        load_config(write_config(), overrides={"sweep.nonexistent.x": 1})
    assert "sweep.nonexistent: unknown key (typo?) (from override sweep.nonexistent.x)" in str(caught.value)


# --- dataset: float targets, tensor columns, demo data; evaluate.objective_limit ----------------------------------


def test_num_classes_may_be_left_out_for_a_float_target(write_config, storage_root):
    """No dataset.num_classes (or null) loads: the label is then a float target."""
    raw = base_config(storage_root)
    del raw["dataset"]["num_classes"]
    assert load_config(write_config(raw)).dataset.num_classes is None
    raw["dataset"]["num_classes"] = None
    assert load_config(write_config(raw)).dataset.num_classes is None


def test_one_class_is_refused(write_config, storage_root):
    """num_classes, when given, is at least 2."""
    raw = base_config(storage_root)
    raw["dataset"]["num_classes"] = 1
    assert "dataset.num_classes" in _load_error(write_config, raw)


def test_tensor_columns_mix_with_plain_names(write_config, storage_root):
    """features may mix plain names and {column, shape, normalize} entries; shapes lists the declared ones."""
    raw = base_config(storage_root)
    raw["dataset"]["features"] = ["age", {"column": "image", "shape": [1, 8, 8]}, {"column": "v", "shape": [3], "normalize": False}]
    dataset = load_config(write_config(raw)).dataset
    assert dataset.shapes == {"image": [1, 8, 8], "v": [3]}
    # unset (None) on a tensor column resolves to standardising it (tests/tasks/test_preprocess_columns.py)
    assert [getattr(item, "normalize", "plain") for item in dataset.features] == ["plain", None, False]


@pytest.mark.parametrize(("item", "problem"), [
    ({"column": "t", "dtype": "int64", "shape": [4], "max_length": 8}, "not both"),
    ({"column": "t", "dtype": "int64", "normalize": True}, "int64 column is never normalised"),
    ({"column": "t", "max_length": 8, "normalize": True}, "variable-length column is never normalised"),
    ({"column": "t", "dtype": "categorical", "max_length": 8}, "one value a row"),
    ({"column": "t", "dtype": "int64", "truncate": True}, "truncate applies to a variable-length column"),
    ({"column": "t", "dtype": "int64", "max_categories": 5}, "max_categories applies to dtype categorical"),
    ({"column": "t", "dtype": "int32"}, "dtype"),
])
def test_typed_columns_are_checked_when_the_config_loads(write_config, storage_root, item, problem):
    """A typed feature column that contradicts itself fails at load, naming the column and the clash."""
    raw = base_config(storage_root)
    raw["dataset"]["features"] = ["age", item]
    message = _load_error(write_config, raw)
    assert problem in message and "dataset.features" in message


def test_typed_columns_are_not_tensor_shapes(write_config, storage_root):
    """Only float32 tensor columns are flattened into the feature vector; typed ones are listed apart."""
    raw = base_config(storage_root)
    raw["dataset"]["features"] = ["age", {"column": "ids", "dtype": "int64", "shape": [4]},
                                  {"column": "tokens", "dtype": "int64", "max_length": 16}, {"column": "image", "shape": [2]}]
    dataset = load_config(write_config(raw)).dataset
    assert dataset.shapes == {"image": [2]}
    assert {name for name, item in dataset.declared.items() if item.typed} == {"ids", "tokens"}


@pytest.mark.parametrize("shape", [[], [0], [1, -2]])
def test_a_tensor_column_shape_must_be_positive_and_non_empty(write_config, storage_root, shape):
    """A declared shape has at least one dimension and every dimension is at least 1."""
    raw = base_config(storage_root)
    raw["dataset"]["features"] = ["age", {"column": "image", "shape": shape}]
    message = _load_error(write_config, raw)
    assert "dataset.features: item 1" in message and "shape" in message


def test_a_column_declared_twice_is_refused(write_config, storage_root):
    """The same column as a plain name and as a tensor column repeats."""
    raw = base_config(storage_root)
    raw["dataset"]["features"] = ["image", {"column": "image", "shape": [4]}]
    assert "feature columns repeat" in _load_error(write_config, raw)


def test_demo_data_is_one_of_the_writers(write_config, storage_root):
    """dataset.demo_data names a data set stagewise.data can write; digits by default."""
    raw = base_config(storage_root)
    assert load_config(write_config(raw)).dataset.demo_data == "digits"
    raw["dataset"]["demo_data"] = "mnist"
    assert "dataset.demo_data" in _load_error(write_config, raw)


@pytest.mark.parametrize("name", ["diabetes", "digits_cnn"])
def test_example_configs_load(name):
    """The shipped examples are valid configs (diabetes: a float target; digits_cnn: a declared image column)."""
    config = load_config(REPO_ROOT / "examples" / f"{name}.yaml")
    assert (config.dataset.num_classes is None) == (name == "diabetes")
    assert config.dataset.shapes == ({"image": [1, 8, 8]} if name == "digits_cnn" else {})


SAGEMAKER = {"instance_type": "ml.g5.12xlarge", "image_uri": "123456789012.dkr.ecr.eu-west-1.amazonaws.com/stagewise:1",
             "role_arn": "arn:aws:iam::123456789012:role/stagewise-training"}
KUBERNETES = {"image": "registry.example/stagewise:1", "gpus_per_pod": 8}


def _multinode(storage_root, backend: str, **profile) -> dict:
    raw = base_config(storage_root)
    raw["storage_root"] = "s3://bucket/stagewise"
    raw["profiles"]["ddp2"].update({"backend": backend, "nodes": 2, backend: SAGEMAKER if backend == "sagemaker" else KUBERNETES,
                                    **profile})
    return raw


@pytest.mark.parametrize("backend", ["sagemaker", "kubernetes"])
def test_a_multinode_stage_counts_every_process_on_every_node(write_config, storage_root, backend):
    """nodes x processes_per_node is the world size the batch arithmetic uses: a global batch must divide by it."""
    raw = _multinode(storage_root, backend, processes_per_node=2)
    config = load_config(write_config(raw))
    assert config.profile("ddp2").world_size == 4
    raw["train"]["stages"][1].update({"global_batch": 6, "per_process_batch": None})
    with pytest.raises(ConfigError, match=r"global_batch 6 does not divide into 4 process\(es\)"):
        load_config(write_config(raw))


@pytest.mark.parametrize("change, message", [
    ({"backend": "local", "nodes": 2, "sagemaker": None}, "backend 'local' runs on one worker: nodes must be 1"),
    ({"sagemaker": None}, "backend 'sagemaker' needs a 'sagemaker:' block"),
    ({"kubernetes": KUBERNETES}, "a 'kubernetes:' block belongs to backend 'kubernetes', not 'sagemaker'"),
    ({"sagemaker": {**SAGEMAKER, "use_spot": True, "max_run_s": 3600, "max_wait_s": 3600}}, "max_wait_s 3600 must exceed max_run_s 3600"),
    ({"sagemaker": {**SAGEMAKER, "max_wait_s": 7200}}, "max_wait_s applies to spot training only"),
    ({"sagemaker": {**SAGEMAKER, "role_arn": "stagewise-training"}}, "role_arn"),
])
def test_a_profile_that_cannot_run_is_refused_when_the_config_loads(write_config, storage_root, change, message):
    """Backends and their settings are checked at load time, naming the setting, not when a job is submitted."""
    raw = _multinode(storage_root, "sagemaker")
    raw["profiles"]["ddp2"].update(change)
    with pytest.raises(ConfigError, match=message):
        load_config(write_config(raw))


def test_sagemaker_needs_an_s3_storage_root_and_only_train_stages_leave_the_worker(write_config, storage_root):
    """A SageMaker job reads and writes the run through S3; preprocessing, sweep, evaluation and inference stay local."""
    raw = _multinode(storage_root, "sagemaker")
    raw["storage_root"] = str(storage_root)
    with pytest.raises(ConfigError, match="backend 'sagemaker' reads and writes the run through S3"):
        load_config(write_config(raw))
    raw = _multinode(storage_root, "kubernetes")
    raw["evaluate"]["profile"] = "ddp2"
    raw["profiles"]["ddp2"]["processes_per_node"] = 1
    with pytest.raises(ConfigError, match="evaluate.profile: profile 'ddp2' has backend 'kubernetes'; only train stages"):
        load_config(write_config(raw))


@pytest.mark.parametrize("metric,limit", [("accuracy", 1e308), ("accuracy", -0.5), ("accuracy", 1.01), ("rmse", -1.0)])
def test_an_objective_limit_outside_the_metric_range_is_refused(write_config, storage_root, metric, limit):
    """A limit no model can meet or miss (accuracy 1e308, a negative rmse) fails at load (start_run), not at evaluate."""
    raw = base_config(storage_root)
    raw["objective"] = {"metric": metric, "direction": "maximize" if metric == "accuracy" else "minimize"}
    raw["evaluate"]["objective_limit"] = limit
    message = _load_error(write_config, raw)
    assert "evaluate.objective_limit" in message and f"outside the range of {metric}" in message


@pytest.mark.parametrize("limit", [float("nan"), float("inf")])
def test_a_non_finite_objective_limit_is_refused_not_read_as_no_limit(write_config, limit):
    """A JSON NaN (or Infinity) from the trigger form is an error naming the key; null is the only 'no limit'."""
    with pytest.raises(ConfigError, match=r"evaluate\.objective_limit"):
        load_config(write_config(), overrides={"evaluate.objective_limit": limit})


def test_a_warm_start_study_longer_than_optuna_keeps_is_refused(write_config):
    """sweep.warm_start_from is bounded (Optuna's 512 characters): a 1 MB value fails at load, naming the key."""
    with pytest.raises(ConfigError, match=r"sweep\.warm_start_from"):
        load_config(write_config(), overrides={"sweep.warm_start_from": "x" * 1_000_000})


@pytest.mark.parametrize("name", ["pipeline.yaml", *sorted(p.name for p in (REPO_ROOT / "examples").glob("*.yaml"))])
def test_a_config_snapshot_loads_back_to_the_same_config_with_the_same_hash(name, tmp_path):
    """A run's config.yaml (every default and override written out) validates back to an equal config, from a path or
    a file:// URI, so the run reads exactly what start_run resolved; the hash is stable across the round trip."""
    from stagewise.definitions.loading import snapshot

    source = REPO_ROOT / name if name == "pipeline.yaml" else REPO_ROOT / "examples" / name
    config = load_config(source, {"sweep.num_trials": 3})
    text, digest = snapshot(config)
    (tmp_path / "config.yaml").write_text(text)
    for where in (tmp_path / "config.yaml", f"file://{tmp_path / 'config.yaml'}"):
        again = load_config(where)
        assert again == config and snapshot(again)[1] == digest


def test_a_missing_snapshot_uri_is_a_config_error_naming_it(tmp_path):
    """A run's config.yaml that is not there names the URI (a read fault would be retried instead)."""
    with pytest.raises(ConfigError, match=rf"file://{tmp_path}/gone.yaml: cannot read pipeline config"):
        load_config(f"file://{tmp_path}/gone.yaml")


@pytest.mark.parametrize("root", ["/", "file:///", "/etc", "/usr/local/stagewise", "/proc/self", "/home", "/tmp/"])
def test_a_storage_root_at_the_filesystems_root_or_in_a_system_folder_is_refused(write_config, storage_root, root):
    """storage_root '/' would write /runs, /models and /raw: refused at load naming the key, as are system folders and
    shared top-level folders themselves."""
    raw = base_config(storage_root)
    raw["storage_root"] = root
    with pytest.raises(ConfigError, match=r"storage_root: .*storage_root '"):
        load_config(write_config(raw))


def test_a_relative_storage_root_may_climb_one_folder_but_not_more(tmp_path, storage_root):
    """'../storage' beside a pipelines folder loads (the examples' layout); '../../../..' is refused naming the root,
    how far it climbs and where it would land."""
    pipelines = tmp_path / "repo" / "pipelines"
    pipelines.mkdir(parents=True)
    raw = base_config(storage_root)
    raw["storage_root"] = "../storage"
    (pipelines / "ml.yaml").write_text(yaml.safe_dump(raw))
    assert load_config(pipelines / "ml.yaml").storage_root == str(tmp_path / "repo" / "storage")
    raw["storage_root"] = "../../../.."
    (pipelines / "ml.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"storage_root '\.\./\.\./\.\./\.\.' climbs 4 folders above"):
        load_config(pipelines / "ml.yaml")


def test_a_key_given_twice_is_refused_naming_it_and_both_lines(write_config, storage_root, tmp_path):
    """YAML keeps the last of a key given twice; a pipeline config refuses it (naming the key and where), while a
    merge key ('<<: *base') still lets a mapping override what it merges."""
    path = tmp_path / "twice.yaml"
    text = yaml.safe_dump(base_config(storage_root), sort_keys=False)
    path.write_text(text.replace("sweep:\n", "sweep:\n  num_trials: 7\n", 1))
    with pytest.raises(ConfigError, match=r"key 'num_trials' is given twice in one mapping \(first on line \d+\)"):
        load_config(path)
    from stagewise.definitions.loading import read_yaml

    assert read_yaml("base: &b {x: 1, y: 2}\nuse:\n  <<: *b\n  x: 3\n", "merge.yaml")["use"] == {"x": 3, "y": 2}

