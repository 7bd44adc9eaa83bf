"""Run benchmarks, judge each ratio against its goal, and merge the results into bench/results/latest.json.

Run: ``python -m bench [--only a,b] [--rows N]`` (``make bench ONLY=a,b``). A result entry is
``{"name", "ours", "baseline", "ratio", "unit", "goal", "met", "details", "seconds", "measured_at"}``;
a benchmark that raised is recorded as ``{"name", "goal", "met": false, "error", "trace"}``; one that cannot run
here (:class:`BenchmarkSkipped`, e.g. a GPU benchmark without CUDA) as ``{"name", "goal", "skipped", "measured_at"}``,
counted neither met nor missed, never with a number.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import inspect
import json
import operator
import os
import platform
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from bench.registry import BENCHMARKS, load

RESULTS = Path(__file__).resolve().parent / "results" / "latest.json"
_COMPARE = {">=": operator.ge, "<=": operator.le}


class BenchmarkSkipped(Exception):
    """This machine cannot run the benchmark (the message says why, e.g. 'no CUDA'): recorded as skipped."""


def goal_met(ratio: float, goal: str) -> bool | None:
    """``goal`` is '>= 0.95' or '<= 1.5'; 'info' (a figure kept for information, judged elsewhere) meets none: None."""
    if goal == "info":
        return None
    sign, value = goal.split()
    return _COMPARE[sign](ratio, float(value))


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)  # no import: torch alone would cost seconds
    except importlib.metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": _version("torch"),
            "pyarrow": _version("pyarrow"), "pandas": _version("pandas"), "numpy": _version("numpy"),
            "airflow": _version("apache-airflow"), "platform": platform.platform()}


def run_one(name: str, rows: int | None = None) -> dict[str, Any]:
    """Run one benchmark; ``rows`` overrides its data size where it takes one (its default otherwise)."""
    goal = BENCHMARKS[name][1]
    started = time.perf_counter()
    try:
        function = load(name)
        kwargs = {"rows": rows} if rows and "rows" in inspect.signature(function).parameters else {}
        measured = function(**kwargs)
        # A benchmark whose two sides run in alternating pairs may give the median of the pairs' ratios itself.
        ratio = measured.get("ratio", measured["ours"] / measured["baseline"])
    except BenchmarkSkipped as skipped:
        return {"name": name, "goal": goal, "skipped": str(skipped),
                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    except Exception as exc:  # a broken benchmark is reported, not fatal: the others still run
        return {"name": name, "goal": goal, "met": False, "error": f"{type(exc).__name__}: {exc}",
                "trace": traceback.format_exc()[-2000:]}
    met = goal_met(ratio, goal)
    if met and measured.get("also_met") is False:  # a goal of its own besides the ratio (runs_page_10k: <= 0.5 s)
        met = False
    return {"name": name, "ours": round(measured["ours"], 4), "baseline": round(measured["baseline"], 4),
            "ratio": round(ratio, 4), "unit": measured["unit"], "goal": goal, "met": met,
            "details": measured.get("details", {}), "seconds": round(time.perf_counter() - started, 1),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def merge(results: list[dict[str, Any]], path: Path = RESULTS) -> dict[str, Any]:
    """Replace the entries of the benchmarks just run, keep the others; write atomically.

    A lock on the results folder serialises concurrent ``make bench ONLY=...`` runs, so neither loses
    the other's entries (and no lock file is left behind for git to see).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        existing = json.loads(path.read_text()) if path.exists() else {"results": []}
        fresh = {result["name"] for result in results}
        kept = [entry for entry in existing.get("results", []) if entry["name"] not in fresh]
        order = list(BENCHMARKS)
        merged = sorted(kept + results,
                        key=lambda entry: order.index(entry["name"]) if entry["name"] in order else len(order))
        document = {"machine": machine(), "results": merged}
        handle = tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name + ".", suffix=".tmp", delete=False)
        try:
            with handle:
                handle.write(json.dumps(document, indent=2) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(handle.name, 0o644)
            os.replace(handle.name, path)  # readers see the old file or the new one, never half of one
        except BaseException:
            Path(handle.name).unlink(missing_ok=True)
            raise
    finally:
        os.close(folder)  # closing releases the lock
    return document


def _number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


def _met(met: bool | None) -> str:
    return "-" if met is None else "yes" if met else "NO"


def table(results: list[dict[str, Any]]) -> str:
    """A fixed-width table: name, ours, baseline, ratio, goal, met, unit."""
    lines = [f"{'benchmark':26} {'ours':>12} {'baseline':>12} {'ratio':>7}  {'goal':8} {'met':4} unit",
             "-" * 92]
    for entry in results:
        if "error" in entry:
            lines.append(f"{entry['name']:26} ERROR {entry['error'][:80]}")
            continue
        if "skipped" in entry:
            lines.append(f"{entry['name']:26} {'skipped: ' + entry['skipped']:>40}  {entry['goal']:8} -")
            continue
        lines.append(f"{entry['name']:26} {_number(entry['ours']):>12} {_number(entry['baseline']):>12} "
                     f"{entry['ratio']:>7.3f}  {entry['goal']:8} {_met(entry['met']):4} {entry['unit']}")
    return "\n".join(lines)
