"""What code a run started with (stagewise.reporting.lineage): the fingerprint covers the user's spec, the modules of
theirs it imports, and every entrypoint script, never Stagewise's own modules or installed packages; reading the
version never fails."""

from __future__ import annotations

import hashlib
import importlib.metadata

import yaml

from stagewise.definitions.loading import load_config
from stagewise.reporting import lineage
from tests.conftest import REPO_ROOT, base_config


def _write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path.resolve()


def test_the_spec_and_the_modules_of_its_folder_it_imports_are_fingerprinted(write_config, storage_root, tmp_path):
    """A spec in a package beside the config, importing a sibling (relative), a helper module (absolute, inside a
    function) and torch/stagewise: the three user files are fingerprinted, nothing installed is, an unrelated file of
    the folder is not."""
    spec = _write(tmp_path / "team" / "spec.py",
                  "import torch\nfrom stagewise.spec import ModelSpec\nfrom .layers import WIDTH\n\n"
                  "class TeamSpec(ModelSpec):\n    default_params = {}\n\n"
                  "    def build(self):\n        import helpers.blocks\n        return helpers.blocks\n")
    init = _write(tmp_path / "team" / "__init__.py", "")
    layers = _write(tmp_path / "team" / "layers.py", "WIDTH = 8\n")
    blocks = _write(tmp_path / "helpers" / "blocks.py", "from . import missing_is_fine\n")
    _write(tmp_path / "other_team.py", "X = 1\n")
    raw = base_config(storage_root)
    raw["model"] = {"spec": "team.spec:TeamSpec"}
    found = lineage.fingerprints(load_config(write_config(raw)))
    # helpers/ has no __init__.py: a namespace package, imported through helpers.blocks all the same
    assert set(found) == {str(spec), str(init), str(layers), str(blocks)}
    assert found[str(spec)] == hashlib.sha256(spec.read_bytes()).hexdigest()


def test_entrypoint_scripts_are_fingerprinted_and_the_builtin_spec_is_stagewises_own(storage_root, tmp_path):
    """The DDP tutorial example: its script (every trial and both stages) is the run's only user source; the built-in
    spec is named by the Stagewise version, not fingerprinted."""
    raw = yaml.safe_load((REPO_ROOT / "examples" / "ddp_tutorial.yaml").read_text())
    raw["storage_root"] = str(storage_root)
    config_path = tmp_path / "ddp_tutorial.yaml"
    config_path.write_text(yaml.safe_dump(raw))
    script = _write(tmp_path / "ddp_tutorial.py", (REPO_ROOT / "examples" / "ddp_tutorial.py").read_text())
    recorded = lineage.record(load_config(config_path))
    assert list(recorded["source_fingerprints"]) == [str(script)]
    assert recorded["source_fingerprint"] == lineage.combined(recorded["source_fingerprints"])
    assert recorded["stagewise_version"] == importlib.metadata.version("stagewise")


def test_the_version_reads_unknown_when_the_metadata_is_gone(monkeypatch):
    """After an in-place upgrade a long-running process may find no metadata (MetadataNotFound is a
    FileNotFoundError) or no distribution at all: the version says so instead of failing the task."""
    for error in (importlib.metadata.PackageNotFoundError("stagewise"), FileNotFoundError("No package metadata")):
        def missing(name, error=error):
            raise error

        monkeypatch.setattr(importlib.metadata, "version", missing)
        assert lineage.stagewise_version() == "unknown"
        monkeypatch.setattr(lineage, "CHECKOUT_ROOT", None)
        assert lineage.code_version() == "unknown"
