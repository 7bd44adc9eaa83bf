"""Two emulated hosts on this machine: network namespaces joined by a veth pair (root and iproute2's ``ip netns``).

Used by tests/tasks/training/test_multinode.py and bench's multinode_overhead. Only the network is separate: both
"hosts" share this machine's filesystem, CPUs and clock.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_pair_numbers = itertools.count()


class NetnsUnavailable(RuntimeError):
    """This machine cannot create network namespaces here (not root, or no ``ip netns``)."""


@dataclass(frozen=True)
class Host:
    namespace: str
    """Network namespace: run a command there with ``ip netns exec NAMESPACE ...``."""
    interface: str
    """This host's end of the veth pair (what GLOO_SOCKET_IFNAME names)."""
    address: str
    """Its IPv4 address on the pair's /24."""


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")


def namespace_pids(namespace: str) -> list[int]:
    """The processes in a namespace (``ip netns pids``)."""
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=30)
    return [int(pid) for pid in listed.stdout.split()]


def check_available() -> None:
    """Raise NetnsUnavailable saying why two hosts cannot be emulated here."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("emulating two hosts creates network namespaces: run as root")
    if shutil.which("ip") is None or subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        raise NetnsUnavailable("emulating two hosts needs `ip netns` (iproute2)")


@contextlib.contextmanager
def two_hosts() -> Iterator[list[Host]]:
    """Namespaces sw-<pid><n>-a/b, ``lo`` up in each, a veth pair with 10.213.x.1 and .2; on leaving (even on an
    error) every process left in them is SIGKILLed and the namespaces (and so the pair) are deleted."""
    check_available()
    number = next(_pair_numbers)
    tag = f"{os.getpid()}{number}"
    octet = (os.getpid() * 7 + number) % 250 + 1  # a /24 per pair, unlikely to clash with another run's
    hosts = [Host(f"sw-{tag}-{side}", f"sw{tag}{side}"[-15:], f"10.213.{octet}.{index + 1}")
             for index, side in enumerate("ab")]
    created: list[str] = []
    try:
        for host in hosts:
            _ip("netns", "add", host.namespace)
            created.append(host.namespace)
            _ip("-n", host.namespace, "link", "set", "lo", "up")
        a, b = hosts
        _ip("link", "add", a.interface, "netns", a.namespace, "type", "veth", "peer", "name", b.interface, "netns", b.namespace)
        for host in hosts:
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _ip("-n", host.namespace, "link", "set", host.interface, "up")
        yield hosts
    finally:
        for namespace in created:
            for pid in namespace_pids(namespace):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)


def popen(host: Host, argv: list[str], env: dict[str, str], **kwargs) -> subprocess.Popen:
    """Start ``argv`` in the host's namespace with ``env`` (``ip netns exec`` passes the environment on; PYTHONPATH is
    also given on the command line, so the namespace's python imports this checkout)."""
    command = ["ip", "netns", "exec", host.namespace, "env", f"PYTHONPATH={env.get('PYTHONPATH', '')}", *argv]
    return subprocess.Popen(command, env=env, **kwargs)


def sagemaker_environment(host: Host, hosts: list[Host], folder: Path, env: dict[str, str]) -> dict[str, str]:
    """``env`` plus what a SageMaker node sees: its resourceconfig.json, written under ``folder`` and named by
    $STAGEWISE_SM_RESOURCE_CONFIG (hosts are the pair's addresses; the interface its end of the pair)."""
    path = folder / f"resourceconfig-{host.namespace}.json"
    path.write_text(json.dumps({"current_host": host.address, "hosts": [h.address for h in hosts],
                                "network_interface_name": host.interface}))
    return {**env, "STAGEWISE_SM_RESOURCE_CONFIG": str(path), "STAGEWISE_JOIN_TIMEOUT_S": "120"}
