"""What code a run started with: the Stagewise version and a fingerprint of the team's own source, read at its start.

Run: nothing to run; ``start_run`` writes ``runs/<dag_id>/<run_id>/lineage.json`` (before ``config.yaml``, the run's
commit) and the registry's model card copies it (stagewise.registry.model_card), so a model trained by one version and
registered after an upgrade, or after its spec was edited, still names the code that trained it.

The fingerprint covers the user's source as the run's processes import it: the spec module (``model.spec``, found
under ``model.import_paths``), every entrypoint's script or module (``sweep.entrypoint``, each stage's), and the modules
of theirs each imports from those folders (a helper beside the spec). Stagewise's own modules are named by the version.
"""

from __future__ import annotations

import ast
import datetime as dt
import hashlib
import json
import logging
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stagewise.core import storage
from stagewise.core.errors import DataError
from stagewise.definitions.config import PipelineConfig
from stagewise.definitions.loading import CHECKOUT_ROOT
from stagewise.definitions.spec_source import local_module_file, module_file

log = logging.getLogger("stagewise.lineage")
LINEAGE_FILE = "lineage.json"
OWN_PACKAGE = "stagewise"
MAX_SOURCE_FILES = 200  # a spec folder that imports half a repository still starts its run in well under a second


def stagewise_version() -> str:
    """The installed Stagewise's version, read when asked (never at import: an in-place upgrade removes the metadata a
    long-running process found first); "unknown" when the metadata cannot be read."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(OWN_PACKAGE)
    except (PackageNotFoundError, OSError):  # OSError: importlib_metadata's MetadataNotFound (a removed dist-info)
        return "unknown"


def code_version() -> str:
    """The code that trains: the git commit of a checkout, else the installed package's version."""
    if CHECKOUT_ROOT is None:
        found = stagewise_version()
        return "unknown" if found == "unknown" else f"{OWN_PACKAGE} {found}"
    try:
        return subprocess.run(["git", "-C", str(CHECKOUT_ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _own(module: str) -> bool:
    return module.partition(".")[0] == OWN_PACKAGE


def _module_name(path: Path, search: Sequence[str]) -> str | None:
    """The dotted name ``path`` imports as from one of ``search``; None outside them."""
    for folder in search:
        try:
            parts = path.resolve().relative_to(Path(folder).resolve()).with_suffix("").parts
        except ValueError:
            continue
        return ".".join(parts[:-1] if parts and parts[-1] == "__init__" else parts)
    return None


def _imported(path: Path, search: Sequence[str]) -> set[str]:
    """The modules ``path`` imports (inside functions too), absolute; an unparsable file imports nothing we can name."""
    try:
        tree = ast.parse(path.read_text(), str(path))
    except (OSError, SyntaxError, ValueError):
        return set()
    own_name = _module_name(path, search)
    package = (own_name or "").split(".") if path.name == "__init__.py" else (own_name or "").split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if own_name is None or node.level > len(package):  # beyond the top package: not importable
                    continue
                base = ".".join(package[:len(package) - node.level + 1])
                module = ".".join(part for part in (base, node.module or "") if part)
            else:
                module = node.module or ""
            names = [module, *(f"{module}.{alias.name}" for alias in node.names if module)]
        else:
            continue
        for name in names:  # `import a.b.c` runs a, a.b and a.b.c
            parts = name.split(".")
            found.update(".".join(parts[:end]) for end in range(1, len(parts) + 1) if parts[0])
    return found


def source_files(config: PipelineConfig) -> list[Path]:
    """The user's source files a run of ``config`` imports or runs: the spec module, each entrypoint's script or
    module, and every module of theirs those import from ``model.import_paths`` (or a script's own folder)."""
    import_paths = list(config.model.import_paths or ())
    roots: list[tuple[Path, list[str]]] = []
    spec_module = config.model.spec.partition(":")[0]
    if not _own(spec_module) and (spec_file := module_file(spec_module, import_paths)) is not None:
        roots.append((spec_file, import_paths))
    entries = [config.sweep.entrypoint, *(stage.entrypoint for stage in config.train.stages)]
    for entry in (entry for entry in entries if entry is not None):
        if entry.script:
            script = Path(entry.script)
            roots.append((script, [str(script.parent), *import_paths]))
        elif entry.module and not _own(entry.module) and (found := module_file(entry.module, import_paths)) is not None:
            roots.append((found, import_paths))
    seen: dict[Path, None] = {}
    pending = [(path.resolve(), search) for path, search in roots]
    while pending and len(seen) < MAX_SOURCE_FILES:
        path, search = pending.pop(0)
        if path in seen or not path.is_file():
            continue
        seen[path] = None
        for module in sorted(_imported(path, search)):
            if not _own(module) and (found := local_module_file(module, search)) is not None:
                pending.append((found.resolve(), search))
    return list(seen)


def fingerprints(config: PipelineConfig) -> dict[str, str]:
    """``{path: sha256 of its bytes}`` of :func:`source_files`, sorted by path."""
    found = {}
    for path in source_files(config):
        try:
            found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as exc:  # gone between listing and reading: the run's own processes will say so
            log.warning("cannot fingerprint %s: %s", path, exc)
    return dict(sorted(found.items()))


def combined(found: dict[str, str]) -> str:
    """One short hash of every fingerprint (paths included): equal exactly when the recorded sources are."""
    return hashlib.sha256(json.dumps(found, sort_keys=True).encode()).hexdigest()[:16]


def record(config: PipelineConfig) -> dict[str, Any]:
    """What lineage.json holds: the versions and fingerprints of the code a run of ``config`` starts with now."""
    found = fingerprints(config)
    return {"stagewise_version": stagewise_version(), "code_version": code_version(), "source_fingerprints": found,
            "source_fingerprint": combined(found)}


def lineage_uri(out: str) -> str:
    return storage.join(out, LINEAGE_FILE)


def write(out: str, config: PipelineConfig) -> dict[str, Any]:
    """Record the run's lineage under its folder ``out`` (one file, written whole: readers see all of it or none), with
    ``started_at``: the run's start, which dates it wherever it has no report yet (stagewise.reporting.run_dates)."""
    recorded = {**record(config), "started_at": dt.datetime.now(dt.UTC).isoformat()}
    storage.write_json(lineage_uri(out), recorded)
    return recorded


def read(out: str) -> dict[str, Any] | None:
    """The lineage start_run recorded for the run at ``out``; None for a run that began before runs recorded it.
    A torn file, or one that holds something else, is a DataError naming it (storage.read_json names a torn one)."""
    uri = lineage_uri(out)
    if not storage.exists(uri):
        return None
    recorded = storage.read_json(uri)
    found = recorded.get("source_fingerprints") if isinstance(recorded, dict) else None
    if not isinstance(recorded, dict) or not isinstance(found, dict | None) or not all(
            isinstance(path, str) and isinstance(digest, str) for path, digest in (found or {}).items()):
        held = type(recorded).__name__ if not isinstance(recorded, dict) else f"source_fingerprints of type {type(found).__name__}"
        raise DataError(f"{uri}: is not a run's lineage record (a JSON object whose source_fingerprints map each path "
                        f"to its sha256; this holds a {held}): the file was edited or replaced; restore or remove it")
    return recorded


def for_card(out: str | None) -> dict[str, Any]:
    """The model card's lineage fields: the run's recorded lineage (``lineage_uri`` names it), else, for a run that
    recorded none, this process's versions and no fingerprints (``lineage_uri`` None says the values are not the run's)."""
    recorded = read(out) if out else None
    if recorded is None:
        if out:
            log.warning("%s has no %s (the run began before runs recorded their code): the card names the code "
                        "registering it", out, LINEAGE_FILE)
        return {"stagewise_version": stagewise_version(), "code_version": code_version(), "source_fingerprints": {},
                "source_fingerprint": None, "lineage_uri": None}
    keys = ("stagewise_version", "code_version", "source_fingerprints", "source_fingerprint")
    return {**{key: recorded.get(key) for key in keys}, "lineage_uri": lineage_uri(out)}
