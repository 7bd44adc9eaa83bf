"""A real Slurm cluster on this machine for the tests (Debian's slurm-wlm and munge; root and ``ip netns``).

munged runs in the root namespace on a key and socket of the cluster's own; slurmctld and each slurmd run in a network
namespace of their own (tests/netns.py's way), each under ``unshare --uts`` with its own hostname, joined by a bridge
in the root namespace that holds .1 of a /24 of the cluster's own, so Slurm's clients (sbatch, squeue, scontrol) run
from here with ``SLURM_CONF`` and nothing listens on the machine's real interfaces. Names and the /24 are unique per
process and cluster, so several clusters (one per pytest-xdist worker) run side by side. The nodes share this
machine's filesystem, CPUs and clock: a job's working folder and output files are the same paths everywhere.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.netns import namespace_pids

_cluster_numbers = itertools.count()
_SBIN = os.pathsep.join(("/usr/local/sbin", "/usr/sbin", "/sbin"))
_NET_LOCK = Path(tempfile.gettempdir()) / "stagewise-slurm-net.lock"
CONTROLLER_PORT = 6817
# How long slurmctld waits for a silent slurmd before setting its node DOWN (failing or requeueing its jobs) and a
# message's round trip: with 3 and 3 a killed slurmd's job ends 7-12 s later (with 5 and 5: 16 s; 1 and 1 save 2-5 s
# but leave no slack for a loaded machine). A requeued job waits cred_expire + 1 s before it may start again: Slurm
# ignores a cred_expire under 5 (it then waits its default 120 s).
SLURMD_TIMEOUT_S = 3
MESSAGE_TIMEOUT_S = 3
CRED_EXPIRE_S = 5
TERMINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL", "TIMEOUT", "PREEMPTED", "BOOT_FAIL",
                      "OUT_OF_MEMORY", "DEADLINE"})


class SlurmUnavailable(RuntimeError):
    """This machine cannot run the test cluster (not root, no ``ip netns``, or Slurm or munge not installed)."""


def _which(program: str) -> str | None:
    return shutil.which(program, path=os.pathsep.join((os.environ.get("PATH", ""), _SBIN)))


def unavailable_reason() -> str | None:
    """Why a Slurm cluster cannot be started here, or None when it can."""
    if os.geteuid() != 0:
        return "the Slurm test cluster creates network namespaces: run as root"
    if shutil.which("ip") is None or subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "the Slurm test cluster needs `ip netns` (iproute2)"
    if shutil.which("unshare") is None:
        return "the Slurm test cluster needs `unshare` (util-linux) to give each daemon its hostname"
    missing = [program for program in ("slurmctld", "slurmd", "munged", "sbatch", "scontrol") if _which(program) is None]
    if missing:
        return f"no {', '.join(missing)} on PATH: install Debian's slurm-wlm and munge (apt-get install slurm-wlm munge)"
    return None


@dataclass(frozen=True)
class Node:
    name: str
    """Slurm's node name and the hostname its daemon sees (``ctl`` for the controller)."""
    namespace: str
    """Network namespace: run a command there with ``ip netns exec NAMESPACE ...``."""
    address: str
    """Its IPv4 address on the cluster's /24 (slurm.conf's NodeAddr)."""
    interface: str
    """Its interface inside the namespace (what GLOO_SOCKET_IFNAME names)."""
    link: str
    """The other end of its veth pair, on the bridge in the root namespace (what network_down takes down)."""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")


def _free_octet(start: int) -> int:
    """A third octet of 10.215.X.0/24 that no interface here uses (the caller holds _NET_LOCK)."""
    used = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=30).stdout
    taken = {int(match) for match in re.findall(r"inet 10\.215\.(\d+)\.", used)}
    for step in range(250):
        octet = (start + step) % 250 + 1
        if octet not in taken:
            return octet
    raise RuntimeError("no free /24 in 10.215.0.0/16 for a Slurm test cluster")


