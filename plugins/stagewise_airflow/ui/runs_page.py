"""The runs page (``/``): every run with a report under each pipeline's storage root, newest first, a page at a time.

Run: ``register(router, User)`` adds its route (``stagewise.airflow.ui.create_app``).

``?pipeline=<name>&state=<state>&from=YYYY-MM-DD&to=YYYY-MM-DD&page=N&per_page=N``: filters by pipeline, by the
state the report records (stagewise.reporting.listing.STATES) and by the UTC day the run started (both ends
included; a run is dated by what it recorded, stagewise.reporting.run_dates, never by when retention last noted in its
report); the page says which runs of how many it shows ("runs 51–100 of 10,000") and its links keep the filters.
The listing comes from stagewise.reporting.listing, reused while the folders' mtimes say nothing changed; a report is
read only when the page shows it (or the state filter needs it), once per version of its file, so a page over 10,000
reports costs a few dozen stats and 50 reads at most. Counts are of the runs this user may read; who may read a run
follows its DAG folder, as on the run page.
"""

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import HTMLResponse

from stagewise.airflow.ui.access import can_read_runs
from stagewise.airflow.ui.layout import esc, fmt, gate_badge, link, page, pager, run_href, table
from stagewise.airflow.ui.pipelines import Pipeline, pipelines
from stagewise.airflow.ui.storage_access import Storage, StorageProblem, read_each, storage_error, storages
from stagewise.core import storage
from stagewise.reporting.listing import STATES, Listed, RunRow, report_dates, run_reports, run_rows

PER_PAGE = 50
MAX_PER_PAGE = 500


@dataclass(frozen=True)
class Filters:
    """What the user asked to see; empty: everything."""

    pipeline: str = ""
    state: str = ""
    start: dt.date | None = None
    end: dt.date | None = None
    per_page: int = PER_PAGE

    def params(self) -> dict[str, str]:
        """The filters as the query of a link (only those set), so paging keeps them."""
        params = {"pipeline": self.pipeline, "state": self.state, "from": self.start.isoformat() if self.start else "",
                  "to": self.end.isoformat() if self.end else "",
                  "per_page": str(self.per_page) if self.per_page != PER_PAGE else ""}
        return {key: value for key, value in params.items() if value}

    def keeps_time(self, started: dt.datetime | None) -> bool:
        """Whether a run that started at ``started`` falls on the days asked for (UTC, both ends included)."""
        if started is None:
            return False
        day = started.astimezone(dt.UTC).date()
        return not ((self.start and day < self.start) or (self.end and day > self.end))


def _day(value: str, name: str) -> dt.date | None:
    if not value:  # the form sends an empty field for "any"
        return None
    try:
        return dt.date.fromisoformat(value)
    except ValueError:
        raise HTTPException(400, f"{name}: {value!r} is not a day (YYYY-MM-DD)") from None


def filters_of(pipeline: str, state: str, start: str, end: str, per_page: int) -> Filters:
    if state and state not in STATES:
        raise HTTPException(400, f"state: {state!r} is none of {', '.join(STATES)}")
    return Filters(pipeline, state, _day(start, "from"), _day(end, "to"), per_page)


def filter_form(root: str, chosen: Filters, names: list[str]) -> str:
    """A GET form back to this page (no script): pipeline, state and the days, with a link that clears them."""

    def options(values: list[str], current: str, blank: str) -> str:
        return f"<option value=''>{esc(blank)}</option>" + "".join(
            f"<option value='{esc(v)}'{' selected' if v == current else ''}>{esc(v)}</option>" for v in values)

    per_page = f"<input type='hidden' name='per_page' value='{chosen.per_page}'>" if chosen.per_page != PER_PAGE else ""
    return (f"<form class='filters' method='get' action='{esc(root + '/')}' data-stagewise-filters>"
            f"<label>pipeline<select name='pipeline'>{options(names, chosen.pipeline, 'all')}</select></label>"
            f"<label>state<select name='state'>{options(list(STATES), chosen.state, 'any')}</select></label>"
            f"<label>started from<input type='date' name='from' value='{esc(chosen.start or '')}'></label>"
            f"<label>to<input type='date' name='to' value='{esc(chosen.end or '')}'></label>{per_page}"
            f"<button type='submit'>Filter</button>"
            + (f"<a href='{esc(root + '/')}'>clear filters</a>" if chosen.params() else "") + "</form>")


