"""A real SMTP server on loopback (aiosmtpd) that keeps every message it is sent: the receiver of the notification
tests. Use: ``with SmtpReceiver() as receiver: ... receiver.messages`` (each an email.message.Message)."""

from __future__ import annotations

import email
import socket
import threading
from email.message import Message
from typing import Any


class _Keeper:
    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.lock = threading.Lock()

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:  # noqa: N802 - aiosmtpd's hook name
        with self.lock:
            self.messages.append(email.message_from_bytes(envelope.original_content or envelope.content))
        return "250 OK"


def closed_port() -> int:
    """A loopback port nothing listens on (a receiver that is down)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SmtpReceiver:
    """aiosmtpd's Controller on 127.0.0.1 and a free port; ``messages`` is what it received, in order."""

    def __init__(self) -> None:
        from aiosmtpd.controller import Controller

        self._keeper = _Keeper()
        self.port = closed_port()
        self._controller = Controller(self._keeper, hostname="127.0.0.1", port=self.port)

    @property
    def messages(self) -> list[Message]:
        with self._keeper.lock:
            return list(self._keeper.messages)

    def connection_uri(self) -> str:
        """An Airflow SMTP connection to this receiver (plain SMTP, no TLS, no login)."""
        return smtp_connection(self.port)

    def __enter__(self) -> SmtpReceiver:
        self._controller.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._controller.stop()


def smtp_connection(port: int) -> str:
    """``AIRFLOW_CONN_<ID>``'s value for plain SMTP on loopback ``port``."""
    return (f"smtp://127.0.0.1:{port}?disable_tls=true&disable_ssl=true&from_email=stagewise%40example.org"
            f"&timeout=5&retry_limit=0")
