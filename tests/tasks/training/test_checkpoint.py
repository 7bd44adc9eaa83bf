"""Checkpoints are atomic: a crash while writing leaves the previous one in force; only the last N stay."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from stagewise.training.checkpoint import CheckpointStore


def _state(step: int) -> dict:
    return {"step": step, "weights": torch.full((3,), float(step))}


def test_latest_is_the_newest_saved_and_old_ones_are_pruned(tmp_path):
    """Saving more than keep_last deletes the oldest files; latest() returns the newest state."""
    store = CheckpointStore(str(tmp_path / "s1"), keep_last=2)
    for step in (10, 20, 30):
        store.save(step, _state(step))
    uri, state = store.latest()
    assert state["step"] == 30 and uri.endswith("step-000000030.pt")
    assert sorted(os.listdir(tmp_path / "s1" / "checkpoints")) == [
        "latest.json", "step-000000020.pt", "step-000000020.pt.checksums.json", "step-000000030.pt",
        "step-000000030.pt.checksums.json"]


def test_crash_before_the_rename_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """A crash mid-write (before the atomic rename) leaves no torn file visible and the old checkpoint loads."""
    store = CheckpointStore(str(tmp_path / "s1"), keep_last=3)
    store.save(10, _state(10))

    def crash(*_args, **_kwargs):
        raise OSError("disk vanished mid-write")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        store.save(20, _state(20))
    monkeypatch.undo()
    assert not (tmp_path / "s1" / "checkpoints" / "step-000000020.pt").exists()
    assert store.latest()[1]["step"] == 10


def test_torn_file_behind_the_pointer_falls_back_to_an_older_readable_one(tmp_path):
    """If the newest file is unreadable (torn by a foreign writer), the newest readable checkpoint wins."""
    store = CheckpointStore(str(tmp_path / "s1"), keep_last=3)
    store.save(10, _state(10))
    store.save(20, _state(20))
    (tmp_path / "s1" / "checkpoints" / "step-000000020.pt").write_bytes(b"\x80\x02 torn")
    assert store.latest()[1]["step"] == 10


@pytest.mark.parametrize("pointer", [b'{"uri": "/x/step-0', b"", b"[1, 2]"], ids=["torn", "empty", "foreign"])
def test_an_unreadable_pointer_falls_back_to_the_newest_readable_step_file(tmp_path, pointer):
    """latest.json cut or foreign: the newest step file that loads is resumed, as latest() promises (no JSON error)."""
    store = CheckpointStore(str(tmp_path / "s1"), keep_last=3)
    store.save(10, _state(10))
    store.save(20, _state(20))
    (tmp_path / "s1" / "checkpoints" / "latest.json").write_bytes(pointer)
    assert store.latest()[1]["step"] == 20


def test_a_cut_torch_file_is_a_data_error_naming_it(tmp_path):
    """A file that exists but does not load (e.g. a cut s1/final.pt) names itself as a data error: no retry mends it."""
    from stagewise.core.errors import DataError
    from stagewise.models.torch_io import load_torch, save_torch

    uri = str(tmp_path / "s1" / "final.pt")
    save_torch(uri, _state(3))
    data = Path(uri).read_bytes()
    Path(uri).write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=rf"{uri}: cannot be loaded as a torch file .*it is cut or corrupt"):
        load_torch(uri)


def test_checkpoints_load_with_weights_only(tmp_path):
    """Files hold tensors and plain values only: torch.load(weights_only=True) reads them."""
    store = CheckpointStore(str(tmp_path / "s1"))
    uri = store.save(5, _state(5))
    assert torch.equal(torch.load(uri, weights_only=True)["weights"], torch.full((3,), 5.0))


def test_no_checkpoint_yet_means_none(tmp_path):
    """A fresh stage finds nothing to resume."""
    assert CheckpointStore(str(tmp_path / "fresh")).latest() is None


@pytest.mark.parametrize("mapped", [False, True], ids=["read", "memory-mapped"])
def test_memory_that_runs_out_while_loading_a_hand_off_is_named_as_memory_not_as_corruption(tmp_path, monkeypatch,
                                                                                             mapped):
    """The CPU allocator failing inside torch.load (a fault made on purpose) is a user error naming the file, its size,
    the rank and what to change; never "cut or corrupt"."""
    from stagewise.core.errors import DataError, UserError
    from stagewise.models import torch_io

    uri = str(tmp_path / "s1" / "final.pt")
    torch_io.save_torch(uri, {"model": {"weight": torch.zeros(1024, 256)}})
    size_mib = Path(uri).stat().st_size / 2**20

    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory: you tried "
                           "to allocate 1048576 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(torch_io.torch, "load", no_memory)
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(UserError) as raised:
        torch_io.load_torch(uri, mapped=mapped)
    message = str(raised.value)
    assert not isinstance(raised.value, DataError) and "cut or corrupt" not in message
    assert message.startswith(f"{uri}: rank 2 ran out of memory loading it ({size_mib:.1f} MiB")
    assert "hand_on_optimizer: false" in message and "strategy fsdp" in message


def _flip(path: Path, count: int, offset_from_end: int = 200) -> None:
    """Flip ``count`` bytes near the end of ``path`` (inside a torch file's tensor data, before its zip directory)."""
    data = bytearray(path.read_bytes())
    start = max(0, len(data) - offset_from_end - count)
    for index in range(start, start + count):
        data[index] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flipped", "cut"])
def test_a_step_file_altered_after_it_committed_is_skipped_for_the_newest_intact_one(tmp_path, caplog, damage):
    """Each step file's checksum is recorded when it commits; one whose bytes changed since is named as a data error
    and never loaded: the checkpoint before it is."""
    store = CheckpointStore(str(tmp_path / "s1"), keep_last=3)
    store.save(10, _state(10))
    newest = Path(store.save(20, _state(20)))
    if damage == "flipped":
        _flip(newest, 8)
    else:
        newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    uri, state = store.latest()
    assert state["step"] == 10 and uri.endswith("step-000000010.pt")
    assert f"skipping checkpoint {newest}: {newest} is cut or altered since it was written" in caplog.text


def test_a_cut_shard_of_a_sharded_checkpoint_falls_back_to_the_one_before(tmp_path, caplog):
    """A DCP shard cut after its checkpoint committed: the checkpoint is skipped (named, never read) for the older one,
    whose shards load into the live state."""
    from stagewise.training.checkpoint import ShardedCheckpointStore

    store = ShardedCheckpointStore(str(tmp_path / "s2"), keep_last=3, master=True)
    for step in (10, 20):
        store.save(step, {"model": {"w": torch.full((64,), float(step))}, "optimizer": {"m": torch.zeros(4)},
                          "step": step})
    shard = next((tmp_path / "s2" / "checkpoints" / "step-000000020.dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-40])
    target = {"model": {"w": torch.zeros(64)}, "optimizer": {"m": torch.ones(4)}}
    uri, state = store.latest(into=lambda: target)
    assert uri.endswith("step-000000010.dcp") and state["step"] == 10
    assert torch.equal(target["model"]["w"], torch.full((64,), 10.0))
    assert f"{shard} is cut or altered" in caplog.text


def test_a_pointer_left_half_written_is_removed_at_the_next_commit(tmp_path):
    """A rank killed while writing latest.json leaves latest.json.tmp-*: the next checkpoint's commit removes it."""
    store = CheckpointStore(str(tmp_path / "s1"))
    store.save(10, _state(10))
    leftover = tmp_path / "s1" / "checkpoints" / "latest.json.tmp-0123456789"
    leftover.write_text('{"uri": ')
    store.save(20, _state(20))
    assert not leftover.exists() and store.latest()[1]["step"] == 20


def test_a_best_epoch_file_altered_since_it_was_kept_is_a_data_error_naming_it(tmp_path):
    """hand_on: best never hands on an altered best-epoch file: loading it fails as a data error naming the file."""
    from stagewise.core.errors import DataError
    from stagewise.training.distributed import DistEnv
    from stagewise.training.selection import BestEpoch
    from stagewise.training.strategy import DDPStrategy

    module = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    best = BestEpoch(DDPStrategy(DistEnv(rank=0, local_rank=0, world_size=1, device="cpu")), str(tmp_path / "s1"),
                     master=True)
    best.keep(1, module, optimizer)
    kept = Path(best.record()["uri"])
    _flip(kept, 64, offset_from_end=2000)
    with pytest.raises(DataError, match=rf"checkpoint {kept}: {kept} is cut or altered"):
        best.load_into(module, optimizer)


@pytest.mark.service
def test_on_s3_a_checkpoint_is_verified_by_its_etag_and_an_object_replaced_since_is_skipped(s3_bucket, caplog):
    """On S3 the record keeps each object's ETag and size (a HEAD at load, no download); an object uploaded again
    with other bytes since it committed is named and its checkpoint skipped for the one before."""
    from stagewise.core import storage

    store = CheckpointStore(f"{s3_bucket}/runs/x/train/s1", keep_last=3)
    store.save(10, _state(10))
    newest = store.save(20, _state(20))
    record = storage.read_json(store.record_for(newest))["files"]["step-000000020.pt"]
    assert set(record) == {"bytes", "etag"}
    storage.write_bytes(newest, storage.read_bytes(store.path_for(10)))  # another upload: other bytes, a new ETag
    uri, state = store.latest()
    assert state["step"] == 10 and uri.endswith("step-000000010.pt")
    assert f"{newest} is cut or altered since it was written" in caplog.text


def _sharded_state(step: int) -> dict:
    return {"model": {"w": torch.full((64,), float(step))}, "optimizer": {"m": torch.zeros(4)}, "step": step}


@pytest.mark.parametrize("sharded", [False, True], ids=["ddp-file", "fsdp-folder"])
def test_a_checkpoint_whose_checksum_record_was_removed_is_refused_unless_trusted(tmp_path, caplog, sharded):
    """A step checkpoint whose checksums.json is gone is never loaded unchecked: it is skipped, named with its record
    and the setting that trusts it, for the one before; with train.trust_unrecorded_checkpoints it loads."""
    from stagewise.training.checkpoint import ShardedCheckpointStore

    def store(trusted: bool) -> CheckpointStore:
        if sharded:
            return ShardedCheckpointStore(str(tmp_path / "s2"), keep_last=3, master=True, trust_unrecorded=trusted)
        return CheckpointStore(str(tmp_path / "s2"), keep_last=3, trust_unrecorded=trusted)

    strict = store(False)
    for step in (10, 20):
        newest = strict.save(step, _sharded_state(step) if sharded else _state(step))
    Path(strict.record_for(newest)).unlink()
    target = {"model": {"w": torch.zeros(64)}, "optimizer": {"m": torch.ones(4)}}
    uri, state = strict.latest(into=lambda: target)
    assert state["step"] == 10 and uri.endswith("step-000000010" + strict.SUFFIX)
    assert f"skipping checkpoint {newest}: its checksum record {strict.record_for(newest)} is missing" in caplog.text
    assert "train.trust_unrecorded_checkpoints: true" in caplog.text
    assert store(True).latest(into=lambda: target)[1]["step"] == 20


def test_a_sharded_checkpoint_saved_again_into_its_folder_verifies(tmp_path):
    """A best epoch redone after a resume (saved again under the same name, e.g. by 3 ranks where 2 wrote it) is the
    new save alone: no shard of the earlier one stays, and its record matches (it once listed the old record itself:
    "checksums.json is cut or altered since it was written")."""
    from stagewise.training.checkpoint import ShardedCheckpointStore

    store = ShardedCheckpointStore(str(tmp_path / "s2"), keep_last=2, master=True, folder="best")
    uri = store.save(0, _sharded_state(1))
    stale = Path(uri, "__2_0.distcp")
    stale.write_bytes(b"a shard of a save by three ranks")
    store.save(0, _sharded_state(2))
    assert store.verify(uri) is None and not stale.exists()
    target = {"model": {"w": torch.zeros(64)}, "optimizer": {"m": torch.ones(4)}}
    store.require_intact(uri)
    assert torch.equal(store.load_shards(uri, target)["model"]["w"], torch.full((64,), 2.0))


@pytest.mark.parametrize("trusted", [False, True], ids=["refused", "trusted"])
def test_a_hand_offs_optimizer_state_is_verified_by_its_record(tmp_path, trusted):
    """The sharded optimizer state a stage hands on is recorded like a checkpoint: without its record the next stage
    fails as a data error naming it (trusted: it loads), never loading it unchecked."""
    from stagewise.core.errors import DataError
    from stagewise.training.distributed import DistEnv
    from stagewise.training.strategy import DDPStrategy, sharded_optimizer_uri

    module = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    module(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    strategy = DDPStrategy(DistEnv(rank=0, local_rank=0, world_size=1, device="cpu"))
    handed = strategy.full_state(module, optimizer, str(tmp_path / "s1"))
    folder = Path(sharded_optimizer_uri(handed))
    assert (folder / "checksums.json").exists()
    (folder / "checksums.json").unlink()
    strategy.trust_unrecorded = trusted
    module.zero_grad(set_to_none=True)  # as a next stage's fresh model has none
    fresh = torch.optim.AdamW(module.parameters(), lr=0.1)
    if trusted:
        strategy.load_full_state(module, fresh, handed)
        assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    else:
        with pytest.raises(DataError, match=rf"optimizer state {folder}: its checksum record .* is missing"):
            strategy.load_full_state(module, fresh, handed)
