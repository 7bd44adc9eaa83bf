"""Carrying out a retention plan (stagewise.upkeep.policy): the files go, emptied folders with them, and a finished
run that loses files gets a ``retention`` entry in its report.json first (its dates pinned there, so the rewrite moves
none: stagewise.reporting.run_dates), then its report.html rendered again once they are gone, saying so.

Only the files the plan lists are removed, never a folder wholesale, so a file written after the plan was made (a
run cleared and started again) stays. A file already gone (another pass, a run's own cleanup) is no error.
"""

from __future__ import annotations

import datetime as dt
import html as html_text
import logging
import os
from collections.abc import Iterable
from typing import Any

from stagewise.core import assets, storage
from stagewise.reporting import html, run_dates
from stagewise.upkeep.inventory import REPORT
from stagewise.upkeep.ledger import NoteNotWritten
from stagewise.upkeep.policy import STUDY, Removal
from stagewise.upkeep.progress import Progress

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


def remove_files(uris: Iterable[str], progress: Progress | None = None) -> int:
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
                try:
                    fs.rm_file(path)
                except FileNotFoundError:
                    pass
        if progress is not None:
            progress.add(files=len(batch))
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


def note_in_report(prefix: str, removals: list[Removal], at: str, pass_name: str = "",
                   stopped: Iterable[str] = ()) -> dict[str, Any] | None:
    """Add what retention removes to the finished run's report.json, before it goes, with the run's dates pinned
    (``at`` from the removal's dates where the report had none); an entry a stopped pass (``stopped``: their names)
    left for the same kind is marked finished, not repeated. Returns the report written (None: it has none)."""
    uri = storage.join(prefix, REPORT)
    try:
        report = storage.read_json(uri)
    except FileNotFoundError:  # no report (a failed run), or another pass took the run: nothing to note in
        return None
    if not isinstance(report, dict):
        return None
    dates = next((r.dates for r in removals if r.dates is not None), None)
    if dates is not None:
        run_dates.pin(report, dates)
    entries = list(report.get("retention") or [])
    stopped = set(stopped)
    for r in removals:
        earlier = next((e for e in entries if isinstance(e, dict) and e.get("removed") == r.what
                        and e.get("pass") in stopped and not e.get("finished")), None)
        if earlier is not None:
            earlier["finished"] = at
            continue
        entries.append({"removed": r.what, "files": len(r.files), "bytes": r.bytes, "reason": r.reason, "at": at,
                        "pass": pass_name})
    report["retention"] = entries
    try:
        storage.write_json(uri, report)
    except OSError as exc:
        raise NoteNotWritten(f"retention stopped before removing anything of {prefix}: its note in {uri} could not be "
                             f"written ({exc}). What earlier runs lost is noted in their reports; free some space "
                             f"and run the pass again") from None
    return report


def render_noted(prefix: str, report: dict[str, Any], scripts: dict[str | None, str] | None = None) -> None:
    """report.html again, once the noted files are gone, saying what retention removed. ``scripts``: the plotly
    <script> by storage root, made once a pass (every run folder sits as deep under its root, so one tag fits all)."""
    if storage.exists(storage.join(prefix, "report.html")):
        _render_again(report, prefix, list(report.get("retention") or []), {} if scripts is None else scripts)


def _render_again(report: dict[str, Any], prefix: str, entries: list[dict[str, Any]], scripts: dict[str | None, str]) -> None:
    """report.html from the report and what files are left, with a line naming what retention removed."""
    try:
        root = assets.root_of(prefix)
        if root not in scripts:  # reading and hashing plotly.js took 17 ms a run: half a pass over trimmed runs
            scripts[root] = assets.plotly_script(prefix, prefix)
        page = html.render(report, html.load_sources(report, prefix), plotly_script=scripts[root])
        said = "; ".join(f"{e['removed']} ({e['files']} files, {human(e['bytes'])}) on {e['at']}" for e in entries)
        banner = (f'<p class="retention" style="padding:.5em;background:#fff3cd">Removed by retention '
                  f'(python -m stagewise.retention): {html_text.escape(said)}. Charts that read those files are gone.</p>')
        head, body, rest = page.partition("<body>")
        storage.write_bytes(storage.join(prefix, "report.html"), (head + body + banner + rest if body else page).encode())
    except Exception:  # the page is a view; report.json, already updated, is the record
        log.exception("report.html of %s not rendered again; its report.json says what retention removed", prefix)


def apply(plan: list[Removal], dry_run: bool, now: dt.datetime, delete_study: Any = None, pass_name: str = "",
          stopped: Iterable[str] = ()) -> dict[str, Any]:
    """Remove what ``plan`` lists (with ``dry_run`` only log it); returns the plan as JSON with its totals.
    ``delete_study(name)`` removes one study (stagewise.upkeep.studies). A run's report notes its removals before
    any of its files go; ``pass_name``, ``stopped``: this pass's name and those of stopped passes it finishes
    (stagewise.upkeep.ledger)."""
    at = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    verb = "would remove" if dry_run else "removing"
    partial: dict[str, list[Removal]] = {}
    for removal in plan:
        if not removal.whole and removal.what != STUDY and removal.prefix:
            partial.setdefault(removal.prefix, []).append(removal)
    noted: dict[str, dict[str, Any] | None] = {}
    progress = Progress("retention " + ("dry run" if dry_run else "removal"), len(plan), "removals")
    for index, removal in enumerate(plan, 1):
        log.info("[%d/%d] %s %s of %s: %d file(s), %s (%s)", index, len(plan), verb, removal.what, removal.target,
                 len(removal.files), human(removal.bytes), removal.reason)
        if dry_run:
            progress.add(1, len(removal.files))
            continue
        if removal.what == STUDY:
            delete_study(removal.target)
            progress.add(1, len(removal.files))
            continue
        if removal.prefix in partial and removal.prefix not in noted:  # the note first: a failure stops before removing
            noted[removal.prefix] = note_in_report(removal.prefix, partial[removal.prefix], at, pass_name, stopped)
        remove_files(removal.files, progress)
        prune_empty_folders(removal.prefix)
        progress.add(1)
    scripts: dict[str | None, str] = {}
    for prefix, report in noted.items():
        if report is not None:
            render_noted(prefix, report, scripts)
            progress.add()
    progress.done()
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
