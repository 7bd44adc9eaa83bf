# The Airflow image: api-server, scheduler, dag-processor and Celery workers (docker/compose.yaml), with the Amazon and
# cncf.kubernetes providers the sagemaker and kubernetes backends submit through, and the project.
# Build from the repo root:  docker build -f docker/airflow.Dockerfile -t stagewise-airflow:3.3.2 .
# Workers run local-backend stages themselves (torchrun), so the image carries torch too: CPU by default,
# --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 for GPU workers.
FROM python:3.11-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1

WORKDIR /opt/stagewise
COPY requirements.txt .
RUN pip install --index-url "$TORCH_INDEX" "$(grep '^torch==' requirements.txt)" \
 && pip install -r requirements.txt
COPY . .
RUN pip install --no-deps -e .
# The build metadata it leaves here would read as a second installed stagewise from this folder.
RUN rm -rf stagewise.egg-info

# What scripts/airflow_env.sh sets for one machine, fixed for the image (compose.yaml adds the services' addresses).
ENV STAGEWISE_HOME=/opt/stagewise \
    STAGEWISE_CONFIG=/opt/stagewise/pipeline.yaml \
    AIRFLOW_HOME=/opt/airflow \
    AIRFLOW__CORE__DAGS_FOLDER=/opt/stagewise/dags \
    AIRFLOW__CORE__PLUGINS_FOLDER=/opt/airflow/plugins \
    AIRFLOW__CORE__LOAD_EXAMPLES=False
RUN useradd --create-home --uid 50000 airflow && mkdir -p /opt/airflow /opt/stagewise/storage /opt/stagewise/.stagewise \
 && chown -R airflow /opt/airflow /opt/stagewise/storage /opt/stagewise/.stagewise
USER airflow
