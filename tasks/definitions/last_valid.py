"""The last valid config of every pipeline, kept so a broken, clashing or deleted file never ends a running run.

A DAG file rebuilds its pipelines at every parse, and with Airflow's dags-folder bundle a run follows the latest
parse: a pipeline whose file stops loading would lose its tasks mid-run. So each parse that loads a pipeline records
its resolved config here, and a parse that cannot load it builds the DAGs from this record instead (and names the
error as an import error, :func:`stagewise.airflow.dags.check_pipelines`).

Where: ``$STAGEWISE_STATE_DIR``, else ``$AIRFLOW_HOME/stagewise`` (``~/airflow/stagewise`` without it); one folder
per pipelines setting (the hash of its sources as configured: made absolute, never resolved through a symlink, so a
git-sync revision swap keeps the records), one JSON file per pipeline name. Workers on other hosts need the same folder
(a shared volume) to run a broken pipeline's in-flight tasks; without it they fail that task naming the config error.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATE_ENV_VAR = "STAGEWISE_STATE_DIR"


def state_dir() -> Path:
    """The folder that holds the last valid configs (see the module doc)."""
    if chosen := os.environ.get(STATE_ENV_VAR, "").strip():
        return Path(chosen).expanduser()
    home = os.environ.get("AIRFLOW_HOME", "").strip() or "~/airflow"
    return Path(home).expanduser() / "stagewise"


@dataclass(frozen=True)
class Record:
    """One pipeline's last valid config: the file it came from and its resolved values."""

    name: str
    path: str
    config: dict[str, Any]

    @property
    def registry_key(self) -> tuple[str, str]:
        """(storage root, registry model name): what two pipelines may not share."""
        return str(self.config.get("storage_root", "")).rstrip("/"), str(self.config.get("registry", {}).get("model_name"))


class LastValid:
    """The records of one pipelines setting (the folders and files a DAG file names, as it names them)."""

    def __init__(self, sources: list[Path], root: Path | None = None):
        key = hashlib.sha256(os.pathsep.join(str(source) for source in sources).encode()).hexdigest()[:16]
        self.folder = (root or state_dir()) / "last-valid" / key

    def _file(self, name: str) -> Path:
        return self.folder / f"{name}.json"

    def get(self, name: str) -> Record | None:
        try:
            raw = json.loads(self._file(name).read_text())
            return Record(raw["name"], raw["path"], raw["config"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def all(self) -> dict[str, Record]:
        if not self.folder.is_dir():
            return {}
        records = (self.get(path.stem) for path in sorted(self.folder.glob("*.json")))
        return {record.name: record for record in records if record is not None}

    def save(self, name: str, path: Path | str, config: dict[str, Any]) -> None:
        """Record ``config`` unless the same is recorded already (a parse writes only what changed), atomically."""
        text = json.dumps({"name": name, "path": str(path), "config": config}, sort_keys=True)
        target = self._file(name)
        try:
            if target.is_file() and target.read_text() == text:
                return
            self.folder.mkdir(parents=True, exist_ok=True)
            partial = target.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(text)
            os.replace(partial, target)
        except OSError:
            pass  # a read-only state folder costs the fallback, never the parse

    def forget(self, name: str) -> bool:
        """Drop a retired pipeline's record (its DAGs go when the DAG file next parses); whether there was one."""
        try:
            self._file(name).unlink()
            return True
        except FileNotFoundError:
            return False
