"""Run: ``python -m bench [--only name,name] [--list]`` (``make bench ONLY=a,b``)."""

from __future__ import annotations

import argparse
import logging
import sys

from bench.harness import RESULTS, merge, run_one, table
from bench.registry import BENCHMARKS


def main() -> None:
    parser = argparse.ArgumentParser(description="Stagewise benchmarks: ours vs a baseline, as ratios.")
    parser.add_argument("--only", default="", help="comma-separated benchmark names (default: all)")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and their goals")
    args = parser.parse_args()
    if args.list:
        for name, (function, goal) in BENCHMARKS.items():
            print(f"{name:26} {goal:8} {function.__doc__.splitlines()[0]}")
        return
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        sys.exit(f"unknown benchmark(s) {unknown}; known: {', '.join(BENCHMARKS)}")
    logging.basicConfig(level=logging.WARNING)
    results = []
    for name in names:
        print(f"running {name} ...", flush=True)
        results.append(run_one(name))
        print(table(results[-1:]), flush=True)
    merge(results)
    print(f"\n{table(results)}\n\nmerged into {RESULTS}")


if __name__ == "__main__":
    main()
