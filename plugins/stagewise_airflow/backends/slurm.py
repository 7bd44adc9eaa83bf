"""Backend 'slurm': one sbatch allocation per stage try, ``srun`` starting one torchrun agent per node.

:func:`run_job` is the backend's interface (stagewise.airflow.backends). :func:`batch_script` writes the job's batch
script from the :class:`~stagewise.airflow.stage_job.StageJob` (pure: tests read every ``#SBATCH`` line of it). The
allocation's first node hosts the rendezvous store: the script looks its address up (``scontrol show hostnames`` of
the node list, then the node's NodeAddr) and exports it as $STAGEWISE_RDZV_ENDPOINT before ``srun`` starts
``stagewise.training.node_launch slurm`` on every node. Every node runs the same install on a shared filesystem, so a
Slurm stage takes the local path's arguments (its fingerprints, environment and result file), and its secrets reach
the job through sbatch's environment (``--export``, Slurm's default), never through the script.

The task submits (:func:`submit`: sbatch's refusal of a setting is the user's, named once, never retried), polls
:func:`job_record` (``scontrol show job``, else ``sacct``, else the job-completion log), streams the job's output file
into the task log (:class:`OutputTail`), cancels the job on SIGTERM, timeout or any other exit before the job ended
(:func:`cancel`), and maps the end onto Airflow (:func:`outcome`). A requeue (``scontrol requeue``, preemption)
restarts the batch script, which resumes from the newest checkpoint within the same try; a node lost mid-stage
(Slurm requeues such a job itself) fails the try as NODE_FAIL, and the Airflow retry is a new allocation that resumes.
What the allocation cost (:func:`cost`) comes back in the result under ``slurm``.

:func:`run_command` runs any other sub-job (an inference shard, a sweep worker) as a one-node job of its own.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stagewise.airflow.backends.remote import USER_ERROR_MARKER, is_user_error, stop_on_sigterm
from stagewise.airflow.backends.slurm_records import (  # noqa: F401  (the backend's names: slurm.cost, slurm.SlurmJob)
    SACCT_FIELDS,
    TERMINAL,
    SlurmJob,
    cost,
    parse_fields,
    parse_jobcomp,
    parse_sacct,
    parse_scontrol,
)
from stagewise.airflow.stage_job import TRAIN_MODULE, StageJob, job_name
from stagewise.core import contract
from stagewise.core.errors import UserError
from stagewise.definitions.config import Profile

log = logging.getLogger(__name__)

# Pending reasons a job never leaves (the cluster refuses what it asked for): the profile setting to fix.
NEVER_RUNS = {"PartitionNodeLimit": "nodes (more than the partition has)", "PartitionTimeLimit": "slurm.time_limit",
              "PartitionConfig": "nodes, slurm.cpus_per_task or slurm.mem_per_cpu (more than the partition's nodes have)",
              "BadConstraints": "slurm.constraint", "InvalidAccount": "slurm.account", "InvalidQOS": "slurm.qos"}
# sbatch's refusals (its stderr) -> the profile setting they name; anything else is retried as transient.
REFUSALS = (("invalid partition", "slurm.partition"), ("invalid account", "slurm.account"),
            ("invalid qos", "slurm.qos"), ("invalid feature", "slurm.constraint"),
            ("invalid --time", "slurm.time_limit"), ("time limit", "slurm.time_limit"),
            ("generic resource", "slurm.gpus_per_node"), ("gres", "slurm.gpus_per_node"),
            ("memory specification", "slurm.mem_per_cpu"), ("node count", "nodes"),
            ("requested node configuration is not available", "nodes, slurm.cpus_per_task, slurm.mem_per_cpu or slurm.gpus_per_node"),
            ("accounting/qos policy", "slurm.account or slurm.qos"), ("unrecognized option", "slurm.extra_sbatch_options"),
            ("invalid option", "slurm.extra_sbatch_options"), ("unknown option", "slurm.extra_sbatch_options"))
ACCOUNTING_DISABLED = "accounting storage is disabled"
# What slurmstepd writes into the job's output when it ends a run: "*** JOB 11 ON n1 CANCELLED AT ... DUE TO NODE FAILURE".
_STEPD_END = re.compile(r"\*\*\* (?:JOB|STEP) \S+ ON \S+ CANCELLED AT \S+(?: DUE TO ([A-Z ]+?))?(?:,.*)? \*\*\*")
_LABEL = re.compile(r"^(\d+): ?(.*)$")  # srun --label: "<task>: line", one task per node


def slurm_env(settings: Any, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a Slurm command: ``base`` (this process's) with the profile's slurm_conf as SLURM_CONF."""
    env = dict(os.environ if base is None else base)
    if settings.slurm_conf:
        env["SLURM_CONF"] = settings.slurm_conf
    return env


