"""The STAGEWISE_* environment a bring-your-own script gets: every variable's name and meaning, in one place.

``stagewise.scripting.stage_contract.byo_environment`` sets the stage's variables, the Airflow launcher the ones every sub-job
gets, ``stagewise.sweep`` a trial's (a trial gets the stage's variables too, filled from ``sweep``); all take
the names from here, and docs/your-own-script.md's list is this module's output (``python -m stagewise.contract``),
checked by tests/test_docs.py. Add a variable here, never inline.
"""

from __future__ import annotations

STAGE_ENV: dict[str, str] = {}
"""Set for a bring-your-own stage by stagewise.scripting.stage_contract.byo_environment (name -> meaning)."""
LAUNCH_ENV: dict[str, str] = {}
"""Set by the launcher for every sub-job, ours and a user's (name -> meaning)."""
TRIAL_ENV: dict[str, str] = {}
"""Set, besides STAGE_ENV and LAUNCH_ENV, for a bring-your-own sweep trial by stagewise.sweep (name -> meaning)."""
NODE_ENV: dict[str, str] = {}
"""Set by a SageMaker or Kubernetes job for stagewise.training.node_launch: the node's place in the gang. Not part of a
script's contract (a script sees torchrun's RANK, WORLD_SIZE, ... as on one machine)."""


def _declare(group: dict[str, str], name: str, doc: str) -> str:
    if name in STAGE_ENV or name in LAUNCH_ENV or name in TRIAL_ENV or name in NODE_ENV:
        raise ValueError(f"{name} is declared twice")
    group[name] = doc
    return name


CONFIG = _declare(STAGE_ENV, "STAGEWISE_CONFIG", "The run's config snapshot (a path or URI): stagewise.definitions.loading.load_config reads it.")
STAGE = _declare(STAGE_ENV, "STAGEWISE_STAGE", "The stage's name.")
RUN_PREFIX = _declare(STAGE_ENV, "STAGEWISE_RUN_PREFIX", "The run's storage prefix (`runs/<dag_id>/<run_id>`).")
DATA_MANIFEST = _declare(STAGE_ENV, "STAGEWISE_DATA_MANIFEST",
                         "URI of the committed preprocess manifest: the train/validation/test files, features, "
                         "label and normalisation stats.")
OUTPUT_DIR = _declare(STAGE_ENV, "STAGEWISE_OUTPUT_DIR",
                      "The stage's output dir (`train/<stage>/` of the run): write `final.pt` and `model.pt` here.")
CHECKPOINT_DIR = _declare(STAGE_ENV, "STAGEWISE_CHECKPOINT_DIR",
                          "Keep checkpoints here: an Airflow retry of the stage finds them and can resume.")
INIT_FROM = _declare(STAGE_ENV, "STAGEWISE_INIT_FROM",
                     "The previous stage's `final.pt` to start from; empty for the first stage.")
PARAMS = _declare(STAGE_ENV, "STAGEWISE_PARAMS",
                  "Hyperparameters as a JSON object: built-in defaults, `train.default_params`, then the sweep's best.")
PER_PROCESS_BATCH = _declare(STAGE_ENV, "STAGEWISE_PER_PROCESS_BATCH", "Samples per process per micro-step (a trial: `sweep.batch_size`).")
GRAD_ACCUM_STEPS = _declare(STAGE_ENV, "STAGEWISE_GRAD_ACCUM_STEPS", "Micro-steps accumulated per optimizer step.")
GLOBAL_BATCH = _declare(STAGE_ENV, "STAGEWISE_GLOBAL_BATCH",
                        "Samples per optimizer step over all processes (per-process batch x world size x "
                        "accumulation steps); store it in `final.pt` as `global_batch`.")
LR = _declare(STAGE_ENV, "STAGEWISE_LR", "The learning rate, already rescaled for the global batch (`train.lr_rule`); a trial's is the suggested one.")
EPOCHS = _declare(STAGE_ENV, "STAGEWISE_EPOCHS", "Epochs this stage trains (a trial: `sweep.epochs`).")
WARMUP_STEPS = _declare(STAGE_ENV, "STAGEWISE_WARMUP_STEPS",
                        "Steps to ramp the lr up linearly over (the stage's `warmup_steps` when its global batch grew "
                        "or it is the first stage, else 0; a trial: 0).")
