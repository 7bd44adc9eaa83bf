"""Shared fixtures: a scratch storage root and a small valid pipeline config written to disk."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from stagewise.core.cli import skip_final_collection
from tests import run_cache
from tests import slurm_cluster as test_cluster

# The live_airflow fixture (a real api-server, scheduler and dag-processor) for any test that needs one.
# slow_guard: a test over a minute is marked slow; cpu_cost: the CPU each test cost, printed after the run.
pytest_plugins = ["tests.live_airflow", "tests.shared_stack", "tests.slow_guard", "tests.cpu_cost"]

REPO_ROOT = Path(__file__).resolve().parent.parent
# Sub-jobs a test starts, itself or through the launcher, import test helpers (tests.plugins.fake_subjob, ...):
# the checkout on their path, as pytest's rootdir is on this process's. `stagewise` itself is installed.
os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(
    path for path in (str(REPO_ROOT), *os.environ.get("PYTHONPATH", "").split(os.pathsep)) if path))
# Each test process (and every process it starts) keeps the pipelines' last valid versions apart from the checkout's
# Airflow home and from other test sessions: a version recorded by one test must never serve another's DAGs.
os.environ["STAGEWISE_STATE_DIR"] = tempfile.mkdtemp(prefix="stagewise-state-")

_NEEDS = ("airflow", "torchrun", "browser", "service", "gpu", "slurm")  # the markers of pytest.ini; test-fast runs none
# Fixtures that bring a need with them: checked at collection, so a test using one cannot run unmarked.
_FIXTURE_NEEDS = {"live_airflow": "airflow", "shared_airflow": "airflow", "airflow_env": "airflow", "chromium": "browser",
                  "postgres_databases": "service", "redis_url": "service", "s3_endpoint": "service",
                  "mlflow_server": "service", "mlflow_servers": "service", "slurm_cluster": "slurm", "slurm": "slurm"}
# A process the test starts, named by its argv (a bash -c script or python -c code included).
_TORCHRUN = re.compile(r"(?<![\w.])(torchrun|stagewise\.training\.local_torchrun|stagewise\.training\.node_launch|torch\.distributed\.run)(?![\w.])")
# The CLI as a command (`airflow dags test`, `python -m airflow scheduler`, `... && exec airflow`), not `import airflow`.
_AIRFLOW = re.compile(r"(?:^|[;&|]\s*|\bexec\s+|-m\s+|/)airflow(?=\s)")


def process_needs(argv) -> set[str]:
    """The markers a process started with ``argv`` calls for (``torchrun`` or ``airflow``); empty for anything else."""
    text = argv if isinstance(argv, (str, bytes, os.PathLike)) else " ".join(os.fsdecode(a) for a in argv)
    text = os.fsdecode(text) + " "
    return {name for name, pattern in (("torchrun", _TORCHRUN), ("airflow", _AIRFLOW)) if pattern.search(text)}


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the files on the shared live stack (SHARED_STACK_FILES) as one unit: one worker
    starts that stack. (xdist's own loadgroup renames node ids, which pytest 9 no longer lets it do.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    from tests.shared_stack import SHARED_STACK_FILES  # a plugin of this file: imported after it, for assert rewriting

    class SharedStackScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return "the shared live stack" if file in SHARED_STACK_FILES else file

    return SharedStackScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """A test that takes a fixture needing Airflow, a browser or a service must say so with the marker."""
    unmarked = []
    for item in items:
        marks = {mark.name for mark in item.iter_markers()}
        missing = {need for fixture, need in _FIXTURE_NEEDS.items() if fixture in item.fixturenames} - marks
        if missing:
            unmarked.append(f"{item.nodeid}: needs @pytest.mark.{', @pytest.mark.'.join(sorted(missing))}")
    if unmarked:
        raise pytest.UsageError("tests without the markers of what they need:\n" + "\n".join(unmarked))
    from tests.shared_stack import SHARED_STACK_FILES

    astray = sorted({item.nodeid.split("::")[0] for item in items if "shared_airflow" in item.fixturenames}
                    - set(SHARED_STACK_FILES))
    if astray:
        raise pytest.UsageError(f"{astray} use the shared_airflow stack: list them in tests/shared_stack.py's "
                                "SHARED_STACK_FILES, so one worker runs them")
    # Longest first, so pytest-xdist's workers do not end on one long run each: modules running Airflow or a browser
    # (those needing more besides first), then torchrun or a service, then the rest. A stable sort by module keeps
    # each module's tests together.
    weight: dict[str, tuple[int, int]] = {}
    for item in items:
        marks = {mark.name for mark in item.iter_markers()}
        rank = (0 if marks & {"airflow", "browser"} else 1 if marks & {"torchrun", "service", "slurm"} else 2,
                -len(marks & set(_NEEDS)))
        weight[item.module.__name__] = min(rank, weight.get(item.module.__name__, (2, 0)))
    # The shared stack's files run one after another (its last test stops it), where the first of them sorts.
    shared = {item.module.__name__ for item in items if item.nodeid.split("::")[0] in SHARED_STACK_FILES}
    first = min((weight[name] for name in shared), default=None)
    weight.update(dict.fromkeys(shared, first))
    # and in SHARED_STACK_FILES' order: the browser suite's gated run comes before the approval test's
    def in_stack(item) -> int:
        file = item.nodeid.split("::")[0]
        return SHARED_STACK_FILES.index(file) if file in SHARED_STACK_FILES else 0

    items.sort(key=lambda item: (weight[item.module.__name__], item.module.__name__ not in shared, in_stack(item)))


_running: list = [None]  # the test whose setup, call or teardown runs now (module fixtures start in its setup)
_unmarked_starts: dict[str, list[str]] = {}


_owned_cache: list[str] = []


def pytest_configure(config):
    """Open the run's setup cache (tests/run_cache.py), and watch every process this pytest process starts, so a
    test starting torchrun or Airflow unmarked fails; skip the collection of the worker's heap at exit."""
    skip_final_collection()
    if folder := run_cache.open_cache():
        _owned_cache.append(folder)
    execute_child = subprocess.Popen._execute_child

    def checked(self, args, *rest, **kwargs):
        if (item := _running[0]) is not None:
            marks = {mark.name for mark in item.iter_markers()}
            for need in process_needs(args) - marks:
                _unmarked_starts.setdefault(item.nodeid, []).append(f"{need}: {str(args)[:200]}")
        return execute_child(self, args, *rest, **kwargs)

    subprocess.Popen._execute_child = checked


