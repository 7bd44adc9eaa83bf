"""The model registry: versioned folders, a current pointer moved only by the gate, rollback, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tasks import registry
from tasks.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[2]


def _model(tmp_path: Path, name: str, payload: bytes) -> str:
    path = tmp_path / f"{name}.pt"
    path.write_bytes(payload)
    return str(path)


def _register(root: Path, tmp_path: Path, name: str, accuracy: float) -> str:
    card = registry.register(str(root), _model(tmp_path, name, name.encode() * 10), {"test_accuracy": accuracy, "source_run": name})
    return card["version"]


def test_registering_the_same_model_twice_is_one_version(storage_root, tmp_path):
    """A version is the hash of the model's bytes: a retried register task adds nothing."""
    first = _register(storage_root, tmp_path, "a", 0.9)
    again = _register(storage_root, tmp_path, "a", 0.9)
    assert first == again and len(registry.versions(str(storage_root))) == 1
    card = json.loads((storage_root / "models" / first / "card.json").read_text())
    assert card["test_accuracy"] == 0.9 and (storage_root / "models" / first / "model.pt").exists()


def test_gate_promotes_the_first_model_and_a_better_one(storage_root, tmp_path):
    """No current model: promote. A later model beating the current by more than the margin: promote."""
    first = _register(storage_root, tmp_path, "a", 0.90)
    assert registry.gate(str(storage_root), first, "test_accuracy", margin=0.01)["promoted"]
    better = _register(storage_root, tmp_path, "b", 0.95)
    decision = registry.gate(str(storage_root), better, "test_accuracy", margin=0.01)
    assert decision["promoted"] and decision["current"] == better and decision["previous"] == first


def test_gate_refuses_a_model_that_does_not_beat_the_margin(storage_root, tmp_path):
    """A model within the margin (or worse) is registered but the pointer stays where it was."""
    first = _register(storage_root, tmp_path, "a", 0.90)
    registry.gate(str(storage_root), first, "test_accuracy", margin=0.0)
    close = _register(storage_root, tmp_path, "b", 0.905)
    decision = registry.gate(str(storage_root), close, "test_accuracy", margin=0.01)
    assert not decision["promoted"] and decision["current"] == first
    assert "0.9050 <= current 0.9000 + margin 0.01" in decision["reason"]
    assert registry.current(str(storage_root))["version"] == first


def test_rollback_moves_the_pointer_back_and_runs_out(storage_root, tmp_path):
    """Rollback restores the previous current version; with no history it is a clear error."""
    first = _register(storage_root, tmp_path, "a", 0.90)
    second = _register(storage_root, tmp_path, "b", 0.95)
    registry.gate(str(storage_root), first, "test_accuracy", 0.0)
    registry.gate(str(storage_root), second, "test_accuracy", 0.0)
    assert registry.rollback(str(storage_root))["version"] == first
    with pytest.raises(UserError, match="nothing to roll back to"):
        registry.rollback(str(storage_root))


def test_unknown_version_is_a_user_error(storage_root):
    """Asking for a version that was never registered names it."""
    with pytest.raises(UserError, match="model version 'm-nope' is not registered"):
        registry.card(str(storage_root), "m-nope")


def test_cli_lists_versions_marks_current_and_rolls_back(storage_root, tmp_path, write_config, subprocess_env):
    """`python -m tasks.registry list` marks the current version with '*'; `rollback` moves it back."""
    config = write_config()
    first = _register(storage_root, tmp_path, "a", 0.90)
    second = _register(storage_root, tmp_path, "b", 0.95)
    registry.gate(str(storage_root), first, "test_accuracy", 0.0)
    registry.gate(str(storage_root), second, "test_accuracy", 0.0)

    def cli(*args: str) -> str:
        return subprocess.run([sys.executable, "-m", "tasks.registry", *args, "--config", str(config)], cwd=REPO_ROOT,
                              env=subprocess_env, capture_output=True, text=True, check=True).stdout

    listing = cli("list")
    assert f"* {second}" in listing and f"  {first}" in listing
    assert f"current: {first}" in cli("rollback")
    assert json.loads(cli("show"))["version"] == first


@pytest.mark.parametrize("metric", [float("nan"), float("inf")])
def test_model_with_a_non_finite_metric_is_never_registered(storage_root, tmp_path, metric):
    """register refuses a model whose metric is NaN/inf, naming its URI and version, and writes no version folder."""
    model_uri = _model(tmp_path, "diverged", b"diverged" * 10)
    with pytest.raises(UserError) as caught:
        registry.register(str(storage_root), model_uri, {"test_accuracy": metric, "source_run": "diverged"})
    message = str(caught.value)
    assert model_uri in message and "version m-" in message and "test_accuracy" in message
    assert registry.versions(str(storage_root)) == []
    assert not (storage_root / "models").exists() or not any((storage_root / "models").iterdir())
