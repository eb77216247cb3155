"""The local supervisor behind ``omni-pipeline up``: a pipeline's stages as processes on
127.0.0.1 (the command line itself is ``cli.py``).

Each stage gets the stage config the operator would put in its ConfigMap (the same
renderer), with 127.0.0.1 ports instead of Service addresses, and runs as ``omni-stage
--config`` (the runtime is started as a process, never imported: this package stays free of
vLLM). Stages start downstream first, so receivers listen before senders ship; a live table
shows each stage until Ctrl-C, which stops them upstream first, so that in-flight transfers
can still land.

With ``--watch`` the file is read again every second, and a change that makes a new revision
(``model.revision_of``, as on Kubernetes) rolls the local pipeline the operator's way: the new
revision's stages start, receivers first, each once the ones below it are ready (its own
ports: its senders only ever reach its receivers); then the pipeline's front (``Front``: one
stable address forwarding to the current revision's entry stage) switches to it; once no
request forwarded to the old entry stage is in flight, the old revision drains: its senders
stop first (SIGTERM: they finish their requests and resolve their KV transfers), and its
receivers only once their senders have exited (what reached them is saved first).
"""

from __future__ import annotations

import atexit
import collections
import hashlib
import json
import os
import shutil
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Mapping, TextIO

from omni_contract.metrics import RECEIVED, RESOLVED, STREAMS_RESOLVED, TRANSFERS

from .status import forget_endpoints, pid_alive, record_endpoints, running_record, state_dir
from omni_operator.pipeline.model import Pipeline, find_cycle
from omni_operator.pipeline.stage_config import dump_stage_config, render_endpoint_config, render_stage_config

STARTUP_TIMEOUT_S = 600.0


# ---------------------------------------------------------------------------- up


#: The ports free_port handed out in this process, most recent last: none is handed out
#: twice while it may not be bound yet (each is free when picked, and a stage binds it a
#: moment later: two picks could be the same port, and a stage's HTTP server and its KV
#: receiver once got one port, the HTTP server never reachable).
_HANDED_OUT: collections.OrderedDict[int, None] = collections.OrderedDict()
_HANDED_OUT_MAX = 4096
_PORTS_LOCK = threading.Lock()


def free_port(host: str) -> int:
    """A port free on ``host`` now, for a stage that binds it a moment later, and not handed
    out before by this process: one below the kernel's ephemeral range, which the kernel
    never hands out by itself (a port 0 would come from that range, where any outgoing
    connection's local end could take it before the stage binds it: a new revision's
    receiver once failed so, "Address already in use")."""
    high = _ephemeral_ports()[0]
    low = max(1024, high // 3)
    with _PORTS_LOCK:
        for _ in range(256):
            port = random.randrange(low, high)
            if port in _HANDED_OUT:
                continue
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            if not _reserve(port):
                continue
            return _hand_out(port)
        with socket.socket() as s:  # every try taken: what the kernel gives
            s.bind((host, 0))
            return _hand_out(s.getsockname()[1])


#: This process's port reservations (files), removed at its exit.
_RESERVED: list[Path] = []


def _reserve(port: int) -> bool:
    """Reserve ``port`` against every other process of this user that picks ports so (another
    `omni-pipeline up`, a test): a file named for it under the state directory, holding the
    reserving process's id. A port is free when picked but bound only when its stage starts,
    a minute later for the last ones, and another process checking it meanwhile finds it free
    (two `up`s once shared an endpoint port: one's client got the other pipeline's answer).
    A reservation whose process is gone is taken over; where the directory cannot be used,
    this process's own record (_HANDED_OUT) is all there is."""
    directory = state_dir() / "ports"
    path = directory / str(port)
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            try:
                holder = int(path.read_text() or 0)
            except ValueError:
                holder = 0
            if pid_alive(holder):
                return False
            stale = directory / f".{port}.{os.getpid()}"
            stale.write_text(str(os.getpid()))
            os.replace(stale, path)  # the process that held it is gone: taken over
        else:
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
    except OSError:
        return True
    if not _RESERVED:
        atexit.register(_release_reservations)
    _RESERVED.append(path)
    return True


def _release_reservations() -> None:
    for path in _RESERVED:
        try:
            if path.read_text() == str(os.getpid()):
                path.unlink()
        except (OSError, ValueError):
            pass


def _hand_out(port: int) -> int:
    _HANDED_OUT[port] = None
    while len(_HANDED_OUT) > _HANDED_OUT_MAX:
        _HANDED_OUT.popitem(last=False)
    return port


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ports for connections' local ends (Linux's default otherwise)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            first, last = (int(x) for x in f.read().split())
        return first, last
    except (OSError, ValueError):
        return 32768, 60999


