"""Files a run dropped on purpose once it succeeded, told apart from files that are lost.

Nothing to run: stagewise.reuse.leftovers writes each folder's ``dropped.json`` (what went) before it removes anything;
the readers of what may have gone (a stage's hand-off, a preprocess manifest's split data, an optimizer checkpoint)
ask :func:`was_dropped` so a task cleared alone after the drop says what went instead of failing on a missing file.
"""

from __future__ import annotations

import posixpath

from stagewise.core import storage
from stagewise.core.errors import DataError

RECORD = "dropped.json"


def was_dropped(uri: str) -> bool:
    """Whether the file or folder at ``uri`` was dropped on purpose after its run succeeded (gone, and listed by the
    record of its folder or the one above), rather than lost."""
    if storage.exists(uri):
        return False
    wanted = storage.filesystem(uri)[1].rstrip("/")
    folder = posixpath.dirname(uri.rstrip("/"))
    for record_uri in (storage.join(folder, RECORD), storage.join(posixpath.dirname(folder), RECORD)):
        if storage.exists(record_uri) and any(storage.filesystem(entry["uri"])[1].rstrip("/") == wanted
                                              for entry in storage.read_json(record_uri).get("files", [])):
            return True
    return False


def refuse_dropped(uri: str, what: str) -> None:
    """A DataError naming why ``uri`` (``what`` the task reads) is gone, when it was dropped after its run succeeded."""
    if was_dropped(uri):
        raise DataError(f"{what} {uri} was dropped once its run succeeded (retention.drop_after_success): clear the "
                        f"run's tasks from preprocess on (or start a new run) rather than this task alone")
