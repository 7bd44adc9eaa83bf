"""How a training stage spreads its model over its ranks: the one place the loop and the stage ask about it.

``ddp`` (the default) keeps a full copy of the parameters, the gradients and the optimizer state on every rank and
all-reduces the gradients (DistributedDataParallel). ``fsdp`` shards all three across the ranks with FSDP2
(``torch.distributed.fsdp.fully_shard``: parameters become DTensors on a 1-D device mesh, all-gathered per unit for
its forward and backward, gradients reduce-scattered), so a rank holds about 1/world of them. What differs between the
two lives here: preparing and wrapping the module, the no-sync context of accumulation, the gradient norm and clipping,
the training state a checkpoint saves and loads, and the full state handed to the next stage. A later strategy (tensor
parallel on a 2-D mesh) is one more class with the same methods.

Use::

    strategy = make_strategy("fsdp", env, spec=spec, precision="bf16")
    strategy.prepare(module)                 # in place, before the optimizer sees the parameters
    optimizer = make_optimizer(module, params, spec)
    model = strategy.wrap(module)            # what the forward calls
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from stagewise.core import storage
from stagewise.core.dropped import was_dropped
from stagewise.core.errors import DataError, UserError, out_of_memory
from stagewise.definitions.spec import ModelSpec, user_hook
from stagewise.training.checkpoint import (
    RECORD,
    dcp_reader,
    dcp_writer,
    record_folder,
    restore_training_state,
    verify_recorded,
)
from stagewise.training.distributed import DistEnv
from stagewise.training.selection import cpu_copy

log = logging.getLogger("stagewise.train")

STRATEGIES = ("ddp", "fsdp")


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The optimizer's parameters in the order ``Optimizer.state_dict`` numbers them."""
    return [parameter for group in optimizer.param_groups for parameter in group["params"]]