def local_stage_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment the local stages run in: this one, with vLLM's CPU thread binding off
    unless set. vLLM's CPU executor binds each engine's worker to cores it picks from the whole
    host (``VLLM_CPU_OMP_THREADS_BIND=auto``), the same ones for every engine; here every stage
    shares the host, so a starting engine's worker would be pinned to the core another engine's
    worker keeps busy (it spins a while after each step) and wait there while another core
    idles. Unbound, the kernel places them."""
    return {**environ, "VLLM_CPU_OMP_THREADS_BIND": environ.get("VLLM_CPU_OMP_THREADS_BIND") or "nobind"}


def launch_order(pipeline: Pipeline) -> list[str]:
    """Downstream stages first (reverse topological order of the input graph)."""
    graph = {s.name: list(s.inputs) for s in pipeline.stages}
    assert find_cycle(graph) is None  # admission refused cycles
    order: list[str] = []
    seen: set[str] = set()

    def visit(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        for downstream in pipeline.downstream_of(name):
            visit(downstream)
        order.append(name)

    for stage in pipeline.stages:
        visit(stage.name)
    return order


#: The local endpoint's name in the table, its files, and ``local_stage_configs`` (a stage's
#: name is a DNS label: no stage has it).
def model_not_here(pipeline: Pipeline, cwd: Path | None = None) -> str | None:
    """Why the stages could not load the pipeline's model on this machine, where
    ``spec.model.path`` is a local path (absolute, or beginning with ``.`` or ``~``: no model
    hub id does) that is not there; None otherwise. The stages run here, relative paths from
    the current directory, as the stages see them; a hub id is left to vLLM."""
    path = pipeline.model.path
    if not path or not path.startswith(("/", ".", "~")):
        return None
    where = (cwd or Path.cwd()) / Path(path).expanduser()
    if where.exists():
        return None
    return (f"spec.model.path: {path} is not on this machine ({where} does not exist), and "
            "`omni-pipeline up` runs the stages here; build the tiny random model there with "
            f"`python -m omni_runtime.devtools.tiny_model {path}` (`make demo` does), or point "
            "spec.model.path at a model directory on this machine")


ENDPOINT = "_endpoint"


def local_stage_configs(
    pipeline: Pipeline, ports: dict[str, dict[str, int]], host: str = "127.0.0.1"
) -> dict[str, dict[str, Any]]:
    """The operator's stage configs, with local ports and KV endpoints; with an
    ``ENDPOINT`` entry in ``ports`` (its ``http``), the pipeline's endpoint's too."""
    configs = {}
    for stage in pipeline.stages:
        cfg = render_stage_config(pipeline, stage.name, lambda s: f"{host}:{ports[s]['kv']}")
        cfg["ports"] = dict(ports[stage.name])
        configs[stage.name] = cfg
    shape = pipeline.endpoint_stages
    if ENDPOINT in ports and shape is not None:
        port = ports[ENDPOINT]["http"]
        configs[ENDPOINT] = render_endpoint_config(
            pipeline, f"http://{host}:{ports[shape[0].name]['http']}", f"http://{host}:{port}",
            http_port=port)
    return configs


@dataclass
class LocalStage:
    name: str
    role: str
    config_path: Path
    log_path: Path
    http_port: int
    host: str
    proc: subprocess.Popen | None = None
    ready: bool = False
    counts: dict[str, float] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    def start(self, env: dict[str, str]) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omni_runtime.stages.main", "--config", str(self.config_path), "--host", self.host],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
        log.close()
        # Each stage leads its own process group; an AR stage's vLLM leads another and is
        # stopped by its supervisor, or signalled by the kernel if the supervisor dies. The
        # pid file lets whoever finds the runner gone (kill -9) stop a stage with `kill PID`.
        self.log_path.with_suffix(".pid").write_text(f"{self.proc.pid}\n")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def poll(self) -> None:
        self.ready = _get(self.url + "/health", timeout=1) is not None
        page = _get(self.url + "/metrics", timeout=2) if self.ready and self.role != "endpoint" \
            else None
        if page is not None:
            self.counts = stage_counts(page)

    def stop(self, timeout: float) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # what is left of its process group
        except ProcessLookupError:
            pass
        self.proc.wait()


def _get(url: str, timeout: float) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read().decode() if resp.status == 200 else None
    except (OSError, urllib.error.URLError):
        return None


def stage_counts(page: str) -> dict[str, float]:
    """What the table shows, from a stage's /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: dict[str, float] = {}

    def add(key: str, value: float) -> None:
        counts[key] = counts.get(key, 0.0) + value

    for family in text_string_to_metric_families(page):
        for s in family.samples:
            if s.name == TRANSFERS.name and s.labels.get("state") in ("pending", "active", "held"):
                add(s.labels["state"], s.value)
            elif s.name == RESOLVED.name:
                outcome = s.labels.get("outcome")
                add("delivered" if outcome == "acked" else "failed" if outcome in ("failed", "expired") else "other", s.value)
            elif s.name == RECEIVED.name:
                add("received" if s.labels.get("outcome") == "delivered" else "rejected", s.value)
            elif s.name == STREAMS_RESOLVED.name:
                # A streamed edge's streams count as its transfers do: at the producer's end
                # (the stage streams it) delivered or failed, at the consumer's received.
                outcome = s.labels.get("outcome")
                if s.labels.get("from_stage") == s.labels.get("stage"):
                    add("delivered" if outcome == "finished" else "failed"
                        if outcome in ("producer_error", "consumer_error", "expired") else "other", s.value)
                else:
                    add("received" if outcome == "finished" else "rejected"
                        if outcome in ("producer_error", "consumer_error", "expired") else "other", s.value)
    return counts