def _command(settings: Any, argv: list[str], *, env: dict[str, str] | None = None, stdin: str | None = None,
             timeout_s: float = 60) -> subprocess.CompletedProcess:
    """Run a Slurm client command; a missing client is the user's to fix, a hung controller is retried."""
    try:
        return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout_s,
                              env=env if env is not None else slurm_env(settings))
    except FileNotFoundError:
        raise UserError(f"{argv[0]} is not installed on this worker: a profile with backend slurm needs Slurm's "
                        f"client commands (sbatch, squeue, scontrol, scancel) on the PATH") from None
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{' '.join(argv[:2])} did not answer in {timeout_s:g} s: is slurmctld reachable?") from None


def accounting_record(settings: Any, job_id: str) -> SlurmJob | None:
    """The job as ``sacct`` keeps it; None where the cluster keeps no accounting (not an error) or sacct knows none."""
    answer = _command(settings, ["sacct", "-X", "-D", "-P", "-n", "-j", job_id, f"--format={','.join(SACCT_FIELDS)}"])
    if answer.returncode != 0:
        if ACCOUNTING_DISABLED not in (answer.stderr + answer.stdout).lower():
            log.warning("sacct -j %s failed: %s", job_id, answer.stderr.strip()[:300])
        return None
    return parse_sacct(answer.stdout.splitlines())


def jobcomp_record(settings: Any, job_id: str) -> SlurmJob | None:
    """The job's last line in the job-completion log, where it is a file this worker can read; else None."""
    answer = _command(settings, ["scontrol", "show", "config"])
    config = dict(re.findall(r"^(\w+)\s*=\s*(.*?)\s*$", answer.stdout, re.MULTILINE))
    path = config.get("JobCompLoc", "")
    if config.get("JobCompType") != "jobcomp/filetxt" or not path or not os.access(path, os.R_OK):
        return None
    found = None
    with open(path, errors="replace") as handle:
        for line in handle:
            if line.startswith(f"JobId={job_id} "):
                found = line
    return parse_jobcomp(found) if found else None


def job_record(settings: Any, job_id: str) -> SlurmJob:
    """The job's state now: ``scontrol show job -o`` while the controller keeps it (MinJobAge after its end), then
    ``sacct``, then the job-completion log; a job none of them knows is a RuntimeError (retried)."""
    answer = _command(settings, ["scontrol", "show", "job", "-o", job_id])
    if answer.returncode == 0 and answer.stdout.strip():
        return parse_scontrol(answer.stdout.strip().splitlines()[0])
    if "invalid job id" not in answer.stderr.lower():
        raise RuntimeError(f"scontrol show job {job_id} failed: {answer.stderr.strip()[:300]}")
    record = accounting_record(settings, job_id) or jobcomp_record(settings, job_id)
    if record is None:
        raise RuntimeError(f"Slurm job {job_id} is known neither to the controller nor to sacct or the job-completion log")
    return record


def node_states(settings: Any, node_list: str) -> dict[str, str]:
    """Each node of ``node_list`` and its state (IDLE, ALLOCATED, DOWN+NOT_RESPONDING, DRAINED, ...)."""
    if not node_list:
        return {}
    answer = _command(settings, ["scontrol", "show", "node", "-o", node_list])
    states = {}
    for line in answer.stdout.splitlines():
        raw = parse_fields(line)
        if "NodeName" in raw:
            states[raw["NodeName"]] = raw.get("State", "")
    return states


def lost_nodes(states: dict[str, str]) -> list[str]:
    """The nodes Slurm counts as lost: down, failed or not responding."""
    return sorted(node for node, state in states.items()
                  if any(flag in state.upper() for flag in ("DOWN", "FAIL", "NOT_RESPONDING")))


