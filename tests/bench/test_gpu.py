"""The GPU benchmarks on a machine without CUDA: each is recorded as skipped (never a number), at once; and what a GPU
machine without this project's venv runs (the sub-jobs, the benchmarks) imports only torch's own packages and
bench.gpu.GPU_PACKAGES, which scripts/gpu_check.sh (make gpu-check) brings, CUDA tests included by their marker."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bench.__main__ as bench_main
from bench import gpu, harness, training

REPO_ROOT = Path(__file__).resolve().parents[2]
GPU_BENCHMARKS = gpu.gpu_benchmarks()  # every *_gpu benchmark of bench/registry.py


@pytest.fixture
def no_cuda(monkeypatch):
    """CUDA absent, and any benchmark work beyond the device check fails loudly."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def no_work(*args, **kwargs):
        raise AssertionError("a skipped benchmark must not prepare data")

    monkeypatch.setattr(training, "_prepare", no_work)
    gpu._training_on_cuda.cache_clear()
    yield
    gpu._training_on_cuda.cache_clear()


@pytest.mark.parametrize("name", GPU_BENCHMARKS)
def test_a_gpu_benchmark_without_cuda_is_recorded_as_skipped(no_cuda, name):
    """The entry says 'skipped: no CUDA' with the goal, and carries no ours/baseline/ratio/met."""
    entry = harness.run_one(name)
    assert entry["skipped"] == "no CUDA" and entry["goal"] == harness.BENCHMARKS[name][1]
    assert not {"ours", "baseline", "ratio", "met", "error"} & set(entry), entry


