"""Real processes for the e2e tests: stages (``omni-stage --config``), bare vLLM servers with
the omni scheduler, and the helpers every such test needs (free ports, polling a condition,
stopping a process group). One module for tests/runtime and tests/monitoring alike."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml


#: The ports tests pick lie below the kernel's ephemeral range (32768 and up on Linux), where
#: nothing picks by itself: the ports vLLM, ZeroMQ and the kernel choose (port 0) never land in
#: them. Each pytest-xdist worker has a block of its own, so two workers never pick one port.
PORT_BLOCK = 2000
FIRST_PORT = 20000
_port_cursor = 0


def _worker_index() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # "gw3"; unset without xdist
    return int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0


def free_port() -> int:
    """A port nothing listens on, from this worker's block, each call a port not handed out
    before in this process (a port just closed may still be in TIME_WAIT; a plain bind
    without SO_REUSEADDR refuses it, so it is passed over)."""
    global _port_cursor
    base = FIRST_PORT + _worker_index() * PORT_BLOCK
    for _ in range(PORT_BLOCK):
        port = base + _port_cursor % PORT_BLOCK
        _port_cursor += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {base}-{base + PORT_BLOCK - 1}")


def shell_commands(code: str, substitutions: dict[str, str] | None = None
                   ) -> list[tuple[dict[str, str], list[str]]]:
    """A README's bash block as commands to run: (environment assignments, argv) each.
    Comment lines dropped, continuation lines joined, commands split where one ends with
    ``&``; ``substitutions`` (``$(mktemp -d)`` -> a directory, say) replaced first; the
    ``NAME=value`` words before the program are the environment's."""
    import re
    import shlex

    for old, new in (substitutions or {}).items():
        code = code.replace(old, new)
    code = "\n".join(line for line in code.splitlines() if not line.startswith("#"))
    code = re.sub(r"\\\n\s*", " ", code)
    commands = []
    for command in re.split(r"&\s*\n", code):
        words = shlex.split(command)
        env = {}
        while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        if words:
            commands.append((env, words))
    return commands


def readme_block(containing: str) -> str:
    """The README's first bash block that holds ``containing``."""
    import re

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        if containing in block:
            return block
    raise AssertionError(f"no bash block of README.md holds {containing!r}")


def http_get(url: str, timeout: float = 10.0) -> tuple[int, bytes, dict[str, str]]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read(), dict(err.headers)


def wait_until(predicate, timeout: float, what, interval: float = 0.2,
               proc: subprocess.Popen | None = None, log: Path | None = None):
    """Poll ``predicate`` until it returns a truthy value (returned) or time runs out; with
    ``proc``, fail at once (with the end of ``log``) if that process exits meanwhile.
    ``what``: a string, or a callable made into one when the wait fails (a process's output
    as it is then, not as it was when the wait began)."""
    deadline = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-4000:] if log else ""
            what = what() if callable(what) else what
            raise AssertionError(f"process exited ({proc.returncode}) while waiting for {what}\n{tail}")
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # not up yet
            last_error = exc
        time.sleep(interval)  # polling interval between condition checks
    what = what() if callable(what) else what
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last error: {last_error})")


def wait_all_healthy(stages: list[StageProcess], timeout: float) -> None:
    """Every stage healthy within ``timeout``, waited for side by side: the first that exits
    fails the wait at once, naming it, with the end of its log (a stage waited for later would
    otherwise hide it until the earlier one's whole timeout passed)."""
    pending = list(stages)

    def all_healthy() -> bool:
        for stage in list(pending):
            if stage.proc.poll() is not None:
                raise StageExited(f"stage {stage.name} exited ({stage.proc.returncode}) while the stages "
                                  f"started; the end of its log:\n{stage.log_tail()}")
            try:
                if stage.healthy():
                    pending.remove(stage)
            except OSError:  # not listening yet
                pass
        return not pending

    deadline = time.monotonic() + timeout
    while not all_healthy():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for stages "
                               f"{', '.join(s.name for s in pending)} to be healthy")
        time.sleep(0.2)  # polling interval between health checks


class StageExited(AssertionError):
    """A stage process exited while it was waited for."""


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return found


def _start_time(pid: int) -> str | None:
    """A process's start time (clock ticks since boot, /proc/PID/stat), None once gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def stop_group(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Stop a process started with start_new_session=True, and whatever is left of its
    process group (vLLM's engine core)."""
    stop_groups([proc], timeout)


