"""The plotting library, stored once per storage root and linked by every page a run writes.

Nothing to run: stagewise.reporting.html (report.html) and stagewise.study.summary (the sweep's plots) call it.

``<storage_root>/assets/plotly-<version>.min.js`` is written once (atomically, and again only when missing or not
the expected bytes); a page under ``<storage_root>/runs/<dag>/<run>/`` names it by a relative path
(``../../../assets/...``), so the page opens offline from the root's folder tree (a browser on file://, a synced copy
of the root) and a run folder no longer carries 4.8 MB of plotly.js twice. The same relative path from the Stagewise
plugin's ``/stagewise/runs/<dag>/<run>/report.html`` lands on ``/stagewise/assets/``, but the plugin serves the page
with the library put back inline (:func:`inline`): its sandboxed, fetch-nothing page needs no second request.
A page written outside a run folder (no storage root above it) embeds the library as before.
"""

from __future__ import annotations

import hashlib
import html
import logging
import posixpath
import re

from stagewise.core import storage

log = logging.getLogger("stagewise.report")

ASSETS_FOLDER = "assets"
# The one <script> tag that links an asset, as this module writes it: what :func:`inline` puts back, nothing else.
_LINK = re.compile(rb'<script type="text/javascript" data-stagewise-asset="(?P<name>plotly-[0-9A-Za-z.+-]+\.min\.js)" '
                   rb'src="[^"<>]*"></script>')


def plotly_js() -> tuple[str, bytes]:
    """The bundled plotly.js: its file name (versioned, so two plotly versions never share a file) and its bytes."""
    from plotly.offline import get_plotlyjs, get_plotlyjs_version

    return f"plotly-{get_plotlyjs_version()}.min.js", get_plotlyjs().encode()


def root_of(run_folder: str) -> str | None:
    """The storage root of a run folder (``<root>/runs/<dag>/<run>``), or None for a folder that is no run's."""
    parts = run_folder.rstrip("/").rsplit("/", 3)
    if len(parts) < 4 or parts[1] != "runs" or not parts[0] or parts[0].endswith("/"):
        return None
    return parts[0]


def publish(storage_root: str, name: str, data: bytes) -> str:
    """``<storage_root>/assets/<name>`` holding ``data``: written (one atomic put) only when missing or other bytes,
    so concurrent runs race harmlessly (each would write the same bytes whole); returns its URI."""
    uri = storage.join(storage_root, ASSETS_FOLDER, name)
    fs, path = storage.filesystem(uri)
    if fs.exists(path) and fs.size(path) == len(data) and storage.sha256_of(uri) == hashlib.sha256(data).hexdigest():
        return uri
    storage.write_bytes(uri, data)
    log.info("plotting library written once for this storage root: %s", uri)
    return uri


def relative(page_folder: str, target: str) -> str:
    """``target``'s path from ``page_folder`` (both under one storage root), for a src= that resolves offline."""
    return posixpath.relpath(target.split("://", 1)[-1], page_folder.split("://", 1)[-1].rstrip("/"))


def plotly_script(page_folder: str, run_folder: str) -> str:
    """The <script> that loads plotly.js into a page written to ``page_folder`` (in ``run_folder`` or under it): a link
    to the storage root's one copy, or the library inline where the run folder has no storage root above it."""
    name, data = plotly_js()
    root = root_of(run_folder)
    if root is None:
        return f'<script type="text/javascript">{data.decode()}</script>'
    uri = publish(root, name, data)
    return (f'<script type="text/javascript" data-stagewise-asset="{html.escape(name)}" '
            f'src="{html.escape(relative(page_folder, uri))}"></script>')


def inline(page: bytes, run_folder: str) -> bytes:
    """``page`` (a page of ``run_folder``) with each linked asset put back inline, read from the run's own storage root
    by the asset's name alone (never a path the page gives); a link whose file is gone stays as it is."""
    root = root_of(run_folder)

    def put_back(match: re.Match[bytes]) -> bytes:
        try:
            body = storage.read_bytes(storage.join(root or "", ASSETS_FOLDER, match["name"].decode()))
        except FileNotFoundError:
            log.warning("report asset %s is gone from %s", match["name"].decode(), root)
            return match[0]
        # A script body ends at the first '</script': the minified library holds none, but never trust that.
        return b'<script type="text/javascript">' + body.replace(b"</script", b"<\\/script") + b"</script>"

    return page if root is None else _LINK.sub(put_back, page)
