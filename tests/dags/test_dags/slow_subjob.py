"""A sub-job that sleeps, printing a line every few seconds, then exits with the code asked for.

Run: ``python -m tests.dags.test_dags.slow_subjob SECONDS [--exit-code N] [--result-file F]``
(without --result-file the result goes to $STAGEWISE_RESULT_FILE, where the launcher looks).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from stagewise.core.cli import run_subjob


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("seconds", type=float)
    parser.add_argument("--exit-code", type=int, default=0)
    parser.add_argument("--result-file", default=os.environ.get("STAGEWISE_RESULT_FILE"))
    args = parser.parse_args()

    def work() -> dict:
        started = time.monotonic()
        while (left := args.seconds - (time.monotonic() - started)) > 0:
            print(f"slow sub-job: {left:.0f}s left", flush=True)
            time.sleep(min(5.0, left))
        if args.exit_code:
            sys.exit(args.exit_code)
        print("slow sub-job: done", flush=True)
        return {"slept_s": round(time.monotonic() - started, 3)}

    run_subjob("slow", work, args.result_file)


if __name__ == "__main__":
    main()
