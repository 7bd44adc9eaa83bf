"""A DDP script written the way PyTorch's DDP tutorial writes one (multigpu_torchrun.py), run by Stagewise.

The same file is every sweep trial (``sweep.entrypoint``) and both training stages (``entrypoint`` of each
stage) of examples/ddp_tutorial.yaml. Besides the tutorial's shape (a ``Trainer`` that resumes from its
snapshot, ``_run_epoch``, ``_save_snapshot``, ``train``; ``main`` with ``init_process_group`` and a
DataLoader over a DistributedSampler) only the lines marked ``# stagewise:`` are new: model, data, epochs,
batch and lr come from the runtime helper in ``stagewise.spec``, the snapshot lives in ``checkpoint_dir()``,
a later stage starts from ``init_from()``, ``report`` after each epoch's validation stops a pruned trial,
and ``save_model`` hands the result to the next stage, evaluation, the registry and inference.

Run: ``STAGEWISE_CONFIG=examples/ddp_tutorial.yaml make demo``.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

from stagewise import spec  # stagewise: the runtime helper, the one module a user script imports


class Trainer:
    """Trains a model with DDP, snapshotting every ``save_every`` epochs so a restarted job picks up where it was."""

    def __init__(self, model: torch.nn.Module, train_data: DataLoader, val_data: DataLoader,
                 optimizer: torch.optim.Optimizer, save_every: int, snapshot_path: str) -> None:
        self.rank = dist.get_rank()
        self.model = model
        self.train_data = train_data
        self.val_data = val_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        snapshot = spec.load_state(snapshot_path)  # stagewise: (torch.load of a local path in the tutorial)
        if snapshot is not None:
            self._load_snapshot(snapshot)
        elif spec.init_from():  # stagewise: a later stage starts from the previous stage's model and optimizer
            self._load_state(spec.load_state(spec.init_from()))
        self.model = DDP(self.model)

    def _load_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        spec.load_optimizer(self.model, self.optimizer, state)  # stagewise: a script's or a built-in stage's
        for group in self.optimizer.param_groups:  # this stage's lr, not the one saved with the optimizer
            group["lr"] = spec.context().lr  # stagewise:

    def _load_snapshot(self, snapshot: dict) -> None:
        self._load_state(snapshot)
        self.epochs_run = snapshot["epochs_run"]
        print(f"resuming training from snapshot at epoch {self.epochs_run}")

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(source), targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch: int) -> None:
        self.model.train()
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def _validate(self) -> dict[str, float]:
        """Accuracy and loss over the whole validation split: sums and counts all-reduced, so every rank has them."""
        self.model.eval()
        totals = torch.zeros(3, dtype=torch.float64)  # correct, summed loss, rows
        with torch.no_grad():
            for source, targets in self.val_data:
                output = self.model.module(source)
                totals += torch.tensor([(output.argmax(1) == targets).sum().item(),
                                        F.cross_entropy(output, targets, reduction="sum").item(), len(targets)],
                                       dtype=torch.float64)
        dist.all_reduce(totals)
        return {"accuracy": float(totals[0] / totals[2]), "loss": float(totals[1] / totals[2])}

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {"model": self.model.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "epochs_run": epoch + 1}
        spec.save_state(self.snapshot_path, snapshot)  # stagewise: rank 0 writes, to any storage
        print(f"epoch {epoch} | training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if spec.report(epoch, self._validate()):  # stagewise: progress, and a pruned trial stops here
                break
            if self.rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def load_train_objs() -> tuple[Dataset, Dataset, torch.nn.Module, torch.optim.Optimizer]:
    train_set, val_set = spec.read_split("train"), spec.read_split("validation")  # stagewise: the committed splits
    model = spec.build_model()  # stagewise: the config's model spec with this run's hyperparameters
    params = spec.hyperparameters()  # stagewise: the trial's suggestion or the stage's (the sweep's best)
    optimizer = torch.optim.SGD(model.parameters(), lr=spec.context().lr, momentum=params["momentum"],  # stagewise:
                                weight_decay=params["weight_decay"])
    return train_set, val_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, pin_memory=False, shuffle=False,
                      sampler=DistributedSampler(dataset, seed=spec.context().seed))


def main(save_every: int = 1) -> None:
    dist.init_process_group("gloo")  # one CPU process per rank (the tutorial: "nccl" and a GPU each)
    torch.set_num_threads(1)
    run = spec.context()  # stagewise: epochs, per-process batch, rescaled lr, seed
    train_set, val_set, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(train_set, run.per_process_batch)
    val_data = DataLoader(Subset(val_set, range(run.rank, len(val_set), run.world_size)), batch_size=1024)
    trainer = Trainer(model, train_data, val_data, optimizer, save_every, f"{spec.checkpoint_dir()}/snapshot.pt")  # stagewise:
    trainer.train(run.epochs)
    spec.save_model(trainer.model, optimizer=optimizer)  # stagewise: model.pt and final.pt for what comes next
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    # stagewise: the tutorial's total_epochs and batch_size come from the run (spec.context()), not arguments
    parser.add_argument("--save-every", type=int, default=1, help="How often to save a snapshot (epochs)")
    main(parser.parse_args().save_every)
