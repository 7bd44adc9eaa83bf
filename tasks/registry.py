"""Model registry on the storage root: versioned folders and a ``current`` pointer moved by a gate.

Run: ``python -m tasks.registry list``            versions, newest first, the current one marked
     ``python -m tasks.registry show [VERSION]``  one version's card (default: current)
     ``python -m tasks.registry rollback``        point ``current`` back at the previous version
     ``python -m tasks.registry promote VERSION`` point ``current`` at VERSION (no gate)

Layout: ``models/<version>/model.pt`` and ``card.json`` (metrics, params, data fingerprint, code
version, source run); ``models/current.json`` names the current version and keeps the history of
promotions. A version id is the hash of the model's bytes, so registering the same model again is a
no-op. The pointer file is replaced in one atomic write (rename locally, one PUT on S3).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
import subprocess
import time
from typing import Any

from tasks import storage
from tasks.cli import common_parser, parse_overrides, setup_logging
from tasks.config import load_config
from tasks.errors import UserError

log = logging.getLogger("stagewise.registry")


def models_prefix(storage_root: str) -> str:
    return storage.join(storage_root, "models")


def pointer_uri(storage_root: str) -> str:
    return storage.join(models_prefix(storage_root), "current.json")


def code_version() -> str:
    """The git commit of the code that trained the model, when it runs from a checkout."""
    from tasks.config import REPO_ROOT

    try:
        return subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def data_fingerprint(manifest_uri: str) -> str:
    """A hash of the committed preprocess manifest: which files, rows and statistics trained the model."""
    fs, path = storage.filesystem(manifest_uri)
    with fs.open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()[:16]


def register(storage_root: str, model_uri: str, card: dict[str, Any]) -> dict[str, Any]:
    """Copy the model into ``models/<version>/`` with its card; idempotent per model bytes."""
    fs, path = storage.filesystem(model_uri)
    with fs.open(path, "rb") as handle:
        data = handle.read()
    version = "m-" + hashlib.sha256(data).hexdigest()[:12]  # tasks.infer.model_version gives the same id
    nonfinite = {key: value for key, value in card.items() if isinstance(value, float) and not math.isfinite(value)}
    if nonfinite:
        raise UserError(f"refusing to register {model_uri} (version {version}): its metric(s) {nonfinite} are not finite; "
                        f"a model whose training or evaluation diverged is never registered")
    folder = storage.join(models_prefix(storage_root), version)
    card_uri = storage.join(folder, "card.json")
    if storage.exists(card_uri):
        log.info("model %s is already registered", version)
        return storage.read_json(card_uri)
    storage.write_bytes(storage.join(folder, "model.pt"), data)
    full_card = {**card, "version": version, "model_uri": storage.join(folder, "model.pt"),
                 "registered_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    storage.write_json(card_uri, full_card)  # the card, written last, is what makes a version exist
    log.info("registered model %s (%s)", version, {k: v for k, v in card.items() if k.startswith("test_") or k == "source_run"})
    return full_card


def pointer(storage_root: str) -> dict[str, Any]:
    uri = pointer_uri(storage_root)
    return storage.read_json(uri) if storage.exists(uri) else {"version": None, "history": []}


def card(storage_root: str, version: str) -> dict[str, Any]:
    uri = storage.join(models_prefix(storage_root), version, "card.json")
    if not storage.exists(uri):
        raise UserError(f"model version '{version}' is not registered under {models_prefix(storage_root)}")
    return storage.read_json(uri)


def current(storage_root: str) -> dict[str, Any] | None:
    """The current version's card, or None before the first promotion."""
    version = pointer(storage_root)["version"]
    return card(storage_root, version) if version else None


