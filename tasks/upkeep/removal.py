"""Carrying out a retention plan (stagewise.upkeep.policy): the files go, emptied folders with them, and a finished
run that lost files gets a ``retention`` entry in its report.json (and its report.html rendered again, saying so).

Only the files the plan lists are removed, never a folder wholesale, so a file written after the plan was made (a
run cleared and started again) stays.
"""

from __future__ import annotations

import datetime as dt
import html as html_text
import logging
import os
from collections.abc import Iterable
from typing import Any

from stagewise.core import assets, storage
from stagewise.reporting import html
from stagewise.upkeep.inventory import REPORT
from stagewise.upkeep.policy import STUDY, Removal

log = logging.getLogger("stagewise.retention")

DELETE_BATCH = 500  # S3 deletes up to 1,000 keys a request; smaller batches log progress on a large backlog


def human(size: int) -> str:
    """Bytes as people read them (1.2 MB)."""
    value = float(size)
    for unit in ("B", "kB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"


def remove_files(uris: Iterable[str]) -> int:
    """Delete ``uris`` (all on one filesystem) in batches; returns how many were gone afterwards."""
    uris = list(uris)
    if not uris:
        return 0
    fs, _ = storage.filesystem(uris[0])
    paths = [storage.filesystem(uri)[1] for uri in uris]
    for start in range(0, len(paths), DELETE_BATCH):
        batch = paths[start:start + DELETE_BATCH]
        try:
            fs.rm(batch)  # S3: one DeleteObjects request, a key already gone is no error
        except FileNotFoundError:  # a local file already gone (another pass, a run's own cleanup): the rest still go
            for path in batch:
                if fs.exists(path):
                    fs.rm_file(path)
    return len(paths)


def prune_empty_folders(prefix: str) -> None:
    """Remove folders under (and including) a local ``prefix`` that removal left empty; S3 has no folders."""
    if "://" in prefix and not prefix.startswith("file://"):
        return
    path = storage.filesystem(prefix)[1]
    if not os.path.isdir(path):
        return
    for folder, _, _ in sorted(os.walk(path), key=lambda item: len(item[0]), reverse=True):
        try:
            os.rmdir(folder)  # only succeeds on an empty folder
        except OSError:
            pass


def note_in_report(prefix: str, removals: list[Removal], at: str) -> None:
    """Add what retention removed to the finished run's report.json, then render its report.html again to say so."""
    uri = storage.join(prefix, REPORT)
    if not storage.exists(uri):
        return
    report = storage.read_json(uri)
    entries = list(report.get("retention") or [])
    entries.extend({"removed": r.what, "files": len(r.files), "bytes": r.bytes, "reason": r.reason, "at": at}
                   for r in removals)
    report["retention"] = entries
    storage.write_json(uri, report)
    if storage.exists(storage.join(prefix, "report.html")):
        _render_again(report, prefix, entries)


def _render_again(report: dict[str, Any], prefix: str, entries: list[dict[str, Any]]) -> None:
    """report.html from the report and what files are left, with a line naming what retention removed."""
    try:
        page = html.render(report, html.load_sources(report, prefix), plotly_script=assets.plotly_script(prefix, prefix))
        said = "; ".join(f"{e['removed']} ({e['files']} files, {human(e['bytes'])}) on {e['at']}" for e in entries)
        banner = (f'<p class="retention" style="padding:.5em;background:#fff3cd">Removed by retention '
                  f'(python -m stagewise.retention): {html_text.escape(said)}. Charts that read those files are gone.</p>')
        head, body, rest = page.partition("<body>")
        storage.write_bytes(storage.join(prefix, "report.html"), (head + body + banner + rest if body else page).encode())
    except Exception:  # the page is a view; report.json, already updated, is the record
        log.exception("report.html of %s not rendered again; its report.json says what retention removed", prefix)


def apply(plan: list[Removal], dry_run: bool, now: dt.datetime, delete_study: Any = None) -> dict[str, Any]:
    """Remove what ``plan`` lists (with ``dry_run`` only log it); returns the plan as JSON with its totals.
    ``delete_study(name)`` removes one study (stagewise.upkeep.studies)."""
    at = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    done: dict[str, list[Removal]] = {}
    for index, removal in enumerate(plan, 1):
        verb = "would remove" if dry_run else "removing"
        log.info("[%d/%d] %s %s of %s: %d file(s), %s (%s)", index, len(plan), verb, removal.what, removal.target,
                 len(removal.files), human(removal.bytes), removal.reason)
        if dry_run:
            continue
        if removal.what == STUDY:
            delete_study(removal.target)
            continue
        remove_files(removal.files)
        prune_empty_folders(removal.prefix)
        if not removal.whole and removal.prefix:
            done.setdefault(removal.prefix, []).append(removal)
    for prefix, removals in done.items():
        note_in_report(prefix, removals, at)
    return summary(plan, dry_run)


def summary(plan: list[Removal], dry_run: bool) -> dict[str, Any]:
    """The plan as the job's result: each removal, and the totals by kind and overall."""
    by_kind: dict[str, dict[str, int]] = {}
    for removal in plan:
        kind = by_kind.setdefault(removal.what, {"count": 0, "files": 0, "bytes": 0})
        kind["count"] += 1
        kind["files"] += len(removal.files)
        kind["bytes"] += removal.bytes
    return {"dry_run": dry_run, "total_bytes": sum(r.bytes for r in plan), "total_files": sum(len(r.files) for r in plan),
            "by_kind": by_kind,
            "removals": [{"what": r.what, "target": r.target, "reason": r.reason, "files": len(r.files), "bytes": r.bytes}
                         for r in plan]}
