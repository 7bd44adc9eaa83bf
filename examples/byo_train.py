"""A user's own DDP training script, run by Stagewise as a stage (bring your own script).

Run under the pipeline by naming it in a stage (see docs/your-own-script.md):

    - name: custom
      profile: ddp2
      per_process_batch: 64
      epochs: 3
      entrypoint: {script: examples/byo_train.py, args: ["--hidden", "{hidden}"]}   # {hidden}: the sweep's best

It imports only ``stagewise.spec`` (and torch): the committed splits (read_split), the config's model
(build_model, here with the script's own --hidden), the stage's batch, epochs and rescaled lr (context),
checkpoints in checkpoint_dir() resumed on retry, a progress line per epoch (report) and final.pt and
model.pt for what comes next (save_model). A small JSON result in $STAGEWISE_RESULT_FILE (its ``params``,
the ones it trained with, go into the model card) is optional.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from stagewise.spec import build_model, checkpoint_dir, context, load_state, read_split, report, save_model, save_state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=64, help="hidden width (the script's own argument)")
    args = parser.parse_args()
    run = context()
    if run.world_size > 1:
        dist.init_process_group("gloo")
    torch.set_num_threads(1)
    train, validation = read_split("train"), read_split("validation")
    x, y = train.tensors[0][run.rank::run.world_size], train.tensors[1][run.rank::run.world_size]  # this rank's rows
    x_val, y_val = validation.tensors

    model = build_model(hidden=args.hidden, dropout=0.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=run.lr, momentum=0.9)  # lr: already rescaled for the global batch
    checkpoint = f"{checkpoint_dir()}/byo.pt"
    start_epoch = 0
    if (state := load_state(checkpoint)) is not None:  # an Airflow retry: pick up where the last attempt stopped
        model.load_state_dict(state["model"])  # on GPUs: move the model first, then load the optimizer
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1
    ddp = DistributedDataParallel(model) if run.world_size > 1 else model
    steps = len(y) // run.per_process_batch
    if run.world_size > 1:  # every rank must take the same number of steps
        count = torch.tensor([steps])
        dist.all_reduce(count, op=dist.ReduceOp.MIN)
        steps = int(count)
    accuracy = float("nan")
    for epoch in range(start_epoch, run.epochs):
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(epoch))
        for step in range(steps):
            index = order[step * run.per_process_batch : (step + 1) * run.per_process_batch]
            loss = F.cross_entropy(ddp(x[index]), y[index])
            optimizer.zero_grad()
            loss.backward()
            loss = loss.detach()
            optimizer.step()
        with torch.no_grad():  # every rank scores the whole validation split: the same value everywhere
            accuracy = float((model(x_val).argmax(1) == y_val).float().mean())
        report(epoch, {"accuracy": accuracy, "train_loss": loss.item()})
        save_state(checkpoint, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch})
    save_model(model, optimizer=optimizer)
    if run.master:
        seen = {name: os.environ.get(name) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        with open(os.environ["STAGEWISE_RESULT_FILE"], "w") as handle:
            params = {"hidden": args.hidden, "optimizer": "sgd", "momentum": 0.9, "lr": run.lr}  # what this script trained with
            json.dump({"val_metric": accuracy, "world_size": run.world_size, "torchrun_env": seen, "args": vars(args),
                       "params": params}, handle)
    if run.world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