ORPHAN_NOTE = ("no pipeline holds this DAG now: its pipeline was renamed or removed, and its runs stay under the DAG id "
               "they ran as (docs/operations.md)")


def row_cells(root: str, row: RunRow, retired: bool, orphan: bool = False) -> list[str]:
    """A row's cells; ``retired``: its pipeline's DAGs are stale; ``orphan``: no pipeline holds its DAG now."""
    href = run_href(root, row.dag_folder, row.run_folder)
    started, ended = (when.strftime("%Y-%m-%d %H:%M UTC") if when else "" for when in (row.started, row.ended))
    if row.error:
        return [esc(row.dag_id), link(href, row.run_id), esc(started), esc(ended), "", "", "",
                f'<span class="badge err">unreadable</span> {esc(row.error)}']
    badge = (' <span class="badge">retired</span>' if retired else
             f' <span class="badge" title="{esc(ORPHAN_NOTE)}">former name</span>' if orphan else "")
    return [esc(row.dag_id) + badge, link(href, row.run_id), esc(started), esc(ended), esc(row.metric), fmt(row.value),
            fmt(row.sweep_best), gate_badge(row.registry)]


def read_rows(items: list[Listed], owner: Callable[[Listed], Storage],
              problem: Callable[[Storage, StorageProblem], None], recheck_files: bool = False) -> list[RunRow | None]:
    """The rows of these reports, each read from its own storage (``owner``; reports read before at their version are
    not read again; ``recheck_files``: each stat'ed first, None for one gone); a storage that fails now gives None for
    its reports and its error to ``problem``."""
    by_place: dict[Storage, list[Listed]] = {}
    for item in items:
        by_place.setdefault(owner(item), []).append(item)
    read = read_each(by_place, lambda place: dict(zip(by_place[place], run_rows(place.root, by_place[place],
                                                                                recheck_files), strict=True)))
    for place, result in read.items():
        if isinstance(result, StorageProblem):
            problem(place, result)
    return [None if isinstance(rows := read[owner(item)], StorageProblem) else rows[item] for item in items]


_folder_sets: dict[int, tuple[list[Listed], frozenset[str]]] = {}


def _folders_of(reports: list[Listed]) -> frozenset[str]:
    """The DAG folders in a listing, found once per listing (a listing is reused while nothing changed)."""
    known = _folder_sets.get(id(reports))
    if known is not None and known[0] is reports:
        return known[1]
    folders = frozenset(item.parts[0] for item in reports)
    if len(_folder_sets) > 64:  # listings replaced by newer ones
        _folder_sets.clear()
    _folder_sets[id(reports)] = (reports, folders)
    return folders