def test_skipped_entries_show_in_the_table_and_count_neither_met_nor_missed(no_cuda, monkeypatch, tmp_path, capsys):
    """python -m bench --only <gpu benchmarks> exits 0, prints the skips, reports no missed goal, merges the skips."""
    results = tmp_path / "latest.json"
    monkeypatch.setattr(bench_main, "merge", lambda entries: harness.merge(entries, results))
    assert bench_main.main(["--only", ",".join(GPU_BENCHMARKS)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("skipped: no CUDA") >= len(GPU_BENCHMARKS) and "goal missed" not in printed
    merged = json.loads(results.read_text())["results"]
    assert [entry["name"] for entry in merged] == GPU_BENCHMARKS
    assert all(entry["skipped"] == "no CUDA" for entry in merged)


# The GPU sub-jobs as the DAG runs them (train, evaluate, infer plan/shard/commit: their CLIs, in one process, on the
# CPU, device batches resident, the noise scale on), the GPU benchmarks (skipped: CUDA hidden) and the preprocessing
# their data comes from, with every import refused that is neither the standard library, nor torch or a package torch
# requires (what a GPU machine's torch brings), nor bench.gpu.GPU_PACKAGES, nor this project. Prints what was imported.
# Both probes' own helpers: a distribution's name as PEP 503 normalises it, and every distribution it requires.
_DISTRIBUTIONS = r"""
import importlib.metadata as metadata, re


def normal(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(dist, seen):
    for line in metadata.requires(dist) or []:
        if "extra ==" in line:
            continue
        name = normal(re.split(r"[\s;<>=!~\[(]", line.strip(), maxsplit=1)[0])
        if name not in seen:
            seen.add(name)
            try:
                requirements(name, seen)
            except metadata.PackageNotFoundError:
                pass
    return seen
"""

_IMPORT_PROBE = _DISTRIBUTIONS + r"""
import importlib.abc, importlib.machinery, json, os, sys, tempfile
from pathlib import Path

import torch


LISTED = set(json.loads(sys.argv[1]))
TORCH_OWN = requirements("torch", {"torch"})
DISTRIBUTIONS = metadata.packages_distributions()
STDLIB = set(sys.stdlib_module_names)
OWN = {"stagewise", "bench"}
refused = []


def allowed(top):
    return (top in STDLIB or top.startswith("_sysconfigdata") or top in LISTED or top in OWN or top in sys.modules
            or any(normal(dist) in TORCH_OWN for dist in DISTRIBUTIONS.get(top, [])))


class Installed(importlib.abc.MetaPathFinder):
    # The path finder, blind to every other package: to importlib (find_spec probes included) they are not installed.

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if not allowed(top):
            refused.append(top)
            return None
        return self.finder.find_spec(name, path, target)

    def invalidate_caches(self):
        self.finder.invalidate_caches()

    def find_distributions(self, *args, **kwargs):  # metadata stays visible (pytest finds its plugins by it)
        return self.finder.find_distributions(*args, **kwargs)


before = {name.partition(".")[0] for name in sys.modules}
sys.meta_path[:] = [Installed(finder) if finder is importlib.machinery.PathFinder else finder for finder in sys.meta_path]

from bench import gpu
from bench.harness import run_one
from bench.training import _prepare

entries = [run_one(name) for name in gpu.gpu_benchmarks()]
work = Path(tempfile.mkdtemp(prefix="gpu-probe-"))
config, out = _prepare(work, 3000, features=8, **{"train__stages": [
    {"name": "s1", "profile": "ddp1", "per_process_batch": 64, "epochs": 1, "data_placement": "resident"}]})
common = ["--config", str(work / "pipeline.yaml")]


def subjob(main, *args):
    result = work / "result.json"
    try:
        main([*args, *common, "--result-file", str(result)])
    except SystemExit as exc:
        if exc.code:
            raise RuntimeError(f"{main.__module__} {args[:1]} exited with {exc.code}")
    return json.loads(result.read_text())


from stagewise import evaluate, infer, train

trained = subjob(train.main, "--stage", "s1", "--out", out, "--params", json.dumps({"lr": 0.05, "hidden": 16}))
assert trained["noise_scale"] is not None, trained
subjob(evaluate.main, "--model", trained["model_uri"], "--out", out)
shards = subjob(infer.main, "plan")["shards"]
results = [subjob(infer.main, "shard", "--shard", json.dumps(shard), "--model", trained["model_uri"], "--out", out)
           for shard in shards]
subjob(infer.main, "commit", "--results", json.dumps(results), "--model", trained["model_uri"], "--out", out)
# Packages of installed distributions (not the interpreter's own, nor modules that extensions make at run time).
imported = sorted(top for top in {name.partition(".")[0] for name in sys.modules} - before - STDLIB
                  if top in DISTRIBUTIONS or top in OWN)
print(json.dumps({"entries": entries, "imported": imported, "refused": sorted(set(refused)),
                  "torch_own": sorted(TORCH_OWN)}), flush=True)
os._exit(0)  # what was imported is printed: the interpreter's teardown (about 2 s of torch's) checks nothing
"""


@pytest.mark.subprocess
def test_the_gpu_sub_jobs_import_only_what_a_gpu_machine_has_and_the_listed_packages():
    """With every other package refused (Airflow, optuna, pandas, croniter, scikit-learn, httpx ...), a stage trains,
    evaluates and scores a shard through the sub-jobs' CLIs, and the GPU benchmarks record their skips; what was
    imported beyond torch's own is bench.gpu.GPU_PACKAGES and this project. scripts/gpu_check.sh brings the same."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, json.dumps(sorted(gpu.GPU_PACKAGES))], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    probe = json.loads(done.stdout.strip().splitlines()[-1])
    assert [entry.get("skipped") for entry in probe["entries"]] == ["no CUDA"] * len(GPU_BENCHMARKS), probe["entries"]
    torch_own = {name.replace("-", "_") for name in probe["torch_own"]}
    beyond = set(probe["imported"]) - torch_own - {"stagewise", "bench"}
    assert beyond <= set(gpu.GPU_PACKAGES), (beyond, probe["refused"])


_COLLECTION_PROBE = _DISTRIBUTIONS + r"""
import importlib.abc, importlib.machinery, json, os, sys


THERE = set()
for dist in sys.argv[1].split():
    THERE |= requirements(dist, {normal(dist)})
DISTRIBUTIONS = metadata.packages_distributions()
refused = []


def allowed(top):
    return (top in sys.stdlib_module_names or top.startswith("_sysconfigdata") or top in {"stagewise", "bench", "tests"}
            or top in sys.modules or any(normal(dist) in THERE for dist in DISTRIBUTIONS.get(top, [])))


class Installed(importlib.abc.MetaPathFinder):
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if not allowed(top):
            refused.append(top)
            return None
        return self.finder.find_spec(name, path, target)

    def invalidate_caches(self):
        self.finder.invalidate_caches()

    def find_distributions(self, *args, **kwargs):  # metadata stays visible (pytest finds its plugins by it)
        return self.finder.find_distributions(*args, **kwargs)


sys.meta_path[:] = [Installed(f) if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
import pytest

status = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu", *sys.argv[2:]])
sys.stdout.flush(), sys.stderr.flush()
os._exit(int(status))  # collected or not is printed: the interpreter's teardown checks nothing
"""


@pytest.mark.subprocess
def test_the_gpu_checks_pytest_collects_with_only_what_the_check_brings():
    """pytest -m gpu over the marked files, as scripts/gpu_check.sh runs it, collects (tests/conftest.py and its
    plugins included) with nothing importable but what a GPU machine has (torch, numpy, pyarrow, pandas, pytest and
    what they require) and the check's wheels; so another import there is a wheel to add to the check, not a surprise
    on the lent machine."""
    script = (REPO_ROOT / "scripts" / "gpu_check.sh").read_text()
    wheels = [name for group in ("RUNTIME", "TESTS", "SWEEP")
              for name in re.search(rf"^{group}=\(([^)]*)\)", script, re.M).group(1).split()]
    files = sorted(str(path.relative_to(REPO_ROOT)) for path in (REPO_ROOT / "tests").rglob("test_*.py")
                   if re.search(r"pytest\.mark\.gpu\b", path.read_text()))
    there = ["torch", "numpy", "pyarrow", "pandas", "pytest", *wheels]
    done = subprocess.run([sys.executable, "-c", _COLLECTION_PROBE, " ".join(there), *files], cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "error" not in done.stdout.lower().splitlines()[-1], done.stdout[-3000:]


def test_the_gpu_check_brings_every_listed_package():
    """scripts/gpu_check.sh's runtime wheels are bench.gpu.GPU_PACKAGES' distributions (those torch does not bring)."""
    script = (REPO_ROOT / "scripts" / "gpu_check.sh").read_text()
    runtime = re.search(r"^RUNTIME=\(([^)]*)\)", script, re.M).group(1).split()
    normal = {re.sub(r"[-_.]+", "-", name).lower() for name in runtime}
    wanted = {re.sub(r"[-_.]+", "-", dist).lower() for dist in gpu.GPU_PACKAGES.values()} - {"numpy", "pyarrow"}
    assert wanted == normal


@pytest.mark.parametrize(("schedule", "refused"), [("0 3 * * 0", False), ("*/15 * * * 1-5", False), ("@daily", False),
                                                   ("0 0 1 jan-mar mon", False), ("0 0 * * 5#3", False),
                                                   ("every sunday", True), ("61 * * * *", True), ("0 3 * *", True),
                                                   ("0 25 * * *", True), ("0 0 * * 0/0", True)])
def test_without_croniter_the_retrain_schedule_is_still_checked_for_its_shape(write_config, storage_root, monkeypatch,
                                                                              schedule, refused):
    """A GPU machine has no croniter (Airflow's cron parser): config validation does not need it, and a schedule that is
    no cron expression is still refused there, naming the key."""
    from stagewise.core.errors import UserError
    from stagewise.definitions.loading import load_config
    from tests.conftest import base_config

    monkeypatch.setitem(sys.modules, "croniter", None)  # import croniter raises ImportError
    raw = base_config(storage_root)
    raw["retrain"] = {"schedule": schedule}
    if refused:
        with pytest.raises(UserError, match=re.escape(f"retrain.schedule: '{schedule}' is not a cron expression")):
            load_config(write_config(raw))
    else:
        assert load_config(write_config(raw)).retrain.schedule == schedule


def test_every_test_that_needs_cuda_is_marked_gpu():
    """A test module that skips without CUDA carries the gpu marker, so `pytest -m gpu` (make gpu-check) runs it and
    `make test-fast` leaves it out; and the check's test files are exactly the marked ones."""
    needs_cuda, marked = set(), set()
    for path in sorted((REPO_ROOT / "tests").rglob("test_*.py")):
        text = path.read_text()
        if re.search(r"skipif\(\s*not torch\.cuda\.is_available\(\)", text):
            needs_cuda.add(path.name)
        if re.search(r"pytest\.mark\.gpu\b", text):
            marked.add(path.name)
    assert needs_cuda and needs_cuda <= marked, needs_cuda - marked
    assert {"test_train_cuda.py", "test_infer_cuda.py"} <= marked


_JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" time="12.5">
<testcase classname="tests.tasks.test_train_cuda" name="test_a" time="1"/>
<testcase classname="tests.tasks.test_train_cuda" name="test_b" time="1"/>
<testcase classname="tests.tasks.test_train_cuda" name="test_c" time="1"><failure message="AssertionError: low">x</failure></testcase>
<testcase classname="tests.tasks.test_train_cuda" name="test_d" time="0"><skipped message="no optuna"/></testcase>
</testsuite></testsuites>"""


def test_the_gpu_check_shows_the_tests_and_every_gpu_benchmark_in_one_table(no_cuda, tmp_path):
    """python -m bench.gpu run then report (what scripts/gpu_check.sh ends with): one table with the tests' counts and
    a row per GPU benchmark; its numbers in gpu_check.json; exit 1 while a test failed; the results merged into
    latest.json of the same folder."""
    assert gpu.main(["run", "--out", str(tmp_path)]) == 0
    junit = tmp_path / "gpu_tests.xml"
    junit.write_text(_JUNIT)
    text = gpu.report(tmp_path, junit)
    rows = {line.split()[0]: line for line in text.splitlines()[2:] if line and not line.startswith(" ")}
    assert "2 " in rows["pytest"] and "1 failed, 0 errors, 1 skipped" in rows["pytest"]
    assert all("skipped: no CUDA" in rows[name] for name in GPU_BENCHMARKS)
    assert "failed: tests.tasks.test_train_cuda::test_c: AssertionError: low" in text
    checked = json.loads((tmp_path / "gpu_check.json").read_text())
    assert checked["tests"]["passed"] == 2 and [entry["name"] for entry in checked["benchmarks"]] == GPU_BENCHMARKS
    assert [entry["name"] for entry in json.loads((tmp_path / "latest.json").read_text())["results"]] == GPU_BENCHMARKS
    assert gpu.main(["report", "--out", str(tmp_path), "--junit", str(junit)]) == 1
    assert "did not finish" in gpu.report(tmp_path, tmp_path / "absent.xml")


def test_the_fsdp_gpu_benchmark_measures_each_side_and_what_fsdp_adds_per_step():
    """fsdp_throughput_gpu's sides run for real (here on the CPU, tiny): ddp at its defaults, ddp eager and fsdp each
    train and report samples/s, and the ratio and the per-step cost are computed from the two eager sides."""
    measured = gpu._fsdp_vs_ddp(torch.device("cpu"), rows=4000, hidden=32, batch=128, epochs=2)
    assert [measured[side]["strategy"] for side in ("ddp_defaults", "ddp", "fsdp")] == ["ddp", "ddp", "fsdp"]
    assert measured["ddp"]["step_graph"]["why"] == "cuda_graph off"
    rates = {side: measured[side]["samples_per_s"] for side in ("ddp", "fsdp")}
    assert all(rate > 0 for rate in rates.values()) and measured["fsdp"]["val_accuracy"] > 0.5
    assert measured["fsdp_vs_ddp"] == pytest.approx(rates["fsdp"] / rates["ddp"], abs=1e-4)
    assert measured["fsdp_adds_ms_per_step"] == pytest.approx(128_000 / rates["fsdp"] - 128_000 / rates["ddp"], abs=1e-3)
