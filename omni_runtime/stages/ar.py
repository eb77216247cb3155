"""The AR stage: vLLM's OpenAI server with the omni scheduler and KV connector, supervised.

This process does not import vLLM or prometheus_client. It prepares the environment (an
empty ``PROMETHEUS_MULTIPROC_DIR`` shared by the API server and the engine-core process, the
stage's name), starts ``python -m vllm.entrypoints.openai.api_server`` as a child in its own
process group, and supervises it:

* Stop (SIGTERM/SIGINT) drains requests and transfers within the grace period: vLLM runs
  with ``--shutdown-timeout`` = the grace period (vLLM 0.32's default, 0, aborts every request
  in flight), so on the SIGTERM passed on to it the engine refuses new requests, keeps
  stepping until its in-flight requests have finished and every KV transfer has resolved
  (the omni scheduler reports unresolved transfers as unfinished work), then exits; the
  supervisor waits that long plus STOP_TIMEOUT_S, then kills what is left. On Kubernetes the
  pod also leaves its Service's endpoints when it starts terminating.
* Health: every HEALTH_CHECK_PERIOD_S it reads its own ``/metrics``; if the KV sender's thread
  in the engine process reports itself dead (``omni_kv_transport_thread_up == 0``), the
  stage cannot move KV any more while looking healthy, so it stops vLLM and exits with
  EXIT_TRANSPORT_DEAD: the pod restarts, and ``omni-pipeline up`` reports the stage's exit.
* Priority: vLLM's engine-core processes (every thread) run reniced to ENGINE_NICE, so the
  API server that answers /health and /metrics gets a CPU when it needs one under full load
  (benchmarks/metrics_scrape.py; docs/metrics.md, "Scrape time under load").
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Mapping
from typing import Any

from omni_contract.engine_args import (
    ADDITIONAL_CONFIG,
    KV_TRANSFER_CONFIG,
    OMNI_KV_CONFIG,
    EngineArgsError,
    check_engine_args,
    flag_name,
    user_kv_transfer_config,
)
from omni_contract.metrics import TRANSFERS, TRANSPORT_THREAD_UP
from omni_runtime.kv.connector_config import composed_kv_transfer_config, kv_transfer_config
from omni_runtime.stages.config import StageConfig, StageConfigError
# Imports no vLLM at module level (its server process is where it runs).
from omni_contract.edges import stream_config
from omni_runtime.stages.stage_input import DRAIN_PATH
from omni_runtime.stages.stage_input import SETTINGS_KEY as INPUT_SETTINGS_KEY
from omni_runtime.stages.stage_input import StageInputMiddleware

logger = logging.getLogger(__name__)

SCHEDULER_CLS = "omni_runtime.sched.OmniARScheduler"
#: vLLM's --middleware that makes requests from hand-offs (stage_input.py).
INPUT_MIDDLEWARE = f"{StageInputMiddleware.__module__}.{StageInputMiddleware.__name__}"
#: How long vLLM gets, beyond the grace period its engine drains for, to tear down before
#: SIGKILL.
STOP_TIMEOUT_S = 30
#: How often the supervisor reads its own /metrics for the KV transport's thread state.
HEALTH_CHECK_PERIOD_S = 10.0
#: Exit status when the KV sender's thread died (the stage could not move KV any more).
EXIT_TRANSPORT_DEAD = 3
#: Niceness given to vLLM's engine-core processes (every thread), so that the API server,
#: which answers /health and /metrics, is never starved of CPU by the engine's busy loop and
#: its compute threads (benchmarks/metrics_scrape.py). OMNI_ENGINE_NICE overrides; 0 leaves
#: the engine alone. Raising niceness needs no privilege.
ENGINE_NICE = 10
ENGINE_NICE_ENV = "OMNI_ENGINE_NICE"
_IN_FLIGHT = re.compile(
    "^" + TRANSFERS.name + r'\{[^}]*state="(pending|active)"[^}]*\}\s+(\S+)', re.M)
_THREAD_UP = re.compile(
    "^" + TRANSPORT_THREAD_UP.name + r'\{[^}]*thread="(sender|receiver)"[^}]*\}\s+(\S+)', re.M)


def engine_args_to_cli(engine_args: Mapping[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """``engineArgs`` as vLLM flags (keys in kebab, snake or camel case: the stage contract's
    ``flag_name``; ``true`` is a bare flag, ``false`` is left out); returns (flags, the user's
    additional-config to merge). A ``kv-transfer-config`` is left to :func:`vllm_command`,
    which composes it with the omni KV connector. Arguments the contract refuses
    (``omni_contract.engine_args``; parse_stage_config has refused them already) raise
    StageConfigError."""
    try:
        check_engine_args(engine_args, sends_kv=False)
    except EngineArgsError as exc:
        raise StageConfigError(str(exc)) from None
    argv: list[str] = []
    additional: dict[str, Any] = {}
    for key, value in engine_args.items():
        flag = flag_name(key)
        if flag == KV_TRANSFER_CONFIG:
            continue  # vllm_command composes it with the omni connector
        if flag == ADDITIONAL_CONFIG:
            additional.update(value or {})
        elif value is True:
            argv.append(f"--{flag}")
        elif value is False or value is None:
            continue
        elif isinstance(value, (dict, list)):
            argv += [f"--{flag}", json.dumps(value)]
        else:
            argv += [f"--{flag}", str(value)]
    return argv, additional


def shutdown_timeout_flag(grace_seconds: float) -> list[str]:
    """vLLM's ``--shutdown-timeout`` (whole seconds, 0 would mean abort) from the grace
    period: the engine drains in-flight requests that long before it stops."""
    return ["--shutdown-timeout", str(max(1, math.ceil(grace_seconds)))]


def user_kv_connector(engine_args: Mapping[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The user's own KV connector in ``engineArgs`` (key, config), if any: a mapping, or
    its JSON text as vLLM's flag takes it."""
    try:
        return user_kv_transfer_config(engine_args)
    except EngineArgsError as exc:
        raise StageConfigError(str(exc)) from None


