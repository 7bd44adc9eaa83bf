"""An in-place upgrade under running Airflow processes is no plugin error (issue 34): a process that cached the
entry points before ``pip install --upgrade`` (a scheduler, and every task it forks) still loads the plugin, from the
version now installed; and the plugin reads no package metadata at import. Each case runs in a process of its own
(forked from one that imported Airflow): Airflow's caches and the plugin's import are per process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

# A process that read the entry points (Airflow's cache, core and task SDK) with stagewise 0.1.0 installed, and with
# argv[1] == "imported" had imported the plugin module too; then pip replaces 0.1.0's dist-info by 0.1.1's; then the
# process (or a task it forks) loads the plugins, as each task does.
UPGRADE_UNDER_A_RUNNING_PROCESS = r"""
import json, os, shutil, sys, tempfile
from pathlib import Path

site = Path(tempfile.mkdtemp())
def install(version):
    dist = site / f"stagewise-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: stagewise\nVersion: {version}\n")
    (dist / "entry_points.txt").write_text("[airflow.plugins]\nstagewise = stagewise.airflow.plugin:StagewiseUIPlugin\n")
    return dist
old = install("0.1.0")
sys.path.insert(0, str(site))  # found before the checkout's own (editable) install, as the only one would be

from airflow._shared.module_loading import _get_grouped_entry_points as core_cache
from airflow.sdk._shared.module_loading import _get_grouped_entry_points as sdk_cache
core_cache.cache_clear(), sdk_cache.cache_clear()  # forked from a process whose Airflow import filled them
core_cache(), sdk_cache()
if sys.argv[1] == "imported":
    import stagewise.airflow.plugin
shutil.rmtree(old)
install("0.1.1")
os.utime(site, (site.stat().st_mtime + 10,) * 2)  # the folder changed: metadata lookups see it (ms timestamps)
stale = [dist for entry, dist in core_cache()["airflow.plugins"] if str(getattr(dist, "_path", "")).startswith(str(site))]
assert stale and stale[0].read_text("METADATA") is None, "the cache names the removed dist-info"

from airflow._shared.plugins_manager import plugins_manager as core
from airflow.sdk._shared.plugins_manager import plugins_manager as sdk
result = {}
for name, manager in (("core", core), ("sdk", sdk)):
    plugins, errors = manager._load_entrypoint_plugins()
    result[name] = {"errors": errors, "sources": [str(plugin.source) for plugin in plugins]}
print("RESULT " + json.dumps(result))
"""

# Every way of reading Stagewise's package metadata fails, as it may in a process whose dist-info pip removed.
NO_METADATA = r"""
import importlib.metadata as stdlib, importlib_metadata as backport
import airflow.plugins_manager  # Airflow reads its own providers' metadata: only ours is gone
for module in (stdlib, backport):
    for name in ("version", "distribution", "metadata", "files", "requires"):
        def missing(package, *args, real=getattr(module, name), **kwargs):
            if package.lower() == "stagewise":
                raise stdlib.PackageNotFoundError(package)
            return real(package, *args, **kwargs)
        setattr(module, name, missing)
import stagewise.airflow.plugin as plugin
from stagewise.reporting import lineage
print("RESULT", plugin.StagewiseUIPlugin.name, lineage.stagewise_version())
"""


# The cases share one interpreter: it imports Airflow once (seconds), then forks a child per case, its stdout and
# stderr in files of its own; each case empties the entry point caches it relies on, and imports the plugin itself.
FORKED = r"""
import json, os, sys, traceback
import airflow._shared.module_loading, airflow.sdk._shared.module_loading
results = {}
for name, code, args in json.loads(sys.argv[1]):
    out, err = (os.path.join(sys.argv[2], f"{name}.{kind}") for kind in ("out", "err"))
    sys.stdout.flush(), sys.stderr.flush()
    child = os.fork()
    if child == 0:
        os.dup2(os.open(out, os.O_WRONLY | os.O_CREAT), 1), os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT), 2)
        status = 0
        try:
            sys.argv = ["-c", *args]
            exec(compile(code, "<" + name + ">", "exec"), {"__name__": "__main__"})
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(status)
    _, status = os.waitpid(child, 0)
    results[name] = {"rc": os.waitstatus_to_exitcode(status), "stdout": open(out).read(), "stderr": open(err).read()}
print("CASES " + json.dumps(results))
"""
CASES = {"imported": (UPGRADE_UNDER_A_RUNNING_PROCESS, "imported"),
         "not imported": (UPGRADE_UNDER_A_RUNNING_PROCESS, "not imported"), "no metadata": (NO_METADATA,)}


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, dict]:
    """Each case's exit status, stdout and stderr, by name."""
    listed = json.dumps([[name.replace(" ", "_"), code, list(args)] for name, (code, *args) in CASES.items()])
    done = subprocess.run([sys.executable, "-c", FORKED, listed, str(tmp_path_factory.mktemp("cases"))],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    found = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("CASES "))[6:])
    return {name: found[name.replace(" ", "_")] for name in CASES}


def _run(cases: dict[str, dict], name: str) -> tuple[str, str]:
    done = cases[name]
    assert done["rc"] == 0, done["stdout"] + done["stderr"]
    output = done["stdout"] + done["stderr"]
    return next(line for line in done["stdout"].splitlines() if line.startswith("RESULT ")).removeprefix("RESULT "), output


@pytest.mark.parametrize("plugin_module", ["imported", "not imported"])
@pytest.mark.subprocess
def test_an_upgrade_under_a_running_process_loads_the_plugin_from_the_new_version(plugin_module, cases):
    """Whether or not the process had imported the plugin's module before the upgrade (a fork inherits it)."""
    printed, output = _run(cases, plugin_module)
    result = json.loads(printed)
    assert "Failed to import plugin" not in output and "MetadataNotFound" not in output, output
    for manager in ("core", "sdk"):
        assert result[manager]["errors"] == {}, result
        assert any(source.startswith("stagewise==0.1.1:") for source in result[manager]["sources"]), result
    assert "restart the scheduler, dag-processor, api-server and workers" in output, "one line says what to restart"


def test_the_plugin_imports_without_package_metadata(cases):
    printed, _ = _run(cases, "no metadata")
    assert printed == "stagewise_ui unknown"