def _move_pointer(storage_root: str, version: str | None, history: list[str], reason: str) -> dict[str, Any]:
    state = {"version": version, "history": history, "reason": reason,
             "moved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    storage.write_json(pointer_uri(storage_root), state)
    return state


def promote(storage_root: str, version: str, reason: str = "manual") -> dict[str, Any]:
    card(storage_root, version)  # must exist
    state = pointer(storage_root)
    if state["version"] == version:
        return state
    history = [*state["history"], state["version"]] if state["version"] else list(state["history"])
    log.info("current model: %s -> %s (%s)", state["version"], version, reason)
    return _move_pointer(storage_root, version, history, reason)


def gate(storage_root: str, version: str, metric: str, margin: float, direction: str = "maximize") -> dict[str, Any]:
    """Promote ``version`` only if it beats the current model's ``metric`` by ``margin`` in ``direction`` (or none is current)."""
    candidate = card(storage_root, version)
    if metric not in candidate:
        raise UserError(f"model {version} has no metric '{metric}' (registry.gate_metric) in its card")
    incumbent = current(storage_root)
    if incumbent is None:
        decision = {"promoted": True, "reason": "no current model"}
    elif incumbent["version"] == version:
        decision = {"promoted": False, "reason": "already current"}
    else:
        if metric not in incumbent:
            raise UserError(f"current model {incumbent['version']} has no metric '{metric}' to compare with: it was "
                            f"trained for another objective; promote explicitly (python -m tasks.registry promote {version})")
        minimize = direction == "minimize"
        better = candidate[metric] < incumbent[metric] - margin if minimize else candidate[metric] > incumbent[metric] + margin
        relation = ("<" if better else ">=") if minimize else (">" if better else "<=")
        decision = {"promoted": better, "reason": f"{metric} {candidate[metric]:.4f} {relation} current "
                                                  f"{incumbent[metric]:.4f} {'-' if minimize else '+'} margin {margin}"}
        decision["previous"] = incumbent["version"]
    if decision["promoted"]:
        promote(storage_root, version, reason=f"gate: {decision['reason']}")
    log.info("gate for %s: %s (%s)", version, "promoted" if decision["promoted"] else "refused", decision["reason"])
    return {"version": version, "current": pointer(storage_root)["version"], **decision}


def rollback(storage_root: str) -> dict[str, Any]:
    """Point ``current`` back at the version before it."""
    state = pointer(storage_root)
    if not state["history"]:
        raise UserError(f"nothing to roll back to: {pointer_uri(storage_root)} has no earlier version")
    *earlier, previous = state["history"]
    log.info("rollback: current model %s -> %s", state["version"], previous)
    return _move_pointer(storage_root, previous, earlier, f"rollback from {state['version']}")


def versions(storage_root: str) -> list[dict[str, Any]]:
    fs, path = storage.filesystem(models_prefix(storage_root))
    if not fs.isdir(path):
        return []
    cards = [storage.read_json(fs.unstrip_protocol(p) if "://" in storage_root else p) for p in fs.glob(path + "/*/card.json")]
    return sorted(cards, key=lambda c: c["registered_at"], reverse=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="The model registry.")
    common = common_parser()
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", parents=[common], help="versions, newest first")
    show = sub.add_parser("show", parents=[common], help="one version's card")
    show.add_argument("version", nargs="?")
    sub.add_parser("rollback", parents=[common], help="current -> the previous version")
    promote_cmd = sub.add_parser("promote", parents=[common], help="current -> VERSION, without the gate")
    promote_cmd.add_argument("version")
    args = parser.parse_args(argv)
    setup_logging(quiet=True)
    root = load_config(args.config, parse_overrides(args.override)).storage_root
    try:
        if args.command == "list":
            now = pointer(root)["version"]
            for entry in versions(root):
                mark = "*" if entry["version"] == now else " "
                print(f"{mark} {entry['version']}  {entry['registered_at']}  {entry.get('objective', 'accuracy')}={entry.get('test_' + entry.get('objective', 'accuracy'))}  "
                      f"run={entry.get('source_run')}")
        elif args.command == "show":
            import json

            print(json.dumps(card(root, args.version) if args.version else current(root), indent=2))
        elif args.command == "rollback":
            print(f"current: {rollback(root)['version']}")
        else:
            print(f"current: {promote(root, args.version)['version']}")
    except UserError as exc:
        raise SystemExit(str(exc)) from None


if __name__ == "__main__":
    main()
