"""A real MLflow tracking server for the tests, run from its own environment (.venv-mlflow, `make mlflow-env`) as a
team runs it: `mlflow server` on 127.0.0.1, a SQLite backend store, artifacts proxied to a local folder or an S3
bucket. ``client`` runs code with MLflow's official client in that environment and returns what it prints as JSON.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import textwrap
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MLFLOW_PYTHON = REPO_ROOT / ".venv-mlflow" / "bin" / "python"
START_TIMEOUT_S = 90


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MlflowServer:
    """One `mlflow server` process; ``start`` waits until /health answers, ``stop`` ends it (a test may stop it mid-run)."""

    def __init__(self, folder: Path, artifacts: str | None = None, env: dict[str, str] | None = None) -> None:
        self.folder, self.port = folder, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.artifacts = artifacts or str(folder / "artifacts")
        # No job runner: MLflow's huey consumers (several processes per server) poll all session long and Stagewise
        # submits no server-side job.
        self.env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **(env or {})}
        self.process: subprocess.Popen | None = None

    def start(self) -> MlflowServer:
        import requests

        self.folder.mkdir(parents=True, exist_ok=True)
        log = open(self.folder / "server.log", "ab")
        self.process = subprocess.Popen(
            [str(MLFLOW_PYTHON), "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--backend-store-uri", f"sqlite:///{self.folder}/mlflow.db", "--artifacts-destination", self.artifacts,
             "--workers", "1"], stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.folder, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"mlflow server exited with {self.process.returncode}: {self.log_tail()}")
            try:
                if requests.get(f"{self.uri}/health", timeout=2).ok:
                    return self
            except requests.RequestException:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"mlflow server did not answer /health in {START_TIMEOUT_S}s: {self.log_tail()}")

    def stop(self, crash: bool = False) -> None:
        """Shut the server down (``crash``: SIGKILL, no graceful end of the requests in flight)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, 9 if crash else 15)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait()

    def log_tail(self) -> str:
        path = self.folder / "server.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def client(self, code: str, **env: str) -> object:
        """Run ``code`` in the MLflow environment with ``client = MlflowClient(<this server>)`` and the JSON helper
        ``emit(value)``; returns what it emitted."""
        script = "import json, mlflow\nfrom mlflow import MlflowClient\n" \
                 f"mlflow.set_tracking_uri({self.uri!r})\nclient = MlflowClient()\n" \
                 "def emit(value):\n    print('RESULT ' + json.dumps(value, default=str))\n" + textwrap.dedent(code)
        done = subprocess.run([str(MLFLOW_PYTHON), "-c", script], capture_output=True, text=True, timeout=300,
                              env={**self.env, **env}, cwd=self.folder)
        if done.returncode != 0:
            raise AssertionError(f"MLflow client code failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        return json.loads(lines[-1][len("RESULT "):]) if lines else None
