"""The runtime helper of your own torchrun script, as a training stage or as a sweep trial.

Import it through the one public module, ``stagewise.spec``::

    from stagewise.spec import build_model, checkpoint_dir, context, read_split, report, save_model

Everything comes from the STAGEWISE_* environment the framework sets (stagewise.core.contract), so the same
script runs as a stage (``train.stages[].entrypoint``) and as each trial of a sweep
(``sweep.entrypoint``). Only rank 0 logs, talks to the Optuna study and writes; every rank gets the
same answers. torch.distributed and Optuna are imported when first needed.
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass
from typing import Any

from stagewise.core import contract, storage
from stagewise.core.errors import UserError
from stagewise.datasets.manifest import load_split, read_manifest
from stagewise.definitions.loading import load_config
from stagewise.definitions.spec import SpecRef
from stagewise.models.building import data_info, model_for_run
from stagewise.models.bundle import preprocessing_of, save_bundle
from stagewise.models.torch_io import load_torch, save_torch
from stagewise.study.studies import make_pruner, open_storage
from stagewise.training.distributed import read_env
from stagewise.training.strategy import load_sharded_optimizer, sharded_optimizer_uri


@dataclass(frozen=True, kw_only=True)
class Context:
    """This run's values, read once from the environment: a stage's, or a sweep trial's (from ``sweep``)."""

    stage: str
    """The stage's name; ``trial-<number>`` in a sweep."""
    trial: int | None
    """The trial's number in the shared study; None in a stage."""
    epochs: int
    """Epochs to train (``sweep.epochs`` in a trial)."""
    warmup_steps: int
    """Optimizer steps to ramp the lr up linearly over (0: none; a trial's is 0)."""
    per_process_batch: int
    """Samples per process per micro-step (``sweep.batch_size`` in a trial)."""
    grad_accum_steps: int
    """Micro-steps accumulated per optimizer step."""
    global_batch: int
    """Samples per optimizer step over all processes."""
    lr: float
    """The learning rate, already rescaled for the global batch (a trial's lr is the suggested one)."""
    seed: int
    """The run's seed."""
    objective: str
    """The metric :func:`report` must get (``objective.metric``)."""
    rank: int
    """This process's global rank (torchrun's RANK)."""
    world_size: int
    """Processes in the job (torchrun's WORLD_SIZE)."""

    @property
    def master(self) -> bool:
        """Rank 0: the one process that logs, reports to the study and writes."""
        return self.rank == 0


def _env(name: str) -> str:
    value = os.environ.get(name)
    if value is None:
        raise UserError(f"${name} is not set: stagewise.spec's runtime helpers work in a script Stagewise launches "
                        f"(a train stage's or the sweep's entrypoint)")
    return value


def _fail(message: str) -> UserError:
    """A user error that fails the task without retry: rank 0 leaves the reason in $STAGEWISE_ERROR_FILE."""
    error_file = os.environ.get(contract.ERROR_FILE)
    if error_file and int(os.environ.get("RANK", "0")) == 0:
        with open(error_file, "w") as handle:
            handle.write(message)
    return UserError(message)


# When context() was first read: the script's start, for the ETA of its progress lines.
_started = [time.monotonic()]
# Rank 0's latest report in this process (save_model records its metrics in the bundle).
_latest: dict[str, Any] = {}
# The hyperparameters build_model last built with (save_model's bundle rebuilds the module from them).
_built: dict[str, Any] = {}


@functools.cache
def context() -> Context:
    """This run's stage values (epochs, batch sizes, rescaled lr, seed, objective) and rank, read once."""
    env = read_env("cpu")
    _started[0] = time.monotonic()
    trial = os.environ.get(contract.TRIAL_NUMBER)
    return Context(stage=_env(contract.STAGE), trial=int(trial) if trial else None, epochs=int(_env(contract.EPOCHS)),
                   warmup_steps=int(_env(contract.WARMUP_STEPS)),
                   per_process_batch=int(_env(contract.PER_PROCESS_BATCH)),
                   grad_accum_steps=int(_env(contract.GRAD_ACCUM_STEPS)), global_batch=int(_env(contract.GLOBAL_BATCH)),
                   lr=float(_env(contract.LR)), seed=int(_env(contract.SEED)), objective=_env(contract.OBJECTIVE),
                   rank=env.rank, world_size=env.world_size)


