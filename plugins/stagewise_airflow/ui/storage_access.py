"""Each pipeline's own storage, read through its connection, every storage at once within a deadline.

Run: imported by the pages (``stagewise.airflow.ui``). A storage that fails or is slow becomes a StorageProblem naming
its pipelines and the cause, never a path; the details go to the api-server's log.
"""

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import HTTPException

from stagewise.airflow.credentials import StorageConnectionError, storage_options
from stagewise.airflow.ui.layout import esc
from stagewise.airflow.ui.pipelines import Pipeline
from stagewise.core import storage

log = logging.getLogger("stagewise.ui")

T = TypeVar("T")

# What one page waits for a pipeline's storage; a read still running then goes on in the background, bounded by
# botocore's own timeouts (STORAGE_CLIENT_CONFIG), and its rows show the error.
STORAGE_DEADLINE_S = 5.0
STORAGE_CLIENT_CONFIG = {"connect_timeout": 2, "read_timeout": 3, "retries": {"mode": "standard", "max_attempts": 2}}


@dataclass(frozen=True)
class Storage:
    """One storage root as the pipelines writing there reach it: with their connection (two may share a root)."""

    root: str
    conn_id: str
    names: tuple[str, ...]

    def label(self) -> str:
        return f"pipeline{'s' if len(self.names) > 1 else ''} {', '.join(self.names)}"


class StorageProblem(Exception):
    """A storage that did not answer, or not in time: its message names the pipelines and the cause, never a path."""


def storages(found: dict[str, Pipeline]) -> list[Storage]:
    """Each (storage root, connection) the pipelines use, with the names of the pipelines using it."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for name, pipeline in sorted(found.items()):
        grouped.setdefault((pipeline.config.storage_root, pipeline.config.storage_conn_id), []).append(name)
    return [Storage(root, conn_id, tuple(names)) for (root, conn_id), names in grouped.items()]


def _read_as(place: Storage, read: Callable[[Storage], T]) -> T:
    """``read(place)`` with the place's own connection: s3fs arguments scoped to this call, never the environment."""
    options: dict[str, Any] = {}
    if "://" in place.root and not place.root.startswith("file://"):
        options = {**storage_options(place.conn_id), "config_kwargs": STORAGE_CLIENT_CONFIG}
    with storage.using_options(options):
        return read(place)


def read_each(places: Iterable[Storage], read: Callable[[Storage], T],
              deadline_s: float | None = None) -> dict[Storage, T | StorageProblem]:
    """``read(place)`` for every place at once, each with its own connection; what fails or is still running at the
    deadline is a StorageProblem naming its pipelines and the cause (the details go to the api-server's log)."""
    deadline_s = STORAGE_DEADLINE_S if deadline_s is None else deadline_s
    boxes: dict[Storage, dict[str, Any]] = {}
    threads = []
    for place in places:
        box = boxes[place] = {}

        def run(place: Storage = place, box: dict[str, Any] = box) -> None:
            try:
                box["value"] = _read_as(place, read)
            except BaseException as exc:  # noqa: BLE001 - whatever it is, it is this storage's error alone
                box["error"] = exc

        thread = threading.Thread(target=run, name=f"stagewise-ui-storage-{len(threads)}", daemon=True)
        thread.start()
        threads.append(thread)
    end = time.monotonic() + deadline_s
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()))
    results: dict[Storage, T | StorageProblem] = {}
    for place, box in boxes.items():
        if "value" in box:
            results[place] = box["value"]
        elif "error" in box:
            results[place] = _problem(place, box["error"])
        else:
            log.warning("%s: storage %s gave no answer within %g s", place.label(), place.root, deadline_s)
            results[place] = StorageProblem(f"{place.label()}: storage unreachable: no answer within {deadline_s:g} s")
    return results


def _problem(place: Storage, error: BaseException) -> StorageProblem:
    log.warning("%s: storage %s cannot be read: %s: %s", place.label(), place.root, type(error).__name__, error)
    if isinstance(error, StorageConnectionError):
        return StorageProblem(f"{place.label()}: {error}")
    return StorageProblem(f"{place.label()}: storage unreachable: {type(error).__name__}")


def path_segment(value: str, what: str) -> str:
    """``value`` as one folder name under the storage root; refuses anything that could leave its folder."""
    if not value or value in (".", "..") or any(char in value for char in "/\\\0"):
        raise HTTPException(400, f"{what} {value!r} is not a valid id (no '/', '\\', or '.'/'..')")
    return storage.safe_name(value)  # a folder name maps to itself, an Airflow run id to its folder


def storage_error(place: Storage, problem: StorageProblem) -> str:
    """A storage's error in place of what it holds, marked with its pipelines' names."""
    return (f"<span class='badge err' data-stagewise-storage-error='{esc(', '.join(place.names))}'>storage error</span> "
            f"{esc(problem)}")
