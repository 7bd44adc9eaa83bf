"""A user's script in the DDP-tutorial style: it loads ``snapshot.pt`` from its cwd if one is there, then writes one.

Run by tests/plugins/test_byo_stage.py through the launcher, as a stage's ``entrypoint: {script: ...}``.
``--write-outputs`` also leaves (placeholder) final.pt and model.pt in STAGEWISE_OUTPUT_DIR, and
``--params JSON`` reports the hyperparameters it trained with in its result JSON.
"""

from __future__ import annotations

import argparse
import json
import os

parser = argparse.ArgumentParser()
parser.add_argument("--write-outputs", action="store_true")
parser.add_argument("--params", type=json.loads, default=None)
args = parser.parse_args()
found = os.path.exists("snapshot.pt")
with open("snapshot.pt", "w") as handle:
    handle.write("epoch 3")
if int(os.environ.get("RANK", "0")) == 0:
    if args.write_outputs:
        out = os.environ["STAGEWISE_OUTPUT_DIR"]
        os.makedirs(out, exist_ok=True)
        for name in ("final.pt", "model.pt"):
            with open(os.path.join(out, name), "w") as handle:
                handle.write(f"{name} of {os.environ['STAGEWISE_STAGE']} in {out}")
    result = {"found_snapshot": found, "cwd": os.getcwd()}
    if args.params is not None:
        result["params"] = args.params
    with open(os.environ["STAGEWISE_RESULT_FILE"], "w") as handle:
        json.dump(result, handle)
