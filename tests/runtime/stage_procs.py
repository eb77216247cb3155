"""Starting and stopping real stage processes (``omni-stage --config``) for e2e tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 10.0) -> tuple[int, bytes, dict[str, str]]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read(), dict(err.headers)


def wait_until(predicate, timeout: float, what: str, interval: float = 0.2):
    """Poll ``predicate`` until it returns a truthy value (returned) or time runs out."""
    deadline = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # not up yet
            last_error = exc
        time.sleep(interval)  # polling interval between condition checks
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last error: {last_error})")


class StageProcess:
    """One ``omni-stage`` process with its config file and log."""

    def __init__(self, config: dict[str, Any], workdir: Path, env: dict[str, str] | None = None):
        self.config = config
        self.name = config["stage"]
        self.http_port = config["ports"]["http"]
        self.kv_port = config["ports"]["kv"]
        self.config_path = workdir / f"{self.name}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / f"{self.name}.log"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self, timeout: float = 180.0) -> StageProcess:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omni_runtime.stage", "--config", str(self.config_path),
             "--host", "127.0.0.1", "--grace-seconds", "5"],
            stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
        )
        log.close()

        def healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"stage {self.name} exited: {self.log_tail()}")
            return http_get(self.url + "/health", timeout=2)[0] == 200

        try:
            wait_until(healthy, timeout, f"stage {self.name} to be healthy")
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self) -> None:
        """SIGKILL the whole process group (a crash: no drain, no goodbye)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        # Whatever is left of the group (vLLM's engine-core process) goes too.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)
        return self.proc.returncode

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def metrics(self) -> str:
        status, body, _ = http_get(self.url + "/metrics")
        assert status == 200
        return body.decode()


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
