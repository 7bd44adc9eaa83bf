"""A fake Kubernetes API server on 127.0.0.1: the few endpoints the kubernetes backend calls, recorded.

It answers creating and deleting a Service and a Job, reading the Job's status (a scripted sequence of
status objects, the last repeated), listing pods by label and reading a pod's log (scripted the same way). Enough to drive the real KubernetesHook and
kubernetes client end to end; it schedules nothing.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


class FakeKubeAPI:
    def __init__(self, statuses: list[dict[str, Any]], pods: list[dict[str, Any]] | None = None,
                 refuse_job: tuple[int, str] | None = None, logs: dict[str, list[list[str]]] | None = None) -> None:
        self.statuses, self.pods, self.refuse_job = list(statuses), pods or [], refuse_job
        # pod name -> what each successive log read returns (timestamped lines; the last answer repeats)
        self.logs = {name: list(answers) for name, answers in (logs or {}).items()}
        self.requests: list[tuple[str, str, Any]] = []  # (method, path, JSON body or query)
        self.objects: dict[str, dict[str, Any]] = {}
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> Any:
                length = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(length)) if length else None

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self._body()
                fake.requests.append(("POST", self.path, body))
                if "/jobs" in self.path and fake.refuse_job:
                    code, message = fake.refuse_job
                    return self._reply(code, {"kind": "Status", "status": "Failure", "message": message, "code": code})
                fake.objects[self.path.split("?")[0] + "/" + body["metadata"]["name"]] = body
                self._reply(201, body)

            def do_DELETE(self) -> None:  # noqa: N802
                path = urlsplit(self.path).path
                fake.requests.append(("DELETE", path, self._body()))
                if fake.objects.pop(path, None) is None:
                    return self._reply(404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404})
                self._reply(200, {"kind": "Status", "status": "Success"})

            def do_GET(self) -> None:  # noqa: N802
                parts = urlsplit(self.path)
                fake.requests.append(("GET", parts.path, parse_qs(parts.query)))
                if parts.path.endswith("/status"):
                    job = fake.objects.get(parts.path.removesuffix("/status"))
                    if job is None:
                        return self._reply(404, {"kind": "Status", "code": 404})
                    status = fake.statuses.pop(0) if len(fake.statuses) > 1 else fake.statuses[0]
                    return self._reply(200, {**job, "status": status})
                if parts.path.endswith("/log"):
                    answers = fake.logs.get(parts.path.split("/")[-2], [[]])
                    text = "\n".join(answers.pop(0) if len(answers) > 1 else answers[0])
                    data = text.encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    return self.wfile.write(data)
                if parts.path.endswith("/pods"):
                    return self._reply(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": fake.pods})
                self._reply(404, {"kind": "Status", "code": 404})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def kubeconfig(self) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Config", "current-context": "fake",
                "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                "users": [{"name": "fake", "user": {"token": "fake-token"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}]}

    def calls(self, method: str) -> list[str]:
        return [path for verb, path, _ in self.requests if verb == method]

    def __enter__(self) -> FakeKubeAPI:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
