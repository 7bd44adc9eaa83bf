"""What many tests set up the same way, made once per pytest run and copied or read: a migrated Airflow SQLite DB
(with a config's pools), demo data, the uninterrupted reference run of the stage the resume tests interrupt.

``airflow db migrate`` costs a few CPU-seconds in a fresh home and writing the digits imports scikit-learn; a
dozen Airflow homes and pipeline runs paid both every run of the suite. The cache lives in $STAGEWISE_TEST_CACHE,
made by the first pytest process (pytest-xdist's workers inherit it) and removed when that process ends.
Tests that guard migration or the demo writer themselves do not use it.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import yaml

CACHE_ENV = "STAGEWISE_TEST_CACHE"
REPO_ROOT = Path(__file__).resolve().parent.parent


def open_cache() -> str | None:
    """Make the run's cache folder unless a parent pytest already did; returns it when this process owns it."""
    if os.environ.get(CACHE_ENV):
        return None
    os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="stagewise-tests-")
    return os.environ[CACHE_ENV]


@contextlib.contextmanager
def _entry(name: str) -> Iterator[tuple[Path, bool]]:
    """``(folder, ready)`` of one cache entry, under an exclusive lock so concurrent workers build it once."""
    if own := open_cache():  # outside pytest (a benchmark using LiveAirflow): a cache for this process alone
        atexit.register(shutil.rmtree, own, ignore_errors=True)
    root = Path(os.environ[CACHE_ENV])
    folder = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield folder, (folder / ".ready").exists()


def _mark_ready(folder: Path) -> None:
    (folder / ".ready").touch()


def migrated_sqlite_db(target: str | os.PathLike, pools_of: str | os.PathLike | None = None) -> None:
    """Put an Airflow metadata DB that ``airflow db migrate`` made into ``target`` (mode 0600, as airflow_env.sh);
    with ``pools_of`` (a pipeline config), with the pools ``python -m stagewise.airflow.pools`` creates for it."""
    pools = yaml.safe_load(Path(pools_of).read_text()).get("pools") if pools_of else None
    key = hashlib.sha256(json.dumps(pools, sort_keys=True).encode()).hexdigest()[:12] if pools_of else "bare"
    with _entry(f"airflow-db-{key}") as (folder, ready):
        template = folder / "airflow.db"
        if not ready:
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW")}
            env.update({"AIRFLOW_HOME": str(folder / "home"), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
                        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{template}",
                        "PYTHONPATH": str(REPO_ROOT)})
            steps = [["airflow", "db", "migrate"]]
            if pools_of:
                steps.append(["stagewise.airflow.pools", "--config", str(pools_of)])
            for step in steps:
                result = subprocess.run([sys.executable, "-m", *step], env=env, cwd=folder, capture_output=True,
                                        text=True, timeout=600)
                if result.returncode != 0:
                    raise RuntimeError(f"{' '.join(step)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
            _mark_ready(folder)
    Path(target).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template, target)
    os.chmod(target, 0o600)


def demo_data(config_path: str | os.PathLike, num_shards: int = 2, env: dict[str, str] | None = None) -> str:
    """The config's demo data set (dataset.demo_data) at its dataset.uri in ``num_shards`` files; returns the URI.

    Two shards, not the demo's four: the mapped tasks still fan out, with half the processes. A local storage root
    gets a copy of files written once per run; any other (s3://) is written there by ``python -m stagewise.data demo``
    in ``env`` (default: this process's), which must reach that storage.
    """
    from stagewise.core import storage
    from stagewise.datasets.demo import DEMO_WRITERS
    from stagewise.definitions.loading import load_config

    config = load_config(config_path)
    target = storage.resolve(config.storage_root, config.dataset.uri)
    if "://" in target:
        env = {**(os.environ if env is None else env), "STAGEWISE_CONFIG": str(config_path)}
        subprocess.run([sys.executable, "-m", "stagewise.data", "demo", "--num-shards", str(num_shards)], cwd=REPO_ROOT,
                       env=env, check=True, capture_output=True)
        return target
    with _entry(f"data-{config.dataset.demo_data}-{num_shards}") as (folder, ready):
        if not ready:
            shutil.rmtree(folder, ignore_errors=True)
            DEMO_WRITERS[config.dataset.demo_data](str(folder), num_shards=num_shards)
            _mark_ready(folder)
        shutil.copytree(folder, target, ignore=shutil.ignore_patterns(".ready"), dirs_exist_ok=True)
    return target


# Stage s2 of the digits MLP as the resume and multi-node tests run it: checkpoints every 10 steps, 4 epochs, a cosine
# schedule and clipping (their state must resume exactly too), handing on its best epoch (the default).
REFERENCE_CHECKPOINT_EVERY = 10
REFERENCE_STAGE_ARGS = ("--stage", "s2", "--params", json.dumps({"lr": 0.02, "dropout": 0.1}),
                        f"--override=train.checkpoint_every_steps={REFERENCE_CHECKPOINT_EVERY}",
                        "--override=train.stages.1.epochs=4",
                        '--override=train.stages.1.lr_schedule={"type": "cosine", "min_lr_ratio": 0.1}',
                        "--override=train.stages.1.grad_clip_norm=1.0")


def reference_stage(env: dict[str, str]) -> tuple[str, dict]:
    """The run prefix and result of REFERENCE_STAGE_ARGS run uninterrupted on one node with two processes (the local
    launcher) over the tests' digits (tests.conftest.base_config, preprocess_digits); made once per pytest run.

    A killed-and-resumed stage, or one on two emulated nodes, must end exactly where this one does: the data, its
    order per global rank, the seed and the dropout masks are the same whichever test preprocessed the digits.
    """
    from tests.conftest import base_config, preprocess_digits

    with _entry("reference-s2") as (folder, ready):
        out, result_file = folder / "storage" / "runs" / "test" / "reference", folder / "result.json"
        if not ready:
            shutil.rmtree(folder, ignore_errors=True)
            (folder / "storage").mkdir(parents=True)
            config_path = folder / "pipeline.yaml"
            config_path.write_text(yaml.safe_dump(base_config(folder / "storage")))
            preprocess_digits(config_path, str(out))
            command = [sys.executable, "-m", "stagewise.training.local_torchrun", "--nproc-per-node=2", "-m", "stagewise.train",
                       "--config", str(config_path), "--out", str(out), *REFERENCE_STAGE_ARGS,
                       "--result-file", str(result_file)]
            done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"the reference stage failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                                   f"{done.stderr[-3000:]}")
            _mark_ready(folder)
    return str(out), json.loads(result_file.read_text())
