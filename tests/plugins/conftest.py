"""Fixtures shared by the plugin tests."""

from __future__ import annotations

import signal

import pytest


@pytest.fixture
def airflow_on_term():
    """Airflow's own SIGTERM handler stand-in (it calls the operator's on_kill and returns): the calls it got."""
    calls = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        yield calls
    finally:
        signal.signal(signal.SIGTERM, previous)