SEED = _declare(STAGE_ENV, "STAGEWISE_SEED", "The run's seed (`train.seed`; a trial: `sweep.seed` plus its number).")
STAGE_VALUES: tuple[str, ...] = tuple(name.removeprefix("STAGEWISE_").lower() for name in STAGE_ENV)
"""The stage's own values (config through seed, above), by the name an entrypoint's ``{name}`` arg uses (stagewise.definitions.config)."""

OVERRIDES = _declare(STAGE_ENV, "STAGEWISE_OVERRIDES",
                     "The run's config overrides (e.g. from the trigger form) as a JSON object of dotted key -> "
                     "value; `stagewise.definitions.loading.load_config(path, overrides)` applies them.")
OBJECTIVE = _declare(STAGE_ENV, "STAGEWISE_OBJECTIVE",
                      "The objective metric (`objective.metric`): `stagewise.spec.report` needs it among the metrics.")
RESULT_FILE = _declare(LAUNCH_ENV, "STAGEWISE_RESULT_FILE",
                       "Optional: a JSON object written here becomes the task's result (XCom), over the defaults.")
ERROR_FILE = _declare(LAUNCH_ENV, "STAGEWISE_ERROR_FILE",
                      "Write a reason here (e.g. bad input) to fail the task without retry; it becomes the error.")

METRICS_FILE = _declare(LAUNCH_ENV, "STAGEWISE_METRICS_FILE",
                        "Where `stagewise.spec.report` keeps rank 0's latest epoch, metrics and prune decision for the "
                        "framework (a trial's value, a stage's val_metric).")
STUDY_STORAGE = _declare(TRIAL_ENV, "STAGEWISE_STUDY_STORAGE", "The Optuna storage of the sweep's shared study.")
STUDY_NAME = _declare(TRIAL_ENV, "STAGEWISE_STUDY_NAME", "The shared study's name.")
TRIAL_ID = _declare(TRIAL_ENV, "STAGEWISE_TRIAL_ID", "The Optuna trial id `stagewise.spec.report` reports to.")
TRIAL_NUMBER = _declare(TRIAL_ENV, "STAGEWISE_TRIAL_NUMBER", "The trial's number in the study (for logs).")

SM_RESOURCE_CONFIG = _declare(NODE_ENV, "STAGEWISE_SM_RESOURCE_CONFIG",
                              "SageMaker's resourceconfig.json to read instead of /opt/ml/input/config/resourceconfig.json.")
MASTER_PORT = _declare(NODE_ENV, "STAGEWISE_MASTER_PORT", "Port of node 0's rendezvous store on SageMaker (default 29500).")
RDZV_ENDPOINT = _declare(NODE_ENV, "STAGEWISE_RDZV_ENDPOINT",
                         "host:port of pod 0's rendezvous store under the Job's headless Service (Kubernetes).")
NNODES = _declare(NODE_ENV, "STAGEWISE_NNODES", "Pods of the Kubernetes Job, one node each.")
RDZV_ID = _declare(NODE_ENV, "STAGEWISE_RDZV_ID", "The rendezvous id, new for each Airflow try (Kubernetes).")
SOCKET_IFNAME = _declare(NODE_ENV, "STAGEWISE_SOCKET_IFNAME",
                         "Network interface gloo/NCCL use between pods; empty: their own choice (Kubernetes).")
JOIN_TIMEOUT_S = _declare(NODE_ENV, "STAGEWISE_JOIN_TIMEOUT_S", "Seconds node 0's store waits for every node to join.")

ENVIRONMENT: dict[str, str] = {**STAGE_ENV, **LAUNCH_ENV, **TRIAL_ENV}
"""Everything a bring-your-own script gets besides torchrun's own variables (name -> meaning)."""


def markdown() -> str:
    """The docs' table of the contract: one row per variable, in declaration order, with who gets it."""
    who = {**dict.fromkeys(STAGE_ENV, "stage, trial"), **dict.fromkeys(LAUNCH_ENV, "every sub-job"),
           **dict.fromkeys(TRIAL_ENV, "trial")}
    rows = [f"| `{name}` | {who[name]} | {doc} |" for name, doc in ENVIRONMENT.items()]
    return "\n".join(["| variable | set for | meaning |", "|---|---|---|", *rows])
