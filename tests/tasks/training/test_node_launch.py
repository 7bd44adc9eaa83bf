"""Each node reads its place in the job from what its backend gives it, and a missing or inconsistent input is
refused naming the file or variable (the launch itself is tested in test_multinode.py)."""

from __future__ import annotations

import json
import sys

import pytest

from stagewise.training import torchrun_command
from stagewise.training.node_launch import (
    NodeConfigError,
    kubernetes_node,
    route_interface,
    sagemaker_node,
    slurm_node,
    torchrun_argv,
)

ENTRY = ["--nproc-per-node=2", "-m", "stagewise.train", "--stage", "s2"]


def resource_config(tmp_path, current: str, hosts: list[str], interface: str = "eth0") -> dict:
    path = tmp_path / "resourceconfig.json"
    path.write_text(json.dumps({"current_host": current, "hosts": hosts, "network_interface_name": interface}))
    return {"STAGEWISE_SM_RESOURCE_CONFIG": str(path)}


def pod(index: int, nnodes: int = 2, **extra: str) -> dict:
    return {"JOB_COMPLETION_INDEX": str(index), "STAGEWISE_NNODES": str(nnodes),
            "STAGEWISE_RDZV_ENDPOINT": "stage-s2-0.stage-s2:29400", "STAGEWISE_RDZV_ID": "run1-s2-try2", **extra}


def test_sagemaker_node_rank_is_the_place_in_sorted_hosts_and_node_0_hosts_the_store(tmp_path):
    """SageMaker lists hosts in any order: every node sorts them, so all agree on who is node 0."""
    node = sagemaker_node(resource_config(tmp_path, "algo-1", ["algo-3", "algo-1", "algo-2"]))
    assert (node.node_rank, node.num_nodes, node.master_addr, node.master_port) == (0, 3, "algo-1", 29500)
    node = sagemaker_node({**resource_config(tmp_path, "algo-3", ["algo-3", "algo-1", "algo-2"]), "STAGEWISE_MASTER_PORT": "7000"})
    assert (node.node_rank, node.master_addr, node.master_port, node.interface) == (2, "algo-1", 7000, "eth0")


def test_sagemaker_variables_stand_in_for_a_missing_resource_config(tmp_path):
    environ = {"STAGEWISE_SM_RESOURCE_CONFIG": str(tmp_path / "absent.json"), "SM_HOSTS": '["algo-2", "algo-1"]',
               "SM_CURRENT_HOST": "algo-2", "SM_NETWORK_INTERFACE_NAME": "eth1"}
    node = sagemaker_node(environ)
    assert (node.node_rank, node.num_nodes, node.interface) == (1, 2, "eth1")


@pytest.mark.parametrize("make, message", [
    (lambda tmp: resource_config(tmp, "algo-9", ["algo-1", "algo-2"]), "current host 'algo-9' is not among the hosts"),
    (lambda tmp: resource_config(tmp, "algo-1", ["algo-1", "algo-1"]), "lists a host twice"),
    (lambda tmp: resource_config(tmp, "algo-1", []), "hosts must be a non-empty list"),
    (lambda tmp: {"STAGEWISE_SM_RESOURCE_CONFIG": str(tmp / "absent.json")}, "no SageMaker resource config at"),
    (lambda tmp: {"STAGEWISE_SM_RESOURCE_CONFIG": str(tmp / "absent.json"), "SM_HOSTS": "algo-1", "SM_CURRENT_HOST": "algo-1"},
     "$SM_HOSTS must be a JSON list"),
])
def test_sagemaker_inputs_that_place_no_node_are_refused_by_name(tmp_path, make, message):
    environ = make(tmp_path)
    with pytest.raises(NodeConfigError, match="stagewise.training.node_launch: ") as raised:
        sagemaker_node(environ)
    assert message in str(raised.value)
    if "STAGEWISE_SM_RESOURCE_CONFIG" in environ and "absent" not in environ["STAGEWISE_SM_RESOURCE_CONFIG"]:
        assert environ["STAGEWISE_SM_RESOURCE_CONFIG"] in str(raised.value), "the message names the file"


def test_kubernetes_node_rank_is_the_job_completion_index():
    node = kubernetes_node(pod(1, 4, STAGEWISE_JOIN_TIMEOUT_S="60"))
    assert (node.node_rank, node.num_nodes, node.master_addr, node.master_port) == (1, 4, "stage-s2-0.stage-s2", 29400)
    assert (node.run_id, node.join_timeout_s, node.interface) == ("run1-s2-try2", 60, None)


@pytest.mark.parametrize("environ, message", [
    (pod(2, 2), "$JOB_COMPLETION_INDEX 2 is outside 0..1"),
    ({k: v for k, v in pod(0).items() if k != "JOB_COMPLETION_INDEX"}, "$JOB_COMPLETION_INDEX is not set"),
    (pod(0, STAGEWISE_NNODES="two"), "$STAGEWISE_NNODES must be an integer"),
    (pod(0, STAGEWISE_RDZV_ENDPOINT="stage-s2-0"), "$STAGEWISE_RDZV_ENDPOINT must be host:port"),
    (pod(0, STAGEWISE_RDZV_ID=""), "$STAGEWISE_RDZV_ID is not set"),
])
def test_kubernetes_inputs_that_place_no_node_are_refused_by_name(environ, message):
    with pytest.raises(NodeConfigError) as raised:
        kubernetes_node(environ)
    assert message in str(raised.value)