def hyperparameters() -> dict[str, Any]:
    """This run's hyperparameters: the trial's suggestion, or the stage's resolved ones (the sweep's best), with defaults."""
    return dict(json.loads(_env(contract.PARAMS)))


def checkpoint_dir() -> str:
    """Where to keep resumable snapshots: an Airflow retry of the stage finds them there (a URI or a local path)."""
    return _env(contract.CHECKPOINT_DIR)


def init_from() -> str | None:
    """The previous stage's ``final.pt`` to start from (:func:`load_state` reads it), or None in the first stage."""
    return os.environ.get(contract.INIT_FROM) or None


def load_state(uri: str) -> dict[str, Any] | None:
    """A state dict written by :func:`save_state` or :func:`save_model` (``final.pt``), or None if there is none yet."""
    return load_torch(uri) if storage.exists(uri) else None


def load_optimizer(module: Any, optimizer: Any, state: dict[str, Any]) -> bool:
    """The optimizer state a ``final.pt`` (``state``, from :func:`load_state`) hands on, loaded into ``optimizer`` over
    ``module`` (plain, not DDP-wrapped): held inline (a script's), or as a sharded checkpoint beside it (a built-in
    stage's: ``{"sharded_checkpoint": uri}``, read at any world size). Every rank calls it; False when ``state`` holds
    no optimizer state (the stage before set ``hand_on_optimizer: false``): keep the fresh one."""
    uri = sharded_optimizer_uri(state)
    if uri is not None:
        load_sharded_optimizer(module, optimizer, uri)
    elif state.get("optimizer") is not None:
        optimizer.load_state_dict(state["optimizer"])
    else:
        return False
    return True


def save_state(uri: str, state: dict[str, Any]) -> None:
    """Rank 0 writes ``state`` (tensors and plain values) atomically to ``uri``; other ranks do nothing."""
    if context().master:
        save_torch(uri, state)


@functools.cache
def _config() -> Any:
    return load_config(_env(contract.CONFIG), json.loads(os.environ.get(contract.OVERRIDES) or "{}"))


@functools.cache
def _manifest() -> dict[str, Any]:
    return read_manifest(_env(contract.DATA_MANIFEST))


def read_split(name: str) -> Any:
    """The whole committed split ``train``, ``validation`` or ``test`` as a TensorDataset of (float32 features, labels).

    Shard it with ``torch.utils.data.DistributedSampler`` as any DDP script does; labels are int64 for a
    class label and float32 otherwise. When the data set declares typed columns (int64, categorical,
    variable-length) each row is its stored record: turn a batch of them into :class:`Features` with
    :func:`features_of`.
    """
    import torch
    from torch.utils.data import TensorDataset

    manifest = _manifest()
    if name not in manifest["splits"]:
        raise _fail(f"read_split({name!r}): the preprocess manifest has splits {sorted(manifest['splits'])}")
    features, labels = load_split(manifest, name)  # labels already typed: int64 classes, float32 targets
    return TensorDataset(torch.from_numpy(features), torch.from_numpy(labels))


def features_of(records: Any) -> Any:
    """A batch from :func:`read_split` as the spec's ``batch`` receives it: :class:`stagewise.spec.Features` (by
    column, variable-length ones padded to the batch's longest row, with masks) for typed data, else the records."""
    layout = data_info(_manifest()).layout
    return records if layout is None else layout.decode(records)


def build_model(**overrides: Any) -> Any:
    """The config's ``model.spec`` built from :func:`hyperparameters` (with ``overrides``, e.g. the script's own arguments) and
    the data's description, seeded with the run's seed; :func:`save_model` records the same hyperparameters."""
    import torch

    torch.manual_seed(context().seed)
    built = model_for_run(_config(), _manifest(), {**hyperparameters(), **overrides})
    _built["params"] = built.params
    return built.module