def vllm_command(config: StageConfig, host: str, python: str = sys.executable, *,
                 grace_seconds: float | None = None) -> list[str]:
    flags, additional = engine_args_to_cli(config.engine_args)
    additional[OMNI_KV_CONFIG] = config.omni_kv_config()
    argv = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", config.model,
        "--served-model-name", config.model_name,
        "--host", host,
        "--port", str(config.http_port),
        "--scheduler-cls", SCHEDULER_CLS,
    ]
    user = user_kv_connector(config.engine_args)
    connector = user[1] if user else None
    if config.takes_hand_offs:
        # Its requests come from its upstreams' hand-offs (stage_input.py, in vLLM's server
        # through its --middleware plug-in point).
        additional[INPUT_SETTINGS_KEY] = _input_settings(config, host)
        argv += ["--middleware", INPUT_MIDDLEWARE]
    if additional[OMNI_KV_CONFIG].get("need_send_cache") or config.takes_hand_offs:
        # The omni KV connector moves the bytes (vLLM's KV connector interface; no worker
        # class of ours), composed with the user's own through vLLM's MultiConnector.
        # The user's connector config cannot reach ours (composed_kv_transfer_config refuses
        # one naming it): our settings, io_cpus included, come from kvTransfer alone.
        io_cpus = config.kv_io_cpus
        sends = additional[OMNI_KV_CONFIG].get("need_send_cache")
        connector = kv_transfer_config(
            {d.stage: d.zmq_address for d in config.downstream} if sends else {},
            config.pipeline, list(io_cpus) if isinstance(io_cpus, tuple) else io_cpus,
            revision=config.revision, loads=config.takes_hand_offs,
        )
        if user is not None:
            try:
                check_engine_args({user[0]: user[1]}, sends_kv=True)
            except EngineArgsError as exc:
                raise StageConfigError(str(exc)) from None
            connector = composed_kv_transfer_config(connector, user[1])
    argv += ["--additional-config", json.dumps(additional, sort_keys=True)]
    if connector is not None:
        argv += ["--kv-transfer-config", json.dumps(connector, sort_keys=True)]
    if config.model_dir:
        argv += ["--download-dir", config.model_dir]
    if config.otlp_endpoint:
        argv += ["--otlp-traces-endpoint", config.otlp_endpoint]
    if grace_seconds is not None:
        argv += shutdown_timeout_flag(grace_seconds)
    return argv + flags


