"""A team's Airflow of each supported minor, and Stagewise installed into it as the README says (tests/dags/
test_airflow_versions.py, tests/dags/test_adoption.py).

A team's environment is this one's packages (Airflow, torch, ...) as links, never copies: an *image* folder of
symlinks into this environment's site-packages, put on a fresh venv's path by a ``.pth`` file, so pip sees the
packages as installed and must resolve the wheel against them. The newest minor (3.3) is this environment as it is.
An older Airflow is a *layer* in front of the image: Airflow of that release with its dependencies as they were on its
release day (what its constraints file pins; pip resolves them with ``--uploaded-prior-to``), installed into a venv
of their own, and left out of the image, file by file where they share a folder with others (``airflow/`` holds the
core, the task SDK and the providers). The layer is made once per machine (about half a minute, the downloads
included) and kept inside this environment (``<sys.prefix>/stagewise-airflow/``, keyed by the Airflow version and
this environment's packages); a test then makes a throwaway venv over the layer and the image in a second.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

REPO_ROOT = Path(__file__).resolve().parent.parent
# What a wheel is built from: the project's files, as `pip wheel .` of a fresh clone sees them.
WHEEL_SOURCES = ("pyproject.toml", "README.md", "tasks", "plugins/stagewise_airflow", "examples")
# The newest release of each supported minor but this environment's own (requirements.txt pins the newest), and
# when it was published on PyPI: its dependencies are resolved as of then, as its constraints file pins them.
OLDER_AIRFLOW = {"3.2.2": "2026-05-30T00:00:00Z"}
# The folder the layers live in; a changed environment (another package list) makes new ones and drops the old.
LAYERS_ENV = "STAGEWISE_AIRFLOW_LAYERS"
PIP_TIMEOUT_S = 900


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def site_packages(python: str | os.PathLike = sys.executable) -> Path:
    if Path(python) == Path(sys.executable):
        return Path(sysconfig.get_paths()["purelib"])
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout.strip())


def _ours(name: str) -> bool:
    """Stagewise itself (the editable install of the checkout) and .pth files: never part of a team's image."""
    return name.startswith(("stagewise", "__editable__")) or name.endswith(".pth")


def _files_of(site: Path, names: Iterable[str]) -> set[str]:
    """Every path (relative to ``site``) that the distributions ``names`` installed there, their .dist-info included."""
    wanted, files = {_normalize(name) for name in names}, set()
    for info in site.glob("*.dist-info"):
        name = _normalize(info.name.removesuffix(".dist-info").rsplit("-", 1)[0])
        if name not in wanted:
            continue
        wanted.discard(name)
        files.add(info.name)
        record = (info / "RECORD").read_text().splitlines()
        files.update(path for path in (line.rsplit(",", 2)[0] for line in record if line)
                     if not path.startswith("..") and not path.startswith(info.name))
    assert not wanted, f"not installed here: {sorted(wanted)}"
    return files


def make_image(target: Path, without: Iterable[str] = ()) -> Path:
    """A folder of links to every package installed here but Stagewise and the distributions ``without``: a folder
    holding no file of theirs is one link, one holding some is a real folder of links to the rest (its compiled
    ``__pycache__`` left out: it may hold theirs, and Python writes its own)."""
    site = site_packages()
    left_out = _files_of(site, without)
    split = {str(parent) for path in left_out for parent in Path(path).parents if str(parent) != "."}

    def lay(source: Path, dest: Path, prefix: str) -> None:
        dest.mkdir()
        for entry in source.iterdir():
            relative = prefix + entry.name
            if (not prefix and _ours(entry.name)) or relative in left_out or (prefix and entry.name == "__pycache__"):
                continue
            if relative in split:
                lay(entry, dest / entry.name, relative + "/")
                if not any((dest / entry.name).iterdir()):
                    (dest / entry.name).rmdir()
            else:
                (dest / entry.name).symlink_to(entry)

    lay(site, target, "")
    return target


