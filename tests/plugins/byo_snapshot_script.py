"""A user's script in the DDP-tutorial style: it loads ``snapshot.pt`` from its cwd if one is there, then writes one.

Run by tests/plugins/test_byo_stage.py through the launcher, as a stage's ``entrypoint: {script: ...}``.
"""

from __future__ import annotations

import json
import os

found = os.path.exists("snapshot.pt")
with open("snapshot.pt", "w") as handle:
    handle.write("epoch 3")
if int(os.environ.get("RANK", "0")) == 0:
    with open(os.environ["STAGEWISE_RESULT_FILE"], "w") as handle:
        json.dump({"found_snapshot": found, "cwd": os.getcwd()}, handle)