def stop_groups(procs: list[subprocess.Popen], timeout: float = 30.0) -> None:
    """Stop processes started with start_new_session=True, and whatever is left of their
    process groups, side by side: each is sent SIGTERM (in the order given) before any is
    waited for, so their shutdowns overlap."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=timeout)


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` on the tiny model with OmniARScheduler
    and a KV connector whose worker side never answers (tests/silent_kv_connector.py):
    transfers are marked and handed off but nobody acknowledges them (the tests of stuck,
    held and expiring transfers). Multi-process engine core, a
    fresh ``PROMETHEUS_MULTIPROC_DIR``, as a stage launcher sets them up."""

    def __init__(self, workdir: Path, *, omni_kv_config: dict[str, Any], served_model_name: str,
                 block_size: int = 32, extra_args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None):
        from omni_runtime.devtools.tiny_model import ensure_tiny_model

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "server.log"
        multiproc = workdir / "prometheus-multiproc"
        multiproc.mkdir()  # empty, before prometheus_client loads (docs/metrics.md)
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("OTEL_", "PROMETHEUS_")) and k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        self.env.update(PROMETHEUS_MULTIPROC_DIR=str(multiproc), VLLM_TARGET_DEVICE="cpu", **(env or {}))
        # The silent connector's module lives next to this file.
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(Path(__file__).resolve().parent), self.env.get("PYTHONPATH")) if p)
        silent_connector = {
            "kv_connector": "SilentOmniKVConnector", "kv_connector_module_path": "silent_kv_connector",
            # An endpoint the connector needs to start; the silent one never contacts it.
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"endpoints": {"next": "tcp://127.0.0.1:9"}},
        }
        self.cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(ensure_tiny_model()), "--served-model-name", served_model_name,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--scheduler-cls", "omni_runtime.sched.OmniARScheduler",
            "--additional-config", json.dumps({"omni_kv_config": omni_kv_config}),
            "--kv-transfer-config", json.dumps(silent_connector),
            "--kv-cache-memory-bytes", "67108864", "--max-model-len", "512",
            "--block-size", str(block_size), "--enforce-eager", *extra_args,
        ]
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300.0) -> VllmServer:
        with self.log_path.open("wb") as out:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        try:
            wait_until(lambda: http_get(self.url + "/health", timeout=5)[0] == 200, timeout,
                       "the vLLM server to be healthy", interval=0.5, proc=self.proc, log=self.log_path)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)


class StageProcess:
    """One ``omni-stage`` process with its config file and log."""

    def __init__(self, config: dict[str, Any], workdir: Path, env: dict[str, str] | None = None,
                 grace_seconds: float = 5):
        self.grace_seconds = grace_seconds
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
        """Launched, and healthy within ``timeout`` (else stopped, and the wait's error)."""
        return self.launch().wait_healthy(timeout)

    def launch(self) -> StageProcess:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omni_runtime.stages.main", "--config", str(self.config_path),
             "--host", "127.0.0.1", "--grace-seconds", str(self.grace_seconds)],
            stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
        )
        log.close()
        return self

    def wait_healthy(self, timeout: float = 180.0) -> StageProcess:
        """Healthy within ``timeout``; a stage that exits meanwhile fails the wait at once."""
        try:
            wait_until(self.healthy, timeout, f"stage {self.name} to be healthy", proc=self.proc,
                       log=self.log_path)
        except BaseException:
            self.stop()
            raise
        return self

    def healthy(self) -> bool:
        return http_get(self.url + "/health", timeout=2)[0] == 200

    def signal_tree(self, sig: int) -> None:
        """``sig`` to the stage and every process under it, vLLM's included, which an AR
        stage runs in a session of its own (SIGSTOP: a hung pod; SIGCONT: it goes on)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        below = descendants(self.proc.pid)
        os.killpg(self.proc.pid, sig)
        for pid in below:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL the stage and every process under it (a crash of its pod: no drain, no
        goodbye)."""
        if self.proc is not None and self.proc.poll() is None:
            self.signal_tree(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self, timeout: float = 60.0) -> int | None:
        """Stop the stage (SIGTERM: it drains) and whatever of it is left. A paused stage is
        resumed first (stopped, it cannot take SIGTERM); a process under it that outlived it
        (vLLM runs in a session of its own) is killed (a test that failed with a stage
        paused had left its vLLM stopped, and orphaned)."""
        if self.proc is None:
            return None
        below = [(pid, _start_time(pid)) for pid in descendants(self.proc.pid)] \
            if self.proc.poll() is None else []
        self.signal_tree(signal.SIGCONT)
        stop_group(self.proc, timeout)
        for pid, started in below:
            if started is not None and _start_time(pid) == started:  # not a reused pid
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
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


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found: `make setup` installs the Debian packages", pytrace=False)
    return path


class ReadyServer:
    """A server binary on a free 127.0.0.1 port, ready once its ``/-/ready`` answers 200
    (Prometheus' and Alertmanager's readiness endpoint), stopped by :meth:`stop`."""

    name = "server"

    def __init__(self, workdir: Path, argv: list[str], port: int):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = workdir / f"{self.name}.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            wait_until(self._ready, 30, f"{self.name} to be ready")
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"{self.name} exited:\n{self.log_path.read_text()[-3000:]}")
        return requests.get(f"{self.url}/-/ready", timeout=2).status_code == 200

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


class PrometheusServer(ReadyServer):
    """A real `prometheus` process on 127.0.0.1 with its own config and storage."""

    name = "prometheus"

    def __init__(self, workdir: Path, config: str):
        port = free_port()
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(config)
        super().__init__(workdir, [
            binary("prometheus"),
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--web.enable-lifecycle",
        ], port)

    def query(self, expr: str) -> dict:
        response = requests.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        return response.json()
