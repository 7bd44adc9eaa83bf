# The runtime image: what every node of a SageMaker training job or Kubernetes Indexed Job runs.
# Build from the repo root:  docker build -f docker/runtime.Dockerfile -t stagewise-runtime:0.1.0 .
# CUDA nodes:                docker build -f docker/runtime.Dockerfile --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 ...
# The pinned set is requirements.txt, exactly as `make venv` installs it; only torch's build (CPU or CUDA) is chosen
# here, by the wheel index it is installed from first (the same torch version, so requirements.txt is satisfied).
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1

WORKDIR /opt/stagewise
COPY requirements.txt .
RUN pip install --index-url "$TORCH_INDEX" "$(grep '^torch==' requirements.txt)" \
 && pip install -r requirements.txt
# The project itself, editable as in make venv (configs and user scripts resolve under /opt/stagewise).
COPY . .
RUN pip install --no-deps -e .
# The build metadata it leaves here would read as a second installed stagewise from this folder.
RUN rm -rf stagewise.egg-info

# STAGEWISE_CONFIG: a job passes its own --config (the run's config, as a path under /opt/stagewise).
ENV STAGEWISE_HOME=/opt/stagewise STAGEWISE_CONFIG=/opt/stagewise/pipeline.yaml
# Jobs give the whole command (`python -m stagewise.training.node_launch sagemaker|kubernetes ...`); run bare, the
# image starts the same module, which reads the node's place in the gang from the platform.
ENTRYPOINT ["python", "-m", "stagewise.training.node_launch"]
