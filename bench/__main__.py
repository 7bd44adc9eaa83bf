"""Run: ``python -m bench [--only name,name] [--rows N] [--list]`` (``make bench ONLY=a,b``).

Exits 0 when every benchmark ran or was skipped (a GPU benchmark without CUDA), whether or not it met
its goal (a missed goal is reported in the table and in bench/results/latest.json, never a failure);
exits 1 only when a benchmark raised. Benchmark modules are imported only when they run.
"""

from __future__ import annotations

import argparse
import logging
import sys

from bench.harness import RESULTS, merge, run_one, table
from bench.registry import BENCHMARKS, load


def summary(name: str) -> str:
    """The first line of benchmark ``name``'s docstring, for ``--list``; what stands in where it has none or cannot load."""
    try:
        doc = load(name).__doc__ or ""
    except ImportError as exc:  # e.g. a GPU box without Airflow: list it all the same
        return f"(cannot import here: {exc})"
    # A function without a docstring listed as such (cache_rerun had none: --list ended in an IndexError).
    return next((line.strip() for line in doc.splitlines() if line.strip()), "(no description)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench",
                                     description="Stagewise benchmarks: ours vs a baseline in the same run, as ratios.")
    parser.add_argument("--only", default="", help="comma-separated benchmark names (default: all)")
    parser.add_argument("--rows", type=int, default=None,
                        help="data size for the benchmarks that take one (default: each benchmark's own)")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and their goals")
    args = parser.parse_args(argv)
    if args.list:
        for name, (_, goal) in BENCHMARKS.items():
            print(f"{name:26} {goal:8} {summary(name)}")
        return 0
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; known: {', '.join(BENCHMARKS)}")
    if args.rows is not None and args.rows <= 0:
        parser.error("--rows must be positive")
    logging.basicConfig(level=logging.WARNING)
    results = []
    for name in names:
        print(f"running {name} ...", flush=True)
        results.append(run_one(name, rows=args.rows))
        print(table(results[-1:]).splitlines()[-1], flush=True)
    merge(results)
    print(f"\n{table(results)}\n\nmerged into {RESULTS}")
    missed = [entry["name"] for entry in results if entry.get("met") is False and "error" not in entry]
    if missed:
        print(f"goal missed (reported, not a failure): {', '.join(missed)}")
    failed = [entry["name"] for entry in results if "error" in entry]
    if failed:
        for entry in results:
            if "error" in entry:
                print(f"\n{entry['name']} raised:\n{entry['trace']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
