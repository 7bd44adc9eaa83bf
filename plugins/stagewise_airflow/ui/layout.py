"""The pages' shared layout: one inline style, the header with its tabs, tables and escaped cells.

Run: imported by the pages (``stagewise.airflow.ui``). Everything taken from storage goes through ``esc``/``fmt``, so a
value can never become markup; a page runs no script and allows only its own style (PAGE_CSP).
"""

import base64
import hashlib
import html
import json
import math
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote, urlencode

from fastapi import Request
from fastapi.responses import HTMLResponse

from stagewise.airflow.ui.access import BASE_CSP, csp

STYLE = """
:root { --blue: #017cee; --ink: #1a202c; --muted: #5f6b7a; --line: #e2e8f0; --head: #f7fafc; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
       color: var(--ink); background: #fff; }
header { display: flex; align-items: baseline; gap: 20px; padding: 12px 24px; border-bottom: 1px solid var(--line); }
header .brand { font-weight: 700; font-size: 16px; color: var(--ink); text-decoration: none; }
header nav a { margin-right: 14px; color: var(--muted); text-decoration: none; font-weight: 500; }
header nav a.on { color: var(--blue); border-bottom: 2px solid var(--blue); padding-bottom: 2px; }
main { padding: 16px 24px 32px; max-width: 1400px; }
h1 { font-size: 20px; margin: 4px 0 4px; }
h1.run-id { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 17px; } h2 { font-size: 16px; margin: 22px 0 8px; }
.sub { color: var(--muted); margin: 0 0 14px; } .crumbs { color: var(--muted); margin-bottom: 6px; }
a { color: var(--blue); } code, .mono { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 12.5px; }
table { border-collapse: collapse; min-width: 420px; margin: 6px 0 10px; } table.wide { width: 100%; }
th, td { text-align: left; padding: 7px 10px; border-bottom: 1px solid var(--line); vertical-align: top; }
th { background: var(--head); font-weight: 600; color: #334155; white-space: nowrap; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
tbody tr:hover { background: #f1f7fe; }
.badge { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 12px; font-weight: 600; }
.ok { background: #dcfce7; color: #166534; } .no { background: #f1f5f9; color: #475569; }
.cur { background: #dbeafe; color: #1e40af; } .err { background: #fee2e2; color: #991b1b; }
.warn { background: #fef3c7; color: #92400e; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; margin: 10px 0 4px; }
.card { border: 1px solid var(--line); border-radius: 8px; padding: 10px 14px; min-width: 170px; }
.card .label { color: var(--muted); font-size: 12px; } .card .value { font-size: 20px; font-weight: 600; }
.card .note { color: var(--muted); font-size: 12px; max-width: 320px; }
details summary { cursor: pointer; color: var(--blue); }
details.card-of { margin: 6px 0; }
details.card-of table { max-width: 900px; } details.card-of td:first-child { width: 200px; color: var(--muted); }
.blocks { display: flex; flex-wrap: wrap; gap: 0 36px; align-items: flex-start; }
.empty { color: var(--muted); padding: 20px 0; }
/* a fixed height, the report scrolling inside: sizing the frame to its content would grow charts sized to it */
iframe.report { width: 100%; height: calc(100vh - 150px); min-height: 480px; border: 1px solid var(--line); display: block; }
form.filters { display: flex; flex-wrap: wrap; gap: 8px 14px; align-items: end; margin: 4px 0 10px; }
form.filters label { display: flex; flex-direction: column; font-size: 12px; color: var(--muted); gap: 2px; }
form.filters select, form.filters input, form.filters button { font: inherit; padding: 3px 6px; }
.pager { display: flex; gap: 14px; align-items: baseline; color: var(--muted); margin: 6px 0; }
.pager .count { color: var(--ink); font-weight: 600; }
"""

# A page runs no script: it needs its one inline <style> (allowed by its hash), the report's frame, and its filter
# form, which sends a GET to the page itself.
PAGE_CSP = csp(BASE_CSP.replace("form-action 'none'", "form-action 'self'"),
               f"style-src 'sha256-{base64.b64encode(hashlib.sha256(STYLE.encode()).digest()).decode()}'", "frame-src 'self'")


