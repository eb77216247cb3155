"""The AR stage: vLLM's OpenAI server with the omni scheduler and KV connector, supervised.

This process does not import vLLM or prometheus_client. It prepares the environment (an
empty ``PROMETHEUS_MULTIPROC_DIR`` shared by the API server and the engine-core process, the
stage's name), starts ``python -m vllm.entrypoints.openai.api_server`` as a child in its own
process group, and turns SIGTERM/SIGINT into a drain: wait until the stage's pending and active
transfers (read from its own ``/metrics``) are zero or the grace period ends, then stop vLLM.
On Kubernetes the pod leaves its Service's endpoints when it starts terminating, so no new
requests arrive while it drains; vLLM itself finishes in-flight requests on SIGTERM.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Mapping
from typing import Any

from omni_runtime.kv.connector_config import (
    ConnectorConfigError,
    composed_kv_transfer_config,
    kv_transfer_config,
)
from omni_runtime.stages.config import StageConfig, StageConfigError

logger = logging.getLogger(__name__)

SCHEDULER_CLS = "omni_runtime.sched.OmniARScheduler"
#: How long vLLM gets to stop on SIGTERM (finishing in-flight requests) before SIGKILL.
STOP_TIMEOUT_S = 30
#: engineArgs the stage sets itself; a user value would break the stage contract.
RESERVED_ARGS = frozenset({"model", "host", "port", "scheduler-cls", "served-model-name"})
_IN_FLIGHT = re.compile(r'^omni_kv_transfers\{[^}]*state="(pending|active)"[^}]*\}\s+(\S+)', re.M)


def _flag(key: str) -> str:
    kebab = re.sub(r"(?<!^)(?=[A-Z])", "-", key).replace("_", "-").lower()
    return kebab.lstrip("-")


def engine_args_to_cli(engine_args: Mapping[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """``engineArgs`` as vLLM flags (keys in kebab, snake or camel case; ``true`` is a bare
    flag, ``false`` is left out); returns (flags, the user's additional-config to merge).
    A ``kv-transfer-config`` is left to :func:`vllm_command`, which composes it with the
    omni KV connector (:func:`user_kv_connector`)."""
    argv: list[str] = []
    additional: dict[str, Any] = {}
    for key, value in engine_args.items():
        flag = _flag(key)
        if flag in RESERVED_ARGS:
            raise StageConfigError(
                f"engineArgs.{key} is set by the stage itself; remove it (model, ports and "
                "the omni scheduler come from the pipeline spec)"
            )
        if flag == "kv-transfer-config":
            continue  # vllm_command composes it with the omni connector (user_kv_connector)
        if flag == "additional-config":
            if not isinstance(value, Mapping):
                raise StageConfigError(f"engineArgs.{key} must be a mapping")
            additional.update(value)
        elif value is True:
            argv.append(f"--{flag}")
        elif value is False or value is None:
            continue
        elif isinstance(value, (dict, list)):
            argv += [f"--{flag}", json.dumps(value)]
        else:
            argv += [f"--{flag}", str(value)]
    return argv, additional


def user_kv_connector(engine_args: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The user's own KV connector in ``engineArgs`` (key, config), if any: a mapping, or
    its JSON text as vLLM's flag takes it."""
    for key, value in engine_args.items():
        if _flag(key) != "kv-transfer-config" or value is None:
            continue
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise StageConfigError(f"engineArgs.{key} is not valid JSON: {exc}") from None
        if not isinstance(value, Mapping):
            raise StageConfigError(
                f"engineArgs.{key} must be a mapping (a vLLM KVTransferConfig), "
                f"got {type(value).__name__}")
        return key, dict(value)
    return None


def vllm_command(config: StageConfig, host: str, python: str = sys.executable) -> list[str]:
    flags, additional = engine_args_to_cli(config.engine_args)
    for key in ("omni_kv_config",):
        if key in additional:
            raise StageConfigError(
                f"engineArgs.additional-config.{key} is set by the stage from kvTransfer and "
                "the pipeline graph; remove it"
            )
    additional["omni_kv_config"] = config.omni_kv_config()
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", config.model,
        "--served-model-name", config.model_name,
        "--host", host,
        "--port", str(config.http_port),
        "--scheduler-cls", SCHEDULER_CLS,
        "--additional-config", json.dumps(additional, sort_keys=True),
    ]
    user = user_kv_connector(config.engine_args)
    connector = user[1] if user else None
    if additional["omni_kv_config"].get("need_send_cache"):
        # The omni KV connector moves the bytes (vLLM's KV connector interface; no worker
        # class of ours), composed with the user's own through vLLM's MultiConnector.
        connector = kv_transfer_config(
            {d.stage: d.zmq_address for d in config.downstream}, config.pipeline
        )
        if user is not None:
            try:
                connector = composed_kv_transfer_config(connector, user[1])
            except ConnectorConfigError as exc:
                raise StageConfigError(f"engineArgs.{user[0]}: {exc}") from None
    if connector is not None:
        argv += ["--kv-transfer-config", json.dumps(connector, sort_keys=True)]
    if config.model_dir:
        argv += ["--download-dir", config.model_dir]
    if config.otlp_endpoint:
        argv += ["--otlp-traces-endpoint", config.otlp_endpoint]
    return argv + flags


