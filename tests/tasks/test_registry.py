"""The model registry: versioned folders, a current pointer moved only by the gate, rollback, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stagewise import registry
from stagewise.core.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[2]
NAME = "digits"  # the registry name the test config gets from its dataset.uri (raw/digits)


def _model(tmp_path: Path, name: str, payload: bytes) -> str:
    path = tmp_path / f"{name}.pt"
    path.write_bytes(payload)
    return str(path)


def _register(root: Path, tmp_path: Path, name: str, accuracy: float) -> str:
    card = registry.register(str(root), NAME, _model(tmp_path, name, name.encode() * 10), {"test_accuracy": accuracy, "source_run": name})
    return card["version"]


def test_registering_the_same_model_twice_is_one_version(storage_root, tmp_path):
    """A version is the hash of the model's bytes: a retried register task adds nothing."""
    first = _register(storage_root, tmp_path, "a", 0.9)
    again = _register(storage_root, tmp_path, "a", 0.9)
    assert first == again and len(registry.versions(str(storage_root), NAME)) == 1
    card = json.loads((storage_root / "models" / NAME / first / "card.json").read_text())
    assert card["test_accuracy"] == 0.9 and (storage_root / "models" / NAME / first / "model.pt").exists()


def test_gate_promotes_the_first_model_and_a_better_one(storage_root, tmp_path):
    """No current model: promote. A later model beating the current by more than the margin: promote."""
    first = _register(storage_root, tmp_path, "a", 0.90)
    assert registry.gate(str(storage_root), NAME, first, "test_accuracy", margin=0.01)["promoted"]
    better = _register(storage_root, tmp_path, "b", 0.95)
    decision = registry.gate(str(storage_root), NAME, better, "test_accuracy", margin=0.01)
    assert decision["promoted"] and decision["current"] == better and decision["previous"] == first


def test_gate_refuses_a_model_that_does_not_beat_the_margin(storage_root, tmp_path):
    """A model within the margin (or worse) is registered but the pointer stays where it was."""
    first = _register(storage_root, tmp_path, "a", 0.90)
    registry.gate(str(storage_root), NAME, first, "test_accuracy", margin=0.0)
    close = _register(storage_root, tmp_path, "b", 0.905)
    decision = registry.gate(str(storage_root), NAME, close, "test_accuracy", margin=0.01)
    assert not decision["promoted"] and decision["current"] == first
    assert "0.9050 <= current 0.9000 + margin 0.01" in decision["reason"]
    assert registry.current(str(storage_root), NAME)["version"] == first


def test_rollback_moves_the_pointer_back_and_runs_out(storage_root, tmp_path):
    """Rollback restores the previous current version; with no history it is a clear error."""
    first = _register(storage_root, tmp_path, "a", 0.90)
    second = _register(storage_root, tmp_path, "b", 0.95)
    registry.gate(str(storage_root), NAME, first, "test_accuracy", 0.0)
    registry.gate(str(storage_root), NAME, second, "test_accuracy", 0.0)
    assert registry.rollback(str(storage_root), NAME)["version"] == first
    with pytest.raises(UserError, match="nothing to roll back to"):
        registry.rollback(str(storage_root), NAME)


def test_unknown_version_is_a_user_error(storage_root):
    """Asking for a version that was never registered names it."""
    with pytest.raises(UserError, match="model version 'm-nope' is not registered"):
        registry.card(str(storage_root), NAME, "m-nope")


@pytest.mark.subprocess
def test_cli_lists_versions_marks_current_and_rolls_back(storage_root, tmp_path, write_config, subprocess_env):
    """`python -m stagewise.registry list` marks the current version with '*'; `rollback` moves it back."""
    config = write_config()
    first = _register(storage_root, tmp_path, "a", 0.90)
    second = _register(storage_root, tmp_path, "b", 0.95)
    registry.gate(str(storage_root), NAME, first, "test_accuracy", 0.0)
    registry.gate(str(storage_root), NAME, second, "test_accuracy", 0.0)

    def cli(*args: str) -> str:
        return subprocess.run([sys.executable, "-m", "stagewise.registry", *args, "--config", str(config)], cwd=REPO_ROOT,
                              env=subprocess_env, capture_output=True, text=True, check=True).stdout

    listing = cli("list")
    assert f"* {second}" in listing and f"  {first}" in listing
    assert f"current {NAME}: {first}" in cli("rollback")
    assert json.loads(cli("show"))["version"] == first


