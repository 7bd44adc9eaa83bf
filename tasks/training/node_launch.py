"""The container entrypoint of a train stage on several nodes: one torchrun agent per node, ranks in a fixed order.

Run (on every node of the job, the same command): ``python -m stagewise.training.node_launch {sagemaker|kubernetes|slurm}
--nproc-per-node=2 [--max-restarts=1] -m stagewise.train --stage s2 --config ... --out s3://...``

The backend names where this node learns its place in the job; everything else is the same torchrun for both:
torch's static rendezvous (``--nnodes N --node-rank R`` on the store of node 0), so node R's ranks are
R*nproc .. R*nproc+nproc-1 on every try, and each rank starts through stagewise.training.rank_guard (no rank outlives
its agent). The other nodes wait up to the join timeout for node 0's store; a node that dies makes the others'
collectives fail, and each agent then stops its ranks and exits nonzero: the job fails, the Airflow try with it,
and the retry resumes from the stage's last checkpoint.

sagemaker: ``/opt/ml/input/config/resourceconfig.json`` ($STAGEWISE_SM_RESOURCE_CONFIG to read another file, else
$SM_HOSTS / $SM_CURRENT_HOST / $SM_NETWORK_INTERFACE_NAME): node rank = index of ``current_host`` in sorted
``hosts``, node 0 = the first of them, port $STAGEWISE_MASTER_PORT (29500); gloo/NCCL use
``network_interface_name``. SageMaker's own checkpoint dir (/opt/ml/checkpoints, synced to S3 by CheckpointConfig)
is not used: the stage checkpoints to the storage root itself (S3), where a retry's new job finds them.

kubernetes (an Indexed Job with a headless Service, one pod per node): node rank = $JOB_COMPLETION_INDEX,
node 0 = $STAGEWISE_RDZV_ENDPOINT (``host:port``, pod 0's name under the Service), $STAGEWISE_NNODES nodes,
$STAGEWISE_RDZV_ID (unique per Airflow try: the store's key prefix), optional $STAGEWISE_SOCKET_IFNAME.
torch's c10d rendezvous is not used: it ignores ``--node-rank`` and orders nodes by host name, and the Job's
index already gives every pod its rank.

slurm (``srun --ntasks-per-node=1`` in an sbatch allocation, one task per node): node rank = $SLURM_NODEID,
nodes = $SLURM_NNODES (else $SLURM_JOB_NUM_NODES: a ``--nodes=min-max`` job runs on those it got), node 0 =
$STAGEWISE_RDZV_ENDPOINT (``address:port`` of the allocation's first node, which the batch script exports), rendezvous
id = $SLURM_JOB_ID and $SLURM_RESTART_COUNT (a requeued job never meets its old run's keys). Without
$STAGEWISE_SOCKET_IFNAME, gloo/NCCL use the interface this node reaches node 0 through.

All: $STAGEWISE_JOIN_TIMEOUT_S (900) bounds the wait for every node. Node 0's store listens on all of the
node's interfaces (the other nodes must reach it), unlike stagewise.training.local_torchrun's loopback-only store.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from stagewise.core import contract
from stagewise.core.cli import skip_final_collection
from stagewise.training.local_torchrun import RENDEZVOUS_OPTIONS, guarded_argv

LAUNCHER = "stagewise.training.node_launch"
BACKENDS = ("sagemaker", "kubernetes", "slurm")
SM_RESOURCE_CONFIG = "/opt/ml/input/config/resourceconfig.json"
SM_RESOURCE_CONFIG_ENV = contract.SM_RESOURCE_CONFIG
MASTER_PORT_ENV = contract.MASTER_PORT
DEFAULT_MASTER_PORT = 29500
JOIN_TIMEOUT_ENV = contract.JOIN_TIMEOUT_S
DEFAULT_JOIN_TIMEOUT_S = 900
# What the Kubernetes launcher puts in each pod's environment (JOB_COMPLETION_INDEX comes from the Indexed Job).
K8S_INDEX_ENV = "JOB_COMPLETION_INDEX"
K8S_ENDPOINT_ENV = contract.RDZV_ENDPOINT
K8S_NNODES_ENV = contract.NNODES
K8S_RDZV_ID_ENV = contract.RDZV_ID
K8S_IFNAME_ENV = contract.SOCKET_IFNAME
# What Slurm gives every task of a step (srun), and what stagewise's batch script adds (the endpoint, above).
SLURM_NODEID_ENV, SLURM_NNODES_ENV, SLURM_JOB_NODES_ENV = "SLURM_NODEID", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"
SLURM_JOB_ID_ENV, SLURM_RESTART_ENV = "SLURM_JOB_ID", "SLURM_RESTART_COUNT"
# This launcher sets the rendezvous; any of these in the command would contradict it.
_REFUSED = (*RENDEZVOUS_OPTIONS, "--node-rank", "--node_rank", "--rdzv-id", "--rdzv_id", "--rdzv-conf", "--rdzv_conf",
            "--local-addr", "--local_addr")


class NodeConfigError(SystemExit):
    """This node's place in the job cannot be read: the message names the file or variable."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{LAUNCHER}: {message}")