def _state(stage: LocalStage) -> str:
    """ready, waiting (not started yet: stages start downstream first), starting or exited."""
    return ("ready" if stage.ready else "waiting" if stage.proc is None
            else "starting" if stage.alive() else "exited")


def render_table(pipeline: str, stages: list[LocalStage]) -> str:
    rows = [("STAGE", "ROLE", "READY", "PENDING/ACTIVE/HELD", "DELIVERED", "FAILED", "RECEIVED", "METRICS")]
    for st in stages:
        if st.role == "endpoint":
            continue  # its own line, below the table
        c = st.counts
        flight = "/".join(str(int(c.get(k, 0))) for k in ("pending", "active", "held")) if st.role == "ar" else "-"
        rows.append((
            st.name, st.role,
            "yes" if st.ready else _state(st),
            flight,
            str(int(c.get("delivered", 0))) if st.role == "ar" else "-",
            str(int(c.get("failed", 0))) if st.role == "ar" else str(int(c.get("rejected", 0))),
            "-" if st.role == "ar" else str(int(c.get("received", 0))),
            st.url + "/metrics",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"pipeline {pipeline}"] + ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    for st in stages:
        if st.role == "endpoint":
            lines.append(f"the pipeline's endpoint (OpenAI API): {st.url}/v1 "
                         f"({_state(st)})")
    return "\n".join(lines)


class LocalPipeline:
    def __init__(self, pipeline: Pipeline, workdir: Path, host: str = "127.0.0.1") -> None:
        self.pipeline = pipeline
        self.workdir = workdir
        self.host = host
        ports = {s.name: {"http": free_port(host), "kv": free_port(host)} for s in pipeline.stages}
        ports[ENDPOINT] = {"http": free_port(host)}
        configs = local_stage_configs(pipeline, ports, host)
        roles = {s.name: s.role for s in pipeline.stages}
        # Downstream first; the endpoint, in front of every stage, last.
        self.order = launch_order(pipeline) + ([ENDPOINT] if ENDPOINT in configs else [])
        roles[ENDPOINT] = "endpoint"
        self.stages: dict[str, LocalStage] = {}
        for name in self.order:
            path = workdir / f"{name}.yaml"
            path.write_text(dump_stage_config(configs[name]))
            self.stages[name] = LocalStage(name, roles[name], path, workdir / f"{name}.log", ports[name]["http"], host)

    def stage_urls(self) -> dict[str, str]:
        """Each stage's API (the endpoint apart)."""
        return {s.name: s.url for s in self.table_order() if s.role != "endpoint"}

    @property
    def endpoint_url(self) -> str | None:
        return self.stages[ENDPOINT].url if ENDPOINT in self.stages else None

    def table_order(self) -> list[LocalStage]:
        return [self.stages[s.name] for s in self.pipeline.stages] + \
            ([self.stages[ENDPOINT]] if ENDPOINT in self.stages else [])

    def start(self, env: dict[str, str], stop: threading.Event, on_poll=None) -> bool:
        """Start every stage, downstream first, each once the ones below it are ready.
        False if a stage exits (one started before as well as the one starting) or ``stop``
        is set first."""
        started: list[LocalStage] = []
        for name in self.order:
            stage = self.stages[name]
            stage.start(env)
            started.append(stage)
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while not stage.ready:
                if (any(not s.alive() for s in started) or stop.is_set()
                        or time.monotonic() > deadline):
                    return False
                stop.wait(0.5)
                self.poll()
                if on_poll:
                    on_poll()
        return True

    def poll(self) -> None:
        for stage in self.stages.values():
            if stage.alive():
                stage.poll()
            else:
                stage.ready = False

    def stop(self) -> None:
        for name in reversed(self.order):  # upstream first: its transfers can still land
            self.stages[name].stop(self.stop_timeout)

    @property
    def entry(self) -> LocalStage:
        """Where the pipeline's requests go: its endpoint, else (a pipeline of another shape)
        the first AR stage with no inputs."""
        if ENDPOINT in self.stages:
            return self.stages[ENDPOINT]
        first = next((s for s in self.pipeline.stages if s.role == "ar" and not s.inputs), self.pipeline.stages[0])
        return self.stages[first.name]

    def drain(self, out: TextIO) -> dict[str, float]:
        """Stop every stage, senders first, each receiver once every stage sending to it has
        exited (SIGTERM drains a sender: its requests finish, its KV transfers resolve); what
        reached each receiver is saved (``<stage>.arrivals.json``) before it stops. The senders'
        last counts (delivered, failed)."""
        totals: collections.Counter[str] = collections.Counter()
        for name in reversed(self.order):
            stage = self.stages[name]
            if stage.role == "endpoint":
                stage.stop(self.stop_timeout)
                print("  stopped the endpoint (its requests had ended)", file=out)
                continue
            if stage.role != "ar":
                page = _get(stage.url + "/v1/kv", timeout=5)
                (self.workdir / f"{name}.arrivals.json").write_text(page or '{"payloads": []}')
            elif stage.alive():
                stage.poll()
            stage.stop(self.stop_timeout)
            if stage.role == "ar":
                totals.update({k: stage.counts.get(k, 0.0) for k in ("delivered", "failed")})
                print(f"  stopped {name} (drained: its requests finished, its KV transfers resolved)", file=out)
            else:
                print(f"  stopped {name} (its senders had exited)", file=out)
        return dict(totals)

    @property
    def stop_timeout(self) -> float:
        """Long enough for an AR stage's drain (its transfer deadline) and vLLM's own stop
        (30 s), before the runner resorts to SIGKILL."""
        return max(s.kv.timeout_seconds for s in self.pipeline.stages) + 30 + 15


# Request headers a client's call carries on to the stage (the rest are the proxy's own).
FORWARDED_HEADERS = ("Content-Type", "Accept", "Authorization", "X-Request-Id", "traceparent", "tracestate")


class Front:
    """The pipeline's one address while revisions come and go: every request is forwarded to
    the current revision's entry stage (``target``), whole (a streamed answer arrives at the
    end), and the requests in flight to each target are counted, so that a rollout drains the
    old entry stage only once nothing forwarded to it is left."""

    def __init__(self, host: str, port: int = 0) -> None:
        self.target = ""
        self.inflight: collections.Counter[str] = collections.Counter()
        self._lock = threading.Condition()
        front = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                with front._lock:
                    target = front.target
                    front.inflight[target] += 1
                try:
                    headers = {h: self.headers[h] for h in FORWARDED_HEADERS if self.headers.get(h)}
                    try:
                        if not target:  # no revision is ready yet
                            raise urllib.error.URLError("the pipeline's stages are still starting")
                        request = urllib.request.Request(target + self.path, data=body, headers=headers,
                                                         method=self.command)
                        with urllib.request.urlopen(request, timeout=600) as resp:
                            status, data, kind = resp.status, resp.read(), resp.headers.get("Content-Type")
                    except urllib.error.HTTPError as exc:
                        status, data, kind = exc.code, exc.read(), exc.headers.get("Content-Type")
                    except (OSError, urllib.error.URLError, ValueError) as exc:
                        status, data, kind = 502, f"the pipeline's entry stage is unreachable: {exc}".encode(), "text/plain"
                finally:
                    with front._lock:
                        front.inflight[target] -= 1
                        front._lock.notify_all()
                self.send_response(status)
                self.send_header("Content-Type", kind or "application/octet-stream")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = _forward

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="omni-front", daemon=True)
        self._thread.start()

    def switch(self, target: str) -> str:
        """Forward new requests to ``target``; the previous target."""
        with self._lock:
            previous, self.target = self.target, target
        return previous

    def wait_idle(self, target: str, timeout: float) -> bool:
        """Wait until no request forwarded to ``target`` is in flight (bounded)."""
        with self._lock:
            return self._lock.wait_for(lambda: self.inflight[target] <= 0, timeout)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