def pytest_unconfigure(config):
    for folder in _owned_cache:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running[0] = item
    try:
        return (yield)
    finally:
        _running[0] = None


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """The test errors at teardown if it (or a fixture set up for it) started torchrun or Airflow without the marker."""
    if started := _unmarked_starts.pop(item.nodeid, None):
        pytest.fail("started without its marker (add @pytest.mark.<need>):\n" + "\n".join(dict.fromkeys(started)),
                    pytrace=False)


# One inference shard per raw file of the tests' two-file digits (run_cache.demo_data): infer_shard still fans out,
# with half the sub-jobs of the demo's 500 rows a shard.
TEST_ROWS_PER_SHARD = 1000


def base_config(storage_root: Path) -> dict:
    """A small, fast, valid config as a plain dict; tests mutate it to make bad cases."""
    with open(REPO_ROOT / "pipeline.yaml") as handle:
        raw = yaml.safe_load(handle)
    raw["storage_root"] = str(storage_root)
    raw["sweep"]["storage"] = f"journal://{storage_root}/optuna.journal"
    raw["sweep"].update({"num_trials": 4, "num_workers": 2, "epochs": 3})
    for stage in raw["train"]["stages"]:
        stage["epochs"] = 2
    raw["inference"]["rows_per_shard"] = TEST_ROWS_PER_SHARD
    return raw


def unnamed(storage_root: Path) -> dict:
    """base_config without pipeline.yaml's `name: ml`: such a config takes its file's name."""
    return {key: value for key, value in base_config(storage_root).items() if key != "name"}


@pytest.fixture
def storage_root(tmp_path: Path) -> Path:
    root = tmp_path / "storage"
    root.mkdir()
    return root


@pytest.fixture
def write_config(tmp_path: Path, storage_root: Path):
    """Write a config dict (default: base_config) to a YAML file and return its path."""

    def write(raw: dict | None = None, name: str = "pipeline.yaml") -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(raw if raw is not None else base_config(storage_root)))
        return path

    return write


@pytest.fixture
def subprocess_env() -> dict:
    """Environment for sub-job processes: the repo importable, one thread each."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def preprocess_digits(config_path: Path, out: str) -> dict:
    """Write the config's demo data (the digits) and run the whole preprocess stage into ``out``; returns the commit result."""
    from stagewise import preprocess
    from stagewise.core import storage
    from stagewise.datasets.demo import DEMO_WRITERS
    from stagewise.definitions.loading import load_config

    config = load_config(config_path)
    raw = storage.resolve(config.storage_root, config.dataset.uri)
    if not storage.exists(raw):
        DEMO_WRITERS[config.dataset.demo_data](raw)
    shards = preprocess.plan(raw)
    stats = [preprocess.shard_stats(config, uri, i, out)["stats_uri"] for i, uri in enumerate(shards)]
    reduced = preprocess.reduce_stats(config, out, stats)
    results = [preprocess.transform_shard(config, uri, i, out, reduced["stats_uri"]) for i, uri in enumerate(shards)]
    return preprocess.commit(config, out, reduced["stats_uri"], results)


