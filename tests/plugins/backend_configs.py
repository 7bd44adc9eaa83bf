"""Pipeline configs whose stage s2 runs on a SageMaker, Kubernetes or Slurm profile, for the backend tests."""

from __future__ import annotations

from pathlib import Path

import yaml

from stagewise.definitions.config import PipelineConfig
from stagewise.definitions.loading import load_config
from tests.conftest import base_config

SAGEMAKER = {"instance_type": "ml.g5.12xlarge", "image_uri": "123456789012.dkr.ecr.eu-west-1.amazonaws.com/stagewise:1",
             "role_arn": "arn:aws:iam::123456789012:role/stagewise-training", "use_spot": True, "max_run_s": 3600,
             "aws_conn_id": "aws_stagewise_test", "region": "us-east-1"}
KUBERNETES = {"image": "registry.example/stagewise:1", "namespace": "ml", "gpus_per_pod": 8, "cpu": "8", "memory": "32Gi",
              "node_selector": {"node.kubernetes.io/instance-type": "p4d.24xlarge"},
              "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
              "service_account": "stagewise-trainer", "kubernetes_conn_id": "kubernetes_stagewise_test"}
SLURM = {"partition": "gpu", "account": "ml-team", "qos": "high", "constraint": "a100&ib", "cpus_per_task": 8,
         "mem_per_cpu": "4G", "gpus_per_node": 2, "time_limit": "02:00:00", "extra_sbatch_options": ["--exclusive"],
         "slurm_conf": "/etc/slurm/cluster.conf", "rendezvous_port": 29555, "join_timeout_s": 300}
BLOCKS = {"sagemaker": SAGEMAKER, "kubernetes": KUBERNETES, "slurm": SLURM}
RUN = {"dag_id": "ml_pipeline", "run_id": "manual__2026-11-23T15:00:00+00:00"}


def backend_config(directory: Path, backend: str, storage_root: str = "s3://stagewise-test/root", retries: int = 2,
                   **settings) -> tuple[Path, PipelineConfig]:
    """Write a config (into ``directory``, standing for the project checkout) whose profile ddp2 uses ``backend``."""
    raw = base_config(directory)
    raw["storage_root"] = storage_root
    block = {**BLOCKS[backend], **settings}
    raw["profiles"]["ddp2"].update({"backend": backend, "nodes": 2, "processes_per_node": 2, "retries": retries,
                                    backend: block})
    path = directory / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path, load_config(path)


def job_args(path: Path, config: PipelineConfig, attempt: int = 1, **changes) -> dict:
    """The builders' keyword arguments for stage s2 of RUN."""
    from stagewise.core.storage import run_prefix

    out = run_prefix(config.storage_root, **RUN)
    args = dict(dag_id=RUN["dag_id"], run_id=RUN["run_id"], stage="s2", out=out, attempt=attempt,
                params={"lr": 0.05, "hidden": 64}, init_from=None, config_file=f"{out}/config.yaml")
    return {**args, **changes}
