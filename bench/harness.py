"""Run benchmarks, judge each ratio against its goal, and merge the results into bench/results/latest.json."""

from __future__ import annotations

import json
import operator
import os
import platform
import time
import traceback
from pathlib import Path
from typing import Any

from bench.registry import BENCHMARKS

RESULTS = Path(__file__).resolve().parent / "results" / "latest.json"
_COMPARE = {">=": operator.ge, "<=": operator.le}


def goal_met(ratio: float, goal: str) -> bool:
    """``goal`` is '>= 0.95' or '<= 1.5'."""
    sign, value = goal.split()
    return _COMPARE[sign](ratio, float(value))


def machine() -> dict[str, Any]:
    import pandas
    import pyarrow
    import torch

    return {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "pyarrow": pyarrow.__version__, "pandas": pandas.__version__, "platform": platform.platform()}


def run_one(name: str) -> dict[str, Any]:
    function, goal = BENCHMARKS[name]
    started = time.perf_counter()
    try:
        measured = function()
    except Exception as exc:  # a broken benchmark is reported, not fatal: the others still run
        return {"name": name, "goal": goal, "met": False, "error": f"{type(exc).__name__}: {exc}",
                "trace": traceback.format_exc()[-2000:]}
    ratio = measured["ours"] / measured["baseline"]
    return {"name": name, "ours": round(measured["ours"], 4), "baseline": round(measured["baseline"], 4),
            "ratio": round(ratio, 4), "unit": measured["unit"], "goal": goal, "met": goal_met(ratio, goal),
            "details": measured.get("details", {}), "seconds": round(time.perf_counter() - started, 1),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def merge(results: list[dict[str, Any]], path: Path = RESULTS) -> dict[str, Any]:
    """Replace the entries of the benchmarks just run, keep the others; write atomically."""
    existing = json.loads(path.read_text()) if path.exists() else {"results": []}
    fresh = {result["name"] for result in results}
    kept = [entry for entry in existing.get("results", []) if entry["name"] not in fresh]
    order = list(BENCHMARKS)
    merged = sorted(kept + results, key=lambda entry: order.index(entry["name"]) if entry["name"] in order else len(order))
    document = {"machine": machine(), "results": merged}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(document, indent=2) + "\n")
    os.replace(tmp, path)
    return document


def table(results: list[dict[str, Any]]) -> str:
    lines = [f"{'benchmark':26} {'ours':>14} {'baseline':>14} {'ratio':>8}  {'goal':8} met   unit"]
    for entry in results:
        if "error" in entry:
            lines.append(f"{entry['name']:26} ERROR {entry['error'][:80]}")
            continue
        lines.append(f"{entry['name']:26} {entry['ours']:>14.4g} {entry['baseline']:>14.4g} {entry['ratio']:>8.3f}  "
                     f"{entry['goal']:8} {'yes' if entry['met'] else 'NO ':3}   {entry['unit']}")
    return "\n".join(lines)
