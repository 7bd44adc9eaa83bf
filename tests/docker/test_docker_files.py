"""docker/: no container engine runs here, so these check statically what can be: the compose services run the
commands the project really runs, with Airflow settings Airflow knows and the ones scripts/airflow_env.sh sets; the
images install requirements.txt exactly and pin what it pins; the runtime image starts the node launcher."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from stagewise.definitions.loading import load_config

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
AIRFLOW_COMMANDS = {("api-server",), ("scheduler",), ("dag-processor",), ("celery", "worker"), ("db", "migrate")}
# Set by airflow_env.sh for one machine only, and why compose leaves them out.
ONE_MACHINE_ONLY = {
    "PATH": "the image's python is on it; there is no .venv",
    "AIRFLOW_HOME": "the image sets it (/opt/airflow)",
    "STAGEWISE_HOME": "the image sets it (/opt/stagewise)",
    "AIRFLOW__API__HOST": "api-server's -H on its command line",
    "AIRFLOW__API__PORT": "api-server's -p on its command line",
    "AIRFLOW__CORE__HOSTNAME_CALLABLE": "loopback hostnames serve logs on one machine; containers use their own names",
}


def _compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            pins[name.lower().replace("_", "-")] = version.strip()
    return pins


def _env_sh_names() -> set[str]:
    return set(re.findall(r"^export (\w+)=", (ROOT / "scripts" / "airflow_env.sh").read_text(), re.M))


def _airflow_services() -> dict[str, dict]:
    return {name: service for name, service in _compose()["services"].items()
            if service["image"].startswith("stagewise-airflow:") and name != "s3"}


def test_every_airflow_service_runs_a_command_the_project_runs():
    services = _airflow_services()
    commands = {name: service["command"] for name, service in services.items()}
    for name, command in commands.items():
        if command[:2] == ["bash", "-c"]:  # airflow-init: make airflow-init's two steps
            assert command[2] == "airflow db migrate && python -m stagewise.airflow.pools", name
            continue
        assert command[0] == "airflow", name
        assert tuple(command[1:3]) in AIRFLOW_COMMANDS or tuple(command[1:2]) in AIRFLOW_COMMANDS, (name, command)
    # make up's three long-running components, each once.
    started = sorted(" ".join(command[1:2]) for command in commands.values() if command[0] == "airflow"
                     and command[1] in ("api-server", "scheduler", "dag-processor"))
    assert started == ["api-server", "dag-processor", "scheduler"]
    assert _compose()["services"]["s3"]["command"][0] == "moto_server"


def test_one_celery_worker_serves_each_queue_the_profiles_name():
    config = load_config(ROOT / "pipeline.yaml")
    queues = {profile.queue for profile in config.profiles.values()}
    served = []
    for service in _airflow_services().values():
        command = service["command"]
        if command[1:3] == ["celery", "worker"]:
            served.extend(command[command.index("--queues") + 1].split(","))
    assert sorted(served) == sorted(queues)


def test_the_airflow_environment_is_airflow_env_sh_s_plus_the_services_and_every_option_exists():
    from airflow.configuration import conf

    known = conf.configuration_description  # Airflow's options and its providers' (celery), as documented
    for name, service in _airflow_services().items():
        env = service["environment"]
        missing = _env_sh_names() - set(env) - set(ONE_MACHINE_ONLY)
        assert not missing, f"{name} lacks what scripts/airflow_env.sh sets: {sorted(missing)}"
        for key in env:
            if key.startswith("AIRFLOW__"):
                section, option = key.removeprefix("AIRFLOW__").lower().split("__", 1)
                assert option in known.get(section, {}).get("options", {}), f"{name}: {key} is no Airflow option"
        assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
        assert env["AIRFLOW__CELERY__BROKER_URL"].startswith("redis://redis:")
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql+psycopg2://")


def test_images_install_requirements_txt_exactly_and_pin_its_versions():
    pins = _pins()
    for dockerfile in ("runtime.Dockerfile", "airflow.Dockerfile"):
        text = (DOCKER / dockerfile).read_text()
        installs = [line.strip(" \\&") for line in text.replace("\\\n", "\n").splitlines() if "pip install" in line]
        args = [shlex.split(line.split("pip install", 1)[1]) for line in installs]
        assert ["-r", "requirements.txt"] in args, f"{dockerfile} must install the pinned set as is"
        assert ["--no-deps", "-e", "."] in args, f"{dockerfile}: the project, editable, as make venv installs it"
        # No other package is named anywhere: torch's version comes out of requirements.txt itself.
        torch = next(a for a in args if "--index-url" in a)
        assert torch == ["--index-url", "$TORCH_INDEX", "$(grep '^torch==' requirements.txt)"], dockerfile
        assert "COPY requirements.txt ." in text and text.startswith("#") and "FROM python:3.11-slim" in text
    tags = {service["image"] for service in _compose()["services"].values()}
    assert f"stagewise-airflow:{pins['apache-airflow']}" in tags
    assert all(":" in tag and not tag.endswith(":latest") for tag in tags), tags


def test_the_runtime_image_starts_the_node_launcher_the_backends_run():
    """The image's entrypoint is the module the backends name, and that module is the project's (installed by the
    image's `pip install -e .`)."""
    import importlib.util

    from stagewise.airflow.stage_job import NODE_LAUNCH_MODULE

    text = (DOCKER / "runtime.Dockerfile").read_text()
    entrypoint = yaml.safe_load(re.search(r"^ENTRYPOINT (.+)$", text, re.M).group(1))
    assert entrypoint == ["python", "-m", NODE_LAUNCH_MODULE]
    assert "RUN rm -rf stagewise.egg-info" in text
    assert importlib.util.find_spec(NODE_LAUNCH_MODULE).origin == str(ROOT / "tasks" / "training" / "node_launch.py")
