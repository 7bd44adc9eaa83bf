"""What a registered model carries so it loads wherever it goes: its spec's own source and the ranges it needs.

Run: nothing to run; both registries call :func:`spec_code` and :func:`requirements` when they register a version
(the storage registry writes the files under ``models/<name>/<version>/code/``, the MLflow one under the artifact's
``code/``, which the MLmodel names as the pyfunc flavor's ``code``: mlflow.pyfunc puts it on ``sys.path`` before it
imports the loader), and :func:`make_importable` puts a registered storage version's ``code/`` on the path when its
spec module is not importable here.

What is shipped: the spec's top-level module file, or the whole top-level package folder's ``.py`` files when the spec
lives in a package, plus the modules and packages beside it that the spec's module imports (a helper in the same
folder) and that those import in turn; nothing for a spec of Stagewise's own (it is a requirement) or of an installed
distribution (named as a requirement instead). More than :data:`MAX_FILES` files or :data:`MAX_BYTES` bytes is
refused: a spec folder that large is a repository, not a module.
"""

from __future__ import annotations

import ast
import atexit
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from stagewise.core import storage
from stagewise.core.errors import DataError, UserError
from stagewise.definitions.spec_source import local_module_file
from stagewise.models.versions import CARD_CHECKSUM

log = logging.getLogger("stagewise.registry")

CODE_FOLDER = "code"
CARD_KEY = "spec_source"
OWN_PACKAGE = "stagewise"
MAX_FILES = 500
MAX_BYTES = 5 * 2**20
# What the pyfunc loader imports beside stagewise and torch (stagewise.models.mlflow_pyfunc, stagewise.models.bundle).
RUNTIME_LIBRARIES = ("pyarrow", "pandas", "numpy", "pyyaml", "fsspec", "pydantic")
_SKIPPED_FOLDERS = ("__pycache__",)


@dataclass(frozen=True, kw_only=True)
class SpecCode:
    """The spec's source a version carries, and what the serving environment installs instead of what is not shipped."""

    spec: str
    """The spec's ``module:Class``."""
    files: dict[str, bytes] = field(default_factory=dict)
    """Path under the code folder (``tscnn.py``, ``team/specs/__init__.py``) -> its bytes."""
    origins: dict[str, str] = field(default_factory=dict)
    """Path under the code folder -> the file it was read from."""
    requirements: list[str] = field(default_factory=list)
    """An installed distribution the spec comes from, as a range (never shipped as source)."""

    def card_entry(self) -> dict[str, Any]:
        """The card's ``spec_source``: the folder and each shipped file's path and sha256."""
        return {"spec": self.spec, "folder": CODE_FOLDER if self.files else None,
                "files": [{"path": path, "sha256": hashlib.sha256(data).hexdigest()} for path, data in self.files.items()],
                **({"requirements": self.requirements} if self.requirements else {})}


def _installed(path: Path) -> bool:
    folders = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    return any(path.resolve().is_relative_to(Path(folder).resolve()) for folder in folders)


def _locate(top: str, search: Sequence[str]) -> tuple[Path, Path] | None:
    """(the folder that holds top-level module ``top``, its file or package folder) as the import system finds it:
    under ``search`` (model.import_paths) first; None for a module with no Python source (built in, compiled)."""
    for folder in search:
        base = Path(folder)
        if (base / top / "__init__.py").is_file():
            return base, base / top
        if (base / f"{top}.py").is_file():
            return base, base / f"{top}.py"
    try:
        found = importlib.util.find_spec(top)  # a top-level name: finding it runs no code of its
    except (ImportError, ValueError):
        found = None
    if found is None:
        raise UserError(f"model.spec '{top}': no module '{top}' in model.import_paths {list(search)} nor installed: "
                        f"the model's spec cannot be shipped with it")
    if found.submodule_search_locations:  # a package, or a namespace package's first folder
        package = Path(next(iter(found.submodule_search_locations)))
        return package.parent, package
    if found.origin and found.origin.endswith(".py") and Path(found.origin).is_file():
        return Path(found.origin).parent, Path(found.origin)
    return None


