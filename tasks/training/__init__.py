"""The training library under the sub-jobs (stagewise.train runs a stage, stagewise.sweep its trials).

- :mod:`stagewise.training.loop`: the one training loop of sweep trials and DDP stages (batch arithmetic,
  LR rules, warmup and schedules, gradient clipping, divergence checks, validation metrics reduced across ranks);
- :mod:`stagewise.training.selection`: the epoch a stage hands on (its best on the objective) and early stopping;
- :mod:`stagewise.training.device_data`: batches shuffled and sliced on the device, the data resident or streamed
  through pinned memory and a side CUDA stream (chosen per stage, automatically on CUDA);
- :mod:`stagewise.training.step_graph`: the training step captured once as a CUDA graph and replayed (one process,
  static shapes), and the stage's TF32 switch;
- :mod:`stagewise.training.checkpoint`: checkpoints written by rank 0, exact resume, restoring model and optimizer state;
- :mod:`stagewise.training.distributed`: the torchrun environment, read once;
- :mod:`stagewise.training.local_torchrun` and :mod:`stagewise.training.rank_guard`: torchrun on one machine with the
  rendezvous on loopback and no rank outliving its agent;
- :mod:`stagewise.training.node_launch`: the same on each node of a SageMaker or Kubernetes job, the node's rank
  from its backend (the container entrypoint).
"""