def test_torchrun_gets_the_static_rendezvous_of_this_node_and_guarded_ranks():
    _, argv = torchrun_argv("kubernetes", ENTRY, pod(1))
    assert argv[:6] == ["--nnodes=2", "--node-rank=1", "--rdzv-backend=static", "--rdzv-endpoint=stage-s2-0.stage-s2:29400",
                        "--rdzv-id=run1-s2-try2", "--rdzv-conf=timeout=900"]
    guard = argv.index("--no-python") + 1
    assert argv[6:guard] == ["--nproc-per-node=2", "--no-python"]
    assert argv[guard:guard + 3] == [sys.executable, "-m", "stagewise.training.rank_guard"]
    assert argv[guard + 4:] == [sys.executable, "-u", "-m", "stagewise.train", "--stage", "s2"]


@pytest.mark.parametrize("argv, message", [
    (["--nnodes=3", *ENTRY], "--nnodes is not accepted"),
    (["--node-rank", "0", *ENTRY], "--node-rank is not accepted"),
    (["--rdzv-endpoint=x:1", *ENTRY], "--rdzv-endpoint is not accepted"),
    (ENTRY[1:], "give --nproc-per-node"),
])
def test_options_that_contradict_the_nodes_place_are_refused(argv, message):
    with pytest.raises(SystemExit) as raised:
        torchrun_argv("kubernetes", argv, pod(0))
    assert message in str(raised.value)


def test_unknown_backend_is_refused():
    with pytest.raises(NodeConfigError, match="one of sagemaker, kubernetes, slurm, got 'lsf'"):
        torchrun_argv("lsf", ENTRY, {})


def srun_task(node: int, nnodes: int = 2, **extra: str) -> dict:
    """What srun gives task ``node`` of a one-task-per-node step, plus the batch script's endpoint."""
    return {"SLURM_NODEID": str(node), "SLURM_NNODES": str(nnodes), "SLURM_JOB_ID": "4242",
            "STAGEWISE_RDZV_ENDPOINT": "10.214.0.3:29400", "STAGEWISE_SOCKET_IFNAME": "eth0", **extra}


def test_slurm_node_rank_is_the_node_id_and_the_rendezvous_is_new_per_requeue():
    """SLURM_NODEID places the node; the job id and its restart count key the store, so a requeued job (the same id)
    never reads the keys its run before left."""
    node = slurm_node(srun_task(1, STAGEWISE_JOIN_TIMEOUT_S="60"))
    assert (node.node_rank, node.num_nodes, node.master_addr, node.master_port) == (1, 2, "10.214.0.3", 29400)
    assert (node.run_id, node.join_timeout_s, node.interface) == ("slurm-4242-r0", 60, "eth0")
    assert slurm_node(srun_task(0, SLURM_RESTART_COUNT="2")).run_id == "slurm-4242-r2"
    job_nodes = {key: value for key, value in srun_task(0, 1).items() if key != "SLURM_NNODES"}
    assert slurm_node({**job_nodes, "SLURM_JOB_NUM_NODES": "1"}).num_nodes == 1


def test_slurm_node_without_an_interface_takes_the_one_that_routes_to_node_0():
    environ = {key: value for key, value in srun_task(0).items() if key != "STAGEWISE_SOCKET_IFNAME"}
    assert slurm_node({**environ, "STAGEWISE_RDZV_ENDPOINT": "127.0.0.1:29400"}).interface == "lo"
    assert route_interface("127.0.0.1") == "lo"


@pytest.mark.parametrize("environ, message", [
    ({k: v for k, v in srun_task(0).items() if k != "SLURM_NODEID"}, "$SLURM_NODEID is not set"),
    ({k: v for k, v in srun_task(0).items() if k != "SLURM_NNODES"}, "$SLURM_JOB_NUM_NODES is not set"),
    (srun_task(2), "$SLURM_NODEID 2 is outside 0..1"),
    (srun_task(0, SLURM_NNODES="n"), "$SLURM_NNODES must be an integer"),
    (srun_task(0, STAGEWISE_RDZV_ENDPOINT=""), "$STAGEWISE_RDZV_ENDPOINT must be host:port (the allocation's first node"),
    (srun_task(0, SLURM_JOB_ID=""), "$SLURM_JOB_ID is not set"),
    (srun_task(0, SLURM_RESTART_COUNT="x"), "$SLURM_RESTART_COUNT must be an integer"),
])
def test_slurm_inputs_that_place_no_node_are_refused_by_name(environ, message):
    with pytest.raises(NodeConfigError) as raised:
        slurm_node(environ)
    assert message in str(raised.value)


def test_a_slurm_node_gets_the_static_rendezvous_of_its_job():
    _, argv = torchrun_argv("slurm", ENTRY, srun_task(1))
    assert argv[:6] == ["--nnodes=2", "--node-rank=1", "--rdzv-backend=static", "--rdzv-endpoint=10.214.0.3:29400",
                        "--rdzv-id=slurm-4242-r0", "--rdzv-conf=timeout=900"]


def test_one_command_builder_serves_the_local_launcher_and_every_node():
    assert torchrun_command.command(["-m", "stagewise.train"], ["--stage", "s2"], 2)[1:3] == ["-m", "stagewise.training.local_torchrun"]
    remote = torchrun_command.command(["-m", "stagewise.train"], ["--stage", "s2"], 4, 1, backend="sagemaker", python="python")
    assert remote == ["python", "-m", "stagewise.training.node_launch", "sagemaker", "--nproc-per-node=4", "--max-restarts=1",
                      "-m", "stagewise.train", "--stage", "s2"]
