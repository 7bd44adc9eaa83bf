"""The suite's Slurm cluster (tests/slurm_cluster.py) and the faults it can make, as Slurm 22.05 answers them: nodes
idle, a two-node job on two namespaces, a node cut off (a requeue, Slurm's default), a drained node, and a cluster
that leaves nothing behind. A killed node and an explicit requeue are tested where a stage meets them
(tests/plugins/test_slurm_cluster_stage.py)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests import slurm_cluster
from tests.conftest import service_unavailable

pytestmark = [pytest.mark.slurm]

# Each task of the job's step writes a line and a marker file (so a fault lands once the step runs on both nodes),
# then sleeps past any test's end.
STEP = """#!/bin/bash
srun bash -c 'run=${{SLURM_RESTART_COUNT:-0}}; echo "task $SLURM_NODEID $run" >> {out}/tasks-$SLURMD_NODENAME
touch {out}/up-$SLURMD_NODENAME-$run; exec sleep 300'
"""


def wait_for(paths: list[Path], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not all(path.exists() for path in paths):
        assert time.monotonic() < deadline, f"never written: {[str(p) for p in paths if not p.exists()]}"
        time.sleep(0.1)


def running_on_both(slurm, tmp_path: Path, *options: str, restarts: int = 0) -> str:
    """A two-node job whose step runs on n1 and n2 (both markers written); its id."""
    job = slurm.sbatch(STEP.format(out=tmp_path), "--nodes=2", f"--output={tmp_path}/slurm-%j.out", *options)
    wait_for([tmp_path / f"up-{name}-{restarts}" for name in ("n1", "n2")])
    return job


def test_the_cluster_answers_sinfo_with_both_nodes_idle_in_partitions_debug_and_small(slurm):
    assert slurm.states() == {"n1": "idle", "n2": "idle"}
    partitions = slurm.run("sinfo", "-h", "-o", "%P %D %T %N", check=True).stdout.split("\n")
    assert partitions[:2] == ["debug* 2 idle n[1-2]", "small 1 idle n1"]
    assert slurm.run("scontrol", "show", "node", "n2", "-o", check=True).stdout.count(f"NodeAddr={slurm.nodes[1].address}")


def test_a_two_node_job_runs_one_srun_task_on_each_node_in_a_namespace_of_its_own(slurm, tmp_path):
    script = """#!/bin/bash
srun bash -c 'echo "$SLURM_NODEID $(hostname) $(hostname -I) $(readlink /proc/self/ns/net) $SLURM_JOB_NODELIST"'
"""
    job = slurm.sbatch(script, "--nodes=2", f"--output={tmp_path}/out")
    record = slurm.wait_state(job, slurm_cluster.TERMINAL)
    assert (record["JobState"], record["NodeList"], record["NumNodes"]) == ("COMPLETED", "n[1-2]", "2")
    lines = sorted((tmp_path / "out").read_text().split("\n")[:2])
    rows = [line.split() for line in lines]
    assert [(row[0], row[1], row[2], row[4]) for row in rows] == [
        ("0", "n1", slurm.nodes[0].address, "n[1-2]"), ("1", "n2", slurm.nodes[1].address, "n[1-2]")]
    assert rows[0][3] != rows[1][3]  # two network namespaces


def test_a_node_cut_off_requeues_a_requeueable_job_which_runs_again_once_the_node_is_back(slurm, tmp_path):
    job = running_on_both(slurm, tmp_path)  # JobRequeue=1: a batch job is requeueable unless it says --no-requeue
    slurm.network_down("n2")
    record = slurm.wait_state(job, "PENDING", timeout=90)
    assert record["Restarts"] == "1"
    assert slurm.node_state("n2") == "down*"
    slurm.network_up("n2")
    slurm.wait_node("n2", {"idle", "allocated", "mixed"}, timeout=60)
    running_again = slurm.wait_state(job, "RUNNING", timeout=60)
    assert running_again["NodeList"] == "n[1-2]"
    wait_for([tmp_path / "up-n1-1", tmp_path / "up-n2-1"])


def test_a_drained_node_makes_a_two_node_job_pend_with_its_reason_while_one_to_two_nodes_runs_on_the_other(
        slurm, tmp_path):
    slurm.drain("n2", "disk replaced")
    assert slurm.node_state("n2") == "drained"
    assert "disk replaced" in slurm.run("sinfo", "-h", "-R", "-o", "%E %N", check=True).stdout
    two = slurm.sbatch("#!/bin/bash\nsrun true\n", "--nodes=2", f"--output={tmp_path}/two")
    deadline = time.monotonic() + 30
    while (record := slurm.job(two))["Reason"] == "None":
        assert time.monotonic() < deadline, record
        time.sleep(0.2)
    assert record["JobState"] == "PENDING"
    assert record["Reason"] in ("ReqNodeNotAvail,_UnavailableNodes:n2",  # what 22.05 says, or:
                                "Nodes_required_for_job_are_DOWN,_DRAINED_or_reserved_for_jobs_in_higher_priority_partitions")
    flexible = slurm.sbatch("#!/bin/bash\nsrun hostname\n", "--nodes=1-2", f"--output={tmp_path}/flexible")
    done = slurm.wait_state(flexible, slurm_cluster.TERMINAL)
    assert (done["JobState"], done["NodeList"], done["NumNodes"]) == ("COMPLETED", "n1", "1")
    assert (tmp_path / "flexible").read_text().split() == ["n1"]
    assert slurm.job(two)["JobState"] == "PENDING"


def test_leaving_a_cluster_even_on_an_error_removes_its_namespaces_bridge_processes_and_folder():
    if reason := slurm_cluster.unavailable_reason():
        service_unavailable(reason)
    with pytest.raises(ValueError, match="inside"), slurm_cluster.cluster(nodes=1) as started:
        namespaces = [node.namespace for node in (started.controller, *started.nodes)]
        pids = [pid for namespace in namespaces for pid in slurm_cluster.namespace_pids(namespace)]
        assert pids and started.states() == {"n1": "idle"}
        raise ValueError("an error inside")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not [namespace for namespace in namespaces if namespace in listed]
    assert subprocess.run(["ip", "link", "show", started.bridge], capture_output=True).returncode != 0
    assert not started.folder.exists()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
