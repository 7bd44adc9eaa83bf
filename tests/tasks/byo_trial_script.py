"""A user's trial script whose behaviour is set by its trial number (run by tests/tasks/test_sweep_byo.py).

trial 0 reports accuracy 0.9 for every epoch; trial 1 reports 0.1 until pruned; trial 2 exits with code 3 after
one good report; trial 3 exits 0 without reporting. It also records its cwd, args and lr to check what it was given.
"""

import json
import os
import sys

from stagewise.spec import context, hyperparameters, report

ctx = context()
with open(os.path.join(os.environ["BYO_TRIAL_LOG"], f"trial{ctx.trial}.json"), "w") as handle:
    json.dump({"cwd": os.getcwd(), "args": sys.argv[1:], "params": hyperparameters(), "epochs": ctx.epochs,
               "per_process_batch": ctx.per_process_batch}, handle)
if ctx.trial == 3:
    sys.exit(0)
for epoch in range(ctx.epochs):
    if report(epoch, {"accuracy": 0.1 if ctx.trial == 1 else 0.9, "loss": 1.0 / (epoch + 1)}):
        break
    if ctx.trial == 2:
        sys.exit(3)