def _input_settings(config: StageConfig, host: str) -> dict[str, Any]:
    """The stage input's settings (stage_input.InputSettings) from the stage config."""
    settings: dict[str, Any] = {
        "listen": f"tcp://{host}:{config.kv_port}", "pipeline": config.pipeline,
        "stage": config.stage, "inputs": list(config.inputs),
        "downstream": [d.stage for d in config.downstream] if config.kv_send else [],
        "sampling_params": dict(config.input_sampling_params),
        "load_kv": config.input_load_kv,
    }
    if config.revision:
        settings["revision"] = config.revision
    if config.input_hook:
        settings["hook"] = config.input_hook
    if config.input_max_inputs is not None:
        settings["max_inputs"] = config.input_max_inputs
    streams = {e.stage: stream_config(e.stream) for e in config.input_edges if e.streamed}
    if streams:
        settings["streams"] = streams
    streams_out = [d.stage for d in config.downstream if d.stream is not None]
    if streams_out and config.kv_send:
        settings["streams_out"] = streams_out
    return settings


def in_flight_transfers(metrics_text: str) -> float:
    """Pending + active transfers on a stage's /metrics page."""
    return sum(float(v) for _, v in _IN_FLIGHT.findall(metrics_text))


def transport_threads_down(metrics_text: str) -> list[str]:
    """The KV transport threads (``sender``, ``receiver``) a /metrics page reports dead."""
    return sorted({t for t, v in _THREAD_UP.findall(metrics_text) if float(v) == 0})


