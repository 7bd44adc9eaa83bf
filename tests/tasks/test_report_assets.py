"""The plotting library once per storage root (stagewise.core.assets): every run's report.html and sweep plots
link ``<root>/assets/plotly-<version>.min.js`` by a relative path that resolves offline from the root's folder tree, the
file is written once and mended when wrong, and the Stagewise UI's copy of the page gets it back inline."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stagewise.core import assets, storage
from stagewise.reporting import html as report_html

LINK = re.compile(r'<script type="text/javascript" data-stagewise-asset="([^"]+)" src="([^"]+)"></script>')


def _page(run_folder: str) -> str:
    report = {"dag_id": "ml_pipeline", "run_id": run_folder.rsplit("/", 1)[-1], "training": [], "stages": {}}
    return report_html.write(report, run_folder)


def _linked(page: Path) -> Path:
    """The file a browser opening ``page`` from disk loads as plotly.js."""
    ((_, src),) = LINK.findall(page.read_text())
    assert not src.startswith(("/", "file:", "http")), "a relative path, so the root's folder tree opens anywhere"
    return (page.parent / src).resolve()


def test_two_runs_share_one_library_file_written_once(storage_root: Path, monkeypatch):
    """Two runs under one root: one assets/ file, written by the first report only, and each report.html links that
    file by a relative path that resolves to it (what a browser opening the page from the root's tree loads)."""
    writes = []
    real_write = storage.write_bytes
    monkeypatch.setattr(storage, "write_bytes", lambda uri, data: (writes.append(uri), real_write(uri, data)))
    pages = [Path(_page(storage.run_prefix(str(storage_root), "ml_pipeline", run))) for run in ("r1", "r2")]
    name, data = assets.plotly_js()
    (library,) = (storage_root / "assets").iterdir()
    assert library.name == name and library.read_bytes() == data
    assert [uri for uri in writes if "/assets/" in uri] == [str(library)], "written once, by the first run"
    for page in pages:
        assert _linked(page) == library.resolve()
        assert page.stat().st_size < 200_000, "the page carries no copy of plotly.js"


def test_a_wrong_library_file_is_written_again(storage_root: Path):
    """A cut or altered assets file (a write that died elsewhere, a hand edit) is replaced whole by the next report."""
    name, data = assets.plotly_js()
    library = storage_root / "assets" / name
    library.parent.mkdir(parents=True)
    library.write_bytes(data[: len(data) // 2])
    _page(storage.run_prefix(str(storage_root), "ml_pipeline", "r1"))
    assert library.read_bytes() == data
    library.write_bytes(data[:-1] + b"!")  # same size, other bytes
    _page(storage.run_prefix(str(storage_root), "ml_pipeline", "r2"))
    assert library.read_bytes() == data


def test_sweep_plots_link_the_same_library(storage_root: Path):
    """The sweep's Optuna plots (sweep/plots/*.html) link the root's one copy too: no plotly.min.js in a run folder."""
    optuna = pytest.importorskip("optuna")
    from stagewise.study.summary import write_plots

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study()
    study.optimize(lambda trial: trial.suggest_float("x", -1, 1) ** 2 + trial.suggest_float("y", -1, 1), n_trials=4)
    out = storage.run_prefix(str(storage_root), "ml_pipeline", "r1")
    written = write_plots(study, storage.join(out, "sweep", "plots"), out)
    assert written and not list(Path(out).rglob("*.js"))
    for uri in written:
        assert _linked(Path(uri)) == (storage_root / "assets" / assets.plotly_js()[0]).resolve()


def test_a_page_outside_a_run_folder_embeds_the_library(tmp_path: Path):
    """A page written where no storage root lies above it (not runs/<dag>/<run>) still opens alone: plotly inline."""
    page = Path(_page(str(tmp_path / "somewhere")))
    assert not LINK.search(page.read_text()) and page.stat().st_size > 1_000_000
    assert not (tmp_path / "assets").exists()


def test_the_ui_copy_of_a_page_gets_the_library_back_inline(storage_root: Path):
    """inline() (what the plugin's report.html route serves in its fetch-nothing sandbox) puts the root's library in
    place of the link, found by the asset's name alone: a src that walks elsewhere reads nothing else."""
    out = storage.run_prefix(str(storage_root), "ml_pipeline", "r1")
    page = Path(_page(out)).read_bytes()
    name, data = assets.plotly_js()
    served = assets.inline(page, out)
    assert not LINK.search(served.decode()) and data in served
    assert served.count(b"<script") == served.count(b"</script>")
    walked = page.replace(b'src="../../../assets/', b'src="../../../../../etc/')
    assert data in assets.inline(walked, out)
    (storage_root / "assets" / name).unlink()
    assert assets.inline(page, out) == page, "a link to a library that is gone stays a link"


@pytest.mark.service
def test_an_s3_root_holds_one_library_too(s3_bucket):
    """On s3:// the library is one object under <root>/assets/, linked by the same relative path as on disk."""
    out = storage.run_prefix(s3_bucket, "ml_pipeline", "r1")
    uri = _page(out)
    _page(storage.run_prefix(s3_bucket, "ml_pipeline", "r2"))
    name, data = assets.plotly_js()
    fs, path = storage.filesystem(storage.join(s3_bucket, "assets"))
    assert [p.rsplit("/", 1)[-1] for p in fs.ls(path)] == [name]
    ((_, src),) = LINK.findall(storage.read_bytes(uri).decode())
    assert src == f"../../../assets/{name}"
    assert data in assets.inline(storage.read_bytes(uri), out)


def test_the_page_mlflow_keeps_carries_the_library_inline(storage_root: Path, monkeypatch):
    """MLflow shows an artifact alone, with no storage root around it: the report.html uploaded to the parent run has
    plotly.js inline in place of the link (report.json goes as written)."""
    from stagewise.tracking import runs

    uploads = {}

    class Recorder:
        def parent(self):
            return "parent"

        def upload(self, handle, path, data):
            uploads[path] = data

        def end_running(self, *args, **kwargs):
            pass

        def end(self, *args, **kwargs):
            pass

        def close(self):
            pass

    monkeypatch.setattr(runs.Tracker, "for_run", classmethod(lambda cls, config, out, task: Recorder()))
    out = storage.run_prefix(str(storage_root), "ml_pipeline", "r1")
    html_uri = _page(out)
    storage.write_json(storage.join(out, "report.json"), {"dag_id": "ml_pipeline"})
    runs.finish_parent(None, out, {"html_uri": html_uri, "report_uri": storage.join(out, "report.json")})
    assert assets.plotly_js()[1] in uploads["report.html"] and not LINK.search(uploads["report.html"].decode())
    assert uploads["report.json"] == storage.read_bytes(storage.join(out, "report.json"))
