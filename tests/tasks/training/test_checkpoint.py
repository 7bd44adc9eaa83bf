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
    assert sorted(os.listdir(tmp_path / "s1" / "checkpoints")) == ["latest.json", "step-000000020.pt", "step-000000030.pt"]


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