@pytest.mark.parametrize("metric", [float("nan"), float("inf")])
def test_model_with_a_non_finite_metric_is_never_registered(storage_root, tmp_path, metric):
    """register refuses a model whose metric is NaN/inf, naming its URI and version, and writes no version folder."""
    model_uri = _model(tmp_path, "diverged", b"diverged" * 10)
    with pytest.raises(UserError) as caught:
        registry.register(str(storage_root), NAME, model_uri, {"test_accuracy": metric, "source_run": "diverged"})
    message = str(caught.value)
    assert model_uri in message and "version m-" in message and "test_accuracy" in message
    assert registry.versions(str(storage_root), NAME) == []
    assert not (storage_root / "models").exists() or not any((storage_root / "models").iterdir())


def test_model_name_defaults_to_the_data_sets_last_path_component_and_ignores_input_overrides(write_config, storage_root):
    """No registry.model_name: the file's dataset.uri names the registry; a run's input_uri override does not move it."""
    from stagewise.definitions.loading import load_config
    from tests.conftest import base_config

    path = write_config()
    assert load_config(path).registry.model_name == "digits"
    assert load_config(path, {"dataset.uri": "raw/digits_v2"}).registry.model_name == "digits"
    raw = base_config(storage_root)
    raw["dataset"]["uri"] = "s3://bucket/raw/diabetes.parquet"
    raw["storage_root"] = str(storage_root)
    assert load_config(write_config(raw, "other.yaml")).registry.model_name == "diabetes"


@pytest.mark.subprocess
def test_two_model_names_on_one_storage_root_each_have_their_own_current_model(write_config, storage_root, tmp_path,
                                                                            subprocess_env):
    """A diabetes model is never gated against the digits model, and each name keeps its own current.json and list.

    Before, one registry spanned the storage root: the weak regressor was compared with the digits classifier.
    """
    from stagewise.definitions.loading import load_config
    from tests.conftest import base_config

    raw = base_config(storage_root)
    raw["registry"] = {"model_name": "diabetes"}
    digits, diabetes = load_config(write_config()), load_config(write_config(raw, "diabetes.yaml"))
    assert digits.storage_root == diabetes.storage_root
    assert (digits.registry.model_name, diabetes.registry.model_name) == ("digits", "diabetes")
    root = str(storage_root)
    strong = registry.register(root, "digits", _model(tmp_path, "cnn", b"cnn" * 10), {"test_accuracy": 0.97})["version"]
    assert registry.gate(root, "digits", strong, "test_accuracy", 0.0)["promoted"]
    weak = registry.register(root, "diabetes", _model(tmp_path, "reg", b"reg" * 10), {"test_accuracy": 0.30})["version"]
    decision = registry.gate(root, "diabetes", weak, "test_accuracy", 0.0)
    assert decision["promoted"] and decision["reason"] == "no current model", "gated against another name's model"
    assert registry.current(root, "digits")["version"] == strong and registry.current(root, "diabetes")["version"] == weak
    for name, version in (("digits", strong), ("diabetes", weak)):
        assert json.loads((storage_root / "models" / name / "current.json").read_text())["version"] == version
        assert [card["version"] for card in registry.versions(root, name)] == [version]
    with pytest.raises(UserError, match=f"model version '{strong}' is not registered under .*diabetes"):
        registry.card(root, "diabetes", strong)

    def cli(config: str, *args: str) -> str:
        return subprocess.run([sys.executable, "-m", "stagewise.registry", *args, "--config", config], cwd=REPO_ROOT,
                              env=subprocess_env, capture_output=True, text=True, check=True).stdout

    listing = cli(str(tmp_path / "diabetes.yaml"), "list")
    assert weak in listing and strong not in listing
    assert strong in cli(str(tmp_path / "diabetes.yaml"), "list", "--model", "digits")