def cancel(settings: Any, job_id: str | None, *, name: str = "") -> None:
    """``scancel`` the job (ended jobs are fine), or the jobs called ``name`` when its id is not known (the task was
    stopped while sbatch ran); a failure is logged, never raised over the error that caused it."""
    argv = ["scancel", job_id] if job_id else ["scancel", "--name", name]
    if not job_id and not name:
        return
    try:
        answer = _command(settings, argv)
    except (UserError, RuntimeError) as exc:
        log.error("could not cancel Slurm job %s: %s", job_id or name, exc)
        return
    if answer.returncode != 0:
        log.error("%s failed: %s", " ".join(argv), answer.stderr.strip()[:300])
    else:
        log.info("cancelled Slurm job %s", job_id or name)


def refusal(stderr: str) -> str | None:
    """The profile setting sbatch's refusal names (None: not a refusal of a setting: retried)."""
    lower = stderr.lower()
    return next((setting for text, setting in REFUSALS if text in lower), None)


def submit(settings: Any, script: str, env: dict[str, str]) -> str:
    """Submit ``script`` with ``sbatch --parsable`` in ``env`` (exported to the job); the job id.

    A refused setting (partition, account, QoS, constraint, time, gres, memory, an extra option) is a UserError
    naming the profile setting: retrying changes nothing. Anything else sbatch fails on is a RuntimeError (retried).
    """
    answer = _command(settings, ["sbatch", "--parsable"], env=env, stdin=script)
    said = " ".join(line.removeprefix("sbatch: error: ") for line in answer.stderr.strip().splitlines())
    if answer.returncode != 0:
        setting = refusal(said)
        if setting is not None:
            raise UserError(f"Slurm refused the job: {said} (check the profile's {setting})")
        raise RuntimeError(f"sbatch failed (exit {answer.returncode}): {said or answer.stdout.strip()}; retrying")
    job_id = answer.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise RuntimeError(f"sbatch answered {answer.stdout.strip()!r}, not a job id")
    return job_id


def attached(settings: Any, name: str) -> str | None:
    """The live job named ``name`` (this try submitted it before the task was restarted), else None."""
    answer = _command(settings, ["squeue", "-h", "--name", name, "-o", "%i %T"])
    live = [line.split()[0] for line in answer.stdout.splitlines() if line.split() and line.split()[-1] not in TERMINAL]
    return live[-1] if answer.returncode == 0 and live else None


class OutputTail:
    """The new complete lines of the job's output file since the last call, each prefixed with the node it came from
    (``srun --label``: ``[node 1] ...``; the batch script's and slurmstepd's own: ``[batch] ...``).

    Remembers what slurmstepd said when it ended a run (``ends``: NODE FAILURE, JOB REQUEUE, TIME LIMIT, ...) and
    whether a rank reported a user error.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path, self.offset, self.partial = Path(path), 0, ""
        self.ends: list[str] = []
        self.user_error = False

    def __call__(self) -> list[str]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self.offset)
                chunk = handle.read()
        except FileNotFoundError:
            return []  # not started yet
        self.offset += len(chunk)
        text = self.partial + chunk.decode("utf-8", errors="replace")
        *complete, self.partial = text.split("\n")
        lines = []
        for line in complete:
            line = line.rstrip("\r")
            if end := _STEPD_END.search(line):
                self.ends.append(end.group(1) or "CANCELLED")
            if USER_ERROR_MARKER in line.lower() or "failed on bad input, not retrying" in line:
                self.user_error = True
            label = _LABEL.match(line)
            lines.append(f"[node {label.group(1)}] {label.group(2)}" if label else f"[batch] {line}")
        return lines


def outcome(record: SlurmJob, user_error: str = "") -> Exception | None:
    """What an ended job means to Airflow: None when it COMPLETED; AirflowFailException when it FAILED on the user's
    input (exit USER_ERROR_EXIT, or ``user_error``: what its ranks wrote to the error file or said in the output);
    else a RuntimeError (retried: a new allocation that resumes from the newest checkpoint)."""
    from airflow.sdk.exceptions import AirflowFailException

    if not record.ended:
        raise ValueError(f"Slurm job {record.job_id} is {record.state}, not ended")
    if record.state == "COMPLETED":
        return None
    code = f"exit {record.exit_code}" + (f", signal {record.signal}" if record.signal else "")
    message = f"Slurm job {record.job_id} ended {record.state} ({code}{', ' + record.reason if record.reason else ''})"
    if record.state == "FAILED" and (user_error or is_user_error(None, record.exit_code)):
        return AirflowFailException(f"{message}: {user_error or 'the job failed on bad input'} (not retried: fix the config or data)")
    return RuntimeError(message + "; retrying if retries are left (a new allocation resumes from the newest checkpoint)")


def sbatch_options(profile: Profile, settings: Any, *, name: str, output: str, nodes: int | None = None) -> list[str]:
    """The ``#SBATCH`` options of a job of ``profile`` on ``nodes`` nodes (default: the profile's; 1 for a sub-job)."""
    options = [f"--job-name={name}", f"--nodes={profile.nodes if nodes is None else nodes}", "--ntasks-per-node=1",
               f"--cpus-per-task={settings.cpus_per_task}"]
    for flag, value in (("--mem-per-cpu", settings.mem_per_cpu), ("--time", settings.time_limit),
                        ("--partition", settings.partition), ("--account", settings.account), ("--qos", settings.qos),
                        ("--constraint", settings.constraint)):
        if value:
            options.append(f"{flag}={value}")
    if settings.gpus_per_node:
        options.append(f"--gres=gpu:{settings.gpus_per_node}")
    options += ["--requeue", f"--output={output}", "--open-mode=append", f"--chdir={Path(output).parent}",
                *settings.extra_sbatch_options]
    return options


