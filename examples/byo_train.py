"""A user's own DDP training script, run by Stagewise as a stage (bring your own script).

Run under the pipeline by naming it in a stage (see README, "Bring your own script"):

    - name: custom
      profile: ddp2
      per_process_batch: 64
      epochs: 3
      entrypoint: {script: examples/byo_train.py, args: ["--hidden", "{hidden}"]}   # {hidden}: the sweep's best

or alone: ``STAGEWISE_DATA_MANIFEST=... STAGEWISE_OUTPUT_DIR=... torchrun --nproc-per-node 2 examples/byo_train.py``.
It uses only torchrun's variables and the STAGEWISE_* contract: data through the committed manifest,
checkpoints in STAGEWISE_CHECKPOINT_DIR (resumed on retry), final.pt and model.pt in
STAGEWISE_OUTPUT_DIR, and a small JSON result in STAGEWISE_RESULT_FILE (its ``params``, the ones it
trained with, go into the model card).
"""

from __future__ import annotations

import argparse
import json
import os

import fsspec
import numpy as np
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from tasks.model import MLPClassifier, build, data_info, load_torch, restore_training_state, save_bundle, save_torch
from tasks.preprocess import feature_matrix
from tasks.spec import SpecRef


def read_files(uris: list[str], label: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Processed shards hold the label and each row's float32 feature vector in a 'features' column."""
    xs, ys = [], []
    for uri in uris:
        with fsspec.open(uri, "rb") as handle:
            table = pq.read_table(handle, columns=[label, "features"])
        xs.append(feature_matrix(table))  # the float32 row vectors as a (rows, features) matrix
        ys.append(table.column(label).to_numpy())
    return torch.from_numpy(np.concatenate(xs)), torch.from_numpy(np.concatenate(ys).astype(np.int64))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=64, help="hidden width (the script's own argument)")
    args = parser.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    with fsspec.open(os.environ["STAGEWISE_DATA_MANIFEST"], "r") as handle:
        manifest = json.load(handle)
    files = [entry["uri"] for entry in manifest["splits"]["train"]]
    x, y = read_files(files[rank::world], manifest["label"])  # this rank's files only
    x_val, y_val = read_files([e["uri"] for e in manifest["splits"]["validation"]], manifest["label"])

    data, params = data_info(manifest), {"hidden": args.hidden, "dropout": 0.0}
    torch.manual_seed(int(os.environ.get("STAGEWISE_SEED", 0)))
    model = build(MLPClassifier(), data, params)
    lr = float(os.environ["STAGEWISE_LR"])  # already rescaled for this stage's global batch
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    checkpoint = f"{os.environ['STAGEWISE_CHECKPOINT_DIR']}/byo.pt"
    fs = fsspec.core.url_to_fs(checkpoint)[0]
    start_epoch = 0
    if fs.exists(checkpoint):  # an Airflow retry: pick up where the last attempt stopped
        state = load_torch(checkpoint)
        restore_training_state(model, optimizer, state, "cpu")  # on GPUs: the model's device, before its optimizer loads
        start_epoch = state["epoch"] + 1
    ddp = DistributedDataParallel(model) if world > 1 else model
    batch = int(os.environ["STAGEWISE_PER_PROCESS_BATCH"])
    epochs = int(os.environ["STAGEWISE_EPOCHS"])
    steps = len(y) // batch
    if world > 1:  # every rank must take the same number of steps
        count = torch.tensor([steps])
        dist.all_reduce(count, op=dist.ReduceOp.MIN)
        steps = int(count)
    for epoch in range(start_epoch, epochs):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(epoch))
        for step in range(steps):
            index = order[step * batch : (step + 1) * batch]
            loss = F.cross_entropy(ddp(x[index]), y[index])
            optimizer.zero_grad()
            loss.backward()
            loss = loss.detach()
            optimizer.step()
        with torch.no_grad():
            accuracy = float((model(x_val).argmax(1) == y_val).float().mean())
        if rank == 0:
            print(f"byo epoch {epoch + 1}/{epochs}: loss {loss.item():.4f}, val_accuracy {accuracy:.4f}", flush=True)
            save_torch(checkpoint, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch})
    if rank == 0:
        out = os.environ["STAGEWISE_OUTPUT_DIR"]
        save_torch(f"{out}/final.pt", {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                       "global_batch": int(os.environ["STAGEWISE_GLOBAL_BATCH"])})
        save_bundle(f"{out}/model.pt", model, SpecRef("tasks.model:MLPClassifier"), data, params,
                    {key: manifest[key] for key in ("features", "mean", "std", "key", "label")},
                    {"stage": os.environ["STAGEWISE_STAGE"], "val_metric": accuracy})
        seen = {name: os.environ.get(name) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        with open(os.environ["STAGEWISE_RESULT_FILE"], "w") as handle:
            params = {"hidden": args.hidden, "optimizer": "sgd", "momentum": 0.9, "lr": lr}  # what this script trained with
            json.dump({"val_metric": accuracy, "world_size": world, "torchrun_env": seen, "args": vars(args), "params": params},
                      handle)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
