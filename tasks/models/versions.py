"""Model version ids: the hash of a model file's bytes, so a registered version can be checked against its file.

No torch here: the registry runs inside the Airflow task process.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from stagewise.core.errors import DataError, UserError

VERSION_PATTERN = r"m-[0-9a-f]{12}"
# A registered model's file: models/<name>/<version>/model.pt (stagewise.registry's layout).
_REGISTERED_FILE = re.compile(rf"/({VERSION_PATTERN})/model\.pt$")
CARD_CHECKSUM = "card.json.sha256"
"""Beside a registered version's card: the SHA-256 of its bytes as registered (versions registered before have none)."""


def version_of(data: bytes) -> str:
    """The version id of a model file's bytes (the registry's id: registering the same bytes again is a no-op)."""
    return "m-" + hashlib.sha256(data).hexdigest()[:12]


def registered_file(uri: str) -> bool:
    """Whether ``uri`` names a registered version's model file (its bytes are checked against the version)."""
    return _REGISTERED_FILE.search(uri) is not None


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


def judge(candidate: dict[str, Any], incumbent_version: str | None, incumbent: dict[str, Any] | None, metric: str,
          margin: float, direction: str, promote_hint: str) -> dict[str, Any]:
    """The gate's decision on ``candidate``'s card against the incumbent's (None: no current model), for either
    registry: promoted only when it beats the incumbent's ``metric`` by more than ``margin`` in ``direction``."""
    if incumbent_version is None:
        return {"promoted": True, "reason": "no current model"}
    if incumbent_version == candidate["version"] or incumbent is None:
        return {"promoted": False, "reason": "nothing changed; current model kept (this version is already current)"}
    if metric not in incumbent:
        raise UserError(f"current model {incumbent_version} has no metric '{metric}' to compare with: it was trained "
                        f"for another objective; promote explicitly ({promote_hint})")
    minimize = direction == "minimize"
    better = candidate[metric] < incumbent[metric] - margin if minimize else candidate[metric] > incumbent[metric] + margin
    relation = ("<" if better else ">=") if minimize else (">" if better else "<=")
    return {"promoted": better, "reason": f"{metric} {candidate[metric]:.4f} {relation} current "
                                          f"{incumbent[metric]:.4f} {'-' if minimize else '+'} margin {margin}",
            "previous": incumbent_version, "incumbent_value": incumbent[metric]}
