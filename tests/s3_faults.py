"""An S3 endpoint that misbehaves on purpose: an HTTP proxy in front of a real S3 server (moto).

Use: ``with FaultyS3(upstream, FaultPlan(every=5)) as proxy: ...`` and point AWS_ENDPOINT_URL at
``proxy.url``. Requests pass through to the real server except the ones the plan picks, which get
one of the faults S3 users meet in production:

- ``slow_down``: 503 SlowDown (S3 throttling), the request never reaches the server;
- ``internal_error``: 500 InternalError, the request never reaches the server;
- ``reset``: the connection is reset before the request is forwarded;
- ``lost_reply``: the request IS applied upstream, then the connection closes without a reply
  (the client cannot know its PUT or DELETE happened, so it must be safe to send again);
- ``truncate``: the reply's headers promise the whole body, half of it arrives, then the connection
  closes (a reader that trusted what arrived would see corrupt data).

``FaultPlan.outage_after`` starts an outage after that many requests: for ``outage_s`` seconds
every request gets a 503 or a reset. :attr:`FaultyS3.injected` counts each fault (and the requests
that fell in the outage), so a test can check that the faults it claims to ride out really happened.
"""

from __future__ import annotations

import collections
import http.client
import socket
import struct
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

FAULT_KINDS = ("slow_down", "internal_error", "reset", "lost_reply", "truncate")
_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "expect",
               "proxy-authorization", "proxy-authenticate", "content-length"}
_ERROR_BODY = ('<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
               '<RequestId>stagewise-fault</RequestId></Error>')
_ERRORS = {"slow_down": (503, "SlowDown", "Please reduce your request rate."),
           "internal_error": (500, "InternalError", "We encountered an internal error. Please try again.")}


@dataclass(frozen=True)
class FaultPlan:
    """Which requests fail, and how."""

    every: int = 0
    """Fault every Nth request (0: none), cycling through ``kinds``."""
    kinds: tuple[str, ...] = FAULT_KINDS
    """The faults to cycle through."""
    outage_after: int = 0
    """Start an outage at this request number (0: none)."""
    outage_s: float = 0.0
    """How long the outage lasts: every request in it gets a 503 or a reset."""

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {FAULT_KINDS}")


class FaultyS3:
    """The proxy: a threaded HTTP/1.1 server on 127.0.0.1 forwarding to ``upstream``."""

    def __init__(self, upstream: str, plan: FaultPlan) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.plan = plan
        self.injected: collections.Counter[str] = collections.Counter()
        self.requests = 0
        self.outage_started: float | None = None
        self._truncate_pending = False
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.proxy = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, name="faulty-s3", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FaultyS3:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def next_fault(self) -> str | None:
        """Count the request and decide its fault (None: pass it through)."""
        with self._lock:
            self.requests += 1
            number = self.requests
            plan = self.plan
            if plan.outage_after and number >= plan.outage_after:
                now = time.monotonic()
                if self.outage_started is None:
                    self.outage_started = now
                if now - self.outage_started < plan.outage_s:
                    self.injected["outage"] += 1
                    return "slow_down" if number % 2 else "reset"
            if plan.every and number % plan.every == 0:
                kind = plan.kinds[(number // plan.every) % len(plan.kinds)]
                if kind != "truncate":
                    return kind
                self._truncate_pending = True
            return None

    def truncate_now(self) -> bool:
        """Whether to cut this reply short: a truncation waits for the next reply that has a body."""
        with self._lock:
            due, self._truncate_pending = self._truncate_pending, False
            return due

    def count(self, kind: str) -> None:
        with self._lock:
            self.injected[kind] += 1

    def forward(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        connection = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            connection.request(method, path, body=body or None, headers=dict(headers))  # sets Content-Length
            response = connection.getresponse()
            data = response.read()
            return response.status, response.reason, response.getheaders(), data
        finally:
            connection.close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients use it

    def log_message(self, format: str, *args: object) -> None:  # quiet: the test output stays readable
        pass

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _abort(self, reset: bool) -> None:
        """End the connection without a reply: a reset (RST) or a plain close (FIN)."""
        if reset:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True

    def _proxy(self) -> None:
        proxy: FaultyS3 = self.server.proxy  # type: ignore[attr-defined]
        body = self._read_body()
        fault = proxy.next_fault()
        if fault in _ERRORS:
            status, code, message = _ERRORS[fault]
            payload = _ERROR_BODY.format(code=code, message=message).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)
            proxy.count(fault)
            return
        if fault == "reset":
            proxy.count(fault)
            return self._abort(reset=True)
        headers = [(k, v) for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP]
        status, reason, reply_headers, data = proxy.forward(self.command, self.path, headers, body)
        if fault == "lost_reply":
            proxy.count(fault)
            return self._abort(reset=False)
        truncate = self.command != "HEAD" and len(data) > 1 and proxy.truncate_now()
        self.send_response(status, reason)
        for key, value in reply_headers:
            if key.lower() not in _HOP_BY_HOP:
                self.send_header(key, value)
        if self.command == "HEAD":
            length = dict((k.lower(), v) for k, v in reply_headers).get("content-length", "0")
            self.send_header("Content-Length", length)
            self.end_headers()
            return
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if truncate:
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            proxy.count("truncate")
            return self._abort(reset=False)
        self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _proxy