def script_text(options: list[str], settings: Any, command: list[str], *, distributed: bool, workdir: str = "") -> str:
    """The batch script: its #SBATCH lines, the rendezvous endpoint (a distributed job), one srun task per node (in
    ``workdir``, made fresh, when given: an own script's relative files stay there)."""
    lines = ["#!/bin/bash", *(f"#SBATCH {shlex.quote(option)}" for option in options), "set -eu"]
    if workdir:
        lines += [f"rm -rf {shlex.quote(workdir)}", f"mkdir -p {shlex.quote(workdir)}", f"cd {shlex.quote(workdir)}"]
    if distributed:
        from stagewise.training import node_launch

        lines += ['first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                  'addr=$(scontrol show node -o "$first" | tr " " "\\n" | sed -n "s/^NodeAddr=//p")',
                  # Per job: two allocations whose first node is the same one never meet on one port.
                  f'export {node_launch.K8S_ENDPOINT_ENV}="${{addr:-$first}}:$(({settings.rendezvous_port} + SLURM_JOB_ID % 1000))"',
                  f"export {node_launch.JOIN_TIMEOUT_ENV}={settings.join_timeout_s}"]
    lines += ['echo "stagewise: Slurm job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST'
              + (', rendezvous $STAGEWISE_RDZV_ENDPOINT' if distributed else '') + '"',
              "exec " + shlex.join(["srun", "--ntasks-per-node=1", f"--cpus-per-task={settings.cpus_per_task}",
                                    "--kill-on-bad-exit=1", "--label", "--unbuffered", *command])]
    return "\n".join(lines) + "\n"


def log_dir(job: StageJob) -> str:
    """The folder of the job's output file: slurm.log_dir, else <run>/train/<stage>/slurm/ under a local storage root."""
    from stagewise.core import storage

    settings = job.settings("slurm")
    folder = settings.log_dir or storage.join(storage.stage_prefix(job.out, job.stage), "slurm")
    if "://" in folder and not folder.startswith("file://"):
        raise UserError(f"stage {job.stage}: a Slurm job's output goes to a folder the nodes share, not {folder}; "
                        f"give the profile's slurm.log_dir")
    return folder.removeprefix("file://")


@dataclass(frozen=True)
class JobFiles:
    """Where one try's files are, in its log folder: the output, the result JSON, the user-error file, an own
    script's last report ($STAGEWISE_METRICS_FILE) and its scratch working folder."""

    output: str
    result: str
    error: str
    metrics: str = ""
    workdir: str = ""

    @classmethod
    def of(cls, folder: str, name: str) -> JobFiles:
        base = os.path.join(folder, name)
        return cls(output=f"{base}.out", result=f"{base}.result.json", error=f"{base}.user_error.txt",
                   metrics=f"{base}.metrics.json", workdir=f"{base}.cwd")


