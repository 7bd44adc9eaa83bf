"""The Slurm backend without a cluster: the batch script of every setting, sbatch's refusals (its real messages), the
records scontrol, sacct and the job-completion log write, what each end state means to Airflow, the cost, the output
tail and the wait's rules for requeues, lost nodes and the queue (the real cluster: test_slurm_cluster_stage.py)."""

from __future__ import annotations

import subprocess

import pytest
from airflow.sdk.exceptions import AirflowFailException

from stagewise.airflow.backends import slurm
from stagewise.airflow.backends.slurm import SlurmJob
from stagewise.airflow.stage_job import stage_job
from stagewise.core.errors import USER_ERROR_EXIT, UserError
from tests.plugins.backend_configs import SLURM, backend_config, job_args

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


@pytest.fixture
def slurm_job(tmp_path):
    """A try of stage s2 on a two-node Slurm profile with every setting given, its local-path arguments and a secret."""

    def make(**settings):
        path, config = backend_config(tmp_path, "slurm", storage_root=str(tmp_path / "root"), **settings)
        args = ("--stage", "s2", "--out", "OUT", "--params", '{"lr": 0.05}', "--inputs-fingerprint", "f1",
                "--config", str(path))
        return stage_job(config, **job_args(path, config, attempt=2), env={"AWS_SECRET_ACCESS_KEY": SECRET}, args=args)

    return make