def test_an_unscoped_registry_from_before_model_names_is_ignored_with_a_warning(storage_root, tmp_path, caplog):
    """models/current.json and models/<version>/ from the old layout neither crash nor count as the current model."""
    old = storage_root / "models" / "m-0123456789ab"
    old.mkdir(parents=True)
    (old / "card.json").write_text(json.dumps({"version": old.name, "test_accuracy": 0.99, "registered_at": "2026-01-01"}))
    (storage_root / "models" / "current.json").write_text(json.dumps({"version": old.name, "history": []}))
    with caplog.at_level("WARNING", logger="stagewise.registry"):
        assert registry.current(str(storage_root), NAME) is None
    assert "unscoped registry" in caplog.text and f"models/{NAME}/" in caplog.text
    assert registry.versions(str(storage_root), NAME) == []
    fresh = _register(storage_root, tmp_path, "a", 0.5)
    assert registry.gate(str(storage_root), NAME, fresh, "test_accuracy", 0.0)["reason"] == "no current model"


def test_the_config_drives_the_gate_serving_and_a_retrains_warm_start(write_config, storage_root, tmp_path):
    """The registry rules a run follows, from its config: a minimize objective's gate, the model inference scores
    with (named version or current), and a retrain warm-started from the current model's study."""
    from stagewise.definitions.loading import load_config

    config = load_config(write_config(), {"objective.metric": "log_loss", "objective.direction": "minimize",
                                          "registry.gate_metric": "test_log_loss", "retrain.num_trials": 3})
    assert registry.retrain_overrides(config) == {"sweep.num_trials": 3, "sweep.warm_start_from": ""}
    with pytest.raises(UserError, match="no current 'digits' model"):
        registry.serving_model(config, None)
    first = registry.register(str(storage_root), NAME, _model(tmp_path, "a", b"a" * 10), {"test_log_loss": 50.0, "study": "s-a"})["version"]
    assert registry.gate_new_version(config, first)["promoted"]
    worse = registry.register(str(storage_root), NAME, _model(tmp_path, "b", b"b" * 10), {"test_log_loss": 60.0, "study": "s-b"})["version"]
    decision = registry.gate_new_version(config, worse)
    assert not decision["promoted"] and decision["current"] == first
    assert decision["model_uri"] == registry.card(str(storage_root), NAME, first)["model_uri"]
    assert registry.serving_model(config, None)["current"] == first
    assert registry.serving_model(config, worse) == {"current": worse, "model_uri": registry.card(str(storage_root), NAME, worse)["model_uri"]}
    assert registry.retrain_overrides(config)["sweep.warm_start_from"] == "s-a"


def test_a_model_card_records_the_objective_and_the_params_it_trained_with(write_config, storage_root, tmp_path):
    """The card holds the test metrics (not the derived test_objective), the objective's validation value, the
    sweep's params for our own stage, and what makes the version traceable (data, code, study, source run)."""
    from stagewise.definitions.loading import load_config

    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"features": ["a"], "splits": {}}))
    config = load_config(write_config())
    card = registry.model_card(config, trained={"val_metric": 0.93, "stage": "s2"},
                               evaluation={"test_accuracy": 0.95, "test_loss": 0.2, "test_objective": 0.95, "metrics_uri": "x"},
                               best_params={"lr": 0.1}, study="st", source_run="ml_pipeline/r1", manifest_uri=str(manifest))
    assert card["test_accuracy"] == 0.95 and "test_objective" not in card and "metrics_uri" not in card
    assert card["objective"] == "accuracy" and card["direction"] == "maximize" and card["val_accuracy"] == 0.93
    assert card["params"] == {"lr": 0.1} and card["params_source"] == "sweep" and card["stages"] == ["s2"]
    assert card["study"] == "st" and card["source_run"] == "ml_pipeline/r1" and card["data_fingerprint"]


@pytest.mark.parametrize("version", ["../other/m-0ther0000001", "../../models/digits/m-0123456789ab", "m-x/../m-y", "..",
                                     "m-0123456789ab/", "/etc"])