def _python_files(entry: Path) -> Iterator[Path]:
    """``entry`` itself, or a package folder's .py files, lazily: a folder past the limits is refused before it is walked."""
    if entry.is_file():
        yield entry
        return
    for folder, subfolders, names in os.walk(entry):
        subfolders[:] = sorted(name for name in subfolders if name not in _SKIPPED_FOLDERS and not name.startswith("."))
        yield from (Path(folder) / name for name in sorted(names) if name.endswith(".py"))


def _imported_tops(source: bytes, path: Path) -> set[str]:
    """The top-level names ``source`` imports absolutely (inside functions too); an unparsable file names none."""
    try:
        tree = ast.parse(source, str(path))
    except (SyntaxError, ValueError):
        return set()
    names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and not node.level and node.module}
    return {name.partition(".")[0] for name in names}


def _refuse_large(spec: str, where: Path, files: int, size: int) -> None:
    if files > MAX_FILES or size > MAX_BYTES:
        raise UserError(f"model.spec '{spec}': shipping its source with the model means {where} ({files} .py files, "
                        f"{size / 2**20:.1f} MiB), more than {MAX_FILES} files or {MAX_BYTES // 2**20} MiB: move the "
                        f"spec into a small module or package of its own, or install it as a distribution")


def spec_code(spec: str, search: Sequence[str]) -> SpecCode:
    """The source files of the spec at ``module:Class`` a model carries (module docstring), found under ``search``
    (model.import_paths) or where the import system finds them."""
    top = spec.partition(":")[0].partition(".")[0]
    if top == OWN_PACKAGE:
        return SpecCode(spec=spec)
    located = _locate(top, search)
    if located is None:
        log.warning("model.spec '%s': module '%s' has no Python source to ship: the serving environment must have it", spec, top)
        return SpecCode(spec=spec)
    root, entry = located
    if _installed(entry):
        from importlib.metadata import packages_distributions

        dists = packages_distributions().get(top) or []
        if dists:
            return SpecCode(spec=spec, requirements=[major_range(dists[0])])
    files: dict[str, bytes] = {}
    origins: dict[str, str] = {}
    # (what ships, the file whose imports are followed): the spec's module leads, then each helper beside it it imports.
    pending = [(entry, local_module_file(spec.partition(":")[0], [str(root)]) or entry)]
    seen = {top, OWN_PACKAGE}
    while pending:
        shipped, lead = pending.pop(0)
        for path in _python_files(shipped):
            relative = path.relative_to(root).as_posix()
            files[relative] = path.read_bytes()
            origins[relative] = str(path.resolve())
            _refuse_large(spec, shipped, len(files), sum(map(len, files.values())))
        if _installed(entry):
            continue  # site-packages' neighbours are other distributions, never the spec's helpers
        for name in sorted(_imported_tops(lead.read_bytes(), lead) - seen):
            seen.add(name)
            if (root / name / "__init__.py").is_file():
                pending.append((root / name, root / name / "__init__.py"))
            elif (root / f"{name}.py").is_file():
                pending.append((root / f"{name}.py", root / f"{name}.py"))
    return SpecCode(spec=spec, files=dict(sorted(files.items())), origins=origins)


def changed_since_start(code: SpecCode, fingerprints: dict[str, str] | None) -> list[str]:
    """The shipped files whose bytes differ from what the run started with (the card's ``source_fingerprints``)."""
    fingerprints = fingerprints or {}
    return [relative for relative, data in code.files.items()
            if code.origins.get(relative) in fingerprints
            and fingerprints[code.origins[relative]] != hashlib.sha256(data).hexdigest()]


