"""The Stagewise run view still draws a report whose plotly.js is the storage root's one copy: the plugin serves
report.html with that library put back inline (its page is sandboxed and fetches nothing, so it cannot load the
linked file), under the same fetch-nothing CSP."""

from __future__ import annotations

import re

from stagewise.core import assets, storage
from tests.plugins.test_ui_plugin import RUN_ID, airflow_api, airflow_db, csp_directives  # noqa: F401 - fixtures
from tests.plugins.test_ui_plugin import write_run as write_report_json


def test_the_run_view_serves_the_report_with_the_roots_plotly_inline(airflow_api, storage_root):  # noqa: F811
    """A report.html written by the report step links <root>/assets/plotly-*.min.js; /report.html answers it with the
    library's bytes inline in place of the link, the rest of the page unchanged, under the same CSP (no fetch)."""
    from stagewise.reporting import html as report_html

    out = write_report_json(str(storage_root), RUN_ID, html="placeholder")
    report = storage.read_json(storage.join(out, "report.json"))
    written = storage.read_bytes(report_html.write(report, out)).decode()
    assert re.search(r'data-stagewise-asset="plotly-[^"]+" src="\.\./\.\./\.\./assets/', written)
    client, token = airflow_api(str(storage_root))
    served = client.get(f"/stagewise/runs/ml_pipeline/{RUN_ID}/report.html", headers={"Authorization": f"Bearer {token}"})
    assert served.status_code == 200
    name, library = assets.plotly_js()
    assert library.decode() in served.text and "data-stagewise-asset" not in served.text
    assert served.text.replace(f'<script type="text/javascript">{library.decode()}</script>', "") == \
        re.sub(r'<script type="text/javascript" data-stagewise-asset="[^"]+" src="[^"]+"></script>', "", written)
    policy = csp_directives(served)
    assert policy["script-src"] == "'unsafe-inline'" and policy["default-src"] == "'none'"
