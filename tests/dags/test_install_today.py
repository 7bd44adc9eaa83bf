"""The README's install into a stock Airflow 3.2 and 3.3, resolved against the package index as it is on the day
(tests/dags/test_airflow_versions.py is the second case: offline, into kept environments, with a pipeline run).

A stock deployment is Airflow installed the way Airflow documents it, ``pip install "apache-airflow==X" --constraint
<its constraints file>``, then the torch build the team wants (the README: "install the torch build you want first").
The constraints file is on GitHub, out of reach here; it pins what Airflow's dependencies were on its release day, so
pip resolves ``apache-airflow==X`` as of then (``--uploaded-prior-to``, as tests/airflow_versions.py does). A team
that installed Airflow without it has the index's newest: that is the second kind of deployment here.

The deployment is what pip sees of one: a venv holding each resolved distribution's metadata (name, version, its
requirements), nothing to import. The README's two commands then run as written against it, with ``PIP_DRY_RUN`` and
``PIP_REPORT`` in the environment, so pip resolves Stagewise and its missing dependencies on today's index exactly as
the real install would (the failure this guards against, ``ResolutionImpossible``, is the resolver's) without
downloading torch, pyarrow and the rest into every run.

The S3 connection command of docs/services.md runs here too, as written, on an Airflow without the Amazon provider.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests import airflow_versions, run_cache
from tests.dags.conftest import REPO_ROOT

pytestmark = [pytest.mark.airflow, pytest.mark.torchrun]  # as tests/dags/test_airflow_versions.py

# Each supported minor's newest release, and the day after PyPI published it: its constraints file's day.
RELEASED = {"3.2.2": airflow_versions.OLDER_AIRFLOW["3.2.2"], "3.3.2": "2026-09-18T00:00:00Z"}
TODAY = None  # no cut-off: the index as it is
PINS = {airflow_versions._normalize(Requirement(line).name): str(Requirement(line).specifier)[2:]
        for line in (REPO_ROOT / "requirements.txt").read_text().splitlines() if line and not line.startswith("#")}
CUDA = re.compile(r"^(nvidia-|cuda-|triton$)")


def _pip(*args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                          timeout=airflow_versions.PIP_TIMEOUT_S, env=env)
    assert not check or done.returncode == 0, f"pip {' '.join(args)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done


def _resolve(report: Path, *requirements: str, prior_to: str | None = None, constraints: Path | None = None) -> list:
    """What ``pip install requirements`` puts into an empty environment: the report's entries (metadata included)."""
    _pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
         *(["--uploaded-prior-to", prior_to] if prior_to else []), *(["-c", str(constraints)] if constraints else []),
         *requirements)
    return json.loads(report.read_text())["install"]


def _metadata_text(meta: dict) -> str:
    lines = ["Metadata-Version: 2.1", f"Name: {meta['name']}", f"Version: {meta['version']}"]
    if meta.get("requires_python"):
        lines.append(f"Requires-Python: {meta['requires_python']}")
    lines += [f"Provides-Extra: {extra}" for extra in meta.get("provides_extra", [])]
    lines += [f"Requires-Dist: {requirement}" for requirement in meta.get("requires_dist", [])]
    return "\n".join(lines) + "\n"


def _deployment(root: Path, entries: list) -> Path:
    """A venv that holds the metadata of ``entries`` as installed distributions; returns its interpreter."""
    python = airflow_versions.make_venv(root / "venv", [])
    site = airflow_versions.site_packages(python)
    for entry in entries:
        meta = entry["metadata"]
        info = site / f"{re.sub(r'[-_.]+', '_', meta['name'])}-{meta['version']}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(_metadata_text(meta))
        (info / "INSTALLER").write_text("pip\n")
        (info / "RECORD").write_text("")
    return python


class Stock:
    """A stock Airflow ``version`` (with its constraints: as of ``prior_to``; without: today's newest) and torch."""

    def __init__(self, root: Path, version: str, prior_to: str | None):
        root.mkdir(parents=True)
        self.airflow = _resolve(root / "airflow.json", f"apache-airflow=={version}", prior_to=prior_to)
        pins = root / "airflow-pins.txt"
        pins.write_text("".join(f"{e['metadata']['name']}=={e['metadata']['version']}\n" for e in self.airflow))
        # The torch build first (this repository's CPU one), with what it needs that Airflow does not bring.
        self.torch = _resolve(root / "torch.json", f"torch=={PINS['torch']}", constraints=pins)
        entries = {airflow_versions._normalize(e["metadata"]["name"]): e for e in [*self.airflow, *self.torch]}
        self.python = _deployment(root, list(entries.values()))
        self.before = {name: e["metadata"]["version"] for name, e in entries.items()}
        self.requirements = {name: e["metadata"].get("requires_dist", []) for name, e in entries.items()}

    def readme_install(self, workdir: Path, wheel: Path) -> dict[str, str]:
        """The README's commands, as written, against the index; ``{distribution: version}`` pip would install."""
        report = workdir / "readme-install.json"
        env = {"PIP_DRY_RUN": "1", "PIP_REPORT": str(report)}
        os.environ.update(env)
        try:
            airflow_versions.install_as_readme_says(self.python, wheel, workdir, offline=False)
        finally:
            for key in env:
                os.environ.pop(key)
        return {airflow_versions._normalize(e["metadata"]["name"]): e["metadata"]["version"] for e in json.loads(report.read_text())["install"]}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return airflow_versions.build_wheel(tmp_path_factory.mktemp("wheel"))