def state_by_name(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """An ``Optimizer.state_dict()`` (parameters numbered) keyed by parameter names instead, as
    torch.distributed.checkpoint.state_dict reads it: the same optimizer built over the same module numbers alike."""
    names = {id(parameter): name for name, parameter in module.named_parameters()}
    numbered = [names[id(parameter)] for parameter in optimizer_params(optimizer)]
    groups = [{**group, "params": [numbered[index] for index in group["params"]]} for group in state["param_groups"]]
    return {"state": {numbered[index]: value for index, value in state["state"].items()}, "param_groups": groups}


def state_by_number(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`state_by_name`: what ``Optimizer.load_state_dict`` of a DDP stage (or a script) reads."""
    names = {id(parameter): name for name, parameter in module.named_parameters()}
    number = {names[id(parameter)]: index for index, parameter in enumerate(optimizer_params(optimizer))}
    groups = [{**group, "params": [number[name] for name in group["params"]]} for group in state["param_groups"]]
    return {"state": {number[name]: value for name, value in state["state"].items()}, "param_groups": groups}


class DDPStrategy:
    """A full replica per rank; DistributedDataParallel all-reduces the gradients (nothing to wrap on one rank)."""

    name = "ddp"
    shards_state = False
    """Whether each rank holds its own part of the training state (then every rank saves and loads a checkpoint)."""

    def __init__(self, env: DistEnv) -> None:
        self.env = env
        self.ddp: nn.Module | None = None
        self.trust_unrecorded = False
        """Load a hand-off's sharded optimizer state that has no checksum record (train.trust_unrecorded_checkpoints)."""

    @property
    def gradient_ranks(self) -> int:
        """How many ranks' rows one synced backward's gradient averages (the noise scale's batch sizes scale by it):
        every rank's, under DDP's all-reduce as under fsdp's reduce-scatter, so both measure the same batch sizes."""
        return self.env.world_size

    def prepare(self, module: nn.Module) -> None:
        """Ready ``module`` in place before an optimizer is made over its parameters (nothing for DDP)."""

    def wrap(self, module: nn.Module) -> nn.Module:
        """What the training forward calls."""
        if not self.env.distributed:
            return module
        from torch.nn.parallel import DistributedDataParallel

        self.ddp = DistributedDataParallel(module, device_ids=[self.env.local_rank] if self.env.device != "cpu" else None)
        return self.ddp

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Around a backward whose gradients the ranks must not average yet (accumulation, a measured step)."""
        return self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext()

    def grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The L2 norm of the whole model's gradient (a device scalar; no host sync)."""
        return nn.utils.get_total_norm(grads)

    def clip(self, parameters: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Clip the gradients to ``max_norm`` overall; returns the norm before clipping (device scalar)."""
        grads = [parameter.grad for parameter in parameters if parameter.grad is not None]
        norm = self.grad_norm(grads)
        nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
        return norm

    @staticmethod
    def local(tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``tensor`` (all of it without sharding)."""
        return tensor

    def forwards_to_match(self, forwards: int) -> int:
        """Extra forwards this rank must run so every rank runs as many as the busiest (none: DDP's forward alone
        makes no collective)."""
        return 0

    def training_state(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The model's and optimizer's state as a checkpoint saves it (rank 0 writes it)."""
        return {"model": module.state_dict(), "optimizer": optimizer.state_dict()}

    def load_training_state(self, module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load a checkpoint's ``training_state`` of this stage (same world size and strategy)."""
        self.load_full_state(module, optimizer, state)

    def load_full_state(self, module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load a stage's final.pt, whatever strategy and world size wrote it: ``model`` full by name, ``optimizer``
        numbered, a reference to a sharded checkpoint of it (:func:`sharded_optimizer_uri`), or absent (a stage that
        hands on no optimizer: this one starts its own)."""
        uri = sharded_optimizer_uri(state)
        if uri is None and "optimizer" in state:
            restore_training_state(module, optimizer, state, self.env.device)
            return
        module.to(self.env.device)
        module.load_state_dict(state["model"])
        if uri is not None:
            load_sharded_optimizer(module, optimizer, uri, trust_unrecorded=self.trust_unrecorded)

    def full_state(self, module: nn.Module, optimizer: torch.optim.Optimizer, stage_prefix: str,
                   with_optimizer: bool = True) -> dict[str, Any]:
        """The model and optimizer state for the next stage and the bundle, on the CPU of rank 0 (every rank must call
        it; others get an empty dict): the model full; the optimizer (``with_optimizer``) as a reference to a sharded
        checkpoint of it written under ``stage_prefix``, so no rank of the next stage reads it whole."""
        if not self.env.master:
            return {}
        handed = {"model": cpu_copy(module.state_dict())}
        if with_optimizer:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            # Every replica holds the same state: rank 0 writes it alone (no collective), one file.
            uri = storage.join(stage_prefix, f"final-optimizer-{storage.unique_token()}.dcp")
            with one_process_dcp():
                dcp.save({"optimizer": get_optimizer_state_dict(module, optimizer)}, storage_writer=dcp_writer(uri),
                         no_dist=True)
            record_folder(uri)  # verified where the next stage loads it, as a checkpoint is
            handed["optimizer"] = {SHARDED_OPTIMIZER: uri}
        return handed

    def committed(self, stage_prefix: str, handed: dict[str, Any]) -> None:
        """Rank 0, once final.pt holding ``handed`` is written: drop the optimizer checkpoints earlier attempts left."""
        keep = sharded_optimizer_uri(handed)
        fs, path = storage.filesystem(stage_prefix)
        for stale in fs.glob(path + "/final-optimizer-*.dcp"):
            if keep is None or not keep.rstrip("/").endswith("/" + stale.rstrip("/").rsplit("/", 1)[-1]):
                fs.rm(stale, recursive=True)

    def describe(self) -> str:
        """The strategy in a few words for the stage's first log line."""
        return "ddp" if self.env.distributed else "ddp, one process"

    def close(self) -> None:
        """Release what :meth:`prepare` set up."""


class FSDPStrategy(DDPStrategy):
    """FSDP2: parameters, gradients and optimizer state sharded over the ranks, one unit at a time all-gathered.

    Units: the modules ``ModelSpec.shard_units`` names, else every direct child that holds parameters; the root is a
    unit too (whatever the children leave). bf16 precision becomes a mixed-precision policy (bf16 parameters for the
    compute, fp32 gradient reduction); ``activation_checkpointing`` recomputes each unit's activations in its backward.
    Gradients are reduce-scattered after every backward, accumulation included: the memory stays sharded (no unsharded
    gradient is kept between micro-batches)."""

    name = "fsdp"
    shards_state = True

    def __init__(self, env: DistEnv, *, spec: ModelSpec, precision: str, activation_checkpointing: bool = False) -> None:
        super().__init__(env)  # fp16 and compile are refused with fsdp where the config is validated
        self.spec, self.precision, self.activation_checkpointing = spec, precision, activation_checkpointing
        self._own_group = False
        self.units = 0

    def _mesh(self) -> Any:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():  # one process (a sweep trial, a one-GPU stage): a group of one
            backend = "nccl" if self.env.device.startswith("cuda") else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            self._own_group = True
        return init_device_mesh(torch.device(self.env.device).type, (dist.get_world_size(),))

    def _units(self, module: nn.Module) -> list[nn.Module]:
        with user_hook(self.spec, "shard_units", module=module):
            named = self.spec.shard_units(module)
        if named is None:
            return [child for child in module.children() if any(True for _ in child.parameters())]
        units = list(named)
        inside = {id(sub) for sub in module.modules()}
        for unit in units:
            if not isinstance(unit, nn.Module) or id(unit) not in inside or unit is module:
                raise UserError(f"{type(self.spec).__name__}.shard_units() must return sub-modules of the built module "
                                f"(not the module itself), got {type(unit).__name__}")
        return units

    def prepare(self, module: nn.Module) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = self._mesh()
        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                  if self.precision == "bf16" else MixedPrecisionPolicy())
        units = self._units(module)
        if self.activation_checkpointing:
            from torch.distributed._composable import checkpoint

            for unit in units:
                checkpoint(unit)
        for index, unit in enumerate(units):  # inner units first: the root then holds only what they leave
            # The last unit's backward follows its forward at once: keeping it gathered saves one all-gather a step.
            fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=index < len(units) - 1)
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
        self.units = len(units) + 1

    def wrap(self, module: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(module, FSDPModule):
            raise RuntimeError("an fsdp stage's module must be prepared (sharded) before its optimizer is made")
        return module

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        norm = nn.utils.get_total_norm(grads)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm  # the shards' squares summed over the ranks

    @staticmethod
    def local(tensor: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    def forwards_to_match(self, forwards: int) -> int:
        import torch.distributed as dist

        if not self.env.distributed:
            return 0
        most = torch.tensor([forwards], device=self.env.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most.item()) - forwards

    def training_state(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(module, optimizer)  # this rank's shards, optimizer by name
        return {"model": model_state, "optimizer": optimizer_state}

    def load_training_state(self, module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    def load_full_state(self, module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        # On several ranks only rank 0 read the file (stagewise.training.handoff): it sends each tensor in turn and
        # every rank keeps its shard; alone, the one rank keeps the whole.
        full = StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.env.distributed)
        set_model_state_dict(module, state["model"], options=full)
        uri = sharded_optimizer_uri(state)
        if uri is not None:
            load_sharded_optimizer(module, optimizer, uri, trust_unrecorded=self.trust_unrecorded)  # each its part
        elif "optimizer" in state:  # inline (a script's final.pt, an older stage's): rank 0 holds it numbered
            inline = state["optimizer"]
            by_name = state_by_name(module, optimizer, inline) if "state" in inline else {}
            set_optimizer_state_dict(module, optimizer, by_name, options=full)

    def full_state(self, module: nn.Module, optimizer: torch.optim.Optimizer, stage_prefix: str,
                   with_optimizer: bool = True) -> dict[str, Any]:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # The optimizer state stays sharded (a name of its own each attempt: final.pt, written after it, commits it);
        # the model is gathered a tensor at a time into rank 0's CPU memory, never a second full copy on a device.
        handed: dict[str, Any] = {}
        if with_optimizer:
            names = [f"final-optimizer-{storage.unique_token()}.dcp"]
            dist.broadcast_object_list(names, src=0)
            uri = storage.join(stage_prefix, names[0])
            dcp.save({"optimizer": self.training_state(module, optimizer)["optimizer"]}, storage_writer=dcp_writer(uri))
            if self.env.master:  # dcp.save returns on rank 0 once every shard and the metadata are written
                record_folder(uri)
            handed["optimizer"] = {SHARDED_OPTIMIZER: uri}
        model_state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.env.master:
            return {}
        return {"model": model_state, **handed}

    def describe(self) -> str:
        extras = [f"{self.units} units", *(["bf16 parameters, fp32 reduction"] if self.precision == "bf16" else []),
                  *(["activation checkpointing"] if self.activation_checkpointing else [])]
        return f"fsdp over {self.env.world_size} rank(s): {', '.join(extras)}"

    def close(self) -> None:
        if self._own_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self._own_group = False


Strategy = DDPStrategy


def make_strategy(name: str, env: DistEnv, *, spec: ModelSpec, precision: str = "fp32",
                  activation_checkpointing: bool = False) -> Strategy:
    """The stage's strategy by name (``ddp`` or ``fsdp``)."""
    if name == "ddp":
        return DDPStrategy(env)
    if name == "fsdp":
        return FSDPStrategy(env, spec=spec, precision=precision, activation_checkpointing=activation_checkpointing)
    raise UserError(f"strategy '{name}' is not one of {', '.join(STRATEGIES)}")


def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy) -> dict[str, int]:
    """Bytes this rank holds of the parameters, the gradients and the optimizer state (its shards under fsdp)."""

    def size(tensors: Iterable[Any]) -> int:
        return sum(strategy.local(t).numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    parameters = list(module.parameters())
    return {"parameters": size(parameters), "gradients": size(p.grad for p in parameters if p.grad is not None),
            "optimizer": size(value for entry in optimizer.state.values() for value in entry.values())}



# final.pt's ``optimizer`` after an fsdp stage: {SHARDED_OPTIMIZER: the URI of its sharded checkpoint}.
SHARDED_OPTIMIZER = "sharded_checkpoint"


def sharded_optimizer_uri(state: dict[str, Any]) -> str | None:
    """The sharded checkpoint holding a final.pt's optimizer state (an fsdp stage's), or None (the state is inline)."""
    optimizer = state.get("optimizer")
    return optimizer.get(SHARDED_OPTIMIZER) if isinstance(optimizer, dict) else None


@contextlib.contextmanager
def one_process_dcp() -> Iterator[None]:
    """DCP used by one process on purpose (a ddp stage's rank 0, a one-process stage): without this its UserWarning
    "torch.distributed is disabled ... assuming the intent is to ... in a single process" lands in every task log."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _verified_once(uri: str, trust_unrecorded: bool) -> str | None:
    """Why the sharded checkpoint at ``uri`` must not load, or None: read on rank 0 alone (one pass over its bytes, not
    one per rank), its answer given to every rank."""
    import torch.distributed as dist

    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    problem = None
    if not several or dist.get_rank() == 0:
        problem = verify_recorded(storage.join(uri, RECORD), uri, trust_unrecorded=trust_unrecorded)
    if several:
        holder = [problem]
        dist.broadcast_object_list(holder, src=0)
        problem = holder[0]
    return problem


def load_sharded_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer, uri: str, *,
                           trust_unrecorded: bool = False) -> None:
    """Load an optimizer state from a sharded checkpoint into ``optimizer`` over ``module`` (plain, DDP's or sharded:
    DCP reads each rank's part of each tensor, whatever world size wrote it), verified against its checksum record
    first (a DataError naming the file otherwise). Every rank calls it. A hand-off dropped on purpose after its run
    succeeded (stagewise.core.dropped) leaves the optimizer fresh, with a warning."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    if was_dropped(uri):
        log.warning("the optimizer state %s was dropped once its run succeeded: this stage starts a fresh optimizer", uri)
        return
    if problem := _verified_once(uri, trust_unrecorded):
        raise DataError(f"the stage before's optimizer state {uri}: {problem}; run the stage before again to remake it")
    target = {"optimizer": get_optimizer_state_dict(module, optimizer)}
    with one_process_dcp():
        dcp.load(target, storage_reader=dcp_reader(uri))
    set_optimizer_state_dict(module, optimizer, target["optimizer"])


def memory_advice(strategy: str, world_size: int) -> str:
    """What a stage that ran out of memory can change, for its strategy."""
    if strategy == "ddp":
        return ("a ddp stage keeps all the parameters, their gradients and the optimizer state on every rank (about 16 "
                "bytes per parameter with Adam, before activations); set train.stages[].strategy: fsdp to shard them "
                "over the stage's ranks, or lower per_process_batch")
    return (f"an fsdp stage over {world_size} rank(s) holds about 1/{world_size} of that state per rank plus one unit "
            f"gathered at a time; add ranks (processes_per_node), set activation_checkpointing: true, name smaller units "
            f"(ModelSpec.shard_units) or lower per_process_batch")


@contextlib.contextmanager
def out_of_memory_named(stage: Any, env: DistEnv) -> Iterator[None]:
    """A stage that runs out of memory fails as a user error (no retry: the same attempt would fail alike) that names
    memory, the rank and what to change."""
    try:
        yield
    except Exception as exc:
        if not out_of_memory(exc):
            raise
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"stage {stage.name}: rank {env.rank} ran out of memory on {env.device} ({first_line[:300]}): "
                        f"{memory_advice(stage.strategy, env.world_size)}") from exc
