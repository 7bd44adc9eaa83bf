"""torchrun for one machine whose rendezvous store listens on 127.0.0.1 only.

Run: ``python -m stagewise.training.local_torchrun --nproc-per-node=2 [--max-restarts=1] -m stagewise.train --stage s1 ...``
(any torchrun option but the rendezvous ones; ``--help`` shows them all).

``torchrun --standalone`` hosts two TCPStores on every interface (``*:port``): a TCPStore server binds
the wildcard address whatever host it is given. Here the agent hosts one store instead, on a socket
bound to 127.0.0.1 before the store takes it over (``master_listen_fd``); the ranks join it as
clients (``use_agent_store``), and gloo/NCCL pick the loopback interface for their own sockets.

Each rank starts through ``stagewise.training.rank_guard``, which gives it a parent-death SIGKILL before it becomes the rank's
own command: torch starts ranks in sessions of their own, so without it a rank whose agent is killed runs on.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys

from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

from stagewise.core.cli import skip_final_collection

LOOPBACK = "127.0.0.1"
RENDEZVOUS_BACKEND = "stagewise-loopback"
RENDEZVOUS_OPTIONS = ("--standalone", "--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint", "--rdzv_endpoint",
                      "--master-addr", "--master_addr", "--master-port", "--master_port", "--nnodes")
# How the user named the entrypoint; the guard's command replaces it ("--" only ends the options).
_ENTRYPOINT_OPTIONS = ("-m", "--module", "--no-python", "--no_python", "--")
# Collective libraries listen and connect on the interface named here; one machine needs only loopback.
LOOPBACK_INTERFACE_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def loopback_store(timeout: datetime.timedelta) -> TCPStore:
    """A TCPStore server reachable on 127.0.0.1 only (given no socket, it would bind every interface)."""
    listener = socket.create_server((LOOPBACK, 0), backlog=128)
    port = listener.getsockname()[1]
    return TCPStore(LOOPBACK, port, is_master=True, timeout=timeout, multi_tenant=True, wait_for_workers=False,
                    master_listen_fd=listener.detach())  # the store owns (and closes) the socket from here on


class LoopbackRendezvous(RendezvousHandler):
    """Single-node rendezvous: this agent is node 0 of 1 and hosts the store its ranks share."""

    def __init__(self, run_id: str, timeout: datetime.timedelta) -> None:
        self._run_id = run_id
        self._timeout = timeout
        self._store: TCPStore | None = None

    def get_backend(self) -> str:
        return RENDEZVOUS_BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # ranks connect to our store as clients instead of rank 0 hosting another one

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            self._store = loopback_store(self._timeout)
        store: Store = PrefixStore(self._run_id, self._store)
        return RendezvousInfo(store, 0, 1, RendezvousStoreInfo(LOOPBACK, self._store.port))

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        return True


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    timeout = datetime.timedelta(seconds=int(params.config.get("timeout", 600)))
    return LoopbackRendezvous(params.run_id, timeout)


def guarded_argv(argv: list[str], launcher: str, refused: tuple[str, ...], why: str) -> list[str]:
    """torchrun's options from ``argv`` then ``--no-python`` and every rank's command through stagewise.training.rank_guard.

    Refuses the ``refused`` options (``why`` says what the launcher sets instead) and ``--run-path``, which would run
    the ranks as this agent's multiprocessing children instead of commands the guard can start. The one rank-command
    builder of this launcher and of stagewise.training.node_launch.
    """
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(argv)
    options = argv[:len(argv) - len(parsed.training_script_args) - 1]  # the script and its arguments end argv
    for arg in options:
        if arg.split("=", 1)[0] in refused:
            raise SystemExit(f"{launcher}: {arg.split('=', 1)[0]} is not accepted: {why}")
    if parsed.run_path:
        raise SystemExit(f"{launcher}: --run-path is not accepted: each rank runs as a process of its own "
                         "that dies with this agent")
    if parsed.no_python and parsed.module:
        raise SystemExit(f"{launcher}: --no-python and --module exclude each other")
    if parsed.no_python:
        rank = [parsed.training_script]
    else:  # the command torchrun itself would give each rank
        rank = [os.getenv("PYTHON_EXEC", sys.executable), "-u", *(["-m"] if parsed.module else []), parsed.training_script]
    # This process becomes the agent, the ranks' parent: the guard checks it is still there once the signal is armed.
    guard = [sys.executable, "-m", "stagewise.training.rank_guard", str(os.getpid()), *rank, *parsed.training_script_args]
    options = [arg for arg in options if arg not in _ENTRYPOINT_OPTIONS]
    return [*options, "--no-python", *guard]


def torchrun_argv(argv: list[str]) -> list[str]:
    """torchrun's arguments with the loopback rendezvous and every rank started through stagewise.training.rank_guard.

    Refuses rendezvous options, which would undo the loopback store.
    """
    own = guarded_argv(argv, "stagewise.training.local_torchrun", RENDEZVOUS_OPTIONS,
                       f"this launcher runs one node with its rendezvous on {LOOPBACK}")
    return ["--nnodes=1", f"--rdzv-backend={RENDEZVOUS_BACKEND}", f"--rdzv-endpoint={LOOPBACK}:0", *own]


def main(argv: list[str] | None = None) -> None:
    from torch.distributed import run as torchrun

    skip_final_collection()  # the agent's torch heap, not collected at its exit
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help"):
        torchrun.main(["--help"])
        return
    for key, value in LOOPBACK_INTERFACE_ENV.items():
        os.environ.setdefault(key, value)  # the ranks inherit the agent's environment
    rendezvous_handler_registry.register(RENDEZVOUS_BACKEND, _create_handler)
    torchrun.main(torchrun_argv(args))


if __name__ == "__main__":
    main()
