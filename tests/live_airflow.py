"""A real Airflow stack for tests (this environment's 3.3, or a team's deployment of another minor): api-server, scheduler
(LocalExecutor), dag-processor and task-log server, a triggerer where asked.

Use: ``with LiveAirflow(tmp_path, dags_folder, env={...}) as live: run_id = live.trigger("my_dag")``,
or in a test module ``from tests.live_airflow import live_airflow`` and take the ``live_airflow`` fixture
(a factory: ``live = live_airflow(dags_folder, env)``; everything it started is stopped at teardown).
Tests that only trigger runs and read them back share one stack of several pipelines: the ``shared_airflow``
fixture (tests/shared_stack.py), from a file listed in its SHARED_STACK_FILES.

Everything lives under one scratch folder: an isolated AIRFLOW_HOME with a SQLite file DB, one log
file per component (``<tmp>/logs/*.log``, tails are attached to every failure) and the task logs.
Servers bind 127.0.0.1 on free ports only (never ``airflow standalone``: it binds all interfaces); as with
``make up``, running tasks' logs are served by ``stagewise.airflow.log_server`` on loopback.
Each component runs in its own process group; on exit the groups get SIGTERM, then SIGKILL, and a
sweep by an environment marker ends anything that left its group (e.g. a sub-job in its own session).
Every wait is bounded and fails with the component logs, so a broken stack never hangs CI.
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx
import pytest

from stagewise.definitions.bookkeeping import BOOKKEEPING_POOL, DEFAULT_POOL
from tests import run_cache

REPO_ROOT = Path(__file__).resolve().parent.parent
MARKER_ENV = "STAGEWISE_LIVE_AIRFLOW"  # every process we start (and their children) carries this
FINAL_RUN_STATES = frozenset({"success", "failed"})
# A REST call's timeout, and how often a timed-out read is asked again: under the full suite on 2 cores the one
# api-server worker has answered a run-state poll after more than 30 s (CI, 2026-11-28).
API_TIMEOUT_S = 60.0
API_READ_ATTEMPTS = 3
_ADMIN = "admin"
# Keys every task log record repeats; task_log() leaves them out so the lines stay readable.
_LOG_CONTEXT_KEYS = frozenset({"event", "timestamp", "level", "logger", "dag_id", "run_id", "task_id", "ti_id",
                               "try_number", "map_index", "filename", "lineno"})


WORKER_NAME_ENV = "STAGEWISE_WORKER_NAME"


def worker_hostname() -> str:
    """Airflow's ``[core] hostname_callable`` for tests: each Celery worker reports its own name."""
    return os.environ.get(WORKER_NAME_ENV) or socket.getfqdn()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    except OSError:  # the process ended meanwhile
        pass
    return inodes


def _proc_net_address(hex_address: str) -> str:
    """``0100007F:1F90`` (or its IPv6 form) from /proc/net/tcp{,6} as ``127.0.0.1:8080`` / ``[::1]:8080``."""
    host, port = hex_address.split(":")
    # The kernel prints each 32-bit word of the address in host (little-endian) byte order.
    raw = b"".join(bytes.fromhex(host[i:i + 8])[::-1] for i in range(0, len(host), 8))
    address = ipaddress.ip_address(raw)
    return f"{address}:{int(port, 16)}" if address.version == 4 else f"[{address}]:{int(port, 16)}"


def listening_sockets(pids: Iterable[int]) -> list[str]:
    """Every TCP socket in LISTEN state owned by one of ``pids``, as ``host:port`` (read from /proc, no ``ss``)."""
    inodes: set[int] = set()
    for pid in pids:
        inodes |= _socket_inodes(pid)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as handle:
            for line in list(handle)[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[9]) in inodes:  # 0A: TCP_LISTEN
                    found.append(_proc_net_address(fields[1]))
    return found


def is_loopback(host_port: str) -> bool:
    """Whether a ``host:port`` from :func:`listening_sockets` is on 127.0.0.0/8 or ::1 (not 0.0.0.0 or ::)."""
    return ipaddress.ip_address(host_port.rsplit(":", 1)[0].strip("[]")).is_loopback