#: What a streamed demo asks of its entry stage (``up --streaming``): enough tokens that a
#: whole hand-off comes well after a stream's first chunk, all of them said (``ignore_eos``:
#: the tiny random model may end a request at once).
STREAMING_DEMO_TOKENS = 40


def send_demo_requests(stage: LocalStage, model: str, count: int, out: TextIO, *,
                       tokens: int = 8, ignore_eos: bool = False, label: str = "",
                       ends: tuple[str, str] | None = None) -> list[float | None]:
    """``count`` requests to ``stage`` (the pipeline's endpoint), each answer printed: the last
    stage's text, or what its payload holds. Returns each request's first output's time
    (:func:`first_output_seconds` between ``ends``, the entry and last stages' names; None
    without them, or where the answer does not say)."""
    prompts = ["Hello world", "The quick brown fox jumps over the lazy dog.",
               "An omni pipeline ships KV caches between stages."]
    firsts: list[float | None] = []
    for i in range(count):
        request = {"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": tokens,
                   "temperature": 0}
        if ignore_eos:
            request["ignore_eos"] = True
        req = urllib.request.Request(stage.url + "/v1/completions", json.dumps(request).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            answer = json.loads(resp.read())
        choice = answer["choices"][0]
        firsts.append(first_output_seconds(answer, *ends) if ends else None)
        payload = choice.get("omni_payload")
        if payload is None:
            text = repr(choice["text"])
        else:
            what = (f"in {payload['chunks']} streamed chunks" if payload.get("streamed")
                    else f"and their KV {payload['dtype']}{payload['shape']}")
            said = len(payload['token_ids']) - payload['prompt_len']
            text = (f"{len(payload['token_ids'])} tokens ({payload['prompt_len']} of its prompt, {said} "
                    f"generated) {what} at stage {payload['stage']}, from {payload['from_stage']}")
        print(f"{label}request {i}: {prompts[i % len(prompts)]!r} -> {text}", file=out, flush=True)
    return firsts


def warm_up(stage: LocalStage, model: str) -> None:
    """One untimed request through the pipeline (``up --streaming``): a pipeline's first
    request pays what no later one does (the KV connections' hellos, the engines' first
    steps), which a comparison of the two modes must not time."""
    body = json.dumps({"model": model, "prompt": "warm-up", "max_tokens": STREAMING_DEMO_TOKENS,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(stage.url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        resp.read()


def first_output_seconds(answer: Mapping[str, Any], entry: str, last: str) -> float | None:
    """A pipeline endpoint's answer's first output's time: from the request's arrival at the
    endpoint (``entry``'s ``sent_at``) to the moment the pipeline's ``last`` stage took its
    first input (``taken_at``: a stream's first chunk, or a whole hand-off; what a vocoder
    would begin to speak from), from the stages' timings the endpoint returns
    (``omni.stages``, docs/stages.md); None for an answer without them."""
    stages = (answer.get("omni") or {}).get("stages") or {}
    sent = (stages.get(entry) or {}).get("sent_at")
    taken = (stages.get(last) or {}).get("taken_at")
    if not isinstance(sent, (int, float)) or not isinstance(taken, (int, float)):
        return None
    return max(0.0, taken - sent)


def endpoint_names(pipeline: Pipeline) -> tuple[str, str] | None:
    """(entry, last) stage names of a pipeline with one endpoint, else None."""
    shape = pipeline.endpoint_stages
    return None if shape is None else (shape[0].name, shape[1].name)


def whole_edges(body: Mapping[str, Any]) -> dict[str, Any]:
    """The same pipeline with every edge fed whole: ``streams`` dropped from each stage (its
    ``inputs`` stay, so each upstream then hands its output off at its
    ``kvTransfer.criteria``). What ``up --streaming`` compares the file with."""
    spec = dict(body.get("spec") or {})
    spec["stages"] = [{k: v for k, v in stage.items() if k != "streams"}
                      for stage in spec.get("stages") or ()]
    return {**body, "spec": spec}


def compare_first_outputs(local: LocalPipeline, whole: Pipeline, streamed: list[float | None],
                          env: dict[str, str], stop: threading.Event, out: TextIO,
                          workdir: Path) -> None:
    """``up --streaming``: the same requests at ``whole`` (the pipeline with every edge fed
    whole), started beside the running one in ``workdir`` and stopped once answered, then
    both modes' first output's times printed."""
    print(f"starting the same pipeline with every edge whole (its streams dropped) to compare "
          f"(its stage configs and logs in {workdir})", file=out, flush=True)
    workdir.mkdir(parents=True, exist_ok=True)
    other = LocalPipeline(whole, workdir, local.host)
    try:
        if not other.start(env, stop):
            if not stop.is_set():
                print(f"the whole-hand-off pipeline did not come up (its logs in {workdir}); "
                      "no comparison", file=out, flush=True)
            return
        warm_up(other.entry, whole.model.name)
        firsts = send_demo_requests(other.entry, whole.model.name, len(streamed), out,
                                    tokens=STREAMING_DEMO_TOKENS, ignore_eos=True,
                                    label="whole: ", ends=endpoint_names(whole))
    finally:
        other.stop()
    print(first_output_summary(local.pipeline, streamed, firsts), file=out, flush=True)


def first_output_summary(pipeline: Pipeline, streamed: list[float | None],
                         whole: list[float | None]) -> str:
    """The two modes' first output's times, each request's and the medians, and how much
    sooner the streamed one came."""
    shape = pipeline.endpoint_stages
    last = shape[1].name if shape is not None else "the last stage"

    def row(times: list[float | None]) -> tuple[str, float | None]:
        known = sorted(t for t in times if t is not None)
        median = known[len(known) // 2] if known else None
        text = ", ".join("-" if t is None else f"{t:.3f} s" for t in times)
        return text + (f" (median {median:.3f} s)" if median is not None else ""), median

    streamed_row, streamed_median = row(streamed)
    whole_row, whole_median = row(whole)
    lines = [f"first output (the request at the endpoint until {last} took its first input), "
             f"{len(streamed)} requests each way:",
             f"  streamed:        {streamed_row}",
             f"  whole hand-offs: {whole_row}"]
    if streamed_median and whole_median:
        if streamed_median < whole_median:
            lines.append(f"  streamed, the first output came {whole_median / streamed_median:.1f}x "
                         "sooner")
        else:
            lines.append("  streamed, the first output came no sooner")
    return "\n".join(lines)


def show_arrivals(local: LocalPipeline, expected: int, stop: threading.Event, out: TextIO) -> None:
    """Print what reached the receiving stages, once ``expected`` arrived or after 30 s: the
    KV payloads of their whole inputs (/v1/kv) and the streams of their streamed ones
    (/v1/streams)."""
    streamed = {consumer for _, consumer, _ in local.pipeline.streamed_edges()}
    receivers = [(s, "/v1/streams" if s.name in streamed else "/v1/kv")
                 for s in local.table_order() if s.role not in ("ar", "endpoint")]
    deadline = time.monotonic() + 30
    listings: dict[str, list[dict]] = {}
    while not stop.is_set():
        for st, path in receivers:
            page = _get(st.url + path, timeout=2)
            found = json.loads(page) if page else {}
            listings[st.name] = found.get("streams" if path == "/v1/streams" else "payloads") or []
        if all(len(v) >= expected for v in listings.values()) or time.monotonic() > deadline:
            break
        stop.wait(0.2)
    lines = []
    for st, path in receivers:
        if path == "/v1/streams":
            lines.append(f"streams taken at stage {st.name} ({st.url}{path}):")
            lines += [f"  {s['request_id']}: {len(s['token_ids'])} tokens in {s['chunks']} chunks from "
                      f"{s['from_stage']}, {s['outcome'] or 'open'}" for s in listings[st.name]]
        else:
            lines.append(f"KV arrived at stage {st.name} ({st.url}{path}):")
            lines += [f"  {p['request_id']}: seq_len={p['seq_len']} {p['dtype']}{list(p['shape'])} "
                      f"{p['bytes']} bytes from {p['from_stage']}" for p in listings[st.name]]
    print("\n".join(lines), file=out, flush=True)  # one write: the table's thread writes too


@dataclass(frozen=True)
class UpOptions:
    host: str = "127.0.0.1"
    workdir: str | None = None  # None: a temporary directory, removed at exit unless keep
    keep: bool = False
    demo: int = 0  # requests to send to the AR stage once every stage is ready
    exit_after: float | None = None  # seconds; None: until Ctrl-C
    #: Read the file again every second: returns the pipeline it now holds (None: unchanged,
    #: or invalid, reported), to roll to when its revision differs. None: no watching.
    reload: Callable[[], Pipeline | None] | None = None
    port: int = 0  # the front's port with reload (0: a free one)
    #: With demo: the same pipeline with every edge whole (``whole_edges``), run after the
    #: demo requests with the same requests, both modes' first output's times printed.
    compare: Pipeline | None = None


def run_pipeline(pipeline: Pipeline, args: UpOptions, out: TextIO) -> int:
    """Run every stage until Ctrl-C (or exit_after); 0 on a clean stop, 1 if a stage failed,
    2 if it could not begin (the pipeline up already, a host, port or directory it cannot
    use: said in one line)."""
    running = running_record(pipeline)  # the pointer: an up of this pipeline from any directory
    if running is None and args.workdir:
        running = running_record(pipeline, Path(args.workdir))
    if running is not None:
        print(f"pipeline {pipeline.namespace}/{pipeline.name} is up already (omni-pipeline up, pid "
              f"{running.get('pid')}, its files in {running.get('workdir')}): stop it first (Ctrl-C "
              "there), or run this one under another metadata.name", file=out)
        return 2
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix=f"omni-{pipeline.name}-"))
    front = None
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        local = LocalPipeline(pipeline, workdir, args.host)
        front = Front(args.host, args.port) if args.reload is not None else None
    except (OSError, OverflowError) as exc:  # a host that does not resolve, a port taken, a file in the way
        print(f"omni-pipeline up: cannot begin: {' '.join(str(exc).split())} (--host {args.host}"
              + (f", --port {args.port}" if args.reload is not None else "")
              + (f", --workdir {args.workdir}" if args.workdir else "") + ")", file=out)
        if not args.workdir and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        return 2
    # Where `omni-pipeline status FILE` finds the stages (removed at exit).
    record_endpoints(pipeline, workdir, local.stage_urls(), front=front.url if front is not None else local.endpoint_url)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    tty = out.isatty()
    last = [""]

    def show() -> None:
        table = render_table(local.pipeline.name, local.table_order())
        if front is not None:
            table += f"\nrevision {local.pipeline.revision}; the pipeline's API: {front.url}"
        if table == last[0]:
            return
        last[0] = table
        print(("\x1b[H\x1b[2J" if tty else "") + table + f"\n(logs and stage configs in {workdir}; Ctrl-C stops)",
              file=out, flush=True)

    env = local_stage_env(os.environ)
    started_at = time.monotonic()
    try:
        if not local.start(env, stop, on_poll=show):
            show()
            if stop.is_set():
                return 0
            for s in local.stages.values():
                if s.proc is None or s.ready:
                    continue
                what = "exited" if not s.alive() else f"was not ready after {STARTUP_TIMEOUT_S:g}s"
                print(f"stage {s.name} {what}; the end of its log ({s.log_path}):\n" + _tail(s.log_path), file=out)
            return 1
        if front is not None:
            front.switch(local.entry.url)
        show()
        if args.demo:
            entry = front if front is not None else local.entry
            if args.compare is None:
                send_demo_requests(entry, pipeline.model.name, args.demo, out)
            else:
                warm_up(entry, pipeline.model.name)
                streamed = send_demo_requests(entry, pipeline.model.name, args.demo, out,
                                              tokens=STREAMING_DEMO_TOKENS, ignore_eos=True,
                                              ends=endpoint_names(pipeline))
            show_arrivals(local, args.demo, stop, out)
            if args.compare is not None:
                compare_first_outputs(local, args.compare, streamed, env, stop, out,
                                      workdir / "whole")
        while not stop.wait(1.0):
            local.poll()
            show()
            if args.exit_after is not None and time.monotonic() - started_at > args.exit_after:
                break
            if any(not s.alive() for s in local.stages.values()):
                print("a stage exited; stopping the pipeline", file=out)
                return 1
            if args.reload is not None and front is not None:
                changed = args.reload()
                if changed is not None and changed.revision != local.pipeline.revision:
                    local = roll(local, changed, front, env, stop, out, workdir / changed.revision)
                    record_endpoints(local.pipeline, workdir, local.stage_urls(), front=front.url)
        local.poll()
        show()
        return 0
    finally:
        local.stop()
        if front is not None:
            front.close()
        forget_endpoints(pipeline, workdir)
        if not args.workdir and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def roll(old: LocalPipeline, pipeline: Pipeline, front: Front, env: dict[str, str], stop: threading.Event,
         out: TextIO, workdir: Path) -> LocalPipeline:
    """Roll the local pipeline to ``pipeline``'s revision (see the module docstring), its
    stage configs and logs in ``workdir``; the pipeline now running (the old one if the new
    revision did not come up)."""
    before, after = old.pipeline.revision, pipeline.revision
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"revision {before} -> {after}: starting its stages, receivers first ({' -> '.join(launch_order(pipeline))})",
          file=out, flush=True)
    new = LocalPipeline(pipeline, workdir, old.host)
    if not new.start(env, stop):
        print(f"revision {after} did not come up (its logs in {workdir}); revision {before} keeps running", file=out)
        new.stop()
        return old
    previous = front.switch(new.entry.url)
    shape = pipeline.endpoint_stages
    target = f"{shape[0].name} through the pipeline's endpoint" if shape is not None else new.entry.name
    print(f"revision {after} is ready; the front forwards to {target} at {new.entry.url}", file=out, flush=True)
    if not front.wait_idle(previous, old.stop_timeout):
        print(f"requests to revision {before} still in flight after {old.stop_timeout:g}s; draining anyway", file=out)
    print(f"revision {before}: draining, senders first", file=out, flush=True)
    totals = old.drain(out)
    print(f"revision {after} rolled out; revision {before} drained (its KV transfers: "
          f"{int(totals.get('delivered', 0))} delivered, {int(totals.get('failed', 0))} failed or expired)",
          file=out, flush=True)
    return new


def file_watcher(path: Path, load: Callable[[Path], Pipeline | None]) -> Callable[[], Pipeline | None]:
    """A reload for UpOptions: the file's pipeline when its text changed (and is valid)."""
    seen = [hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else ""]

    def reload() -> Pipeline | None:
        try:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError:
            return None
        if digest == seen[0]:
            return None
        seen[0] = digest
        return load(path)

    return reload


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""
