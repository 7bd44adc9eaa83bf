"""What a registered model carries so it loads wherever it goes (stagewise.models.shipping): the spec's own source
(its module and the helpers beside it it imports, or its whole package; nothing of Stagewise's own; a requirement for
an installed distribution; a folder too large refused) and requirement ranges where there were this machine's pins."""

from __future__ import annotations

import hashlib
from importlib.metadata import version

import pytest
import yaml
from packaging.requirements import Requirement

from stagewise.core.errors import UserError
from stagewise.models import shipping
from stagewise.tracking.registry import mlmodel_files


def test_a_module_ships_with_the_helpers_beside_it_that_it_imports(tmp_path):
    """A plain module file goes with the module beside it that it imports (and what that imports), not the folder's
    other files; the card lists each file with its sha256."""
    (tmp_path / "team_spec.py").write_text("import team_layers\nfrom stagewise.spec import Classifier\n")
    (tmp_path / "team_layers.py").write_text("from team_init import scale\n")
    (tmp_path / "team_init.py").write_text("scale = 2\n")
    (tmp_path / "unrelated.py").write_text("import os\n")
    code = shipping.spec_code("team_spec:Spec", [str(tmp_path)])
    assert list(code.files) == ["team_init.py", "team_layers.py", "team_spec.py"]
    assert code.card_entry() == {"spec": "team_spec:Spec", "folder": "code", "files": [
        {"path": name, "sha256": hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()} for name in code.files]}


def test_a_spec_in_a_package_ships_the_whole_top_level_package(tmp_path):
    """``pkg.models.net:Spec`` ships every .py file of ``pkg`` (a module it loads by name goes too), never a cache."""
    package = tmp_path / "team_pkg"
    (package / "models" / "__pycache__").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "models" / "__init__.py").write_text("")
    (package / "models" / "net.py").write_text("import importlib\n")
    (package / "registry_of_layers.py").write_text("LAYERS = {}\n")
    (package / "models" / "__pycache__" / "net.cpython-311.py").write_text("stale")
    code = shipping.spec_code("team_pkg.models.net:Spec", [str(tmp_path)])
    assert list(code.files) == ["team_pkg/__init__.py", "team_pkg/models/__init__.py", "team_pkg/models/net.py",
                                "team_pkg/registry_of_layers.py"]


def test_stagewise_specs_ship_nothing_and_an_installed_distribution_is_a_requirement():
    """Stagewise's own specs (built in, examples) are in the stagewise requirement; a spec from an installed
    distribution is named as a requirement range instead of copied."""
    for spec in ("stagewise.model:MLPClassifier", "stagewise.examples.digits_cnn:DigitsCNN"):
        assert shipping.spec_code(spec, []).card_entry() == {"spec": spec, "folder": None, "files": []}
    installed = shipping.spec_code("yaml:SafeLoader", [])
    major = int(version("PyYAML").split(".")[0])
    assert not installed.files and installed.requirements == [f"PyYAML>={'.'.join(version('PyYAML').split('.')[:2])},<{major + 1}"]


def test_a_spec_folder_past_the_limits_is_refused_naming_it(tmp_path, monkeypatch):
    """A package of more files than MAX_FILES is a repository, not a module: registering it is a user error that
    names the folder."""
    monkeypatch.setattr(shipping, "MAX_FILES", 3)
    package = tmp_path / "big_pkg"
    package.mkdir()
    for index in range(5):
        (package / f"part{index}.py").write_text("")
    (package / "__init__.py").write_text("")
    with pytest.raises(UserError, match=rf"{package}.*more than 3 files"):
        shipping.spec_code("big_pkg:Spec", [str(tmp_path)])


def test_the_artifacts_requirements_are_ranges_this_machine_and_a_patch_release_away_meet():
    """requirements.txt holds no == pin: stagewise and torch from the trained major.minor to the next major, the
    loader's libraries as stagewise declares them; this machine's versions and the same minus one patch release
    both meet every line (a serving environment one patch away loads without a mismatch warning)."""
    files = mlmodel_files("run", shipping.requirements(), "2026-01-01 00:00:00.000000", {"team_spec.py": b"x = 1\n"})
    lines = files["requirements.txt"].decode().split()
    assert [Requirement(line).name for line in lines] == ["stagewise", "torch", *shipping.RUNTIME_LIBRARIES]
    assert not any("==" in line for line in lines)
    for line in lines:
        requirement = Requirement(line)
        installed = version(requirement.name).split("+")[0]
        parts = installed.split(".")
        older = ".".join([*parts[:-1], str(max(int(parts[-1]) - 1, 0))]) if parts[-1].isdigit() else installed
        assert requirement.specifier.contains(installed) and requirement.specifier.contains(older), line
    torch_major, torch_minor = version("torch").split(".")[:2]
    assert f"torch>={torch_major}.{torch_minor},<{int(torch_major) + 1}" in lines
    flavor = yaml.safe_load(files["MLmodel"])["flavors"]["python_function"]
    assert flavor["code"] == "code" and files["code/team_spec.py"] == b"x = 1\n"
    assert "code" not in yaml.safe_load(mlmodel_files("run", [], "t")["MLmodel"])["flavors"]["python_function"], \
        "a spec that ships nothing names no code folder"
