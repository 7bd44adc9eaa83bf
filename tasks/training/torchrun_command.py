"""The torchrun command line of every DDP sub-job, built without importing torch.

The Airflow task process builds it for each stage and sweep worker it launches: importing
stagewise.training.local_torchrun (torch and its elastic agent) there cost every such task about two
CPU-seconds before its sub-job even started.
"""

from __future__ import annotations

import sys


def command(entry: list[str], args: list[str], nproc_per_node: int, max_restarts: int = 0, backend: str = "local",
            python: str = sys.executable) -> list[str]:
    """The argv running ``entry`` (``[script]`` or ``["-m", module]``) with ``args`` under torchrun: the one torchrun
    command of the Airflow launcher's DDP sub-jobs, of stagewise.sweep's bring-your-own trials (backend local:
    stagewise.training.local_torchrun) and of every node of a SageMaker or Kubernetes job (stagewise.training.node_launch;
    ``python`` is the image's interpreter there)."""
    launcher = ["stagewise.training.local_torchrun"] if backend == "local" else ["stagewise.training.node_launch", backend]
    return [python, "-m", *launcher, f"--nproc-per-node={nproc_per_node}", f"--max-restarts={max_restarts}", *entry, *args]