def process_tree(root_pid: int) -> list[int]:
    """``root_pid`` and every live descendant (torchrun starts each rank in a session of its own, so no group will do)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if fields[0] != "Z":
                    children.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


class LiveAirflowError(AssertionError):
    """The stack failed to start, a component died, or a wait ran out; the message holds log tails."""


class LiveAirflow:
    """An isolated Airflow (SQLite, LocalExecutor) started as subprocesses; a context manager.

    ``env`` is applied last, so it can override any setting (``AIRFLOW__SECTION__KEY``) chosen here. ``plugins_folder``
    None: Airflow's default under its home, as scripts/airflow_env.sh (the UI plugin comes from its entry point).
    ``python``: a team's deployment (another Airflow, Stagewise installed into it) whose interpreter runs every
    component, the checkout kept off its path; ``migrated_db`` a SQLite DB that its Airflow migrated (default: a copy of
    this environment's); ``triggerer``: start one (Airflow 3.2's HITL task defers to it).
    """

    def __init__(self, tmp_dir: str | os.PathLike, dags_folder: str | os.PathLike, env: dict[str, str] | None = None,
                 *, plugins_folder: str | os.PathLike | None = None, parallelism: int = 4,
                 startup_timeout: float = 120.0, stop_grace: float = 10.0, users: dict[str, str] | None = None,
                 python: str | os.PathLike | None = None, migrated_db: str | os.PathLike | None = None,
                 triggerer: bool = False) -> None:
        if parallelism < 2:
            raise ValueError("parallelism must be >= 2 so tasks can run side by side")
        self.tmp_dir = Path(tmp_dir).resolve()
        self.home = self.tmp_dir / "airflow_home"
        self.log_dir = self.tmp_dir / "logs"
        self.dags_folder = Path(dags_folder).resolve()
        self.plugins_folder = Path(plugins_folder).resolve() if plugins_folder else None
        self.parallelism = parallelism
        self.startup_timeout = startup_timeout
        self.stop_grace = stop_grace
        self.python = str(python or sys.executable)
        self.migrated_db = Path(migrated_db) if migrated_db else None
        self.triggerer = triggerer
        self.port = free_port()
        self.log_server_port = free_port()
        while self.log_server_port == self.port:
            self.log_server_port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.marker = secrets.token_hex(8)
        # The simple auth manager's users beside admin, name -> role (viewer, user, op, admin), each with a password.
        self.users = {_ADMIN: "admin", **(users or {})}
        self.passwords = {name: secrets.token_urlsafe(16) for name in self.users}
        self.env = self._build_env(env or {})
        self.processes: dict[str, subprocess.Popen] = {}
        # Every group ever started: a killed scheduler's LocalExecutor workers live on in its group, and
        # setproctitle overwrites their environment, so the marker sweep cannot find them.
        self._groups: list[int] = []
        self._log_handles: list[Any] = []
        self._client: httpx.Client | None = None
        self.password = self.passwords[_ADMIN]
        self.swept: list[int] = []  # pids the final sweep had to kill: they had left their process group

    # -- environment -------------------------------------------------------------------------------

    def _build_env(self, extra: dict[str, str]) -> dict[str, str]:
        # Start from the caller's environment minus any Airflow settings (e.g. a sourced airflow_env.sh).
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("AIRFLOW__") and k not in ("AIRFLOW_HOME", "AIRFLOW_CONFIG")}
        no_proxy = ",".join(p for p in ("127.0.0.1", "localhost", env.get("NO_PROXY", "")) if p)
        deployment = self.python != sys.executable  # a team's venv: only what it has installed, its bin/ first
        python_path = ([] if deployment else [str(REPO_ROOT)]) + ([str(self.plugins_folder)] if self.plugins_folder else [])
        if env.get("PYTHONPATH") and not deployment:
            python_path.append(env["PYTHONPATH"])
        if deployment:
            env.pop("VIRTUAL_ENV", None)
            env["PATH"] = os.pathsep.join([str(Path(self.python).parent), env.get("PATH", "")])
        env.update({
            MARKER_ENV: self.marker,
            "AIRFLOW_HOME": str(self.home),
            "PYTHONPATH": os.pathsep.join(python_path),
            "PYTHONUNBUFFERED": "1",
            "NO_PROXY": no_proxy, "no_proxy": no_proxy,  # workers reach the execution API on loopback
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{self.home}/airflow.db",
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": str(self.parallelism),
            "AIRFLOW__CORE__DAGS_FOLDER": str(self.dags_folder),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
            "AIRFLOW__CORE__FERNET_KEY": base64.urlsafe_b64encode(os.urandom(32)).decode(),
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__API__BASE_URL": self.base_url,
            "AIRFLOW__API__SECRET_KEY": secrets.token_hex(16),
            "AIRFLOW__API_AUTH__JWT_SECRET": secrets.token_hex(32),  # one signing key for all components
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.base_url}/execution/",
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(self.log_server_port),
            "AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK": "False",  # no extra listening port
            # The DAG files do not change while a test runs: parse them once, not every 30 s (CPU the tasks need).
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "600",
        })
        if self.plugins_folder:
            env["AIRFLOW__CORE__PLUGINS_FOLDER"] = str(self.plugins_folder)
        if len(self.users) > 1:
            env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS"] = ",".join(f"{name}:{role}" for name, role in self.users.items())
        # As `make up`: tasks record 127.0.0.1, where our log server serves their running logs.
        env["AIRFLOW__CORE__HOSTNAME_CALLABLE"] = "stagewise.airflow.log_server.loopback_hostname"
        env.update(extra)
        return env

    # -- lifecycle ---------------------------------------------------------------------------------

    def __enter__(self) -> LiveAirflow:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _airflow(self) -> list[str]:
        return [self.python, "-m", "airflow"]

    def start(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # The simple auth manager keeps generated passwords here and only adds missing users: seed ours.
        (self.home / "simple_auth_manager_passwords.json.generated").write_text(json.dumps(self.passwords))
        migrate_log = self.log_dir / "db-migrate.log"
        db_url = self.env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
        if self.migrated_db is not None:
            Path(db_url.removeprefix("sqlite:///")).write_bytes(self.migrated_db.read_bytes())
            migrate_log.write_text(f"copied {self.migrated_db} to {db_url}\n")
        elif db_url.startswith("sqlite:///"):  # a copy of one migrated DB per pytest run (tests/run_cache.py)
            run_cache.migrated_sqlite_db(db_url.removeprefix("sqlite:///"))
            migrate_log.write_text(f"copied a migrated SQLite DB to {db_url}\n")
        else:
            with open(migrate_log, "w") as handle:
                try:
                    result = subprocess.run([*self._airflow(), "db", "migrate"], env=self.env, cwd=self.tmp_dir,
                                            stdin=subprocess.DEVNULL, stdout=handle, stderr=subprocess.STDOUT,
                                            timeout=self.startup_timeout, start_new_session=True)
                except subprocess.TimeoutExpired:
                    raise LiveAirflowError(f"airflow db migrate timed out\n{self._tail(migrate_log)}") from None
            if result.returncode != 0:
                raise LiveAirflowError(f"airflow db migrate failed ({result.returncode})\n{self._tail(migrate_log)}")
        self._spawn("api-server", "api-server", "-H", "127.0.0.1", "-p", str(self.port), "-w", "1")
        self._spawn("scheduler", "scheduler", "--skip-serve-logs")
        self._spawn("dag-processor", "dag-processor")
        if self.triggerer:
            self._spawn("triggerer", "triggerer", "--skip-serve-logs")
        # The scheduler's own log server binds every interface; this one serves the same app on 127.0.0.1.
        self._spawn("log-server", "-m", "stagewise.airflow.log_server", argv0=[self.python])
        self._wait_healthy()
        self._client = httpx.Client(base_url=self.base_url, timeout=API_TIMEOUT_S, trust_env=False,
                                    headers={"Authorization": f"Bearer {self._token()}"})
        # As `make airflow-init` does for every pipeline: without it the light tasks would never be scheduled.
        self.ensure_pool(BOOKKEEPING_POOL, DEFAULT_POOL["slots"])

    def kill(self, name: str) -> int:
        """SIGKILL one component's main process (not its children), as a crash would; returns its pid."""
        process = self.processes[name]
        process.kill()
        process.wait(timeout=30)
        return process.pid

    def start_celery_worker(self, name: str, queues: list[str], concurrency: int = 2) -> None:
        """A Celery worker serving ``queues``; the task instances it runs record ``name`` as their hostname."""
        self._spawn(f"worker-{name}", "celery", "worker", "--queues", ",".join(queues), "--celery-hostname",
                    f"{name}@%h", "--concurrency", str(concurrency), "--skip-serve-logs", "--without-gossip",
                    "--without-mingle", extra_env={WORKER_NAME_ENV: name})

    def restart_scheduler(self) -> None:
        """Start a new scheduler after :meth:`kill` (its log continues in scheduler.log)."""
        self._spawn("scheduler", "scheduler", "--skip-serve-logs", mode="a")

    def _spawn(self, name: str, *args: str, mode: str = "w", extra_env: dict[str, str] | None = None,
               argv0: list[str] | None = None) -> None:
        """Start ``airflow ARGS`` (or ``argv0 ARGS``) as component ``name``, logging to ``<tmp>/logs/<name>.log``."""
        handle = open(self.log_dir / f"{name}.log", mode)
        self._log_handles.append(handle)
        self.processes[name] = subprocess.Popen(
            [*(argv0 or self._airflow()), *args], env={**self.env, **(extra_env or {})}, cwd=self.tmp_dir, stdin=subprocess.DEVNULL,
            stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
        self._groups.append(self.processes[name].pid)

    def _wait_healthy(self) -> None:
        """Until the api-server answers and reports a live scheduler and dag-processor."""
        last = "no answer"
        with httpx.Client(base_url=self.base_url, timeout=5.0, trust_env=False) as client:
            def healthy() -> bool:
                nonlocal last
                try:
                    response = client.get("/api/v2/monitor/health")
                except httpx.HTTPError as exc:
                    last = repr(exc)
                    return False
                last = f"{response.status_code} {response.text[:500]}"
                if response.status_code != 200:
                    return False
                body = response.json()
                return all((body.get(part) or {}).get("status") == "healthy" for part in ("scheduler", "dag_processor"))

            self.wait_until(healthy, self.startup_timeout, lambda: f"stack not healthy; last health answer: {last}")

    def _token(self, user: str = _ADMIN) -> str:
        with httpx.Client(base_url=self.base_url, timeout=10.0, trust_env=False) as client:
            response = client.post("/auth/token", json={"username": user, "password": self.passwords[user]})
        if response.status_code not in (200, 201):
            raise LiveAirflowError(f"POST /auth/token: {response.status_code} {response.text}\n{self.logs_tail()}")
        return response.json()["access_token"]

    def stop(self) -> None:
        """SIGTERM every process group, SIGKILL what is left after the grace period, then sweep by marker."""
        if self._client is not None:
            self._client.close()
            self._client = None
        groups = set(self._groups)
        for pgid in groups:
            _killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace
        while time.monotonic() < deadline and any(_group_alive(pgid) for pgid in groups):
            for proc in self.processes.values():
                proc.poll()  # reap the leaders as they exit
            time.sleep(0.2)
        for pgid in groups:
            _killpg(pgid, signal.SIGKILL)
        for proc in self.processes.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for pid in self._marked_pids():  # anything that left its group (new session) yet carries our marker
            self.swept.append(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for handle in self._log_handles:
            handle.close()
        self._log_handles.clear()
        self.processes.clear()
        self._groups.clear()

    # -- processes ---------------------------------------------------------------------------------

    def _marked_pids(self) -> list[int]:
        """Live (non-zombie) processes, other than this one, whose environment holds our marker."""
        needle = f"{MARKER_ENV}={self.marker}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if needle not in (entry / "environ").read_bytes().split(b"\0"):
                    continue
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state != "Z":
                found.append(int(entry.name))
        return found

    def stray_processes(self) -> list[str]:
        """Our processes outside the components' process groups (e.g. a sub-job that outlived its task)."""
        groups = {proc.pid for proc in self.processes.values()}
        stray = []
        for pid in self._marked_pids():
            try:
                if os.getpgid(pid) in groups:
                    continue
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, ProcessLookupError):
                continue
            stray.append(f"{pid}: {cmdline.strip()}")
        return stray

    def check_alive(self) -> None:
        """Fail with the logs if a component has exited."""
        for name, proc in self.processes.items():
            if proc.poll() is not None:
                raise LiveAirflowError(f"{name} exited with code {proc.returncode}\n{self.logs_tail()}")

    def wait_until(self, predicate: Callable[[], Any], timeout: float, describe: Callable[[], str] | str,
                   interval: float = 0.5) -> Any:
        """Poll ``predicate`` until it returns something truthy; fail (with logs) on timeout or a dead component."""
        deadline = time.monotonic() + timeout
        while True:
            self.check_alive()
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                message = describe() if callable(describe) else describe
                raise LiveAirflowError(f"timed out after {timeout:.0f}s: {message}\n{self.logs_tail()}")
            time.sleep(interval)

    def _tail(self, path: Path, lines: int = 40) -> str:
        try:
            text = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"--- {path.name}: (missing)"
        return f"--- {path.name} (last {len(text)} lines)\n" + "\n".join(text)

    def component_log(self, name: str) -> str:
        """The whole log of one component: api-server, scheduler, dag-processor, log-server or db-migrate."""
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def logs_tail(self, lines: int = 40) -> str:
        """The end of every component's log file, for failure messages."""
        return "\n".join(self._tail(path, lines) for path in sorted(self.log_dir.glob("*.log")))

    # -- REST --------------------------------------------------------------------------------------

    @property
    def client(self) -> httpx.Client:
        if self._client is None:
            raise LiveAirflowError("LiveAirflow is not started")
        return self._client

    def client_of(self, user: str) -> httpx.Client:
        """A REST client holding ``user``'s own token (one of ``users``); the caller closes it."""
        return httpx.Client(base_url=self.base_url, timeout=API_TIMEOUT_S, trust_env=False,
                            headers={"Authorization": f"Bearer {self._token(user)}"})

    def ensure_pool(self, name: str, slots: int) -> None:
        """Create pool ``name`` with ``slots`` unless it exists (then it keeps its slots)."""
        self.api("POST", "/api/v2/pools", expect=(200, 201, 409), json={"name": name, "slots": slots})

    def api(self, method: str, path: str, expect: tuple[int, ...] = (200,), **kwargs: Any) -> httpx.Response:
        response = self._request(method, path, **kwargs)
        if response.status_code not in expect:
            raise LiveAirflowError(f"{method} {path}: {response.status_code} {response.text[:2000]}")
        return response

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One REST call; a read (GET) that times out is asked again, since a loaded 2-core machine can hold the
        api-server's one worker past the client's timeout while the run it polls goes on fine."""
        attempts = API_READ_ATTEMPTS if method.upper() == "GET" else 1
        for attempt in range(1, attempts + 1):
            try:
                return self.client.request(method, path, **kwargs)
            except httpx.TimeoutException:
                if attempt == attempts:
                    raise
                self.check_alive()
        raise AssertionError("unreachable")

    def import_errors(self) -> list[dict]:
        return self.api("GET", "/api/v2/importErrors").json()["import_errors"]

    def wait_for_dag(self, dag_id: str, timeout: float = 60.0) -> dict:
        """Until the dag-processor has serialized ``dag_id``; fails at once on an import error."""
        def found() -> dict | None:
            if errors := self.import_errors():
                raise LiveAirflowError(f"DAG import errors: {json.dumps(errors, indent=1)[:4000]}")
            response = self._request("GET", f"/api/v2/dags/{dag_id}/details")
            return response.json() if response.status_code == 200 else None

        return self.wait_until(found, timeout, f"DAG {dag_id} never got serialized")

    def unpause(self, dag_id: str) -> None:
        self.api("PATCH", f"/api/v2/dags/{dag_id}", json={"is_paused": False})

    def trigger(self, dag_id: str, conf: dict | None = None) -> str:
        """Start a manual run now (``logical_date: null``); return its run id."""
        response = self.api("POST", f"/api/v2/dags/{dag_id}/dagRuns", expect=(200,),
                            json={"logical_date": None, "conf": conf or {}})
        return response.json()["dag_run_id"]

    def run_state(self, dag_id: str, run_id: str) -> str:
        return self.api("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}").json()["state"]

    def wait_for_run(self, dag_id: str, run_id: str, timeout: float = 300.0) -> str:
        """Until the run is success or failed; return that state."""
        state = ""

        def done() -> str | None:
            nonlocal state
            state = self.run_state(dag_id, run_id)
            return state if state in FINAL_RUN_STATES else None

        return self.wait_until(done, timeout, lambda: f"run {dag_id}/{run_id} still {state!r}", interval=1.0)

    def hitl_path(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> str:
        return f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/{map_index}/hitlDetails"

    def wait_for_hitl(self, dag_id: str, run_id: str, task_id: str, timeout: float = 600.0) -> dict:
        """Until the run's Human-in-the-loop task waits for a person (its state awaiting_input, or deferred on 3.2);
        its HITL detail as the REST API gives it, once the scheduler has taken in the park.

        Airflow 3.3.2's scheduler, handed the parked try's executor event after an answer already re-queued the task,
        takes the try for one that died and retries it, and the new try's request has lost the answer (seen when a
        test answered 6 s after the park, before the busy scheduler got to the event): so this waits for the
        scheduler's own line on the parked try.
        """
        parked = f"TaskInstance Finished: dag_id={dag_id}, task_id={task_id}, run_id={run_id},"
        def asked() -> dict | None:
            if (state := self.run_state(dag_id, run_id)) in FINAL_RUN_STATES:
                raise LiveAirflowError(f"{dag_id}/{run_id} ended {state} without waiting at {task_id}\n{self.logs_tail()}")
            waiting = any(ti["task_id"] == task_id and ti["state"] in ("awaiting_input", "deferred")
                          for ti in self.task_instances(dag_id, run_id))
            response = self._request("GET", self.hitl_path(dag_id, run_id, task_id)) if waiting else None
            return response.json() if response is not None and response.status_code == 200 else None

        detail = self.wait_until(asked, timeout, f"{dag_id}/{run_id} never waited at {task_id}", interval=1.0)
        self.wait_until(lambda: any(parked in line and ("state=awaiting_input" in line or "state=deferred" in line)
                                    for line in self.component_log("scheduler").splitlines()),
                        timeout, f"the scheduler never took in {dag_id}/{run_id}'s park at {task_id}", interval=0.5)
        return detail

    def task_instances(self, dag_id: str, run_id: str) -> list[dict]:
        """Every task instance of the run (REST objects: task_id, map_index, state, try_number, start/end, duration)."""
        found: list[dict] = []
        while True:
            page = self.api("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances",
                            params={"limit": 100, "offset": len(found)}).json()
            found.extend(page["task_instances"])
            if not page["task_instances"] or len(found) >= page["total_entries"]:
                return found

    def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value", map_index: int = -1) -> Any:
        path = f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}"
        return self.api("GET", path, params={"map_index": map_index, "deserialize": True}).json()["value"]

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int = 1, map_index: int = -1) -> str:
        """The task log as text, one line per record."""
        path = f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/logs/{try_number}"
        content = self.api("GET", path, params={"map_index": map_index, "full_content": True},
                           headers={"Accept": "application/json"}).json()["content"]
        lines = []
        for record in content:
            if isinstance(record, dict):
                extra = {k: v for k, v in record.items() if k not in _LOG_CONTEXT_KEYS}
                line = f"{record.get('timestamp', '')} {record.get('level', '')} {record.get('logger', '')}: {record.get('event', '')}"
                lines.append(line + (f" {json.dumps(extra, default=str)}" if extra else ""))
            else:
                lines.append(str(record))
        return "\n".join(lines)


@pytest.fixture
def live_airflow(tmp_path: Path):
    """Factory fixture: ``live_airflow(dags_folder, env=None, **kwargs)`` starts a LiveAirflow, stopped at teardown."""
    started: list[LiveAirflow] = []
    with contextlib.ExitStack() as stack:
        def start(dags_folder: str | os.PathLike, env: dict[str, str] | None = None, **kwargs: Any) -> LiveAirflow:
            live = stack.enter_context(LiveAirflow(tmp_path / f"live_airflow{len(started)}", dags_folder, env, **kwargs))
            started.append(live)
            return live

        yield start


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    """Whether a process group has a member that is not a zombie (a zombie answers kill 0 too)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False
