"""Checkpoints of a training stage: atomic files, a pointer written last, the last N kept.

Layout under a stage prefix: ``checkpoints/step-000000123.pt`` files and ``checkpoints/latest.json``
naming the newest complete one. A file is fully written (temp + rename locally, one PUT on S3)
before the pointer moves to it, so a crash while writing leaves the previous checkpoint in force.
Files hold tensors and plain values only and load with ``torch.load(weights_only=True)``.

Every checkpoint is verified before it loads: when it commits, the SHA-256 and size of each of its files go into a
record beside it (``step-…pt.checksums.json``; ``checksums.json`` inside a sharded folder), written before the pointer
moves, and a file that no longer matches (cut, altered on disk) is named as a data error and skipped for the newest
intact checkpoint. One without a record (removed, or a write killed before it) is refused alike, unless the stage
trusts unrecorded checkpoints (``train.trust_unrecorded_checkpoints``). Leftovers of writes that died (``*.tmp-*``) are
removed at the next commit.
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from stagewise.core import storage
from stagewise.core.errors import DataError
from stagewise.models.torch_io import load_torch, save_torch

log = logging.getLogger("stagewise.checkpoint")


class CheckpointStore:
    """Save, find and prune the checkpoints of one stage."""

    def __init__(self, stage_prefix: str, keep_last: int = 2, *, folder: str = "checkpoints",
                 trust_unrecorded: bool = False) -> None:
        self.prefix = storage.join(stage_prefix, folder)
        self.pointer = storage.join(self.prefix, "latest.json")
        self.keep_last = max(1, keep_last)
        self.trust_unrecorded = trust_unrecorded

    def path_for(self, step: int) -> str:
        return storage.join(self.prefix, f"step-{step:09d}{self.SUFFIX}")

    def poll(self) -> None:
        """Commit a save written in the background (none here: rank 0 writes each file before it returns)."""

    def wait(self) -> None:
        """Wait for a save in flight (none here)."""

    def save(self, step: int, state: dict[str, Any]) -> str:
        uri = self.path_for(step)
        save_torch(uri, state)
        storage.write_json(self.record_for(uri), {"files": {posixpath.basename(uri): file_digest(uri)}})
        storage.write_json(self.pointer, {"uri": uri, "step": step})
        self._prune()
        return uri

    def require_intact(self, uri: str) -> None:
        """A DataError naming the file unless the checkpoint at ``uri`` is as it was written (every rank calls it)."""
        if problem := self._verified(uri):
            raise DataError(f"checkpoint {uri}: {problem}; run the stage again without it (remove it) to remake it")

    def _verified(self, uri: str) -> str | None:
        return self.verify(uri)

    def record_for(self, uri: str) -> str:
        """Where a checkpoint's checksums are kept: beside its file."""
        return f"{uri}{RECORD_SUFFIX}"

    def verify(self, uri: str) -> str | None:
        """Why the checkpoint at ``uri`` must not load (a file cut or altered since it committed), or None."""
        return verify_recorded(self.record_for(uri), uri if self.SUFFIX == ".dcp" else posixpath.dirname(uri),
                               trust_unrecorded=self.trust_unrecorded)

    SUFFIX = ".pt"  # a checkpoint's name: step-<step>SUFFIX

    def _complete(self, fs: Any, path: str) -> bool:
        """Whether a listed checkpoint was written whole (a file is: it is renamed or PUT into place)."""
        return True

    def _listed(self) -> list[str]:
        fs, path = storage.filesystem(self.prefix)
        if not fs.isdir(path):
            return []
        found = sorted(p for p in fs.glob(f"{path}/step-*{self.SUFFIX}") if self._complete(fs, p))
        return [fs.unstrip_protocol(p) if "://" in self.prefix else p for p in found]

    def _prune(self) -> None:
        """Drop all but the newest ``keep_last`` checkpoints (with their records) and what dead writes left."""
        fs, path = storage.filesystem(self.prefix)
        for uri in self._listed()[: -self.keep_last]:
            fs.rm(storage.filesystem(uri)[1], recursive=True)
            if fs.exists(storage.filesystem(self.record_for(uri))[1]):
                fs.rm(storage.filesystem(self.record_for(uri))[1])
        for leftover in fs.glob(f"{path}/*.tmp-*"):  # a pointer or file whose writer was killed mid-write
            fs.rm(leftover, recursive=True)

    def _candidates(self) -> list[str]:
        """The pointer's checkpoint first, then the listed ones newest first."""
        candidates = []
        if storage.exists(self.pointer):
            try:
                candidates.append(storage.read_json(self.pointer)["uri"])
            except (DataError, KeyError, TypeError) as exc:  # a torn or foreign pointer: the step files still say
                log.warning("ignoring unreadable checkpoint pointer %s: %s", self.pointer, exc)
        return candidates + [uri for uri in reversed(self._listed()) if uri not in candidates]

    def latest(self, into: Callable[[], dict[str, Any]] | None = None,
               accept: Callable[[dict[str, Any]], bool] | None = None) -> tuple[str, dict[str, Any]] | None:
        """The newest checkpoint that loads: the pointer's, else the newest readable file (whole: ``into`` and
        ``accept`` serve the sharded store)."""
        for uri in self._candidates():
            if problem := self.verify(uri):
                log.warning("skipping checkpoint %s: %s", uri, DataError(problem))
                continue
            try:
                return uri, load_torch(uri)
            except Exception as exc:  # a torn or foreign file: fall back to an older one
                log.warning("skipping unreadable checkpoint %s: %s", uri, exc)
        return None