CASES = [pytest.param(version, prior_to, id=f"{version}-{kind}") for version in RELEASED
         for kind, prior_to in (("with-constraints", RELEASED[version]), ("today", TODAY))]


@pytest.mark.parametrize(("version", "prior_to"), CASES)
@pytest.mark.slow
def test_the_readme_install_resolves_on_todays_index(version, prior_to, wheel, tmp_path):
    """Into stock Airflow 3.2.2 and 3.3.2, with and without their constraints: pip adds stagewise and what it
    needs, keeps torch's CPU build (no CUDA package), and changes no package the deployment has but a
    python-dateutil the S3 client does not allow (Airflow's newest, 4.0.0), which it moves inside Airflow's range."""
    stock = Stock(tmp_path / "stock", version, prior_to)
    assert stock.before["apache-airflow"] == version and "+cpu" in stock.before["torch"], stock.before.get("torch")
    added = stock.readme_install(tmp_path / "install", wheel)
    assert added.get("stagewise") == "0.1.0", added
    moved = {name: (stock.before[name], v) for name, v in added.items() if name in stock.before}
    dateutil = Version(stock.before["python-dateutil"])
    assert moved == ({} if dateutil.major < 3 else {"python-dateutil": (str(dateutil), "2.9.0.post0")}), moved
    assert not [name for name in added if CUDA.match(name)], sorted(added)
    # Every requirement of every package the deployment keeps still holds after the install.
    after = {**stock.before, **added}
    broken = [(name, text) for name, texts in stock.requirements.items() for text in texts
              for requirement in [Requirement(text)]
              if (requirement.marker is None or requirement.marker.evaluate({"extra": ""}))
              and airflow_versions._normalize(requirement.name) in after
              and not requirement.specifier.contains(after[airflow_versions._normalize(requirement.name)], prereleases=True)]
    assert broken == []


@pytest.mark.parametrize("version", list(RELEASED))
@pytest.mark.slow
def test_requirements_txt_pins_nothing_a_supported_airflow_excludes(version, tmp_path):
    """Each pin of requirements.txt (Airflow's own packages aside: they are 3.3.2's) meets every requirement that
    Airflow ``version``'s own distributions (the meta package, core, task SDK, the providers it brings) state on it:
    3.2.2's core needs aiosqlite<0.22.0, 3.3.2's aiosqlite!=0.22.0, so the pin is 0.21.0."""
    entries = _resolve(tmp_path / "airflow.json", f"apache-airflow=={version}")
    excluded = [(e["metadata"]["name"], text, PINS[name])
                for e in entries for text in e["metadata"].get("requires_dist", [])
                for requirement in [Requirement(text)] for name in [airflow_versions._normalize(requirement.name)]
                if airflow_versions._normalize(e["metadata"]["name"]).startswith("apache-airflow")
                and name in PINS and not name.startswith("apache-airflow")
                and (requirement.marker is None or requirement.marker.evaluate({"extra": ""}))
                and not requirement.specifier.contains(PINS[name], prereleases=True)]
    assert excluded == []


# docs/services.md's command for the storage connection.
_CONNECTION_COMMAND = re.compile(r"^ *```bash\n *(airflow connections add stagewise_s3 .*?)^ *```$", re.M | re.S)


@pytest.mark.slow
def test_the_documented_s3_connection_works_without_the_amazon_provider(tmp_path):
    """docs/services.md's `airflow connections add --conn-type aws`, run as written in an Airflow without the Amazon
    provider, stores a generic connection (Airflow knows no aws type there), and Stagewise reads its credentials."""
    (command,) = _CONNECTION_COMMAND.findall((REPO_ROOT / "docs" / "services.md").read_text())
    image = airflow_versions.make_image(tmp_path / "image", without=["apache-airflow-providers-amazon"])
    python = airflow_versions.make_venv(tmp_path / "venv", [image])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "airflow").write_text(f'#!/bin/sh\nexec "{python}" -m airflow "$@"\n')
    (bin_dir / "airflow").chmod(0o755)
    db = tmp_path / "airflow.db"
    run_cache.migrated_sqlite_db(db)
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("AIRFLOW", "STAGEWISE")) and key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update({"AIRFLOW_HOME": str(tmp_path / "home"), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{db}", "KEY_ID": "AKIADOCS",
                "SECRET": "docs-secret", "PATH": os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")])})
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", command], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "The type provided to --conn-type is invalid: aws" in done.stdout + done.stderr, done.stdout[-3000:]
    probe = ("import json; from airflow.models.connection import Connection; "
             "from stagewise.airflow.credentials import storage_options; "
             "print(json.dumps([Connection.get_connection_from_secrets('stagewise_s3').conn_type, "
             "storage_options('stagewise_s3')]))")
    read = subprocess.run([sys.executable, "-c", probe], env={**env, "PATH": os.environ.get("PATH", "")},
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert read.returncode == 0, f"{read.stdout[-3000:]}\n{read.stderr[-3000:]}"
    assert json.loads(read.stdout.strip().splitlines()[-1]) == [
        "generic", {"key": "AKIADOCS", "secret": "docs-secret", "endpoint_url": "https://minio.internal:9000",
                    "client_kwargs": {"region_name": "eu-west-1"}}]