class ARStage:
    def __init__(self, config: StageConfig, *, host: str, grace_seconds: float) -> None:
        self.config = config
        self.host = host
        self.grace_seconds = grace_seconds
        self._stop = threading.Event()
        self._child: subprocess.Popen | None = None
        #: prometheus_client's multiprocess directory of this run (removed at its end).
        self._metrics_dir: str | None = None

    def _environment(self) -> dict[str, str]:
        from omni_runtime.observability.multiproc import MULTIPROC_ENV, prepare_prometheus_multiproc_dir

        # A directory of this stage's own, under the one the environment names (the image's):
        # two stages started from one environment (omni-pipeline up, a test) must not share one,
        # each empties it at its start.
        base = os.environ.get(MULTIPROC_ENV)
        metrics_dir = (os.path.join(base, f"omni-stage-{os.getpid()}") if base
                       else tempfile.mkdtemp(prefix="omni-metrics-"))
        prepare_prometheus_multiproc_dir(metrics_dir)  # emptied: a previous run's files go
        self._metrics_dir = metrics_dir
        env = dict(os.environ)
        env[MULTIPROC_ENV] = metrics_dir
        env["OMNI_STAGE_NAME"] = self.config.stage
        env["OMNI_PIPELINE"] = self.config.pipeline
        return env

    def run(self) -> int:
        argv = vllm_command(self.config, self.host, grace_seconds=self.grace_seconds)
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
            next_check = time.monotonic() + HEALTH_CHECK_PERIOD_S
            while not self._stop.wait(0.5):
                if (code := self._child.poll()) is not None:
                    logger.error("vLLM exited with %s", code)
                    return code or 1
                self._deprioritize_engine()
                if time.monotonic() >= next_check:
                    if down := self._transport_threads_down():
                        logger.error("KV %s thread of the engine died: the stage cannot ship KV; "
                                     "stopping it so that it is restarted", " and ".join(down))
                        self._stop_child()
                        return EXIT_TRANSPORT_DEAD
                    next_check = time.monotonic() + HEALTH_CHECK_PERIOD_S
            deadline = time.monotonic() + self.grace_seconds
            self._drain_streamed_inputs(deadline)
            return self._stop_child(deadline)
        finally:
            # Whatever is left of vLLM's group (its engine-core process) goes with us, and so
            # does this run's metrics directory (one per run: they piled up in /tmp).
            try:
                os.killpg(self._child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if self._metrics_dir is not None:
                shutil.rmtree(self._metrics_dir, ignore_errors=True)

    def _deprioritize_engine(self) -> None:
        """Renice every thread of vLLM's engine-core processes (the API server's descendants)
        not yet reniced: threads start after the process does (the model's compute pool), so
        this runs on every supervision tick; a /proc scan of a few dozen entries."""
        nice = _engine_nice()
        if nice <= 0:
            return
        for pid in _descendants(self._child.pid):
            for tid in _tasks(pid):
                try:
                    if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                        os.setpriority(os.PRIO_PROCESS, tid, nice)  # Linux: per thread
                except OSError:
                    pass  # the thread ended meanwhile

    def _metrics_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.config.http_port}/metrics"

    def _transport_threads_down(self) -> list[str]:
        try:
            with urllib.request.urlopen(self._metrics_url(), timeout=5) as resp:
                return transport_threads_down(resp.read().decode())
        except OSError:
            return []  # not serving yet, or too busy to answer: the next check tries again

    def _drain_streamed_inputs(self, deadline: float) -> None:
        """A stage fed by a stream, stopping: its streamed inputs drain first (no new hand-off
        or stream is taken; the open streams run to their end), up to ``deadline``: vLLM's
        own drain would end a streamed request that waits for its next chunk as if it had
        finished, cutting its stream (stage_input.py, StageInput.drain_streams)."""
        if not (self.config.takes_hand_offs and any(e.streamed for e in self.config.input_edges)):
            return
        wait = max(0.0, deadline - time.monotonic())
        url = self._metrics_url().rsplit("/", 1)[0] + f"{DRAIN_PATH}?wait={wait:.3f}"
        logger.info("stopping: the streamed inputs drain first, for up to %.0fs", wait)
        try:
            request = urllib.request.Request(url, data=b"", method="POST")
            with urllib.request.urlopen(request, timeout=wait + 10) as resp:
                left = json.loads(resp.read()).get("open", 0)
        except (OSError, ValueError) as exc:
            logger.warning("stopping: the streamed inputs could not drain first: %s", exc)
            return
        if left:
            logger.warning("stopping: %s streamed input(s) still open after %.0fs are cut",
                           left, wait)
        else:
            logger.info("stopping: every streamed input ended")

    def _stop_child(self, deadline: float | None = None) -> int:
        """Stop vLLM: SIGTERM, which its --shutdown-timeout turns into a drain of requests and
        transfers of up to the grace period (what is left of it by ``deadline``, when a
        drain of streamed inputs came first); SIGKILL after that plus STOP_TIMEOUT_S. 0 if
        it stopped by itself, 1 if it had to be killed."""
        child = self._child
        if child.poll() is None:
            logger.info("stopping vLLM: it drains requests and KV transfers for up to %.0fs",
                        self.grace_seconds)
            child.send_signal(signal.SIGTERM)
            left = self.grace_seconds if deadline is None else max(0.0, deadline - time.monotonic())
            limit = math.ceil(left) + STOP_TIMEOUT_S
            try:
                child.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                logger.error("vLLM did not stop within %ds; killing it", limit)
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                return 1
        return 0


def _engine_nice() -> int:
    try:
        return int(os.environ.get(ENGINE_NICE_ENV, ENGINE_NICE))
    except ValueError:
        return ENGINE_NICE


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(k) for k in f.read().split()]
        except OSError:
            pass
    return kids


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (not ``pid`` itself: the API server keeps its priority)."""
    out, todo = [], _children(pid)
    while todo:
        p = todo.pop()
        out.append(p)
        todo += _children(p)
    return out


def _tasks(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def _terminate_with_parent() -> None:
    """In the child, before exec: SIGTERM when the supervisor dies (Linux prctl)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: the supervisor's own cleanup still runs on a normal exit
