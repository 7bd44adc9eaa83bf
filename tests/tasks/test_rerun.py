"""Re-running a past run (issue 34, docs/pipelines.md): its snapshot as it is clashes with the pipeline it came from;
``python -m stagewise.config --rerun SNAPSHOT --as NAME`` writes it as a pipeline of its own, with the run's values, and
says what code changed since the run started."""

from __future__ import annotations

import pytest
import yaml

from stagewise import config as config_cli
from stagewise.core import storage
from stagewise.definitions.loading import load_config, snapshot
from stagewise.definitions.pipelines import resolve
from stagewise.reporting import lineage
from tests.conftest import base_config


@pytest.fixture
def past_run(tmp_path, storage_root):
    """A pipelines folder holding ``ml`` (its spec beside it) and a run of it started with num_trials 3 from the
    trigger form: its snapshot and lineage as start_run writes them; returns (folder, snapshot URI, spec file)."""
    folder = tmp_path / "pipelines"
    folder.mkdir()
    spec = folder / "team_spec.py"
    spec.write_text("from stagewise.spec import ModelSpec\n\n\nclass TeamSpec(ModelSpec):\n    default_params = {}\n")
    raw = base_config(storage_root)
    raw["model"] = {"spec": "team_spec:TeamSpec"}
    (folder / "ml.yaml").write_text(yaml.safe_dump(raw))
    config = load_config(folder / "ml.yaml", {"sweep.num_trials": 3})
    out = f"file://{storage_root}/runs/ml_pipeline/manual__1"
    lineage.write(out, config)
    storage.write_bytes(storage.join(out, "config.yaml"), snapshot(config)[0].encode())
    return folder, storage.join(out, "config.yaml"), spec.resolve()


def test_the_snapshot_as_it_is_clashes_and_the_rerun_config_does_not(past_run, storage_root, capsys):
    folder, snapshot_uri, _ = past_run
    (folder / "copied.yaml").write_bytes(storage.read_bytes(snapshot_uri))
    assert resolve(str(folder)).errors, "the snapshot keeps the original's name: a clash"
    (folder / "copied.yaml").unlink()

    config_cli.main(["--rerun", snapshot_uri, "--as", "ml_again", "--out", str(folder / "ml_again.yaml")])
    assert "wrote" in capsys.readouterr().err
    resolved = resolve(str(folder))
    assert not resolved.errors and sorted(p.name for p in resolved.configs) == ["ml", "ml_again"]
    again = load_config(folder / "ml_again.yaml")
    assert (again.name, again.registry.model_name) == ("ml_again", "ml_again"), "a registry of its own"
    assert again.sweep.num_trials == 3, "the run's trigger value, now the default"
    assert again.storage_root == str(storage_root) and again.model.import_paths == [str(folder)]

    config_cli.main(["--rerun", snapshot_uri, "--as", "ml_third", "--model-name", "ml_shadow"])
    printed = capsys.readouterr().out
    assert printed.startswith("# A re-run of") and yaml.safe_load(printed)["registry"]["model_name"] == "ml_shadow"


def test_the_rerun_says_what_code_changed_since_the_run_started(past_run, monkeypatch, capsys):
    folder, snapshot_uri, spec = past_run
    assert config_cli.rerun(snapshot_uri, "ml_again")[1] == [], "nothing changed yet"
    spec.write_text("from stagewise.spec import ModelSpec\n\n\nclass TeamSpec(ModelSpec):\n    default_params = {'width': 8}\n")
    monkeypatch.setattr(lineage, "stagewise_version", lambda: "9.9.9")
    text, notes = config_cli.rerun(snapshot_uri, "ml_again")
    assert f"{spec}: changed since the run started" in notes and any("this is 9.9.9" in note for note in notes)
    assert f"# note: {spec}: changed since the run started" in text


@pytest.mark.parametrize(("argv", "message"), [
    (["--as", "ml"], "the name of the pipeline the run came from"),
    (["--as", "9lives"], "cannot name DAGs"),
    (["--as", "ok", "--model-name", "bad name"], "--model-name"),
])
def test_a_rerun_that_would_clash_or_cannot_be_named_is_refused(past_run, argv, message):
    with pytest.raises(SystemExit, match=message):
        config_cli.main(["--rerun", past_run[1], *argv])


def test_an_existing_file_is_never_overwritten(past_run):
    folder, snapshot_uri, _ = past_run
    with pytest.raises(SystemExit, match="exists"):
        config_cli.main(["--rerun", snapshot_uri, "--as", "ml_again", "--out", str(folder / "ml.yaml")])
    assert yaml.safe_load((folder / "ml.yaml").read_text())["name"] == "ml"


def test_a_forged_path_in_the_runs_lineage_stays_inside_its_comment(past_run, capsys):
    """A source path holding newlines (lineage.json edited or forged) is written escaped on its note line: the re-run
    config loads to the same values, with no key the path tried to plant."""
    folder, snapshot_uri, _ = past_run
    out = snapshot_uri.rsplit("/", 1)[0]
    recorded = lineage.read(out)
    recorded["source_fingerprints"]["/x\nsweep:\n  num_trials: 99\nplanted: 1"] = "0" * 64
    storage.write_json(lineage.lineage_uri(out), recorded)
    text, notes = config_cli.rerun(snapshot_uri, "ml_again")
    assert any("planted: 1" in note for note in notes)
    assert "# note: /x\\nsweep:\\n  num_trials: 99\\nplanted: 1: part of the run's code, gone from it now" in text
    values = yaml.safe_load(text)
    assert "planted" not in values and values["sweep"]["num_trials"] == 3


def test_an_out_file_in_a_missing_folder_is_one_line_naming_it(past_run):
    """--out into a folder that does not exist: one line naming --out and why, no traceback."""
    missing = past_run[0] / "nowhere" / "ml_again.yaml"
    with pytest.raises(SystemExit, match=rf"--out {missing}: cannot write it \(No such file or directory\)"):
        config_cli.main(["--rerun", past_run[1], "--as", "ml_again", "--out", str(missing)])


@pytest.mark.parametrize(("content", "message"), [
    (None, "is not valid JSON"),  # None: the recorded file cut in half, as a copy interrupted leaves it
    (b"[1, 2]", "this holds a list"),
    (b'{"source_fingerprints": [1]}', "source_fingerprints of type list"),
    (b'{"source_fingerprints": {"/a.py": 1}}', "source_fingerprints of type dict"),
], ids=["torn", "not-an-object", "fingerprints-not-a-map", "digest-not-text"])
def test_a_torn_or_replaced_lineage_ends_the_rerun_in_one_line_naming_the_file(past_run, content, message):
    """A torn lineage.json ended --rerun in a DataError traceback (a list in it: an AttributeError); now it is one
    line naming the file and what to do, and no config is written."""
    folder, snapshot_uri, _ = past_run
    uri = lineage.lineage_uri(snapshot_uri.rsplit("/", 1)[0])
    storage.write_bytes(uri, storage.read_bytes(uri)[:40] if content is None else content)
    out = folder / "ml_again.yaml"
    with pytest.raises(SystemExit) as caught:
        config_cli.main(["--rerun", snapshot_uri, "--as", "ml_again", "--out", str(out)])
    text = str(caught.value)
    assert text.startswith(f"{uri}: ") and message in text and "restore or remove it" in text
    assert not out.exists()
