"""Fixtures for the monitoring tests: paths, promtool, and a real Prometheus server."""
from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "monitoring"
RULES_FILE = ROOT / "alerts" / "omni-pipeline.rules.yaml"
RULE_TESTS = Path(__file__).parent / "rules"
CHART = ROOT / "charts" / "omni-pipeline"

# The mixin, and the operator tests' helpers (the API emulator, the running operator) and the
# runtime tests' stage processes, reused by import (their directories are not packages).
if str(MONITORING) not in sys.path:
    sys.path.insert(0, str(MONITORING))
for path in (ROOT / "tests" / "operator", ROOT / "tests" / "runtime"):
    if str(path) not in sys.path:
        sys.path.append(str(path))


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found: `make setup` installs the Debian packages", pytrace=False)
    return path


@pytest.fixture(scope="session")
def promtool() -> str:
    return _binary("promtool")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition, timeout: float, what: str, interval: float = 0.2):
    """Poll `condition` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = condition()
            if result:
                return result
        except Exception as error:  # noqa: BLE001 - retried until the deadline
            last_error = error
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last error: {last_error})")


class PrometheusServer:
    """A real `prometheus` process on 127.0.0.1 with its own config and storage."""

    def __init__(self, workdir: Path, config: str):
        self.binary = _binary("prometheus")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(config)
        self.log_path = workdir / "prometheus.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [
                self.binary,
                f"--config.file={self.config_path}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        wait_until(self._ready, 30, "Prometheus to be ready")

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"prometheus exited:\n{self.log_path.read_text()[-3000:]}")
        return requests.get(f"{self.url}/-/ready", timeout=2).status_code == 200

    def query(self, expr: str) -> dict:
        response = requests.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        return response.json()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


@pytest.fixture(scope="session")
def empty_prometheus(tmp_path_factory):
    """A Prometheus scraping nothing: enough to check that queries parse and type-check."""
    server = PrometheusServer(tmp_path_factory.mktemp("prometheus"), "global: {}\n")
    yield server
    server.stop()
