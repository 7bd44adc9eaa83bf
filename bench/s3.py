"""S3 benchmark: the whole ml_pipeline with its storage root on a local S3 endpoint vs on local files."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any


def s3_pipeline_overhead(rows: int = 0) -> dict[str, Any]:
    """Wall time of `airflow dags test ml_pipeline` with storage on s3:// (moto's S3 server on 127.0.0.1,
    through s3fs) / the same run on local files, same data and conf."""
    import logging

    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per S3 request otherwise

    from tests.dags.conftest import airflow, make_airflow_env
    from tests.live_airflow import free_port

    conf = json.dumps({"num_trials": 4})
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    aws = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_DEFAULT_REGION": "us-east-1"}
    seconds = {}
    try:
        s3fs.S3FileSystem(key="bench", secret="bench", client_kwargs={"endpoint_url": aws["AWS_ENDPOINT_URL"]}).mkdir("bench")
        with tempfile.TemporaryDirectory(prefix="bench-s3-") as tmp:
            for name, root in (("local", str(Path(tmp, "storage"))), ("s3", "s3://bench/root")):
                home = Path(tmp, f"home-{name}")
                home.mkdir()
                env = make_airflow_env(home, root, Path(tmp), extra=aws if name == "s3" else None)
                started = time.perf_counter()
                airflow(env, "dags", "test", "ml_pipeline", "-c", conf)
                seconds[name] = time.perf_counter() - started
    finally:
        server.stop()
    return {"ours": seconds["s3"], "baseline": seconds["local"], "unit": "s per ml_pipeline run",
            "details": {"s3_s": round(seconds["s3"], 1), "local_s": round(seconds["local"], 1),
                        "endpoint": "moto server on 127.0.0.1 (no network latency: this measures our S3 code path)"}}
