"""Two gates at once: promotion is a compare-and-swap of ``current.json``, on local files and on S3.

Two real processes wait at a barrier and then gate a 0.93 and a 0.95 candidate of the same model name.
Whichever writes first, the second must re-read and compare against the winner, so the better model
ends current and the history keeps every version that was ever current.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from stagewise import registry
from stagewise.core import storage

METRIC = "test_accuracy"
WORSE, BETTER, BASELINE = 0.93, 0.95, 0.90
ROLES = ("worse", "better")
# The old unlocked gate lost a version in nearly every round and let the worse model win in about half; S3 rounds are slower.
LOCAL_ROUNDS, S3_ROUNDS = 30, 20


def _register(root: str, name: str, model_dir: Path, label: str, accuracy: float) -> str:
    model = model_dir / f"{name}-{label}.pt"
    model.write_bytes(f"{name}/{label}".encode() * 10)
    return registry.register(root, name, str(model), {METRIC: accuracy, "source_run": label})["version"]


def _prepare_round(root: str, model_dir: Path, index: int) -> dict[str, Any]:
    """Round ``index``'s own model name; odd rounds start with a 0.90 model current (a replace), even ones with none (a create)."""
    name = f"race{index}"
    baseline = None
    if index % 2:
        baseline = _register(root, name, model_dir, "baseline", BASELINE)
        registry.promote(root, name, baseline)
    return {"name": name, "baseline": baseline, "worse": _register(root, name, model_dir, "worse", WORSE),
            "better": _register(root, name, model_dir, "better", BETTER)}


def _prepare_rounds(root: str, model_dir: Path, count: int) -> list[dict[str, Any]]:
    with ThreadPoolExecutor(8) as pool:  # the rounds share nothing; S3 round trips overlap
        return list(pool.map(lambda index: _prepare_round(root, model_dir, index), range(count)))


_barrier: multiprocessing.synchronize.Barrier | None = None  # the racer processes' shared barrier


def _join_race(barrier: multiprocessing.synchronize.Barrier) -> None:
    global _barrier
    _barrier = barrier


def _gate_each_round(root: str, rounds: list[dict[str, Any]], role: str) -> list[bool]:
    """A racer process: per round, wait for the other racer, then gate this role's candidate; its promoted flags."""
    assert _barrier is not None
    promoted = []
    try:
        for entry in rounds:
            _barrier.wait(timeout=60)
            promoted.append(registry.gate(root, entry["name"], entry[role], METRIC, margin=0.0)["promoted"])
    except BaseException:
        _barrier.abort()  # the other racer fails at once instead of waiting out the timeout
        raise
    return promoted


def _race(root: str, rounds: list[dict[str, Any]]) -> dict[tuple[int, str], bool]:
    """Run the two racers (spawned, so each has its own S3 client and file handles); their promoted flags by round and role."""
    context = multiprocessing.get_context("spawn")
    with context.Pool(2, initializer=_join_race, initargs=(context.Barrier(2),)) as pool:
        flags = pool.starmap(_gate_each_round, [(root, rounds, role) for role in ROLES], chunksize=1)
    return {(index, role): flag for role, role_flags in zip(ROLES, flags) for index, flag in enumerate(role_flags)}


def _assert_the_better_model_won_every_round(root: str, rounds: list[dict[str, Any]],
                                             promoted: dict[tuple[int, str], bool]) -> None:
    problems = []
    for index, entry in enumerate(rounds):
        state = registry.pointer(root, entry["name"])
        ever_current = [*state["history"], state["version"]]
        everything_promoted = [entry[role] for role in ROLES if promoted[(index, role)]]
        if entry["baseline"]:
            everything_promoted.append(entry["baseline"])
        if state["version"] != entry["better"]:
            problems.append(f"round {index}: the 0.93 model ended current over the 0.95 one")
        if not promoted[(index, "better")] or ever_current.count(entry["better"]) != 1:
            problems.append(f"round {index}: the 0.95 model was not promoted exactly once ({ever_current})")
        if missing := set(everything_promoted) - set(ever_current):
            problems.append(f"round {index}: the history lost promoted version(s) {sorted(missing)}")
    assert not problems, f"{len(problems)} problem(s) in {len(rounds)} rounds:\n" + "\n".join(problems)


def test_two_gates_at_once_on_local_files_keep_the_better_model_and_the_whole_history(storage_root, tmp_path):
    """Two processes gating 0.93 and 0.95 at once on a local root: the 0.95 model ends current every round, it is
    promoted exactly once, and every version that was current stays in the history."""
    root = str(storage_root)
    rounds = _prepare_rounds(root, tmp_path, LOCAL_ROUNDS)
    _assert_the_better_model_won_every_round(root, rounds, _race(root, rounds))


@pytest.mark.service
def test_two_gates_at_once_on_s3_keep_the_better_model_and_the_whole_history(s3_bucket, tmp_path):
    """The same race on the S3 endpoint, where conditional PUTs (If-None-Match / If-Match) do the compare-and-swap."""
    root = storage.join(s3_bucket, "store")
    rounds = _prepare_rounds(root, tmp_path, S3_ROUNDS)
    _assert_the_better_model_won_every_round(root, rounds, _race(root, rounds))


def _assert_compare_and_swap(uri: str) -> None:
    assert storage.read_versioned(uri) == (None, None)
    assert storage.write_if_unchanged(uri, {"v": 1}, None)
    assert not storage.write_if_unchanged(uri, {"v": 0}, None), "a create over an existing file"
    first, token = storage.read_versioned(uri)
    assert first == {"v": 1} and token
    assert storage.write_if_unchanged(uri, {"v": 2}, token)
    assert not storage.write_if_unchanged(uri, {"v": 3}, token), "a replace with the token of an older version"
    second, token = storage.read_versioned(uri)
    storage.write_json(uri, {"v": 4})  # a plain write moves the version as well
    assert not storage.write_if_unchanged(uri, {"v": 5}, token)
    assert second == {"v": 2} and storage.read_json(uri) == {"v": 4}


def test_write_if_unchanged_refuses_a_stale_token_on_local_files(tmp_path):
    """Locally a conditional write lands only on the version its token names (or on no file, token None)."""
    _assert_compare_and_swap(str(tmp_path / "pointer" / "current.json"))


@pytest.mark.service
def test_write_if_unchanged_refuses_a_stale_token_on_s3(s3_bucket):
    """On S3 the same through conditional PUTs: If-None-Match: * to create, If-Match: <ETag> to replace."""
    _assert_compare_and_swap(storage.join(s3_bucket, "pointer", "current.json"))