def train_digits_s1(root: Path, run: str, hidden: int) -> tuple[Path, str, str]:
    """The digits preprocessed under ``root`` and stage s1 trained in-process (one rank, CPU) with ``hidden`` units;
    returns (config path, run prefix, model URI)."""
    import yaml

    from stagewise import train
    from stagewise.definitions.loading import load_config

    config_path = root / "pipeline.yaml"
    config_path.write_text(yaml.safe_dump(base_config(root)))
    out = str(root / "runs" / "test" / run)
    preprocess_digits(config_path, out)
    with pytest.MonkeyPatch.context() as patch:
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            patch.delenv(name, raising=False)
        result = train.run_stage(load_config(config_path), "s1", out, {"lr": 0.05, "hidden": hidden}, None)
    return config_path, out, result["model_uri"]


@pytest.fixture
def digits_run(write_config, storage_root) -> tuple[Path, str]:
    """A config file and a run prefix holding a committed preprocess manifest of the digits."""
    config_path = write_config()
    out = str(storage_root / "runs" / "test" / "r1")
    preprocess_digits(config_path, out)
    return config_path, out


@pytest.fixture
def digits_images_run(write_config, storage_root) -> tuple[Path, str]:
    """Like digits_run, over the digits as one declared 1x8x8 ``image`` column (what the CNN example reads)."""
    raw = base_config(storage_root)
    raw["dataset"].update({"uri": "raw/digits_images", "demo_data": "digits-images",
                           "features": [{"column": "image", "shape": [1, 8, 8]}]})
    config_path = write_config(raw)
    out = str(storage_root / "runs" / "test" / "images")
    preprocess_digits(config_path, out)
    return config_path, out


def diabetes_config(root: Path) -> dict:
    """base_config over scikit-learn's diabetes: a float target, the example Regressor, rmse minimised."""
    raw = base_config(root)
    raw["dataset"] = {"uri": "raw/diabetes", "demo_data": "diabetes", "key": "row_id", "label": "target",
                      "features": ["age", "sex", "bmi", "bp", "s1", "s2", "s3", "s4", "s5", "s6"]}
    raw["model"] = {"spec": "stagewise.examples.diabetes:DiabetesMLP", "args": {}}
    raw["objective"] = {"metric": "rmse", "direction": "minimize"}
    raw["registry"] = {"model_name": "diabetes_mlp"}
    return raw


@pytest.fixture
def diabetes_run(write_config, storage_root) -> tuple[Path, str]:
    """Like digits_run, over the diabetes regression set (diabetes_config)."""
    config_path = write_config(diabetes_config(storage_root))
    out = str(storage_root / "runs" / "test" / "diabetes")
    preprocess_digits(config_path, out)  # writes the config's demo_data: here the diabetes
    return config_path, out


def service_unavailable(reason: str) -> None:
    """Skip with the reason on a user's machine; fail in CI, where the service must be there."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: the service is required)")
    pytest.skip(reason)


@pytest.fixture
def postgres_databases():
    """A factory of fresh, empty PostgreSQL databases (dropped after the test); returns their URLs.

    The server is 127.0.0.1:5432 by default ($STAGEWISE_TEST_PG to change).
    """
    import uuid

    psycopg2 = pytest.importorskip("psycopg2")
    server = os.environ.get("STAGEWISE_TEST_PG", "postgresql://postgres@127.0.0.1:5432")
    try:
        admin = psycopg2.connect(f"{server}/postgres", connect_timeout=5)
    except psycopg2.OperationalError as exc:
        service_unavailable(f"PostgreSQL at {server} is unreachable: {str(exc).strip()}")
    admin.autocommit = True
    created: list[str] = []

    def create() -> str:
        name = f"stagewise_test_{uuid.uuid4().hex[:8]}"
        with admin.cursor() as cursor:
            cursor.execute(f"CREATE DATABASE {name}")
        created.append(name)
        return f"{server}/{name}"

    try:
        yield create
    finally:
        with admin.cursor() as cursor:
            for name in created:
                cursor.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.close()


@pytest.fixture
def postgres_url(postgres_databases) -> str:
    """One fresh, empty PostgreSQL database for a test."""
    return postgres_databases()


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real Slurm cluster (tests/slurm_cluster.py: slurmctld and nodes n1, n2 of 2 CPUs each in network namespaces,
    their own munged), started the first time one of this worker's tests asks for it, stopped at the session's end."""
    if reason := test_cluster.unavailable_reason():
        service_unavailable(reason)
    with test_cluster.cluster(nodes=2, cpus_per_node=2) as started:
        yield started


