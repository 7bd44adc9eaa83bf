"""Opening a sweep worker's study when the storage root already holds many others.

``study_open_500``: 500 finished studies of the demo's shape (12 trials each, 8 intermediate values, the worker's
user attributes) plus the worker's own. Ours: the default layout, a journal file per study
(``<root>/optuna/studies/{study}.journal``), opened as a worker opens it (``open_storage(storage_url(sweep, name))``,
``load_study``, its trials). Baseline: the same 501 studies in the one shared journal of earlier releases, opened the
same way. Each side's time is the best of 7 alternated opens in this process (Optuna replays a journal whole when a
storage is made, so each open is a fresh storage). Ratio = ours / baseline, goal <= 0.2. Run alone: ``python -m bench
--only study_open_500`` (about a minute on 2 busy cores, nearly all of it writing the studies).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

NUM_OTHERS = 500
TRIALS = 12
EPOCHS = 8
ROUNDS = 7


def _trials() -> list[Any]:
    """A finished sweep's trials: params, a value, per-epoch intermediate values and the worker's attributes."""
    import optuna

    distributions = {"lr": optuna.distributions.FloatDistribution(1e-4, 1.0, log=True),
                     "hidden": optuna.distributions.CategoricalDistribution([32, 64, 128]),
                     "weight_decay": optuna.distributions.FloatDistribution(1e-6, 1e-2, log=True)}
    return [optuna.trial.create_trial(
        params={"lr": 0.001 * (n + 1), "hidden": (32, 64, 128)[n % 3], "weight_decay": 1e-5 * (n + 1)},
        distributions=distributions, value=0.8 + n / 100,
        intermediate_values={epoch: 0.5 + epoch / 20 for epoch in range(EPOCHS)},
        user_attrs={"worker": n % 2, "epochs": EPOCHS, "steps": 400, "world_size": 1, "rows_seen": 11_000},
        ) for n in range(TRIALS)]


def _write_study(storage: Any, name: str, trials: list[Any]) -> None:
    import optuna

    study = optuna.create_study(study_name=name, storage=storage, direction="maximize")
    study.set_user_attr("stagewise_owner", {"model_name": "digits", "metric": "accuracy", "direction": "maximize"})
    study.set_user_attr("num_trials", TRIALS)
    study.add_trials(trials)


def _open_seconds(uri: str, name: str) -> float:
    """One worker's open: a fresh storage (the journal replayed), its study, every trial."""
    import optuna

    from stagewise.study.studies import open_storage

    started = time.perf_counter()
    study = optuna.load_study(study_name=name, storage=open_storage(uri))
    trials = study.get_trials(deepcopy=False)
    elapsed = time.perf_counter() - started
    if len(trials) != TRIALS:
        raise RuntimeError(f"{uri}: {len(trials)} trials of {name}, expected {TRIALS}")
    return elapsed


def study_open_500() -> dict[str, Any]:
    import optuna

    from stagewise.definitions.config import DEFAULT_JOURNAL, LEGACY_JOURNAL
    from stagewise.study.studies import open_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    trials = _trials()
    mine = "ml_pipeline__worker_run"
    names = [f"ml_pipeline__run_{k:04d}" for k in range(NUM_OTHERS)] + [mine]
    with tempfile.TemporaryDirectory(prefix="stagewise-study-bench-") as folder:
        root = Path(folder)
        shared_uri = f"journal://{root / LEGACY_JOURNAL}"
        shared = open_storage(shared_uri)
        per_study = f"journal://{root / DEFAULT_JOURNAL}"
        for name in names:  # the worker's study last: written after every other, as on a root in use
            _write_study(shared, name, trials)
            _write_study(open_storage(per_study.replace("{study}", name)), name, trials)
        del shared
        own_uri = per_study.replace("{study}", mine)
        ours, baseline = [], []
        for _ in range(ROUNDS):
            ours.append(_open_seconds(own_uri, mine))
            baseline.append(_open_seconds(shared_uri, mine))
        shared_bytes = (root / LEGACY_JOURNAL).stat().st_size
        own_bytes = Path(own_uri.removeprefix("journal://")).stat().st_size
    return {"ours": min(ours), "baseline": min(baseline), "unit": "s",
            "details": {"studies": len(names), "trials_each": TRIALS, "rounds": ROUNDS,
                        "ours_median_s": sorted(ours)[ROUNDS // 2], "baseline_median_s": sorted(baseline)[ROUNDS // 2],
                        "shared_journal_bytes": shared_bytes, "own_journal_bytes": own_bytes}}