def major_range(dist: str) -> str:
    """``dist`` from the major.minor installed here to the next major (``torch>=2.13,<3``); bare when not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version(dist).split("+")[0].split(".")
    except PackageNotFoundError:
        return dist
    major, minor = int(found[0]), found[1] if len(found) > 1 else "0"
    return f"{dist}>={major}.{minor},<{major + 1}"


def _normalized(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def requirements(extra: Sequence[str] = ()) -> list[str]:
    """A version's requirements.txt: stagewise and torch as :func:`major_range` (the loader and the weights' format),
    the libraries the loader imports as the ranges stagewise itself declares, then ``extra``."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import requires as declared_by

    try:
        declared = [line for line in declared_by(OWN_PACKAGE) or [] if ";" not in line]  # extras are not the loader's
    except PackageNotFoundError:
        declared = []
    ranges = {}
    for line in declared:
        name = line.split("<")[0].split(">")[0].split("=")[0].split("!")[0].split("~")[0].split("[")[0].strip()
        ranges[_normalized(name)] = line.replace(" ", "")
    # A pin of this machine's versions would warn against a serving environment one patch release away.
    libraries = [ranges.get(_normalized(name), name) for name in RUNTIME_LIBRARIES]
    return [major_range(OWN_PACKAGE), major_range("torch"), *libraries, *extra]


# Versions whose code folder this process already put on its path: loading one again adds nothing.
_IMPORTABLE: dict[str, str] = {}


def _safe_relative(path: str, card_uri: str) -> str:
    parts = PurePosixPath(path).parts
    if not path.endswith(".py") or PurePosixPath(path).is_absolute() or any(part in ("", ".", "..") for part in parts):
        raise DataError(f"{card_uri}: {CARD_KEY} names {path!r}, which is no path of a .py file under {CODE_FOLDER}/")
    return path


def _verified_card(folder: str) -> dict[str, Any] | None:
    card_uri, checksum_uri = storage.join(folder, "card.json"), storage.join(folder, CARD_CHECKSUM)
    if not storage.exists(card_uri):
        return None
    data = storage.read_bytes(card_uri)
    if storage.exists(checksum_uri) and storage.read_bytes(checksum_uri).decode(errors="replace").strip() \
            != hashlib.sha256(data).hexdigest():
        raise DataError(f"{card_uri}: the card was changed after its version was registered: the spec source it lists "
                        f"cannot be trusted; restore the card or register the model again")
    return storage.parse_json(card_uri, data)


def make_importable(bundle_uri: str, spec: str) -> None:
    """Put the code folder of the registered version at ``bundle_uri`` on this process's path, each file checked
    against its card's sha256 first, when the spec's module is not importable here; nothing otherwise."""
    top = spec.partition(":")[0].partition(".")[0]
    try:
        if not top or importlib.util.find_spec(top) is not None:
            return
    except (ImportError, ValueError):
        return
    folder = bundle_uri.rstrip("/").rsplit("/", 1)[0]
    if folder in _IMPORTABLE:
        return
    card = _verified_card(folder)
    listed = (card or {}).get(CARD_KEY) or {}
    if not listed.get("files"):
        return  # a version registered before code shipping, or a spec that is installed: the import names the module
    local = Path(tempfile.mkdtemp(prefix="stagewise-code-"))
    atexit.register(shutil.rmtree, local, ignore_errors=True)
    card_uri = storage.join(folder, "card.json")
    for entry in listed["files"]:
        relative = _safe_relative(str(entry["path"]), card_uri)
        uri = storage.join(folder, listed.get("folder") or CODE_FOLDER, relative)
        data = storage.read_bytes(uri)
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise DataError(f"{uri}: its bytes do not match the sha256 its card recorded: the shipped spec source was "
                            f"replaced after registration; restore it or register the model again")
        target = local / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)  # a verified copy: what runs is what the card lists, even on S3
    sys.path.insert(0, str(local))
    importlib.invalidate_caches()
    _IMPORTABLE[folder] = str(local)
    log.info("model.spec '%s': module '%s' is not importable here; using the source shipped with %s", spec, top, folder)