@pytest.fixture
def slurm(slurm_cluster):
    """The session's Slurm cluster after reset(): every node up and idle, no job left from an earlier test."""
    slurm_cluster.reset()
    return slurm_cluster


def _make_puts_atomic() -> None:
    """Serialize moto's PutObject, as S3 orders writes to a key: moto checks If-Match / If-None-Match and then stores
    in two steps, so two conditional PUTs racing on its threaded server could both pass (one lost, which S3 refuses)."""
    import threading

    from moto.s3.responses import S3Response

    if getattr(S3Response.put_object, "stagewise_atomic", False):
        return
    unlocked, lock = S3Response.put_object, threading.Lock()

    def put_object(self, *args, **kwargs):
        with lock:
            return unlocked(self, *args, **kwargs)

    put_object.stagewise_atomic = True
    S3Response.put_object = put_object


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 HTTP endpoint on 127.0.0.1 (moto's server mode, as s3fs tests itself) and the AWS env to reach it.

    Credentials are fake but distinctive, so a test can check they never leak into logs or outputs.
    """
    import secrets
    import socket

    server_module = pytest.importorskip("moto.server")
    _make_puts_atomic()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request would drown failure reports
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": f"AKIA{secrets.token_hex(8).upper()}",
           "AWS_SECRET_ACCESS_KEY": secrets.token_urlsafe(30), "AWS_DEFAULT_REGION": "us-east-1"}
    try:
        yield env
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch):
    """The AWS environment of the plain (fault-free) S3 endpoint, with a fresh s3fs client and bucket check."""
    import s3fs

    from stagewise.core import storage

    for key, value in s3_endpoint.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()
    storage._check_bucket.cache_clear()
    yield s3_endpoint
    s3fs.S3FileSystem.clear_instance_cache()
    storage._check_bucket.cache_clear()


@pytest.fixture
def s3_bucket(s3_env) -> str:
    """A fresh, empty bucket on the S3 endpoint, as ``s3://<bucket>``, with the environment that reaches it."""
    import uuid

    import s3fs

    bucket = f"test-{uuid.uuid4().hex[:10]}"
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_env["AWS_ENDPOINT_URL"]}, skip_instance_cache=True).mkdir(bucket)
    return f"s3://{bucket}"


@pytest.fixture
def redis_url() -> str:
    """The Redis broker on 127.0.0.1:6379 ($STAGEWISE_TEST_REDIS to change), on a database of its own."""
    import socket

    url = os.environ.get("STAGEWISE_TEST_REDIS", "redis://127.0.0.1:6379/7")
    host, port = url.split("//", 1)[1].split("/", 1)[0].split(":")
    try:
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(b"PING\r\n")
            if not sock.recv(16).startswith(b"+PONG"):
                raise OSError("no PONG")
    except OSError as exc:
        service_unavailable(f"Redis at {url} is unreachable: {exc}")
    return url


def _mlflow_server_or_skip(folder: Path, **kwargs):
    from tests.mlflow_server import MLFLOW_PYTHON, MlflowServer

    if not MLFLOW_PYTHON.exists():
        service_unavailable(f"no MLflow environment at {MLFLOW_PYTHON.parent.parent}: run `make mlflow-env`")
    try:
        return MlflowServer(folder, **kwargs).start()
    except RuntimeError as exc:
        service_unavailable(f"mlflow server did not start: {exc}")


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server (SQLite store, artifacts proxied to a local folder) shared by a worker's tests;
    each test uses experiments and model names of its own."""
    server = _mlflow_server_or_skip(tmp_path_factory.mktemp("mlflow"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def mlflow_servers(tmp_path):
    """A factory of MLflow servers of the test's own (``artifacts``: an s3:// destination; ``env``: its AWS
    environment), stopped after it; a test may stop one mid-run."""
    started = []

    def start(name: str = "mlflow", **kwargs):
        started.append(_mlflow_server_or_skip(tmp_path / name, **kwargs))
        return started[-1]

    try:
        yield start
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def no_aws_credentials(monkeypatch, tmp_path):
    """This process finds no AWS credentials anywhere (variables, files, instance metadata), and boto's cached session
    is dropped before and after: an S3 storage it reads fails as it would on a host without them."""
    from stagewise.core import storage

    for variable in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL",
                     "AWS_ENDPOINT_URL_S3", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(variable, raising=False)
    for variable in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(variable, str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    storage._s3_session.cache_clear()  # no credentials another test's session found
    yield
    storage._s3_session.cache_clear()