def register(router: APIRouter, User: Any) -> None:  # noqa: N803 - the request's user, as FastAPI resolves it
    """Add the runs page to ``router``."""

    @router.get("/", response_class=HTMLResponse)
    def runs(request: Request, user: User, pipeline: str = "", state: str = "",
             start: str = Query("", alias="from"), end: str = Query("", alias="to"),
             number: int = Query(1, alias="page", ge=1),
             per_page: int = Query(PER_PAGE, ge=1, le=MAX_PER_PAGE)) -> HTMLResponse:
        chosen = filters_of(pipeline, state, start, end, per_page)
        found = pipelines()
        if chosen.pipeline and chosen.pipeline not in found:
            raise HTTPException(400, f"pipeline: no pipeline named {chosen.pipeline!r}")
        places = storages(found)
        root = request.scope.get("root_path", "")
        allowed: dict[str, bool] = {}

        def may_read(dag_id: str) -> bool:  # asked once per DAG and page: a handful, whatever the number of runs
            if dag_id not in allowed:
                allowed[dag_id] = can_read_runs(user, dag_id)
            return allowed[dag_id]

        def readable(of: Pipeline) -> bool:
            return any(may_read(dag_id) for dag_id in of.dag_ids)

        if chosen.pipeline:  # only the chosen pipeline's storage is read
            places = [place for place in places if chosen.pipeline in place.names]
        problems: list[str] = []

        def problem(place: Storage, result: StorageProblem) -> None:  # in place of its runs, for whoever may read one
            if any(readable(found[name]) for name in place.names):
                problems.append(f"<p class='storage-problem'>{storage_error(place, result)}</p>")

        listed: list[tuple[Storage, list[Listed]]] = []
        for place, result in read_each(places, lambda place: run_reports(place.root)).items():
            if isinstance(result, StorageProblem):
                problem(place, result)
            elif place.root not in {seen.root for seen, _ in listed}:  # two connections to one root list the same runs
                listed.append((place, result))
        # One storage's list is used as it is (10,000 reports: no copy, no pass over it unless a filter needs one)
        started_at: dict[int, dt.datetime | None] = {}

        def started(item: Listed) -> dt.datetime | None:  # as the run recorded it, read once per version of its report
            if not started_at:
                for place, result in listed:
                    started_at.update((id(found), dates.started) for found, dates in
                                      zip(result, report_dates(place.root, result), strict=True))
            return started_at.get(id(item))

        if len(listed) == 1:
            (only, reports), owners = listed[0], {}
        else:  # each storage's reports are newest first already
            only, owners = None, {id(item): place for place, result in listed for item in result}
            reports = sorted((item for _, result in listed for item in result),
                             key=lambda item: (when := started(item)) and when.timestamp() or 0.0, reverse=True)

        def owner(item: Listed) -> Storage:
            return only or owners[id(item)]

        # A run's DAG is its folder's (the run page looks a run up the same way): no report is read to decide who sees it
        dag_of = {storage.safe_name(dag_id): dag_id for of in found.values() for dag_id in of.dag_ids}
        folders = {folder for _, result in listed for folder in _folders_of(result)}
        readable_folders = {folder for folder in folders if may_read(dag_of.get(folder, folder))}
        visible = reports if readable_folders == folders else \
            [item for item in reports if item.parts[0] in readable_folders]
        shown = visible
        if chosen.pipeline:  # its storage may hold other pipelines' runs too
            own = {storage.safe_name(dag_id) for dag_id in found[chosen.pipeline].dag_ids}
            shown = [item for item in shown if item.parts[0] in own]
        if chosen.start or chosen.end:
            shown = [item for item in shown if chosen.keeps_time(started(item))]
        if chosen.state:  # the one filter that reads every report it looks at (once per version of each)
            shown = [item for item, row in zip(shown, read_rows(shown, owner, problem), strict=True)
                     if row is not None and row.state == chosen.state]
        last = max(1, -(-len(shown) // chosen.per_page))
        number = min(number, last)  # a page past the end (runs went away since the link was made): the last one
        on_page = shown[(number - 1) * chosen.per_page:number * chosen.per_page]
        retired = {storage.safe_name(dag_id) for of in found.values() if of.retired for dag_id in of.dag_ids}
        cells = [row_cells(root, row, item.parts[0] in retired, item.parts[0] not in dag_of)
                 for item, row in zip(on_page, read_rows(on_page, owner, problem, recheck_files=True), strict=True)
                 if row is not None]

        # A scoped viewer is told only of the pipelines it may read and the roots that hold those or runs it may read.
        roots: dict[str, list[str]] = {}
        for place in storages(found):
            if names := [name for name in place.names if readable(found[name])]:
                roots.setdefault(place.root, []).extend(names)
        for place, result in listed:
            if _folders_of(result) & readable_folders:
                roots.setdefault(place.root, [])
        where = ", ".join(f"<code>{esc(storage_root)}/runs/</code>" + (f" ({esc(', '.join(names))})" if names else "")
                          for storage_root, names in roots.items())
        if not where:
            said = "You may read no Stagewise pipeline's runs." if found else "Airflow holds no Stagewise pipeline's DAGs yet."
            body = f"<h1>Stagewise runs</h1><p class='sub'>{said}</p>"
            return page(request, "Runs", body, "runs", "runs")
        body = (f"<h1>Stagewise runs</h1><p class='sub'>Every run with a report under {where}, newest first. "
                f"Open a run for its report.</p>")
        body += filter_form(root, chosen, sorted(name for name, of in found.items() if readable(of)))
        body += "".join(problems)
        bar = pager(root + "/", chosen.params(), number, chosen.per_page, len(shown), "runs",
                    f" filtered from {len(visible):,}" if len(shown) != len(visible) else "")
        if cells:
            body += bar + table(["DAG", "run", "started", "ended", "objective", "test value", "sweep best", "gate"], cells,
                                numeric=(5, 6), wide=True) + bar
        elif visible:
            body += bar + "<p class='empty'>No run matches these filters.</p>"
        else:
            body += ("<p class='empty'>No run has written a report yet: trigger a pipeline's "
                     "<code>&lt;name&gt;_pipeline</code> DAG.</p>")
        return page(request, "Runs", body, "runs", "runs")
