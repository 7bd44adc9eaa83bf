"""The shared Optuna study of a sweep: its storage, name, sampler and pruner, the search space, trial outcomes."""