def stage_command(job: StageJob, files: JobFiles) -> list[str]:
    """Every node's command: node_launch slurm with the stage's processes, then stagewise.train (or the own entry)."""
    from stagewise.training import torchrun_command

    settings, profile, entry = job.settings("slurm"), job.profile, job.entry
    python = settings.python or sys.executable
    if entry is None:
        target, args = ["-m", TRAIN_MODULE], [*job.args, "--result-file", files.result]
    else:
        target, args = ([entry.script] if entry.script else ["-m", entry.module]), list(job.args)
    return torchrun_command.command(target, args, profile.processes_per_node, profile.max_restarts, backend="slurm",
                                    python=python)


def batch_script(job: StageJob, nodes: int | None = None) -> str:
    """The batch script of one try of the job's stage on ``nodes`` nodes (default: the profile's; see
    :func:`nodes_to_ask`), pure: nothing is submitted or created."""
    settings = job.settings("slurm")
    name = job_name(job.dag_id, job.run_id, job.stage, job.attempt)
    files = JobFiles.of(log_dir(job), name)
    options = sbatch_options(job.profile, settings, name=name, output=files.output, nodes=nodes)
    return script_text(options, settings, stage_command(job, files), distributed=True,
                       workdir=files.workdir if job.entry is not None else "")


# sinfo's compact node states that take jobs now or once their jobs end (a '*' suffix: not responding).
_USABLE = ("idle", "alloc", "mix", "comp", "resv", "plnd")


def usable_nodes(settings: Any) -> int:
    """How many nodes of the profile's partition (else the default one) take jobs: not down, drained or failed."""
    answer = _command(settings, ["sinfo", "-h", "-N", "-o", "%N %t %P", *(["-p", settings.partition] if settings.partition else [])])
    nodes = set()
    for line in answer.stdout.splitlines():
        name, state, partition = (line.split() + ["", "", ""])[:3]
        if (settings.partition or partition.endswith("*")) and state.rstrip("~#!%$@^-") in _USABLE:
            nodes.add(name)
    return len(nodes)


def nodes_to_ask(settings: Any, profile: Profile) -> int:
    """The nodes a stage's job asks for: the profile's; with slurm.min_nodes, the partition's usable nodes between
    min_nodes and nodes (Slurm itself gives a ``--nodes=min-max`` job its minimum whenever that many are free)."""
    if settings.min_nodes is None or settings.min_nodes >= profile.nodes:
        return profile.nodes
    usable = usable_nodes(settings)
    count = max(settings.min_nodes, min(profile.nodes, usable))
    if count < profile.nodes:
        log.warning("the partition has %d usable node(s) (not down or drained); this try asks for %d of the "
                    "profile's %d (slurm.min_nodes %d), resharded at the same global batch", usable, count,
                    profile.nodes, settings.min_nodes)
    return count


@dataclass(frozen=True)
class Submission:
    """One try's job as submitted: its name, files, batch script, the environment sbatch exports to it, its nodes."""

    name: str
    files: JobFiles
    script: str
    env: dict[str, str]
    nodes: int


def submission(job: StageJob) -> Submission:
    """The try's submission (the one way both the waiting task and the deferred operator build it): the node count
    (:func:`nodes_to_ask`, asks sinfo with min_nodes), the script and the job's environment."""
    settings = job.settings("slurm")
    name = job_name(job.dag_id, job.run_id, job.stage, job.attempt)
    files = JobFiles.of(log_dir(job), name)
    env = job_environment(job.profile, settings, files, job.env, job.import_paths)
    nodes = nodes_to_ask(settings, job.profile)
    return Submission(name, files, batch_script(job, nodes), env, nodes)


