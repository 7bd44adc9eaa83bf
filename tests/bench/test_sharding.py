"""bench.sharding's ranks hand their results to the parent through files of their own, never through the stdout they
share (where two ranks' lines ran together once: `JSONDecodeError: Extra data`)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bench import sharding


def test_ranks_whose_stdout_runs_together_still_each_reach_the_parent(monkeypatch):
    """Two ranks print their lines into one stdout with no newline between them; the parent still gets each rank's
    result, from the file that rank wrote."""

    def ranks_run_together(command, **kwargs):
        lines = []
        for rank in (1, 0):
            result = {"rank": rank, "held": {"parameters": 8}, "total": 8, "parameters": None,
                      "peak_device_bytes": None, "peak_resident_bytes": 100 + rank}
            if Path(command[-1]).is_dir():  # the results folder the parent named
                sharding._write_rank_result(command[-1], rank, result)
            lines.append(json.dumps(result))
        return subprocess.CompletedProcess(command, 0, stdout="".join(lines) + "\n", stderr="")

    monkeypatch.setattr(sharding.subprocess, "run", ranks_run_together)
    ranks = sharding._memory("fsdp", 2)
    assert [(rank["rank"], rank["peak_resident_bytes"]) for rank in ranks] == [(0, 100), (1, 101)]


def test_a_rank_that_never_reports_fails_the_benchmark_naming_the_ranks(monkeypatch):
    """Rank 1 exits 0 without its file: the benchmark raises naming the ranks that did report, never records a number."""

    def one_rank_only(command, **kwargs):
        sharding._write_rank_result(command[-1], 0, {"rank": 0})
        return subprocess.CompletedProcess(command, 0, stdout="", stderr="")

    monkeypatch.setattr(sharding.subprocess, "run", one_rank_only)
    with pytest.raises(RuntimeError, match=r"fsdp x2: ranks \[0\] reported"):
        sharding._memory("fsdp", 2)


@pytest.mark.torchrun
def test_each_rank_of_the_worker_writes_its_own_result():
    """The worker under torchrun, 2 ranks of fsdp: a result file per rank, each holding its shard of the state."""
    ranks = sharding._memory("fsdp", 2)
    assert [rank["rank"] for rank in ranks] == [0, 1]
    assert all(rank["total"] > 0 for rank in ranks)