def esc(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def fmt(value: Any) -> str:
    """A value for a table cell: floats to 4 significant places, containers as compact JSON; escaped."""
    if value is None:
        return '<span class="sub">–</span>'
    if isinstance(value, bool):
        return esc("yes" if value else "no")
    if isinstance(value, float):
        return esc(f"{value:.4g}" if math.isfinite(value) else str(value))
    if isinstance(value, dict | list):
        return f'<span class="mono">{esc(json.dumps(value, sort_keys=True, default=str))}</span>'
    return esc(value)


def params_text(params: Any) -> str:
    """Hyperparameters as ``name value`` pairs, numbers shortened (the sweep's floats carry 17 digits)."""
    if not isinstance(params, dict) or not params:
        return fmt(params)
    return " · ".join(f"{esc(k)} <b>{fmt(v)}</b>" for k, v in sorted(params.items()))


def link(href: str, text: Any) -> str:
    return f'<a href="{esc(href)}">{esc(text)}</a>'


def page(request: Request, title: str, body: str, section: str, active: str) -> HTMLResponse:
    root = request.scope.get("root_path", "")
    nav = "".join(f'<a href="{esc(root + href)}" class="{"on" if key == active else ""}">{label}</a>'
                  for key, href, label in (("runs", "/", "Runs"), ("registry", "/registry", "Model registry")))
    document = (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{esc(title)} · Stagewise</title>'
                f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{STYLE}</style></head>'
                f'<body><header><a class="brand" href="{esc(root + "/")}">Stagewise</a><nav>{nav}</nav></header>'
                f'<main data-stagewise-section="{esc(section)}">{body}</main></body></html>')
    return HTMLResponse(document, headers={"Content-Security-Policy": PAGE_CSP})


def table(headers: Iterable[str], rows: Iterable[Iterable[str]], numeric: Iterable[int] = (), wide: bool = False) -> str:
    """An HTML table; cells are already-escaped HTML."""
    numeric = set(numeric)
    head = "".join(f'<th class="{"num" if i in numeric else ""}">{esc(h)}</th>' for i, h in enumerate(headers))
    body = "".join("<tr>" + "".join(f'<td class="{"num" if i in numeric else ""}">{cell}</td>'
                                    for i, cell in enumerate(row)) + "</tr>" for row in rows)
    return f"<table{' class=wide' if wide else ''}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def gate_badge(registry: dict[str, Any] | None) -> str:
    if not isinstance(registry, dict) or "promoted" not in registry:
        return '<span class="sub">–</span>'
    if registry.get("promoted"):
        return f'<span class="badge ok">promoted</span> <span class="mono">{esc(registry.get("version"))}</span>'
    return f'<span class="badge no">kept current</span> <span class="mono">{esc(registry.get("current"))}</span>'


def run_href(root: str, dag_id: str, run_id: str) -> str:
    return f"{root}/runs/{quote(dag_id, safe='')}/{quote(run_id, safe='')}"


def pager(href: str, params: dict[str, str], number: int, per_page: int, total: int, noun: str, note: str = "") -> str:
    """"<noun> 51–100 of 10,000" (and ``note``) with first/previous/next/last links to ``href``, the other ``params``
    (filters) kept in each link; page ``number`` counts from 1."""
    last = max(1, -(-total // per_page))
    first_shown, last_shown = (number - 1) * per_page + 1, min(total, number * per_page)
    count = f"{noun} {first_shown:,}–{last_shown:,} of {total:,}" if total else f"no {noun}"

    def to(target: int, label: str, rel: str) -> str:
        if target == number or not 1 <= target <= last:
            return f"<span>{esc(label)}</span>"
        query = urlencode({**params, "page": str(target)})
        return f'<a href="{esc(href + "?" + query)}" rel="{rel}" data-stagewise-page="{target}">{esc(label)}</a>'

    return (f"<div class='pager' data-stagewise-pager='{esc(noun)}' data-stagewise-total='{total}'>"
            f"<span class='count'>{count}{esc(note)}</span>{to(1, '« first', 'first')}{to(number - 1, '‹ previous', 'prev')}"
            f"<span>page {number:,} of {last:,}</span>{to(number + 1, 'next ›', 'next')}{to(last, 'last »', 'last')}"
            "</div>")