def save_model(module: Any, *, optimizer: Any = None, global_batch: int | None = None) -> None:
    """Rank 0 writes ``model.pt`` (evaluation, the registry and inference load it) and ``final.pt`` (the next stage
    starts from it) in $STAGEWISE_OUTPUT_DIR; pass the optimizer so the next stage continues it. Other ranks do nothing.
    """
    from torch.nn.parallel import DistributedDataParallel

    ctx = context()
    if not ctx.master:
        return
    if isinstance(module, DistributedDataParallel):
        module = module.module
    out, config, manifest = _env(contract.OUTPUT_DIR), _config(), _manifest()
    last = _latest.get("metrics", {})
    save_bundle(storage.join(out, "model.pt"), module, SpecRef(config.model.spec, dict(config.model.args)),
                data_info(manifest), _built.get("params") or hyperparameters(), preprocessing_of(manifest),
                {"stage": ctx.stage, "objective": ctx.objective, "val_metric": last.get(ctx.objective), "val_metrics": last})
    state = {"model": module.state_dict(), "global_batch": global_batch or ctx.global_batch}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    save_torch(storage.join(out, "final.pt"), state)


@functools.cache
def _trial() -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=_env(contract.STUDY_NAME), storage=open_storage(_env(contract.STUDY_STORAGE)),
                              pruner=make_pruner(_config().sweep))
    return optuna.trial.Trial(study, int(_env(contract.TRIAL_ID)))


def _same_on_every_rank(value: bool) -> bool:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return bool(holder[0])


def progress_line(ctx: Context, epoch: int, values: dict[str, float], elapsed_s: float, pruned: bool) -> str:
    """The epoch line a report prints, as the built-in loop's: the metrics, the lr and samples/s when the script
    reports them (``lr``, ``samples_per_s``), and an ETA from the time since :func:`context` was first read."""
    shown = [f"{value:.0f} samples/s" if name == "samples_per_s" else f"lr {value:.4g}" if name == "lr"
             else f"{name} {value:.4f}" for name, value in values.items()]
    remaining = ctx.epochs - epoch - 1
    if remaining > 0 and not pruned:
        shown.append(f"ETA {elapsed_s / (epoch + 1) * remaining:.0f}s")
    return f"{ctx.stage} epoch {epoch + 1}/{ctx.epochs}: {', '.join(shown)}{' -> pruned' if pruned else ''}"


def report(epoch: int, metrics: dict[str, float]) -> bool:
    """After epoch ``epoch`` (0-based, as in ``for epoch in range(epochs)``): record the validation metrics and
    return whether to stop (the trial is pruned; always False in a stage).

    Every rank must call it after every epoch with the same metrics (reduce them across ranks first): in a
    trial rank 0 reports the objective to the study at step ``epoch + 1`` and broadcasts the pruner's decision,
    so every rank returns the same answer.
    """
    ctx = context()
    values = {name: float(value) for name, value in metrics.items()}
    if ctx.objective not in values:
        raise _fail(f"report(epoch={epoch}): the metrics {sorted(values)} lack the objective metric '{ctx.objective}' "
                    f"(objective.metric); report it after every epoch")
    pruned = False
    if ctx.master:
        if ctx.trial is not None:
            trial = _trial()
            trial.report(values[ctx.objective], step=epoch + 1)
            pruned = bool(trial.should_prune())
        _latest.update({"epoch": epoch + 1, "metrics": values, "pruned": pruned})
        path = os.environ.get(contract.METRICS_FILE)
        if path:
            with open(path + ".tmp", "w") as handle:
                json.dump(_latest, handle)
            os.replace(path + ".tmp", path)  # the framework never reads a torn file
        print(progress_line(ctx, epoch, values, time.monotonic() - _started[0], pruned), flush=True)
    return _same_on_every_rank(pruned)