def make_venv(folder: Path, layers: Iterable[Path]) -> Path:
    """A venv without pip (this environment's pip installs into it with ``--python``) whose path ends with
    ``layers``, first first; returns its interpreter."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    python = folder / "bin" / "python"
    (site_packages(python) / "team_image.pth").write_text("".join(f"{layer}\n" for layer in layers))
    return python


def pip(python: Path, *args: str) -> subprocess.CompletedProcess:
    """This environment's pip acting on the venv of ``python``; fails with pip's output."""
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), *args], capture_output=True, text=True,
                          timeout=PIP_TIMEOUT_S)
    assert done.returncode == 0, f"pip {' '.join(args)} failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done


def installed(python: Path) -> dict[str, str]:
    """``{distribution: version}`` of every distribution the venv of ``python`` sees, layers included."""
    listed = json.loads(pip(python, "list", "--format=json").stdout)
    return {_normalize(row["name"]): row["version"] for row in listed}


# The README's install into an existing deployment: the bash block that starts with `pip list`.
_README_INSTALL = re.compile(r"^```bash\n(pip list .*?)^```$", re.MULTILINE | re.DOTALL)
README_SOURCE = "/path/to/stagewise"  # the README's name for the checkout (or wheel) to install


def readme_install() -> str:
    """The README's commands for installing Stagewise into an existing deployment, as written."""
    (block,) = _README_INSTALL.findall((REPO_ROOT / "README.md").read_text())
    return block


def install_as_readme_says(python: Path, source: Path, workdir: Path, offline: bool = True) -> subprocess.CompletedProcess:
    """Run readme_install() in ``workdir`` for the deployment of ``python``, with ``source`` (the wheel) for the
    README's path: its ``pip`` is this environment's pip acting on that venv (built without one). ``offline``: no
    index, so the install can only use what the deployment already has and fails on anything it would fetch."""
    bin_dir = workdir / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "pip").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m pip --python "{python}" "$@"\n')
    (bin_dir / "pip").chmod(0o755)
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    if offline:
        env["PIP_NO_INDEX"] = "1"
    script = readme_install().replace(README_SOURCE, str(source))
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=PIP_TIMEOUT_S)
    assert done.returncode == 0, f"the README's install failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done