def test_a_model_version_that_leaves_its_registry_is_refused(write_config, storage_root, tmp_path, version):
    """A version is one path segment: batch inference never scores (and the CLI never promotes) a model of another
    registry name or outside models/, even when that file exists."""
    from stagewise.definitions.loading import load_config

    config = load_config(write_config())
    other = registry.register(str(storage_root), "other", _model(tmp_path, "o", b"o" * 10), {"test_accuracy": 0.5})["version"]
    assert registry.card(str(storage_root), "other", other)  # the file the traversal would reach is there
    for call in (lambda: registry.serving_model(config, version), lambda: registry.promote(str(storage_root), NAME, version),
                 lambda: registry.card(str(storage_root), NAME, version)):
        with pytest.raises(UserError, match=r"model version .* is not one path segment"):
            call()


@pytest.mark.parametrize("name", ["..", "a/b", "../models"])
def test_a_model_name_that_leaves_models_is_refused(storage_root, name):
    """The registry name (registry.model_name, --model) is one path segment too."""
    with pytest.raises(UserError, match=r"model name \(registry.model_name\) .* is not one path segment"):
        registry.pointer(str(storage_root), name)


def test_a_torn_card_is_a_data_error_naming_it_and_the_listing_shows_the_other_versions(storage_root, tmp_path):
    """A card that does not parse names its file (no retry); versions() lists it with its error beside the good ones."""
    from stagewise.core.errors import DataError

    good = _register(storage_root, tmp_path, "a", 0.9)
    torn = _register(storage_root, tmp_path, "b", 0.8)
    card_file = storage_root / "models" / NAME / torn / "card.json"
    card_file.write_bytes(card_file.read_bytes()[:25])
    with pytest.raises(DataError, match=rf"{torn}/card.json: is not valid JSON"):
        registry.card(str(storage_root), NAME, torn)
    listed = {entry["version"]: entry for entry in registry.versions(str(storage_root), NAME)}
    assert listed[good]["test_accuracy"] == 0.9 and "is not valid JSON" in listed[torn]["card_error"]


def test_a_registered_model_file_that_changed_since_registration_is_named(storage_root, tmp_path):
    """The version id is the digest of the registered bytes: a cut model.pt fails its check, naming the file."""
    from stagewise.core.errors import DataError
    from stagewise.models.versions import check_registered

    version = _register(storage_root, tmp_path, "a", 0.9)
    model_uri = registry.card(str(storage_root), NAME, version)["model_uri"]
    data = Path(model_uri).read_bytes()
    assert check_registered(model_uri, data) == version
    assert registry.card(str(storage_root), NAME, version)["sha256"].startswith(version[2:])
    with pytest.raises(DataError, match=rf"{version}/model.pt: its 5 bytes hash to m-[0-9a-f]{{12}}, not to its registered"):
        check_registered(model_uri, data[:5])


def test_the_card_records_every_hyperparameter_our_stage_built_and_trained_with(write_config, tmp_path):
    """Not only the swept values: the stage's resolved params (framework defaults like optimizer and momentum, the
    spec's own like hidden) are what the card keeps; the sweep's best is the fallback for a result without them."""
    from stagewise.definitions.loading import load_config

    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps({"features": ["a"], "splits": {}}))
    resolved = {"lr": 0.1, "weight_decay": 0.0, "momentum": 0.9, "optimizer": "sgd", "hidden": 64, "dropout": 0.1}
    card = registry.model_card(load_config(write_config()), trained={"val_metric": 0.9, "stage": "s2", "params": resolved},
                               evaluation={"test_accuracy": 0.9}, best_params={"lr": 0.1}, study="st",
                               source_run="ml_pipeline/r1", manifest_uri=str(manifest))
    assert card["params"] == resolved and card["params_source"] == "sweep"


