"""Model version ids: the hash of a model file's bytes, so a registered version can be checked against its file.

No torch here: the registry runs inside the Airflow task process.
"""

from __future__ import annotations

import hashlib
import re

from stagewise.core.errors import DataError

VERSION_PATTERN = r"m-[0-9a-f]{12}"
# A registered model's file: models/<name>/<version>/model.pt (stagewise.registry's layout).
_REGISTERED_FILE = re.compile(rf"/({VERSION_PATTERN})/model\.pt$")


def version_of(data: bytes) -> str:
    """The version id of a model file's bytes (the registry's id: registering the same bytes again is a no-op)."""
    return "m-" + hashlib.sha256(data).hexdigest()[:12]


def check_registered(uri: str, data: bytes) -> str:
    """The version of ``data`` read from ``uri``; a DataError when ``uri`` is a registered version's file whose bytes
    no longer hash to that version (cut, corrupted or replaced after it was registered)."""
    version = version_of(data)
    registered = _REGISTERED_FILE.search(uri)
    if registered and registered.group(1) != version:
        raise DataError(f"{uri}: its {len(data)} bytes hash to {version}, not to its registered version "
                        f"{registered.group(1)}: the file was cut, corrupted or replaced after registration; roll back "
                        f"(python -m stagewise.registry rollback) or register the model again")
    return version