def _free_tag(tag: str) -> str:
    """``tag``, or it with a letter added, so that no namespace or bridge here has the cluster's names yet (another
    process's pid may end in the same digits)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=30).stdout
    for candidate in (tag, *(tag + letter for letter in "abcdefgh")):
        if f"swsl-{candidate}-" not in listed and f"swsb{candidate}:" not in links:
            return candidate
    raise RuntimeError(f"the Slurm test cluster's names swsl-{tag}* are all taken")


def parse_record(line: str) -> dict[str, str]:
    """``scontrol show ... -o``'s one line as a dict (a value may hold spaces: it runs to the next ``Key=``)."""
    starts = list(re.finditer(r"(?:^|\s)([A-Za-z][\w:/.]*)=", line.strip()))
    text = line.strip()
    return {match.group(1): text[match.end():(starts[index + 1].start() if index + 1 < len(starts) else len(text))]
            for index, match in enumerate(starts)}


class SlurmCluster:
    """A started cluster (see ``cluster``): its config, environment, nodes, client commands and faults."""

    def __init__(self, folder: Path, tag: str, octet: int, nodes: int, cpus_per_node: int, memory_mb: int):
        self.folder = folder
        self.tag = tag
        self.bridge = f"swsb{tag}"[:15]
        self.gateway = f"10.215.{octet}.1"
        self.controller = self._node("ctl", f"10.215.{octet}.2", "c")
        self.nodes = [self._node(f"n{index + 1}", f"10.215.{octet}.{index + 3}", str(index + 1)) for index in range(nodes)]
        self.cpus_per_node = cpus_per_node
        self.memory_mb = memory_mb
        self.conf = folder / "slurm.conf"
        self.logs = folder / "log"
        self.env = {**{key: value for key, value in os.environ.items() if not key.startswith("SLURM_")},
                    "SLURM_CONF": str(self.conf)}
        self._daemons: dict[str, subprocess.Popen] = {}
        self._munged: subprocess.Popen | None = None
        self._namespaces: list[str] = []
        self._jobs = itertools.count()

    def _node(self, name: str, address: str, suffix: str) -> Node:
        return Node(name, f"swsl-{self.tag}-{name}", address, "eth0", f"swsl{self.tag}{suffix}"[:15])

    def node(self, name: str) -> Node:
        """The node called ``name``."""
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(f"no node {name!r} in this cluster (nodes: {', '.join(n.name for n in self.nodes)})")

    # -- client commands ------------------------------------------------------------------------------------------

    def run(self, *argv: str, timeout: float = 30, check: bool = False) -> subprocess.CompletedProcess:
        """A Slurm client command (sinfo, sbatch, scontrol, ...) against this cluster; text output captured."""
        done = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
        return done

    def node_state(self, name: str) -> str:
        """sinfo's state of a node: "idle", "allocated", "mixed", "down*" (* = not responding), "drained", ..."""
        self.node(name)
        listed = self.run("sinfo", "-h", "-N", "-n", name, "-o", "%T").stdout.split()
        return listed[0] if listed else "unknown"

    def states(self) -> dict[str, str]:
        """Every node's sinfo state."""
        listed = self.run("sinfo", "-h", "-N", "-o", "%N %T").stdout.split("\n")
        return dict(line.split(None, 1) for line in listed if line.strip())

    def sbatch(self, script: str, *options: str) -> str:
        """Submit a batch script (its text) with sbatch's ``options``; the job id. Output goes to the cluster's folder
        (slurm-<id>.out there) unless the options say otherwise."""
        path = self.folder / "jobs" / f"job{next(self._jobs)}.sh"
        path.parent.mkdir(exist_ok=True)
        path.write_text(script)
        done = self.run("sbatch", "--parsable", f"--chdir={path.parent}", *options, str(path), check=True)
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o``'s record of a job (JobState, Reason, NodeList, Restarts, ExitCode, ...); {} once
        the controller has forgotten it."""
        done = self.run("scontrol", "show", "job", "-o", str(job_id))
        return parse_record(done.stdout) if done.returncode == 0 and done.stdout.strip() else {}

    def wait_state(self, job_id: str, states: Iterable[str], timeout: float = 30) -> dict[str, str]:
        """Poll the job until its JobState is one of ``states``; its record. TimeoutError (with its last record and the
        daemons' log tails) after ``timeout`` seconds."""
        wanted = {state.upper() for state in ([states] if isinstance(states, str) else states)}
        deadline = time.monotonic() + timeout
        record: dict[str, str] = {}
        while True:
            record = self.job(job_id)
            if record.get("JobState") in wanted:
                return record
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not {'/'.join(sorted(wanted))} after {timeout} s: "
                                   f"{record or 'forgotten'}\n{self.log_tails()}")
            time.sleep(0.2)

    def wait_node(self, name: str, states: Iterable[str], timeout: float = 30) -> str:
        """Poll a node until its sinfo state is one of ``states``; the state. TimeoutError after ``timeout``."""
        wanted = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        while (state := self.node_state(name)) not in wanted:
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {name} is {state}, not {'/'.join(sorted(wanted))}, after {timeout} s\n"
                                   f"{self.log_tails()}")
            time.sleep(0.2)
        return state

    def wait_idle(self, timeout: float = 60) -> None:
        """Wait until sinfo shows every node idle; RuntimeError with the states and log tails if not in ``timeout``."""
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while True:
            dead = [name for name, daemon in self._daemons.items() if daemon.poll() is not None]
            if dead:
                raise RuntimeError(f"Slurm daemons exited: {', '.join(dead)}\n{self.log_tails()}")
            states = self.states()
            if set(states) == {node.name for node in self.nodes} and set(states.values()) == {"idle"}:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Slurm cluster's nodes are not all idle after {timeout} s: {states}\n"
                                   f"{self.log_tails()}")
            time.sleep(0.2)

    def log_tails(self, lines: int = 15) -> str:
        """The last lines of every daemon's log (for failure messages)."""
        parts = []
        for path in sorted(self.logs.glob("*")):
            with contextlib.suppress(OSError):
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {path.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    # -- faults ---------------------------------------------------------------------------------------------------

    def kill_slurmd(self, name: str) -> None:
        """SIGKILL a node's slurmd (its running steps live on): slurmctld sets the node DOWN after SlurmdTimeout."""
        daemon = self._daemons[self.node(name).name]
        with contextlib.suppress(ProcessLookupError):
            daemon.kill()
        daemon.wait(timeout=30)

    def kill_node(self, name: str) -> None:
        """A node lost at once: SIGKILL every process in its namespace (slurmd, its steps and their job processes)."""
        self.kill_slurmd(name)
        self._kill_namespace(self.node(name).namespace)

    def start_slurmd(self, name: str) -> None:
        """Start a node's slurmd (again), in its namespace under its hostname; it registers with slurmctld."""
        node = self.node(name)
        if (daemon := self._daemons.get(name)) is not None and daemon.poll() is None:
            raise RuntimeError(f"slurmd of {name} is already running (pid {daemon.pid})")
        # slurmd signals the pid its pid file names: after a kill that pid may be another process by now.
        (self.folder / "spool" / f"slurmd-{name}.pid").unlink(missing_ok=True)
        self._daemons[name] = self._start(node, "slurmd", "-N", node.name)

    def slurmd_running(self, name: str) -> bool:
        """Whether the node's slurmd (as this cluster started it) is alive."""
        daemon = self._daemons.get(self.node(name).name)
        return daemon is not None and daemon.poll() is None

    def network_down(self, name: str) -> None:
        """Take the node's veth link down (its bridge end): slurmctld and the other nodes lose it until network_up."""
        _ip("link", "set", self.node(name).link, "down")

    def network_up(self, name: str) -> None:
        """Bring the node's veth link back up."""
        _ip("link", "set", self.node(name).link, "up")

    def drain(self, name: str, reason: str = "test drain") -> None:
        """``scontrol update state=drain``: the node takes no new job (running ones finish), sinfo shows it drained."""
        self.run("scontrol", "update", f"nodename={self.node(name).name}", "state=drain", f"reason={reason}", check=True)

    def resume(self, name: str) -> None:
        """``scontrol update state=resume``: a drained (or down, responding) node takes jobs again."""
        self.run("scontrol", "update", f"nodename={self.node(name).name}", "state=resume", check=True)

    def requeue(self, job_id: str) -> None:
        """``scontrol requeue``: a running job is killed and queued again (it restarts after CRED_EXPIRE_S or so, with
        SLURM_RESTART_COUNT one more)."""
        self.run("scontrol", "requeue", str(job_id), check=True)

    def cancel_all(self, timeout: float = 30) -> None:
        """scancel every job the cluster holds and wait until none is left pending, running or completing."""
        deadline = time.monotonic() + timeout
        while ids := self.run("squeue", "-h", "-o", "%A").stdout.split():
            self.run("scancel", *ids)
            if time.monotonic() > deadline:
                raise RuntimeError(f"jobs {ids} still in the queue after scancel and {timeout} s\n{self.log_tails()}")
            time.sleep(0.2)

    def reset(self, timeout: float = 60) -> None:
        """Every node back to idle between tests: links up, a killed slurmd started, leftover jobs cancelled (and their
        processes killed), drained or down nodes resumed."""
        running = {node.name for node in self.nodes if self.slurmd_running(node.name)}
        for node in self.nodes:
            self.network_up(node.name)
            if node.name not in running:  # its orphaned steps go first: the new slurmd starts on a clean node
                self._kill_namespace(node.namespace)
                self.start_slurmd(node.name)
        self.cancel_all(timeout)
        for name in running:  # a job's process that outlived its step
            self._kill_namespace(self.node(name).namespace, keep={self._daemons[name].pid})
        deadline = time.monotonic() + timeout
        for name, state in self.states().items():
            if state != "idle":
                self.run("scontrol", "update", f"nodename={name}", "state=resume")
        self.wait_idle(max(1.0, deadline - time.monotonic()))

    # -- start and stop -------------------------------------------------------------------------------------------

    def _start(self, node: Node, daemon: str, *args: str) -> subprocess.Popen:
        """A daemon in the foreground (-D) in the node's namespace, under its hostname; its output in log/."""
        # The hostname without a child process (one a namespace-wide kill could catch between fork and exec).
        script = 'printf %s "$0" > /proc/sys/kernel/hostname && exec "$@"'
        argv = ["ip", "netns", "exec", node.namespace, "unshare", "--uts", "sh", "-c", script, node.name,
                _which(daemon) or daemon, "-D", "-f", str(self.conf), *args]
        with open(self.logs / f"{daemon}-{node.name}.out", "ab") as output:
            return subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL, stdout=output, stderr=output,
                                    start_new_session=True)

    def _write_config(self) -> None:
        folder = self.folder
        for node in self.nodes:
            (folder / "spool" / node.name).mkdir(parents=True)
        (folder / "state").mkdir()
        memory_per_cpu = max(1, self.memory_mb // self.cpus_per_node)
        lines = [
            "ClusterName=stagewise",
            f"SlurmctldHost=ctl({self.controller.address})",
            "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={folder / 'munge' / 'munge.sock'},cred_expire={CRED_EXPIRE_S}",
            "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={folder / 'state'}",
            f"SlurmdSpoolDir={folder / 'spool' / '%n'}",
            f"SlurmctldPidFile={folder / 'slurmctld.pid'}", f"SlurmdPidFile={folder / 'spool' / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={self.logs / 'slurmctld.log'}", f"SlurmdLogFile={self.logs / 'slurmd-%n.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/linux",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/filetxt", f"JobCompLoc={self.logs / 'jobcomp.log'}",
            "SchedulerType=sched/backfill", "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core_Memory",
            # Nodes take the CPUs and memory written here, whatever this machine has.
            "SlurmdParameters=config_overrides",
            "SlurmctldTimeout=30", f"SlurmdTimeout={SLURMD_TIMEOUT_S}", f"MessageTimeout={MESSAGE_TIMEOUT_S}",
            # The main scheduler every second (Slurm's default 60 s): a requeued job starts once its BeginTime passes.
            "SchedulerParameters=sched_interval=1,bf_interval=1,batch_sched_delay=0",
            "InactiveLimit=0", "KillWait=2", "MinJobAge=600", "ReturnToService=2", "JobRequeue=1",
            "MpiDefault=none", "MailProg=/bin/true",
            f"DefMemPerCPU={memory_per_cpu}",
            *(f"NodeName={node.name} NodeAddr={node.address} CPUs={self.cpus_per_node} RealMemory={self.memory_mb} "
              "State=UNKNOWN" for node in self.nodes),
            f"PartitionName=debug Nodes={','.join(node.name for node in self.nodes)} Default=YES MaxTime=INFINITE State=UP",
            f"PartitionName=small Nodes={self.nodes[0].name} MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        # Autodetection of the cgroup version fails in a container: Slurm reads this beside slurm.conf.
        (folder / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n")

    def _start_munged(self) -> None:
        munge = self.folder / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        argv = [_which("munged") or "munged", "--foreground", "--force", f"--key-file={key}",
                f"--socket={munge / 'munge.sock'}", f"--pid-file={munge / 'munged.pid'}", f"--seed-file={munge / 'seed'}",
                f"--log-file={self.logs / 'munged.log'}"]
        self._munged = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 20
        while not (munge / "munge.sock").exists():
            if self._munged.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start\n{self.log_tails()}")
            time.sleep(0.05)

    def _network(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for node in (self.controller, *self.nodes):
            _ip("netns", "add", node.namespace)
            self._namespaces.append(node.namespace)
            _ip("-n", node.namespace, "link", "set", "lo", "up")
            _ip("link", "add", node.link, "type", "veth", "peer", "name", node.interface, "netns", node.namespace)
            _ip("link", "set", node.link, "master", self.bridge)
            _ip("link", "set", node.link, "up")
            _ip("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", node.interface)
            _ip("-n", node.namespace, "link", "set", node.interface, "up")

    def _wait_controller(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self._daemons["ctl"].poll() is not None:
                raise RuntimeError(f"slurmctld exited ({self._daemons['ctl'].returncode})\n{self.log_tails()}")
            with contextlib.suppress(OSError), socket.create_connection((self.controller.address, CONTROLLER_PORT), 1):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"slurmctld does not listen after {timeout} s\n{self.log_tails()}")
            time.sleep(0.05)

    def start(self, timeout: float = 60) -> None:
        """Network, munged, slurmctld, every slurmd; returns once sinfo shows every node idle."""
        self.logs.mkdir(parents=True)
        self._write_config()
        self._start_munged()
        self._daemons["ctl"] = self._start(self.controller, "slurmctld", "-i")
        self._wait_controller()
        for node in self.nodes:
            self.start_slurmd(node.name)
        self.wait_idle(timeout)

    def _kill_namespace(self, namespace: str, keep: set[int] = frozenset()) -> None:
        for pid in namespace_pids(namespace):
            if pid not in keep:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        """SIGKILL every process in the namespaces, delete them and the bridge, stop munged (the folder stays)."""
        for namespace in self._namespaces:
            self._kill_namespace(namespace)
        for daemon in self._daemons.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                daemon.wait(timeout=10)
        for namespace in self._namespaces:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
        if self._munged is not None:
            self._munged.terminate()
            try:
                self._munged.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._munged.kill()
                self._munged.wait(timeout=10)


@contextlib.contextmanager
def cluster(nodes: int = 2, cpus_per_node: int = 2, memory_mb: int = 2000, timeout: float = 60) -> Iterator[SlurmCluster]:
    """A Slurm cluster of ``nodes`` nodes (n1, n2, ...) with ``cpus_per_node`` CPUs and ``memory_mb`` MB each, partitions
    ``debug`` (all nodes, the default) and ``small`` (n1 only), started and idle; on leaving (even on an error) every
    daemon and job process is killed, the namespaces and bridge deleted and its folder removed."""
    if reason := unavailable_reason():
        raise SlurmUnavailable(reason)
    if not 1 <= nodes <= 200:
        raise ValueError(f"nodes must be 1..200, not {nodes}")
    number = next(_cluster_numbers)
    folder = Path(tempfile.mkdtemp(prefix="stagewise-slurm-"))
    started: SlurmCluster | None = None
    try:
        with open(_NET_LOCK, "a") as lock:  # two clusters starting at once must not take the same names or /24
            fcntl.flock(lock, fcntl.LOCK_EX)
            tag = _free_tag(f"{os.getpid() % 100000}{number}")
            octet = _free_octet(os.getpid() * 7 + number)
            started = SlurmCluster(folder, tag, octet, nodes, cpus_per_node, memory_mb)
            started._network()
        started.start(timeout)
        yield started
    finally:
        if started is not None:
            started.stop()
        shutil.rmtree(folder, ignore_errors=True)