@dataclass(frozen=True, kw_only=True)
class Node:
    """Where this node sits in the job, as the backend told it."""

    node_rank: int
    """Index of this node, 0 .. num_nodes-1; node 0 hosts the rendezvous store."""
    num_nodes: int
    """Nodes in the job."""
    master_addr: str
    """Node 0's address (a name or an IP)."""
    master_port: int
    """Port of node 0's rendezvous store."""
    run_id: str
    """Key prefix in the store; unique per try where the backend gives one."""
    join_timeout_s: int
    """How long node 0's store waits for every node."""
    interface: str | None
    """Network interface gloo/NCCL use between nodes; None: their own choice."""

    def torchrun_options(self) -> list[str]:
        return [f"--nnodes={self.num_nodes}", f"--node-rank={self.node_rank}", "--rdzv-backend=static",
                f"--rdzv-endpoint={self.master_addr}:{self.master_port}", f"--rdzv-id={self.run_id}",
                f"--rdzv-conf=timeout={self.join_timeout_s}"]


def _int_env(environ: dict[str, str], name: str, default: int | None = None) -> int:
    text = environ.get(name)
    if text is None or text == "":
        if default is None:
            raise NodeConfigError(f"${name} is not set")
        return default
    try:
        return int(text)
    except ValueError:
        raise NodeConfigError(f"${name} must be an integer, got {text!r}") from None


def _endpoint(environ: dict[str, str], name: str, what: str) -> tuple[str, int]:
    endpoint = environ.get(name, "")
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise NodeConfigError(f"${name} must be host:port ({what}), got {endpoint!r}")
    return host.strip("[]"), int(port)


def sagemaker_node(environ: dict[str, str]) -> Node:
    """This node from SageMaker's resource config (or its SM_* variables)."""
    path = environ.get(SM_RESOURCE_CONFIG_ENV, SM_RESOURCE_CONFIG)
    if Path(path).exists():
        where = path
        try:
            resource = json.loads(Path(path).read_text())
            hosts, current, interface = resource["hosts"], resource["current_host"], resource.get("network_interface_name")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise NodeConfigError(f"{path}: not a SageMaker resource config with 'hosts' and 'current_host' ({exc!r})") from None
    elif "SM_HOSTS" in environ and "SM_CURRENT_HOST" in environ:
        where = "$SM_HOSTS/$SM_CURRENT_HOST"
        try:
            hosts = json.loads(environ["SM_HOSTS"])
        except ValueError:
            raise NodeConfigError(f"$SM_HOSTS must be a JSON list of host names, got {environ['SM_HOSTS']!r}") from None
        current, interface = environ["SM_CURRENT_HOST"], environ.get("SM_NETWORK_INTERFACE_NAME")
    else:
        raise NodeConfigError(f"no SageMaker resource config at {path} (${SM_RESOURCE_CONFIG_ENV}) and no "
                              f"$SM_HOSTS/$SM_CURRENT_HOST: is this running in a SageMaker training job?")
    if not isinstance(hosts, list) or not hosts or not all(isinstance(host, str) for host in hosts):
        raise NodeConfigError(f"{where}: hosts must be a non-empty list of host names, got {hosts!r}")
    if len(set(hosts)) != len(hosts):
        raise NodeConfigError(f"{where}: hosts lists a host twice: {hosts}")
    hosts = sorted(hosts)
    if current not in hosts:
        raise NodeConfigError(f"{where}: current host {current!r} is not among the hosts {hosts}")
    return Node(node_rank=hosts.index(current), num_nodes=len(hosts), master_addr=hosts[0],
                master_port=_int_env(environ, MASTER_PORT_ENV, DEFAULT_MASTER_PORT), run_id="sagemaker",
                join_timeout_s=_int_env(environ, JOIN_TIMEOUT_ENV, DEFAULT_JOIN_TIMEOUT_S), interface=interface or None)


