"""Fixtures for the monitoring tests: paths, promtool, and a real Prometheus server."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "monitoring"
RULES_FILE = ROOT / "alerts" / "omni-pipeline.rules.yaml"
RULE_TESTS = Path(__file__).parent / "rules"
CHART = ROOT / "charts" / "omni-pipeline"

# The mixin, and the operator tests' helpers (the API emulator, the running operator) and the
# runtime tests' helpers, reused by import (their directories are not packages).
if str(MONITORING) not in sys.path:
    sys.path.insert(0, str(MONITORING))
for path in (ROOT / "tests" / "operator", ROOT / "tests" / "runtime"):
    if str(path) not in sys.path:
        sys.path.append(str(path))

from procs import PrometheusServer, binary  # noqa: E402  (tests/procs.py, shared with tests/runtime)


@pytest.fixture(scope="session")
def promtool() -> str:
    return binary("promtool")




@pytest.fixture(scope="module")
def webhook():
    """The receiver of Alertmanager's notifications (alert_sinks.py)."""
    from .alert_sinks import WebhookReceiver

    receiver = WebhookReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="module")
def alertmanager(tmp_path_factory, webhook):
    """A real Alertmanager that sends every alert to ``webhook`` (alert_sinks.py)."""
    from .alert_sinks import Alertmanager

    am = Alertmanager(tmp_path_factory.mktemp("alertmanager"), webhook.url)
    yield am
    am.stop()


@pytest.fixture(scope="session")
def empty_prometheus(tmp_path_factory):
    """A Prometheus scraping nothing: enough to check that queries parse and type-check."""
    server = PrometheusServer(tmp_path_factory.mktemp("prometheus"), "global: {}\n")
    yield server
    server.stop()
