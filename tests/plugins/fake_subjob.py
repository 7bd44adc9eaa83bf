"""A sub-job that fails, hangs or logs at every level on purpose, to test the launcher.

Run: ``python -m tests.plugins.fake_subjob ok|user-error|user-error-every-rank|crash|hang|noisy --result-file F [--pid-file P]``
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time

from stagewise.core import contract
from stagewise.core.cli import run_subjob
from stagewise.core.errors import DataError


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["ok", "user-error", "user-error-every-rank", "crash", "hang", "noisy"])
    parser.add_argument("--result-file")
    parser.add_argument("--pid-file")
    args = parser.parse_args()

    def work() -> dict:
        print("fake sub-job started", flush=True)
        if args.mode == "user-error-every-rank":  # as a second rank that hit the same error would have left it
            with open(os.environ[contract.ERROR_FILE], "a") as handle:
                handle.write("raw/x.parquet: column 'label' is missing\n")
        if args.mode.startswith("user-error"):
            raise DataError("raw/x.parquet: column 'label' is missing")
        if args.mode == "crash":
            sys.exit(7)
        if args.mode == "noisy":
            logging.getLogger("stagewise.train").info("epoch 1/3 step 10 lr 0.05 loss 1.2 ETA 0:00:42")
            logging.getLogger("stagewise.train").warning("validation loss rose two epochs in a row")
            print("a plain line from a user's print", flush=True)
            logging.getLogger("stagewise.train").error("checkpoint upload failed, retrying")
        if args.mode == "hang":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
            with open(args.pid_file, "w") as handle:
                handle.write(str(child.pid))
            time.sleep(300)
        return {"answer": 42}

    run_subjob("fake", work, args.result_file)


if __name__ == "__main__":
    main()