def test_the_gate_refuses_to_trust_an_incumbent_card_changed_after_registration(storage_root, tmp_path):
    """Each card's checksum is recorded when its version registers: an incumbent whose metric was edited down (to let
    a weaker model through) fails the gate as a data error naming the card; the pointer does not move."""
    from stagewise.core.errors import DataError

    incumbent = _register(storage_root, tmp_path, "a", 0.95)
    registry.gate(str(storage_root), NAME, incumbent, "test_accuracy", margin=0.0)
    weaker = _register(storage_root, tmp_path, "b", 0.5)
    card_file = storage_root / "models" / NAME / incumbent / "card.json"
    card_file.write_text(card_file.read_text().replace('"test_accuracy": 0.95', '"test_accuracy": 0.0'))
    with pytest.raises(DataError, match=rf"{incumbent}/card.json: the card was changed after its version was registered"):
        registry.gate(str(storage_root), NAME, weaker, "test_accuracy", margin=0.0)
    assert registry.pointer(str(storage_root), NAME)["version"] == incumbent


SHIPPED_SPEC = '''
from torch import nn

from shipped_spec_layers import WIDTH
from stagewise.spec import Classifier


class TinyNet(Classifier):
    default_params = {"hidden": WIDTH}

    def build(self, data, params):
        return nn.Sequential(nn.Linear(data.num_features, int(params["hidden"])), nn.Tanh(),
                             nn.Linear(int(params["hidden"]), data.num_classes))
'''


def test_a_version_carries_its_spec_source_and_loads_where_the_spec_folder_is_gone(storage_root, tmp_path, monkeypatch):
    """The spec module and the helper it imports go under models/<name>/<version>/code/, the card's spec_source lists
    them with their sha256 (the card's checksum still holds), and loading the version in a process where the spec is
    not importable imports it from there; a shipped file changed after registration is refused."""
    import torch

    from stagewise.core.errors import DataError
    from stagewise.definitions.spec import DataInfo, SpecRef
    from stagewise.models import shipping
    from stagewise.models.bundle import load_bundle, save_bundle

    team = tmp_path / "team"
    team.mkdir()
    (team / "shipped_spec.py").write_text(SHIPPED_SPEC)
    (team / "shipped_spec_layers.py").write_text("WIDTH = 5\n")
    monkeypatch.setattr(sys, "path", [str(team), *sys.path])
    ref, data = SpecRef("shipped_spec:TinyNet"), DataInfo(features=["a", "b", "c"], num_classes=2)
    module = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    save_bundle(str(tmp_path / "model.pt"), module, ref, data, {"hidden": 5}, {}, {})
    card = registry.register(str(storage_root), NAME, str(tmp_path / "model.pt"), {"test_accuracy": 0.9},
                             shipping.spec_code(ref.path, [str(team)]))
    folder = storage_root / "models" / NAME / card["version"]
    assert sorted(p.name for p in (folder / "code").iterdir()) == ["shipped_spec.py", "shipped_spec_layers.py"]
    assert [entry["path"] for entry in registry.card(str(storage_root), NAME, card["version"])["spec_source"]["files"]] \
        == ["shipped_spec.py", "shipped_spec_layers.py"]

    monkeypatch.setattr(sys, "path", [path for path in sys.path if path != str(team)])
    for name in ("shipped_spec", "shipped_spec_layers"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(shipping, "_IMPORTABLE", {})
    (team / "shipped_spec.py").unlink()
    with pytest.raises(UserError, match="cannot import module 'shipped_spec'"):
        ref.load()  # the control: nothing else on this path holds the spec
    loaded = load_bundle(card["model_uri"])
    assert type(loaded.spec).__name__ == "TinyNet" and "stagewise-code-" in sys.modules["shipped_spec"].__file__
    inputs = torch.randn(4, 3)
    assert torch.equal(loaded.module(inputs), module(inputs))

    monkeypatch.setattr(shipping, "_IMPORTABLE", {})
    for name in ("shipped_spec", "shipped_spec_layers"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(sys, "path", [path for path in sys.path if "stagewise-code-" not in path])
    (folder / "code" / "shipped_spec_layers.py").write_text("WIDTH = 6\n")
    with pytest.raises(DataError, match=r"code/shipped_spec_layers.py: its bytes do not match the sha256"):
        load_bundle(card["model_uri"])