def in_flight_transfers(metrics_text: str) -> float:
    """Pending + active transfers on a stage's /metrics page."""
    return sum(float(v) for _, v in _IN_FLIGHT.findall(metrics_text))


class ARStage:
    def __init__(self, config: StageConfig, *, host: str, grace_seconds: float) -> None:
        self.config = config
        self.host = host
        self.grace_seconds = grace_seconds
        self._stop = threading.Event()
        self._child: subprocess.Popen | None = None

    def _environment(self) -> dict[str, str]:
        from omni_runtime.observability.multiproc import MULTIPROC_ENV, prepare_prometheus_multiproc_dir

        metrics_dir = os.environ.get(MULTIPROC_ENV) or tempfile.mkdtemp(prefix="omni-metrics-")
        prepare_prometheus_multiproc_dir(metrics_dir)  # emptied: a previous run's files go
        env = dict(os.environ)
        env[MULTIPROC_ENV] = metrics_dir
        env["OMNI_STAGE_NAME"] = self.config.stage
        env["OMNI_PIPELINE"] = self.config.pipeline
        return env

    def run(self) -> int:
        argv = vllm_command(self.config, self.host)
        env = self._environment()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._stop.set())
        logger.info("stage %s/%s: starting vLLM: %s", self.config.pipeline, self.config.stage, " ".join(argv))
        # Own process group: a terminal's Ctrl-C reaches us only, and we decide when vLLM
        # stops; if we die (kill -9), the kernel sends vLLM SIGTERM.
        self._child = subprocess.Popen(
            argv, env=env, start_new_session=True, preexec_fn=_terminate_with_parent
        )
        try:
            while not self._stop.wait(0.5):
                if (code := self._child.poll()) is not None:
                    logger.error("vLLM exited with %s", code)
                    return code or 1
            self._drain()
            return self._stop_child()
        finally:
            # Whatever is left of vLLM's group (its engine-core process) goes with us.
            try:
                os.killpg(self._child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _metrics_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.config.http_port}/metrics"

    def _drain(self) -> None:
        deadline = time.monotonic() + self.grace_seconds
        while time.monotonic() < deadline and self._child.poll() is None:
            try:
                with urllib.request.urlopen(self._metrics_url(), timeout=2) as resp:
                    left = in_flight_transfers(resp.read().decode())
            except OSError:
                return  # the server is not answering: nothing to wait for
            if left == 0:
                logger.info("drained: no transfer in flight")
                return
            logger.info("draining: %d transfers in flight", left)
            time.sleep(0.5)  # production wait between polls of our own /metrics, not a test
        logger.warning("grace period over with transfers in flight; they will fail")

    def _stop_child(self) -> int:
        """0 if vLLM stopped on SIGTERM within STOP_TIMEOUT_S, 1 if it had to be killed."""
        child = self._child
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.error("vLLM did not stop within %ds; killing it", STOP_TIMEOUT_S)
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                return 1
        return 0


def _terminate_with_parent() -> None:
    """In the child, before exec: SIGTERM when the supervisor dies (Linux prctl)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the supervisor's own cleanup still runs on a normal exit
