"""A stage on two emulated hosts (network namespaces joined by a veth pair) through the real node entrypoint,
stagewise.training.node_launch, trains exactly what one host with two processes does, for both backends' inputs;
a node killed mid-stage fails both nodes' launchers, leaves no process, and the retry resumes.

Only the network is emulated: both "hosts" share this machine's filesystem (the storage root), and gloo talks
across the veth pair, not loopback. Needs root and ``ip netns``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import netns, run_cache
from tests.conftest import service_unavailable
from tests.netns import Host, namespace_pids

REPO_ROOT = Path(__file__).resolve().parents[3]
CHECKPOINT_EVERY = run_cache.REFERENCE_CHECKPOINT_EVERY
KILL_AT_STEP = 25
TIMEOUT_S = 300
STAGE_ARGS = list(run_cache.REFERENCE_STAGE_ARGS)  # the stage whose one-node, two-process run is the reference

pytestmark = pytest.mark.torchrun


@pytest.fixture
def two_hosts():
    """Two emulated hosts (tests/netns.py), torn down with any process left in them even when the test fails."""
    try:
        netns.check_available()
    except netns.NetnsUnavailable as exc:
        service_unavailable(str(exc))
    with netns.two_hosts() as hosts:
        yield hosts


def start_node(host: Host, backend: str, config: Path, out: str, env: dict, result_file: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "stagewise.training.node_launch", backend, "--nproc-per-node=1", "-m", "stagewise.train",
               "--config", str(config), "--out", out, *STAGE_ARGS, "--result-file", str(result_file)]
    return netns.popen(host, command, env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def kubernetes_env(host: Host, hosts: list[Host], run_id: str, env: dict) -> dict:
    """What pod <index> of the Indexed Job sees (node 0's address stands for its name under the headless Service)."""
    return {**env, "JOB_COMPLETION_INDEX": str(hosts.index(host)), "STAGEWISE_NNODES": str(len(hosts)),
            "STAGEWISE_RDZV_ENDPOINT": f"{hosts[0].address}:29400", "STAGEWISE_RDZV_ID": run_id,
            "STAGEWISE_SOCKET_IFNAME": host.interface, "STAGEWISE_JOIN_TIMEOUT_S": "120"}


def run_nodes(hosts: list[Host], envs: list[dict], config: Path, out: str, backend: str, result_name: str) -> list[tuple[int, str]]:
    """Both nodes' launchers run concurrently; their exit codes and output (each bounded by TIMEOUT_S)."""
    nodes = [start_node(host, backend, config, out, env, Path(out) / f"{result_name}-{host.namespace}.json")
             for host, env in zip(hosts, envs, strict=True)]
    finished = []
    for node in nodes:
        try:
            output, _ = node.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for other in nodes:
                other.kill()
            pytest.fail(f"a node launcher hung for {TIMEOUT_S}s")
        finished.append((node.returncode, output))
    return finished


def assert_same_training(out: str, result: dict, env: dict) -> None:
    """``out`` trained what the same stage as one host with two processes (the local launcher) does."""
    reference_out, reference = run_cache.reference_stage(env)
    assert result["world_size"] == reference["world_size"] == 2
    assert result["global_batch"] == reference["global_batch"]
    assert result["steps"] == reference["steps"]
    # Same data order per global rank and same dropout masks; only float summation order may differ.
    assert result["val_metric"] == pytest.approx(reference["val_metric"], abs=1e-9)
    ours = torch.load(Path(out, "train", "s2", "final.pt"), weights_only=True)["model"]
    theirs = torch.load(Path(reference_out, "train", "s2", "final.pt"), weights_only=True)["model"]
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=1e-5)


@pytest.mark.parametrize("backend", ["sagemaker", "kubernetes"])
def test_two_nodes_train_what_one_node_with_two_processes_does(two_hosts, digits_run, subprocess_env, tmp_path, backend):
    """2 nodes x 1 process through node_launch (gloo over the veth) = 1 node x 2 processes: steps, val metric, weights;
    only global rank 0 (node a) writes the result."""
    config, out = digits_run
    if backend == "sagemaker":
        envs = [netns.sagemaker_environment(host, two_hosts, tmp_path, subprocess_env) for host in two_hosts]
    else:
        envs = [kubernetes_env(host, two_hosts, f"try-{tmp_path.name}", subprocess_env) for host in two_hosts]
    finished = run_nodes(two_hosts, envs, config, out, backend, "multi")
    for code, output in finished:
        assert code == 0, output[-4000:]
    a, b = two_hosts
    assert not Path(out, f"multi-{b.namespace}.json").exists(), "only global rank 0 writes the result"
    result = json.loads(Path(out, f"multi-{a.namespace}.json").read_text())
    assert_same_training(out, result, subprocess_env)


@pytest.mark.slow
def test_a_killed_node_fails_both_launchers_and_the_retry_resumes(two_hosts, digits_run, subprocess_env, tmp_path):
    """Node b's rank SIGKILLed at step 25: both launchers exit nonzero in time, no process is left in either
    namespace, and the retry (both nodes again) resumes from step 20 and ends where a clean run does."""
    config, out = digits_run
    a, b = two_hosts
    envs = [netns.sagemaker_environment(host, two_hosts, tmp_path, subprocess_env) for host in two_hosts]
    faulty = [envs[0], {**envs[1], "STAGEWISE_FAULT_KILL_AT": f"1:{KILL_AT_STEP}"}]  # global rank 1 is node b's rank
    crashed = run_nodes(two_hosts, faulty, config, out, "sagemaker", "crashed")
    for (code, output), host in zip(crashed, two_hosts, strict=True):
        assert code != 0, f"node {host.namespace}'s launcher must fail when a node dies:\n{output[-3000:]}"
        assert namespace_pids(host.namespace) == [], f"processes outlived the failed stage in {host.namespace}"
    pointer = json.loads(Path(out, "train", "s2", "checkpoints", "latest.json").read_text())
    assert pointer["step"] == (KILL_AT_STEP // CHECKPOINT_EVERY) * CHECKPOINT_EVERY

    # The retry: the same job again (the fault fires only on a fresh start).
    resumed = run_nodes(two_hosts, faulty, config, out, "sagemaker", "resumed")
    for code, output in resumed:
        assert code == 0, output[-4000:]
    result = json.loads(Path(out, f"resumed-{a.namespace}.json").read_text())
    assert result["resumed_from_step"] == pointer["step"]
    assert_same_training(out, result, subprocess_env)
