"""A 2-rank job whose ranks ignore SIGTERM (as a rank stuck in a collective or a long write does) and idle.

Run: ``python -m stagewise.training.local_torchrun --nproc-per-node=2 tests/plugins/stubborn_ranks.py PID_DIR``
Once the group is up, each rank writes ``PID_DIR/rank<N>.pid``: its pid, then its agent's. A rank gives up after
120 s, so a leak from a broken test does not live on for long.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from stagewise.training.distributed import init_process_group, read_env


def main() -> None:
    pid_dir = sys.argv[1]
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import torch
    import torch.distributed as dist

    env = read_env("cpu")
    init_process_group(env)
    dist.all_reduce(torch.ones(1))  # a real job: the ranks have talked to each other
    path = os.path.join(pid_dir, f"rank{env.rank}.pid")
    with open(f"{path}.tmp", "w") as handle:
        handle.write(f"{os.getpid()} {os.getppid()}")  # the parent is the torchrun agent
    os.replace(f"{path}.tmp", path)
    time.sleep(120)


if __name__ == "__main__":
    main()