def job_environment(profile: Profile, settings: Any, files: JobFiles, extra: dict[str, str] | None = None,
                    import_paths: Sequence[str] = ()) -> dict[str, str]:
    """What sbatch exports to the job: this worker's environment (its own SLURM_* removed: they would bind the job to
    this worker's allocation, if it runs in one), the processes' threads and devices as the local path sets them, the
    error and result files, the credentials (``extra``), SLURM_CONF."""
    from stagewise.airflow import launch

    env = {key: value for key, value in launch.child_env(profile, files.error, import_paths).items()
           if not key.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
    env.update({contract.RESULT_FILE: files.result, contract.METRICS_FILE: files.metrics, **(extra or {})})
    return slurm_env(settings, env)


def _user_error(files: JobFiles, tail: OutputTail) -> str:
    if os.path.exists(files.error):
        with open(files.error, errors="replace") as handle:
            return " | ".join(dict.fromkeys(line.strip() for line in handle if line.strip()))
    return "a rank reported a user error (see the job's output above)" if tail.user_error else ""


def poll_delays(poll_s: float) -> Iterator[float]:
    """The waits between polls: 1 s first, doubling up to ``poll_s``, so a short job is seen ending within about its
    own length and a long one costs the controller one query per ``poll_s``."""
    delay = min(1.0, poll_s)
    while True:
        yield delay
        delay = min(2 * delay, poll_s)


def wait(read: Callable[[], SlurmJob], job_id: str, *, poll_s: float, queue_wait_warn_s: float,
         log_line: Callable[[str], None], node_lines: Callable[[], list[str]] = list,
         lost: Callable[[str], list[str]] = lambda node_list: [], ends: Callable[[], list[str]] = list,
         sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> SlurmJob:
    """Poll until the job ends; log each change of state, the output's new lines, and a job pending longer than
    ``queue_wait_warn_s`` (with Slurm's reason: waiting, not failed). A requeue goes on waiting (the script restarts
    and resumes) unless the run before lost a node (``lost`` of its node list, or slurmstepd's NODE FAILURE in
    ``ends``): that is NODE_FAIL, a RuntimeError. A reason the job never leaves (NEVER_RUNS) is a UserError."""
    seen, restarts, allocated, pending_since, warned_at = None, None, "", None, 0.0
    delays = poll_delays(poll_s)
    while True:
        record = read()
        for line in node_lines():
            log_line(line)
        restarts = record.restarts if restarts is None else restarts  # attached to a job requeued before: not news
        if record.restarts > restarts:
            down = lost(allocated)
            if down or "NODE FAILURE" in ends():
                raise RuntimeError(f"Slurm job {job_id} NODE_FAIL: node(s) {', '.join(down) or allocated} failed "
                                   f"mid-run (Slurm requeued it as restart {record.restarts}); retrying as a new "
                                   f"allocation that resumes from the newest checkpoint")
            log_line(f"Slurm job {job_id} was requeued (restart {record.restarts}): it restarts and resumes from its "
                     f"newest checkpoint")
            restarts = record.restarts
        if record.node_list:
            allocated = record.node_list
        state = (record.state, record.reason)
        if state != seen:
            log_line(f"Slurm job {job_id}: {record.state}" + (f" ({record.reason})" if record.reason else "")
                     + (f" on {record.node_list}" if record.state == "RUNNING" and record.node_list else ""))
            seen = state
        if record.ended:
            return record
        if record.state == "PENDING":
            if record.reason in NEVER_RUNS:
                raise UserError(f"Slurm job {job_id} can never start: {record.reason} (check the profile's "
                                f"{NEVER_RUNS[record.reason]})")
            now = clock()
            pending_since = pending_since if pending_since is not None else now
            if now - pending_since >= queue_wait_warn_s and now - warned_at >= queue_wait_warn_s:
                log_line(f"Slurm job {job_id} is waiting in the queue ({now - pending_since:.0f} s so far): "
                         f"{record.reason or 'no reason given'}; not a failure, it starts when Slurm allocates it")
                warned_at = now
        else:
            pending_since = None
        sleep(next(delays))


def run_submitted(settings: Any, script: str, env: dict[str, str], *, name: str, files: JobFiles) -> tuple[SlurmJob, dict[str, Any]]:
    """Submit ``script`` (or attach to this try's live job), wait for it and cancel it if the task leaves first;
    returns its ended record and cost, or raises as Airflow should take its end."""
    Path(files.output).parent.mkdir(parents=True, exist_ok=True)
    tail, job_id, ended = OutputTail(files.output), None, False
    try:
        with stop_on_sigterm(f"Slurm job {name}"):  # from before sbatch: a kill while it submits cancels by name
            job_id = attached(settings, name)
            if job_id is not None:
                log.info("Slurm job %s (%s) is this try's, submitted before: attaching to it", job_id, name)
            else:
                for stale in (files.error, files.result, files.metrics):
                    Path(stale).unlink(missing_ok=True)
                job_id = submit(settings, script, env)
                log.info("submitted Slurm job %s (%s); output %s", job_id, name, files.output)
            record = wait(lambda: job_record(settings, job_id), job_id, poll_s=settings.poll_s,
                          queue_wait_warn_s=settings.queue_wait_warn_s, log_line=log.info, node_lines=tail,
                          lost=lambda nodes: lost_nodes(node_states(settings, nodes)), ends=lambda: tail.ends)
            ended = True
    finally:
        if not ended:  # killed, timed out, NODE_FAIL, a job that can never start: no allocation outlives its task
            log.warning("cancelling Slurm job %s: its task ends before the job", job_id or name)
            cancel(settings, job_id, name=name)
    time.sleep(min(settings.poll_s, 1.0))  # the output file's last lines (slurmstepd flushes after the state)
    for line in tail():
        log.info("%s", line)
    spent = cost(record, accounting_record(settings, job_id))
    log.info("Slurm job %s %s: %s", job_id, record.state, json.dumps(spent))
    failure = outcome(record, _user_error(files, tail))
    if failure is not None:
        raise failure
    return record, spent


def run_job(job: StageJob) -> dict[str, Any]:
    """The backend's interface: one allocation for the try, run to its end; stagewise.train's result (from the
    result file rank 0 wrote, else the stage's committed metrics) with the allocation's cost under ``slurm``."""
    from stagewise.airflow.backends import stage_result

    prepared = submission(job)
    files = prepared.files
    _, spent = run_submitted(job.settings("slurm"), prepared.script, prepared.env, name=prepared.name, files=files)
    if job.entry is not None:  # an own script: its result file (if it wrote one) and its last stagewise.spec.report
        from stagewise.scripting.entrypoint import LAST_REPORT, read_last_report

        result = _read_json(files.result)
        if (last := read_last_report(files.metrics)) is not None:
            result[LAST_REPORT] = last
    elif os.path.exists(files.result):
        result = _read_json(files.result)
    else:
        result = stage_result(job.out, job.stage)
    return {**result, "slurm": spent}


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path) as handle:
        return json.load(handle)

def run_command(argv: Sequence[str], profile: Profile, settings: Any, *, name: str, log_dir: str,
                env: dict[str, str] | None = None, distributed: bool = False,
                import_paths: Sequence[str] = ()) -> dict[str, Any]:
    """Run one sub-job of any command (an inference shard, a sweep worker, evaluate) as a one-node Slurm job.

    ``argv`` is what the local launcher runs without its interpreter: ``["-m", "stagewise.infer", ...]`` or a
    script and its arguments; with ``distributed`` it runs under torchrun on that node
    (node_launch slurm, ``profile.processes_per_node`` processes), else as one process of ``settings.python`` (this
    worker's interpreter when empty). ``name`` names the job (unique per task try, e.g. stage_job.job_name's),
    ``log_dir`` is a folder every node shares: it holds ``<name>.out`` and the result file the sub-job finds in
    $STAGEWISE_RESULT_FILE (``--result-file`` for stagewise's own ``-m`` modules is the caller's to add).
    ``env`` reaches the job through sbatch's environment (credentials: never in the script). The job runs with the
    profile's slurm settings but one node; SIGTERM, timeout or any exit cancels it.

    Returns the sub-job's JSON result (its result file; {} if it wrote none) with ``slurm``: the job's cost and
    ``job_id``, ``state``, ``exit_code``. Raises AirflowFailException when it failed on the user's input (the error
    file or exit code USER_ERROR_EXIT), UserError for a setting Slurm refuses, RuntimeError for anything else.
    """
    from stagewise.training import torchrun_command

    files = JobFiles.of(log_dir, name)
    python = settings.python or sys.executable
    entry = list(argv)
    if distributed:
        command = torchrun_command.command(entry[:2] if entry[0] == "-m" else entry[:1],
                                           entry[2:] if entry[0] == "-m" else entry[1:], profile.processes_per_node,
                                           profile.max_restarts, backend="slurm", python=python)
    else:
        command = [python, *entry]
    script = script_text(sbatch_options(profile, settings, name=name, output=files.output, nodes=1), settings, command,
                         distributed=distributed)
    record, spent = run_submitted(settings, script, job_environment(profile, settings, files, env, import_paths),
                                  name=name, files=files)
    return {**_read_json(files.result), "slurm": {**spent, "state": record.state, "exit_code": record.exit_code}}