def sbatch_lines(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH ")]


def test_the_batch_script_carries_every_setting_as_its_sbatch_option(slurm_job):
    job = slurm_job()
    script = slurm.batch_script(job)
    name = slurm.job_name(job.dag_id, job.run_id, "s2", 2)
    folder = slurm.log_dir(job)
    assert folder.endswith("/train/s2/slurm")
    assert sbatch_lines(script) == [
        f"--job-name={name}", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=8", "--mem-per-cpu=4G",
        "--time=02:00:00", "--partition=gpu", "--account=ml-team", "--qos=high", "'--constraint=a100&ib'",
        "--gres=gpu:2", "--requeue", f"--output={folder}/{name}.out", "--open-mode=append", f"--chdir={folder}",
        "--exclusive"]
    assert script.startswith("#!/bin/bash\n")
    assert 'export STAGEWISE_RDZV_ENDPOINT="${addr:-$first}:$((29555 + SLURM_JOB_ID % 1000))"' in script
    assert "export STAGEWISE_JOIN_TIMEOUT_S=300" in script
    srun = script.splitlines()[-1]
    assert srun.startswith("exec srun --ntasks-per-node=1 --cpus-per-task=8 --kill-on-bad-exit=1 --label --unbuffered ")
    assert " -m stagewise.training.node_launch slurm --nproc-per-node=2 --max-restarts=0 -m stagewise.train --stage s2 " in srun
    assert "--inputs-fingerprint f1" in srun and f"--result-file {folder}/{name}.result.json" in srun
    assert SECRET not in script, "credentials reach the job through sbatch's environment, never the script"


def test_empty_settings_add_no_option_and_the_node_count_is_the_one_asked(slurm_job):
    job = slurm_job(min_nodes=1, account="", qos="", constraint="", mem_per_cpu="", time_limit="", gpus_per_node=0,
                    partition="", extra_sbatch_options=[], python="/shared/venv/bin/python")
    lines = sbatch_lines(slurm.batch_script(job, nodes=1))
    assert "--nodes=1" in lines
    assert not [line for line in lines if line.split("=")[0] in
                ("--account", "--qos", "--constraint", "--mem-per-cpu", "--time", "--gres", "--partition")]
    assert " /shared/venv/bin/python -m stagewise.training.node_launch slurm " in slurm.batch_script(job)


SINFO = "n1 idle debug*\nn2 drain debug*\nn3 mix* debug*\nn4 alloc debug*\nn1 idle small\ng1 idle gpu\n"


@pytest.mark.parametrize("min_nodes, partition, expected", [(None, "", 4), (1, "", 2), (3, "", 3), (1, "gpu", 1)])
def test_with_min_nodes_a_try_asks_for_the_nodes_that_take_jobs(slurm_job, monkeypatch, min_nodes, partition, expected):
    """Down, drained and unresponsive nodes do not count; never fewer than min_nodes (then the job waits in the queue)."""
    calls = []

    def sinfo(settings, argv, **kwargs):
        calls.append(argv)
        lines = [line for line in SINFO.splitlines() if not partition or line.endswith(f" {partition}")]
        return answer(0, "\n".join(lines) + "\n")

    monkeypatch.setattr(slurm, "_command", sinfo)
    job = slurm_job(partition=partition)
    profile = job.profile.model_copy(update={"nodes": 4})
    settings = job.settings("slurm").model_copy(update={"min_nodes": min_nodes})
    assert slurm.nodes_to_ask(settings, profile) == expected
    assert bool(calls) == (min_nodes is not None)


def test_the_job_environment_has_the_credentials_and_slurm_conf_but_not_this_workers_allocation(slurm_job, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SBATCH_PARTITION", "other")
    job = slurm_job()
    files = slurm.JobFiles.of(slurm.log_dir(job), "name")
    env = slurm.job_environment(job.profile, job.settings("slurm"), files, job.env)
    assert env["AWS_SECRET_ACCESS_KEY"] == SECRET and env["SLURM_CONF"] == "/etc/slurm/cluster.conf"
    assert "SLURM_JOB_ID" not in env and "SBATCH_PARTITION" not in env
    assert env["STAGEWISE_ERROR_FILE"] == files.error and env["OMP_NUM_THREADS"] == "1"


def answer(code: int, stdout: str = "", stderr: str = "") -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess([], code, stdout, stderr)


# What sbatch 22.05 answered on the test cluster (account and QoS: Slurm's messages where accounting enforces them).
REFUSED = [
    (1, "sbatch: error: invalid partition specified: nope\nsbatch: error: Batch job submission failed: Invalid partition "
        "name specified", "slurm.partition"),
    (1, "sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified",
     "slurm.account"),
    (1, "sbatch: error: Batch job submission failed: Invalid qos specification", "slurm.qos"),
    (1, "sbatch: error: Batch job submission failed: Invalid feature specification", "slurm.constraint"),
    (255, "sbatch: error: Invalid --time specification", "slurm.time_limit"),
    (1, "sbatch: error: Invalid generic resource (gres) specification", "slurm.gpus_per_node"),
    (1, "sbatch: error: Memory specification can not be satisfied\nsbatch: error: Batch job submission failed: "
        "Requested node configuration is not available", "slurm.mem_per_cpu"),
    (255, "sbatch: unrecognized option '--bogus=1'\nTry \"sbatch --help\" for more information", "slurm.extra_sbatch_options"),
]


@pytest.mark.parametrize("code, stderr, setting", REFUSED)
def test_a_setting_sbatch_refuses_is_a_user_error_naming_it(slurm_job, monkeypatch, code, stderr, setting):
    calls = []
    monkeypatch.setattr(slurm, "_command", lambda settings, argv, **kw: calls.append(argv) or answer(code, "", stderr))
    job = slurm_job()
    with pytest.raises(UserError, match="Slurm refused the job") as raised:
        slurm.submit(job.settings("slurm"), "#!/bin/bash\n", {})
    assert f"check the profile's {setting}" in str(raised.value) and len(calls) == 1


def test_sbatch_failing_otherwise_is_retried_and_its_job_id_is_read(slurm_job, monkeypatch):
    settings = slurm_job().settings("slurm")
    monkeypatch.setattr(slurm, "_command", lambda *a, **kw: answer(
        1, "", "sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)"))
    with pytest.raises(RuntimeError, match="Unable to contact slurm controller"):
        slurm.submit(settings, "#!/bin/bash\n", {})
    monkeypatch.setattr(slurm, "_command", lambda *a, **kw: answer(0, "4242;cluster\n"))
    assert slurm.submit(settings, "#!/bin/bash\n", {}) == "4242"


SCONTROL = ("JobId=12 JobName=sw-s2-e2caa87621-t1 UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901749 "
            "Nice=0 Account=(null) QOS=(null) JobState=COMPLETED Reason=None Dependency=(null) Requeue=1 Restarts=1 "
            "BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:01:12 TimeLimit=UNLIMITED TimeMin=N/A "
            "SubmitTime=2026-12-03T08:42:16 Partition=debug AllocNode:Sid=localhost:7471 NodeList=n[1-2] BatchHost=n1 "
            "NumNodes=2 NumCPUs=4 NumTasks=2 CPUs/Task=1 ReqB:S:C:T=0:0:*:* TRES=cpu=4,mem=8000M,node=2,billing=4,"
            "gres/gpu=4 Socks/Node=* WorkDir=/shared/runs/my dir StdOut=/shared/runs/my dir/x.out Power=")
JOBCOMP = ("JobId=11 UserId=root(0) GroupId=root(0) Name=wrap JobState=NODE_FAIL Partition=debug TimeLimit=UNLIMITED "
           "StartTime=2026-12-03T08:37:19 EndTime=2026-12-03T08:37:51 NodeList=n[1-2] NodeCnt=2 ProcCnt=2 WorkDir=/tmp/sl "
           "ReservationName= Tres=cpu=2,mem=8000M,node=2,billing=2 Account= QOS= WcKey= Cluster=unknown "
           "SubmitTime=2026-12-03T08:37:18 EligibleTime=2026-12-03T08:37:18 DerivedExitCode=0:0 ExitCode=0:0 ")
SACCT = ["12|NODE_FAIL|0:0|2|n[1-2]|31|4|billing=4,cpu=4,mem=8000M,node=2|None|00:00:40.500|124",
         "12|COMPLETED|0:0|1|n1|72|2|billing=2,cpu=2,mem=4000M,node=1,gres/gpu=2|None|01:02:03|144"]


def test_scontrol_sacct_and_jobcomp_records_parse_into_one_shape():
    record = slurm.parse_scontrol(SCONTROL)
    assert (record.job_id, record.state, record.reason, record.exit_code, record.restarts) == ("12", "COMPLETED", "", 0, 1)
    assert (record.nodes, record.node_list, record.elapsed_s, record.cpus, record.gpus) == (2, "n[1-2]", 72.0, 4, 4)
    assert record.fields["WorkDir"] == "/shared/runs/my dir", "a value with spaces stays whole"
    accounted = slurm.parse_sacct(SACCT)
    assert (accounted.state, accounted.nodes, accounted.elapsed_s, accounted.gpus, accounted.restarts) == ("COMPLETED", 1, 72.0, 2, 1)
    assert accounted.total_cpu_s == 3723.0 and accounted.source == "sacct"
    assert slurm.parse_sacct(["13|CANCELLED by 0|0:15|0|None assigned|0|0||None||0"]).state == "CANCELLED"
    assert slurm.parse_sacct([]) is None
    logged = slurm.parse_jobcomp(JOBCOMP)
    assert (logged.state, logged.nodes, logged.cpus, logged.elapsed_s, logged.source) == ("NODE_FAIL", 2, 2, 32.0, "jobcomp")


def test_a_job_the_controller_forgot_is_read_from_sacct_else_the_job_completion_log(monkeypatch, tmp_path, slurm_job):
    log_file = tmp_path / "jobcomp.log"
    log_file.write_text("JobId=110 JobState=COMPLETED\n" + JOBCOMP + "\n")
    replies = {"scontrol show job": answer(1, "", "slurm_load_jobs error: Invalid job id specified"),
               "sacct -X": answer(1, "", "Slurm accounting storage is disabled"),
               "scontrol show config": answer(0, f"JobCompLoc              = {log_file}\nJobCompType             = jobcomp/filetxt\n")}
    monkeypatch.setattr(slurm, "_command", lambda settings, argv, **kw: replies[" ".join(argv[:2 if argv[0] == "sacct" else 3])])
    settings = slurm_job().settings("slurm")
    assert slurm.job_record(settings, "11").state == "NODE_FAIL"
    assert slurm.accounting_record(settings, "11") is None, "a cluster without accounting is no error"
    replies["sacct -X"] = answer(0, "\n".join(SACCT) + "\n")
    assert slurm.job_record(settings, "12").source == "sacct"


@pytest.mark.parametrize("state, exit_code, user_error, expected", [
    ("COMPLETED", 0, "", None),
    ("FAILED", USER_ERROR_EXIT, "", AirflowFailException),
    ("FAILED", 1, "config: train.stages[1].lr must be positive", AirflowFailException),
    ("FAILED", 1, "", RuntimeError),
    *[(state, 0, "", RuntimeError) for state in ("NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "TIMEOUT", "CANCELLED",
                                                   "OUT_OF_MEMORY", "DEADLINE")],
])
def test_each_end_state_maps_onto_airflows_retry_rules(state, exit_code, user_error, expected):
    failure = slurm.outcome(SlurmJob(job_id="7", state=state, exit_code=exit_code), user_error)
    if expected is None:
        assert failure is None
    else:
        assert type(failure) is expected and f"Slurm job 7 ended {state}" in str(failure)
        assert user_error in str(failure)


@pytest.mark.parametrize("state", ["PENDING", "RUNNING", "REQUEUED", "COMPLETING"])
def test_a_job_not_ended_has_no_outcome_yet(state):
    with pytest.raises(ValueError, match="not ended"):
        slurm.outcome(SlurmJob(job_id="7", state=state))


def test_cost_comes_from_sacct_where_the_cluster_keeps_accounting_else_from_the_jobs_record():
    record = slurm.parse_scontrol(SCONTROL)
    assert slurm.cost(record) == {"job_id": "12", "elapsed_s": 72.0, "cpu_time_s": 288.0, "nodes": 2, "gpu_hours": 0.08,
                                  "restarts": 1, "source": "scontrol"}
    accounted = slurm.cost(record, slurm.parse_sacct(SACCT))
    assert accounted == {"job_id": "12", "elapsed_s": 72.0, "cpu_time_s": 144.0, "nodes": 1, "gpu_hours": 0.04,
                         "restarts": 1, "source": "sacct", "total_cpu_s": 3723.0}


def test_the_output_tail_reads_new_whole_lines_names_their_node_and_remembers_how_a_run_ended(tmp_path):
    path = tmp_path / "job.out"
    tail = slurm.OutputTail(path)
    assert tail() == []
    path.write_text("stagewise: Slurm job 11 (restart 0) on n[1-2]\n0: epoch 1\n1: half a li")
    assert tail() == ["[batch] stagewise: Slurm job 11 (restart 0) on n[1-2]", "[node 0] epoch 1"]
    with open(path, "a") as handle:
        handle.write("ne\nslurmstepd-n1: error: *** JOB 11 ON n1 CANCELLED AT 2026-12-03T08:37:51 DUE TO NODE FAILURE, "
                     "SEE SLURMCTLD LOG FOR DETAILS ***\n0: ERROR train: stagewise user error: bad column\n")
    assert tail()[0] == "[node 1] half a line"
    assert tail.ends == ["NODE FAILURE"] and tail.user_error


def records(*items: tuple) -> list[SlurmJob]:
    return [SlurmJob(job_id="9", state=state, reason=reason, restarts=restarts, node_list=nodes)
            for state, reason, restarts, nodes in items]


def run_wait(sequence: list[SlurmJob], lost=lambda nodes: [], queue_wait_warn_s: float = 600.0) -> tuple[SlurmJob, list[str]]:
    feed, lines, now = iter(sequence), [], [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    ended = slurm.wait(lambda: next(feed), "9", poll_s=100, queue_wait_warn_s=queue_wait_warn_s, log_line=lines.append,
                       lost=lost, sleep=sleep, clock=lambda: now[0])
    return ended, lines


def test_a_requeued_job_is_waited_for_in_the_same_try():
    ended, lines = run_wait(records(("RUNNING", "", 0, "n[1-2]"), ("PENDING", "BeginTime", 1, ""),
                                    ("RUNNING", "", 1, "n[1-2]"), ("COMPLETED", "", 1, "n[1-2]")))
    assert ended.state == "COMPLETED"
    assert "Slurm job 9 was requeued (restart 1): it restarts and resumes from its newest checkpoint" in lines


def test_a_requeue_after_a_lost_node_is_node_fail():
    with pytest.raises(RuntimeError, match=r"Slurm job 9 NODE_FAIL: node\(s\) n2 failed"):
        run_wait(records(("RUNNING", "", 0, "n[1-2]"), ("PENDING", "BeginTime", 1, "")),
                 lost=lambda nodes: ["n2"] if nodes == "n[1-2]" else [])


def test_a_long_queue_wait_is_named_with_slurms_reason_and_a_request_that_never_runs_is_the_users():
    ended, lines = run_wait(records(*[("PENDING", "Resources", 0, "")] * 4, ("RUNNING", "", 0, "n1"), ("COMPLETED", "", 0, "n1")),
                            queue_wait_warn_s=5)  # polls at 0, 1, 3 and 7 s: one warning
    waiting = [line for line in lines if "waiting in the queue" in line]
    assert ended.state == "COMPLETED" and len(waiting) == 1 and "Resources; not a failure" in waiting[0]
    with pytest.raises(UserError, match=r"can never start: PartitionNodeLimit \(check the profile's nodes"):
        run_wait(records(("PENDING", "PartitionNodeLimit", 0, "")))


def test_every_setting_of_the_test_config_is_one_the_profile_has():
    from stagewise.definitions.config import SlurmSettings

    assert set(SLURM) <= set(SlurmSettings.model_fields)


def test_an_own_script_runs_under_node_launch_in_a_fresh_working_folder(slurm_job):
    """An own entrypoint gets node_launch with its script
    and args, no --result-file (it finds $STAGEWISE_RESULT_FILE), and a scratch cwd of the try's own."""
    from dataclasses import replace

    from stagewise.definitions.config import EntryPoint

    job = replace(slurm_job(), entry=EntryPoint(script="/shared/train.py"), args=("--hidden", "32"))
    script = slurm.batch_script(job)
    files = slurm.JobFiles.of(slurm.log_dir(job), slurm.job_name(job.dag_id, job.run_id, "s2", 2))
    assert f"mkdir -p {files.workdir}\ncd {files.workdir}\n" in script
    assert script.splitlines()[-1].endswith("--nproc-per-node=2 --max-restarts=0 /shared/train.py --hidden 32")
    env = slurm.job_environment(job.profile, job.settings("slurm"), files, job.env)
    assert (env["STAGEWISE_RESULT_FILE"], env["STAGEWISE_METRICS_FILE"]) == (files.result, files.metrics)


def test_polls_start_after_a_second_and_double_up_to_poll_s():
    """A short job is seen ending about when it ends; a long one is polled every poll_s."""
    delays = slurm.poll_delays(10)
    assert [next(delays) for _ in range(7)] == [1, 2, 4, 8, 10, 10, 10]
    assert next(slurm.poll_delays(0.5)) == 0.5