def build_wheel(root: Path) -> Path:
    """The stagewise wheel built from the project's files (copied, as a fresh clone has them) into ``root``."""
    source = root / "source"
    for name in WHEEL_SOURCES:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        if (REPO_ROOT / name).is_dir():
            shutil.copytree(REPO_ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(REPO_ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
                    "--wheel-dir", str(root / "wheels"), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = (root / "wheels").glob("stagewise-*.whl")
    return wheel


@dataclass(frozen=True)
class Layer:
    """An older Airflow over this environment: the folders a team venv puts on its path, and a migrated DB."""

    version: str
    paths: tuple[Path, ...]
    airflow_db: Path
    replaced: dict[str, str]  # the distributions installed in the layer, at their versions
    dropped: list[str]  # this environment's distributions the team's does not have (they need a newer Airflow)


def _environment_key() -> str:
    """This environment's packages, as a short hash: a layer links into them, so another set needs another layer."""
    names = sorted(f"{_normalize(d.metadata['Name'])}=={d.version}" for d in metadata.distributions()
                   if d.metadata["Name"] and not _normalize(d.metadata["Name"]).startswith("stagewise"))
    return hashlib.sha256("\n".join(names).encode()).hexdigest()[:12]


def _layers_root() -> Path:
    return Path(os.environ.get(LAYERS_ENV) or Path(sys.prefix) / "stagewise-airflow")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def airflow_layer(version: str) -> Layer:
    """Airflow ``version`` (a key of OLDER_AIRFLOW) as a layer over this environment, made once per machine (pip
    downloads it the first time) and kept; concurrent test processes wait for the one making it."""
    root = _layers_root()
    folder = root / f"airflow-{version}-{_environment_key()}"
    with _locked(root / f"airflow-{version}.lock"):
        if not (folder / "ready.json").exists():
            for stale in root.glob(f"airflow-{version}-*"):
                shutil.rmtree(stale, ignore_errors=True)
            _make_layer(version, folder, root / "pip-cache")
        made = json.loads((folder / "ready.json").read_text())
    return Layer(version, (site_packages(folder / "venv" / "bin" / "python"), folder / "image"), folder / "airflow.db",
                 made["replaced"], made["dropped"])


def _requirements(dist: metadata.Distribution) -> Iterator[Requirement]:
    """What ``dist`` needs installed (no extra's requirements)."""
    for text in dist.requires or []:
        requirement = Requirement(text)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            yield requirement


def _plan_team_environment(version: str, probe: Path, work: Path, cache: tuple[str, ...]) -> tuple[dict, set]:
    """What a team's Airflow ``version`` holds where it differs from this environment: ``(replaced, dropped)``.

    Airflow's own install (with its release's constraints file, out of reach here) resolves its dependencies as they
    were on its release day: pip resolves apache-airflow==version as of then. Those at another version than here are
    replaced; a package of this environment that then no longer fits (a provider needing a newer common-compat)
    is dropped when nothing else needs it, and resolved as of that day with Airflow when something does.
    """
    here = {_normalize(d.metadata["Name"]): d for d in metadata.distributions()
            if d.metadata["Name"] and not _normalize(d.metadata["Name"]).startswith("stagewise")}
    roots, dropped = [f"apache-airflow=={version}"], set()
    while True:
        pip(probe, "install", *cache, "--dry-run", "--ignore-installed", "--quiet", "--report", str(work / "plan.json"),
            "--uploaded-prior-to", OLDER_AIRFLOW[version], *roots)
        plan = {_normalize(item["metadata"]["name"]): item["metadata"]["version"]
                for item in json.loads((work / "plan.json").read_text())["install"]}
        replaced = {name: v for name, v in plan.items() if name not in here or here[name].version != v}
        while True:
            kept = {name: dist for name, dist in here.items() if name not in plan and name not in dropped}
            misfits = {name for name, dist in kept.items() for requirement in _requirements(dist)
                       if _normalize(requirement.name) in replaced
                       and not requirement.specifier.contains(replaced[_normalize(requirement.name)], prereleases=True)}
            if not misfits:
                return replaced, dropped
            needed = {_normalize(r.name) for name, dist in kept.items() if name not in misfits for r in _requirements(dist)}
            if not misfits - needed:
                break
            dropped |= misfits - needed  # dropping one may leave another needed by nothing: look again
        roots += sorted(misfits)


def _make_layer(version: str, folder: Path, pip_cache: Path) -> None:
    """Under the caller's lock; ready.json, written last, says the layer is whole."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    cache = ("--cache-dir", str(pip_cache))
    replaced, dropped = _plan_team_environment(version, make_venv(folder / "probe", []), folder, cache)
    shutil.rmtree(folder / "probe")
    # This environment without them, and the replaced alone in a venv of their own in front of it (no .pyc: paid at
    # import, and only for what a test imports).
    image = make_image(folder / "image", without=[*(name for name in replaced if name in _installed_here()), *dropped])
    python = make_venv(folder / "venv", [image])
    pip(python, "install", *cache, "--no-deps", "--no-compile", *(f"{name}=={v}" for name, v in replaced.items()))
    pip(python, "check")
    # Its own metadata DB, migrated by that Airflow (a 3.3 schema is no 3.2 one).
    env = {key: value for key, value in os.environ.items() if not key.startswith(("AIRFLOW", "STAGEWISE"))
           and key != "PYTHONPATH"}
    env.update({"AIRFLOW_HOME": str(folder / "home"), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{folder / 'airflow.db'}"})
    done = subprocess.run([str(python), "-m", "airflow", "db", "migrate"], env=env, cwd=folder, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"airflow {version} db migrate failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    shutil.rmtree(folder / "home")
    (folder / "ready.json").write_text(json.dumps({"replaced": replaced, "dropped": sorted(dropped)}, indent=1))


def _installed_here() -> set[str]:
    return {_normalize(d.metadata["Name"]) for d in metadata.distributions() if d.metadata["Name"]}