def restore_training_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
                           device: str | torch.device) -> None:
    """Load a checkpoint's model and optimizer state for training on ``device``.

    The model moves to ``device`` first: ``Optimizer.load_state_dict`` puts each state tensor (e.g.
    SGD momentum, Adam moments) on its parameter's device, so loading into a model still on the CPU
    would leave those buffers behind and the first GPU step would fail on mixed devices.
    """
    model.to(device)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


class ShardedCheckpointStore(CheckpointStore):
    """Checkpoints of a stage whose ranks each hold a shard of the state (strategy fsdp).

    Every rank writes its own shard with torch.distributed.checkpoint into ``checkpoints/step-000000123.dcp/`` (nothing is
    gathered); DCP's coordinator writes the directory's ``.metadata`` once every shard is in; then rank 0 writes
    ``meta.pt`` (the plain values: position, history, rng, ...) and last moves ``latest.json``. A directory without
    ``meta.pt`` is a torn save and is never read. Loading reshards to the loading ranks (DCP's planner).
    """

    SHARDED_KEYS = ("model", "optimizer")
    META = "meta.pt"
    SUFFIX = ".dcp"

    def __init__(self, stage_prefix: str, keep_last: int = 2, *, master: bool, folder: str = "checkpoints",
                 background: bool = False, trust_unrecorded: bool = False) -> None:
        """``background``: each save is staged (copied off the training tensors) and written by a background thread
        (DCP's async_save, over a gloo group of its own) while training goes on; it commits when written."""
        super().__init__(stage_prefix, keep_last, folder=folder, trust_unrecorded=trust_unrecorded)
        self.master = master
        self.background = background
        self._pending: tuple[Any, str, int, dict[str, Any]] | None = None  # (future, uri, step, plain values)
        self._group: Any = None

    def save(self, step: int, state: dict[str, Any]) -> str:
        """Collective: every rank calls it with its own shards under ``model`` and ``optimizer``."""
        import torch.distributed.checkpoint as dcp

        uri = self.path_for(step)
        shards = {key: state[key] for key in self.SHARDED_KEYS}
        plain = {key: value for key, value in state.items() if key not in self.SHARDED_KEYS}
        self.wait()  # one save in flight at a time: the one before commits first
        clear_folder(uri, master=self.master)
        if not self.background:
            dcp.save(shards, storage_writer=dcp_writer(uri))
            self._commit(uri, step, plain)  # dcp.save returns on rank 0 once the metadata of every shard is written
            return uri
        self._pending = (dcp.async_save(shards, storage_writer=dcp_writer(uri), process_group=self._checkpoint_group()),
                         uri, step, plain)
        return uri

    def _checkpoint_group(self) -> Any:
        import torch.distributed as dist

        if self._group is None and dist.is_initialized():  # the writer's collectives never interleave the training's
            self._group = dist.new_group(backend="gloo")
        return self._group

    def poll(self) -> None:
        """Commit a background save that has finished (cheap: call it every step)."""
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Wait for the background save in flight, if any, and commit it (every rank calls it)."""
        if self._pending is None:
            return
        future, uri, step, plain = self._pending
        self._pending = None
        future.result()
        self._commit(uri, step, plain)

    def _commit(self, uri: str, step: int, plain: dict[str, Any]) -> None:
        if self.master:  # meta.pt marks the folder whole; its checksums, then the pointer, move last
            save_torch(storage.join(uri, self.META), plain)
            record_folder(uri)
            storage.write_json(self.pointer, {"uri": uri, "step": step})
            self._prune()

    def record_for(self, uri: str) -> str:
        return storage.join(uri, RECORD)

    def _verified(self, uri: str) -> str | None:
        """:meth:`verify` on rank 0, its answer given to every rank (they must all skip the same checkpoints)."""
        problem = self.verify(uri) if self.master else None
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            holder = [problem]
            dist.broadcast_object_list(holder, src=0)
            problem = holder[0]
        return problem

    def _complete(self, fs: Any, path: str) -> bool:
        return fs.exists(f"{path}/{self.META}")  # written after every shard

    def latest(self, into: Callable[[], dict[str, Any]] | None = None,
               accept: Callable[[dict[str, Any]], bool] | None = None) -> tuple[str, dict[str, Any]] | None:
        """Collective: the newest complete checkpoint, its shards loaded into ``into()``'s state dicts (this rank's
        ``model`` and ``optimizer``, loaded in place) and its plain values beside them; one whose plain values
        ``accept`` refuses comes back with those only (nothing loaded)."""
        for uri in self._candidates():
            if problem := self._verified(uri):
                log.warning("skipping checkpoint %s: %s", uri, DataError(problem))
                continue
            try:
                meta = load_torch(storage.join(uri, self.META))
            except Exception as exc:  # a torn save (no meta.pt yet) or a foreign folder: an older one may load
                log.warning("skipping unreadable checkpoint %s: %s", uri, exc)
                continue
            if into is None or (accept is not None and not accept(meta)):
                return uri, meta
            return uri, {**meta, **self.load_shards(uri, into())}
        return None

    @staticmethod
    def load_shards(uri: str, shards: dict[str, Any]) -> dict[str, Any]:
        """Collective: the checkpoint at ``uri`` read into ``shards`` (this rank's state dicts, in place); returns them."""
        import torch.distributed.checkpoint as dcp

        dcp.load(shards, storage_reader=dcp_reader(uri))
        return shards


RECORD = "checksums.json"  # a sharded checkpoint's record, inside its folder
RECORD_SUFFIX = ".checksums.json"  # a whole file's record, beside it
TRUST_SETTING = "train.trust_unrecorded_checkpoints"


def clear_folder(uri: str, *, master: bool) -> None:
    """Collective: rank 0 removes a folder a sharded save is about to write (the same step saved again, e.g. a best
    epoch redone after a resume at another world size), so no shard or record of the earlier save mixes with this
    one; every rank waits for it."""
    import torch.distributed as dist

    if master:
        fs, path = storage.filesystem(uri)
        if fs.exists(path):
            fs.rm(path, recursive=True)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def record_folder(uri: str) -> None:
    """Record the size and content id of every file of the sharded checkpoint at ``uri`` in its ``checksums.json``."""
    fs, path = storage.filesystem(uri)
    files = sorted(name for name in (posixpath.basename(found) for found in fs.find(path)) if name != RECORD)
    storage.write_json(storage.join(uri, RECORD), {"files": {name: file_digest(storage.join(uri, name)) for name in files}})


def verify_recorded(record_uri: str, folder: str, *, trust_unrecorded: bool) -> str | None:
    """Why the files ``record_uri`` lists (names under ``folder``) must not load, or None: a file missing, cut or
    altered since it was recorded, or no record at all (unless ``trust_unrecorded``)."""
    if not storage.exists(record_uri):
        if trust_unrecorded:
            return None
        return (f"its checksum record {record_uri} is missing, so its bytes cannot be verified and it is not loaded; "
                f"remove it to train again from the checkpoint before, or set {TRUST_SETTING}: true to load "
                "checkpoints without a record unchecked")
    try:
        files = storage.read_json(record_uri)["files"]
    except (DataError, KeyError, TypeError) as exc:
        return f"its checksum record {record_uri} is unreadable ({exc})"
    for name, expected in files.items():
        path = storage.join(folder, name)
        if not storage.exists(path):
            return f"{path} is missing"
        found = file_digest(path)
        if found != expected:
            return f"{path} is cut or altered since it was written ({_described(found)}; recorded {_described(expected)})"
    return None


def file_digest(uri: str) -> dict[str, Any]:
    """A file's size and content id, as a checkpoint's record keeps them: its SHA-256, or on S3 its ETag (a HEAD, no
    download: an object's bytes change only with a new upload, which gets a new ETag)."""
    fs, path = storage.filesystem(uri)
    info = fs.info(path)
    etag = info.get("ETag") or info.get("etag")
    if etag and "://" in uri and not uri.startswith("file://"):
        return {"bytes": info["size"], "etag": str(etag).strip('"')}
    return {"bytes": info["size"], "sha256": storage.sha256_of(uri)}


def _described(digest: dict[str, Any]) -> str:
    content = f"sha256 {digest['sha256'][:12]}…" if "sha256" in digest else f"ETag {digest.get('etag')}"
    return f"{digest['bytes']} bytes, {content}"


def dcp_writer(uri: str) -> Any:
    if "://" in uri and not uri.startswith("file://"):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter  # torch's own, not re-exported

        return FsspecWriter(uri, **storage.filesystem(uri)[0].storage_options)
    from torch.distributed.checkpoint import FileSystemWriter

    return FileSystemWriter(uri.removeprefix("file://"))


def dcp_reader(uri: str) -> Any:
    if "://" in uri and not uri.startswith("file://"):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(uri, **storage.filesystem(uri)[0].storage_options)
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(uri.removeprefix("file://"))


def checkpoint_store(stage_prefix: str, keep_last: int, *, sharded: bool, master: bool,
                     background: bool = False, trust_unrecorded: bool = False) -> CheckpointStore:
    """The stage's checkpoint store: whole files from rank 0, or every rank's shard (``sharded``, strategy fsdp; written
    in the ``background`` where asked)."""
    if sharded:
        return ShardedCheckpointStore(stage_prefix, keep_last, master=master, background=background,
                                      trust_unrecorded=trust_unrecorded)
    return CheckpointStore(stage_prefix, keep_last, trust_unrecorded=trust_unrecorded)