def kubernetes_node(environ: dict[str, str]) -> Node:
    """This pod from the Indexed Job's index and the launcher's rendezvous variables."""
    index, num_nodes = _int_env(environ, K8S_INDEX_ENV), _int_env(environ, K8S_NNODES_ENV)
    if num_nodes < 1:
        raise NodeConfigError(f"${K8S_NNODES_ENV} must be at least 1, got {num_nodes}")
    if not 0 <= index < num_nodes:
        raise NodeConfigError(f"${K8S_INDEX_ENV} {index} is outside 0..{num_nodes - 1} (${K8S_NNODES_ENV} = {num_nodes})")
    host, port = _endpoint(environ, K8S_ENDPOINT_ENV, "pod 0 under the headless Service")
    run_id = environ.get(K8S_RDZV_ID_ENV, "")
    if not run_id:
        raise NodeConfigError(f"${K8S_RDZV_ID_ENV} is not set: give each Airflow try its own rendezvous id")
    return Node(node_rank=index, num_nodes=num_nodes, master_addr=host, master_port=port, run_id=run_id,
                join_timeout_s=_int_env(environ, JOIN_TIMEOUT_ENV, DEFAULT_JOIN_TIMEOUT_S),
                interface=environ.get(K8S_IFNAME_ENV) or None)


def route_interface(address: str) -> str | None:
    """The network interface this machine reaches ``address`` through (None: not found), so gloo/NCCL need no name."""
    import socket

    import psutil

    try:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))  # UDP: no packet is sent, the kernel only picks the route
            local = probe.getsockname()[0]
    except OSError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(item.address.split("%")[0] == local for item in addresses):
            return name
    return None


def slurm_node(environ: dict[str, str]) -> Node:
    """This node from the srun task's SLURM_* variables and the batch script's rendezvous endpoint."""
    num_nodes = _int_env(environ, SLURM_NNODES_ENV if environ.get(SLURM_NNODES_ENV) else SLURM_JOB_NODES_ENV)
    index = _int_env(environ, SLURM_NODEID_ENV)
    if num_nodes < 1:
        raise NodeConfigError(f"${SLURM_NNODES_ENV} must be at least 1, got {num_nodes}")
    if not 0 <= index < num_nodes:
        raise NodeConfigError(f"${SLURM_NODEID_ENV} {index} is outside 0..{num_nodes - 1} (${SLURM_NNODES_ENV} = {num_nodes}): "
                              f"run one task per node (srun --ntasks-per-node=1)")
    host, port = _endpoint(environ, K8S_ENDPOINT_ENV, "the allocation's first node, exported by the batch script")
    job = environ.get(SLURM_JOB_ID_ENV, "")
    if not job:
        raise NodeConfigError(f"${SLURM_JOB_ID_ENV} is not set: is this running in a Slurm job (srun)?")
    restarts = _int_env(environ, SLURM_RESTART_ENV, 0)
    interface = environ.get(K8S_IFNAME_ENV) or None
    return Node(node_rank=index, num_nodes=num_nodes, master_addr=host, master_port=port,
                run_id=f"slurm-{job}-r{restarts}", join_timeout_s=_int_env(environ, JOIN_TIMEOUT_ENV, DEFAULT_JOIN_TIMEOUT_S),
                interface=interface if interface or num_nodes == 1 else route_interface(host))


READERS = {"sagemaker": sagemaker_node, "kubernetes": kubernetes_node, "slurm": slurm_node}


def torchrun_argv(backend: str, argv: list[str], environ: dict[str, str]) -> tuple[Node, list[str]]:
    """This node and torchrun's arguments: the node's static rendezvous, then the user's options and guarded ranks."""
    if backend not in READERS:
        raise NodeConfigError(f"the first argument must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if not any(arg.split("=", 1)[0] in ("--nproc-per-node", "--nproc_per_node") for arg in argv):
        raise NodeConfigError("give --nproc-per-node (the profile's processes_per_node): every node runs that many ranks")
    node = READERS[backend](environ)
    own = guarded_argv(argv, LAUNCHER, _REFUSED, f"the {backend} node's place in the job sets the rendezvous")
    return node, [*node.torchrun_options(), *own]


def main(argv: list[str] | None = None) -> None:
    from torch.distributed import run as torchrun

    skip_final_collection()  # the agent's torch heap, not collected at its exit
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return
    node, torchrun_args = torchrun_argv(args[0], args[1:], dict(os.environ))
    if node.interface:  # the ranks inherit the agent's environment
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = node.interface
    print(f"{LAUNCHER}: node {node.node_rank} of {node.num_nodes}, store {node.master_addr}:{node.master_port}, "
          f"interface {node.interface or 'default'}", file=sys.stderr, flush=True)
    torchrun.main(torchrun_args)


if __name__ == "__main__":
    main()
