"""A 2-rank job that joins its process group, then holds it open until told, so a test can list its sockets.

Run: ``python -m stagewise.training.local_torchrun --nproc-per-node=2 tests/plugins/rendezvous_probe.py READY_FILE RELEASE_FILE``
"""

from __future__ import annotations

import os
import sys
import time

from stagewise.training.distributed import init_process_group, read_env


def main() -> None:
    ready_file, release_file = sys.argv[1:3]
    import torch
    import torch.distributed as dist

    env = read_env("cpu")
    init_process_group(env)
    total = torch.ones(1)
    dist.all_reduce(total)  # the ranks really talk to each other before the sockets are listed
    if env.master:
        with open(f"{ready_file}.tmp", "w") as handle:
            handle.write(f"{os.getppid()} {int(total.item())}")  # the parent is the torchrun agent
        os.replace(f"{ready_file}.tmp", ready_file)
    deadline = time.monotonic() + 120
    while not os.path.exists(release_file) and time.monotonic() < deadline:
        time.sleep(0.1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
