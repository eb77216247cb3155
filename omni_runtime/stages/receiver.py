"""A receiving stage: the KV receiver and its inbox, behind a small HTTP server.

HTTP (the stage's ``http`` port):
  * ``GET /health``: 200 while the KV receiver serves; 503 once it stopped, drains, or its
    thread died (the body says which: Kubernetes' liveness probe then restarts the pod, and
    ``omni_kv_transport_thread_up{thread="receiver"}`` is 0);
  * ``GET /metrics``: Prometheus text (the receiver families, ``omni_kv_receiver_*``);
  * ``GET /v1/kv``: JSON list of the payloads that arrived and are still in the inbox;
  * ``GET /v1/streams``: JSON list of the streamed inputs open or ended (a stage with a
    streamed input: stream_inbox.py); ``GET /v1/streams/<request id>?wait=SECONDS``: one
    stream once ended (its tokens in order, its outcome), waiting up to ``wait`` seconds;
  * ``GET /v1/kv/<request id>?wait=SECONDS``: the payload (found by vLLM's internal request
    id or by the client-facing one the sender named, e.g. ``cmpl-<X-Request-Id>-0``; header
    ``X-Omni-Request-Id`` gives the internal one) with its K and V as a NumPy ``.npy``
    array ``[layers, 2, kv_heads, seq_len, head_size]`` (header ``X-Omni-Seq-Len`` etc.),
    waiting up to ``wait`` seconds for it to arrive; 404 if it does not. It stays in the
    inbox (the inbox's TTL bounds its life), so several readers may fetch it.
  A ``wait`` is 0 to :data:`MAX_WAIT_S` seconds (more is taken as that; nan or negative: 400).

KV (the stage's ``kv`` port): the control channel of the KV receiver, which reads each
transfer's blocks with NIXL straight out of the AR's KV cache (docs/connector.md). It
expects the pipeline's model and revision: an AR stage of another model or revision is refused
at its hello.
A real generation stage (a diffusion model or a talker) reads the inbox in-process with
``KVInbox.get``; this stage is what the CPU demo and the tests run.
"""

from __future__ import annotations

import functools
import io
import json
import math
import logging
import signal
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlparse

from omni_runtime.pipeline.link import LinkReporter
from omni_runtime.pipeline.protocol import ProtocolError, origin_token, parse_origin
from omni_runtime.stages.config import DEFAULT_GRACE_SECONDS, StageConfig
from omni_runtime.stages.heap import freeze_startup_heap
from omni_runtime.transfers.streams import PRODUCERS_DOING, check_interval

logger = logging.getLogger(__name__)

MAX_WAIT_S = 60.0
WAIT_REFUSED = (f"wait must be a number of seconds from 0 to {MAX_WAIT_S:g} (larger is taken as "
                f"{MAX_WAIT_S:g})").encode()


def wait_seconds(query: dict[str, list[str]]) -> float | None:
    """The ``wait`` of a query (0 without one), at most :data:`MAX_WAIT_S`; None when it is
    not a number of seconds (nan waited forever: a handler thread held for good)."""
    try:
        wait = float(query.get("wait", ["0"])[0])
    except ValueError:
        return None
    if math.isnan(wait) or wait < 0:
        return None
    return min(wait, MAX_WAIT_S)
def header_value(text: str) -> str:
    """``text`` as a response header's value: as it is when it is printable ASCII, else
    percent-encoded (UTF-8), so that no value (a request id a client chose, with a line break
    or a character outside Latin-1) can end the header or break the response."""
    if text.isascii() and text.isprintable():
        return text
    return quote(text, safe=" !\"#$&'()*+,/:;<=>?@[\\]^`{|}~")


#: After a stop's drain, how long the streams' senders get to read the last acks before the
#: KV receiver closes its connections.
LAST_ANSWERS_S = 1.0


class ReceiverStage:
    def __init__(self, config: StageConfig, *, host: str,
                 grace_seconds: float = DEFAULT_GRACE_SECONDS) -> None:
        from omni_runtime.kv.transport import KVInbox, KVReceiver
        from omni_runtime.observability.receiver_metrics import ReceiverMetrics
        from omni_runtime.observability.tracing import resolve_tracer

        self.config = config
        #: On SIGTERM, how long the streams open here may run on (_drain_and_close).
        self.grace_seconds = grace_seconds
        self.host = host
        self.inbox = KVInbox()
        self.receiver = KVReceiver(
            f"tcp://{host}:{config.kv_port}",
            self.inbox,
            pipeline=config.pipeline,
            stage=config.stage,
            metrics=ReceiverMetrics(stage=config.stage, model_name=config.model_name,
                                    from_stages=config.inputs),
            # A sender of another model or pipeline revision is refused at its hello
            # (``incompatible``, counted): None (no revision in the config) checks nothing.
            expect={"model": config.model_name, "revision": config.revision},
            consumer=self._stored,
            # Its receive spans exported as the standard OTEL_* variables say (None: no-op).
            tracer=resolve_tracer(),
            streams=self._stream_message if any(e.streamed for e in config.input_edges)
            else None,
        )
        #: The streamed inputs, gathered per stream (stream_inbox.py); None without any.
        self.streams = None
        if any(e.streamed for e in config.input_edges):
            from omni_runtime.stages.stream_inbox import StreamInbox

            from prometheus_client import REGISTRY

            from omni_runtime.observability.stream_metrics import StreamMetrics

            streamed = {e.stage: e.stream for e in config.input_edges if e.streamed}
            self.streams = StreamInbox(streamed, settle=self.receiver.settle,
                                       on_start=self._stream_started, on_end=self._stream_ended)
            self._stream_metrics = StreamMetrics(
                config.stage, config.model_name, REGISTRY, from_stages=streamed)
            self.streams.ledger.add_observer(self._stream_metrics)
        # The pipeline's last stage: what it stored is the answer of the request's endpoint.
        self._links = LinkReporter(config.stage)
        self._stopping = threading.Event()
        #: SIGTERM came: /health answers 503, no new work is taken; the streams open here
        #: drain (the deadline timer runs on until ``_stopping``).
        self._draining = threading.Event()
        self._http = ThreadingHTTPServer((host, config.http_port), self._handler_class())
        self._http.daemon_threads = True

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._begin_stop())
        # Sets up NIXL (its agent, the registered staging memory) before serving: a stage
        # whose memory cannot be registered refuses to start, naming the cause.
        self.receiver.start()
        if self.streams is not None:
            threading.Thread(target=self._expire_streams, name="omni-stream-deadlines",
                             daemon=True).start()
        freeze_startup_heap()  # heap.py: no full collection of it on the receiver's thread
        logger.info(
            "stage %s/%s: receiving KV on %s, HTTP on %s:%d",
            self.config.pipeline, self.config.stage, self.receiver.endpoint, self.host,
            self.config.http_port,
        )
        try:
            self._http.serve_forever(poll_interval=0.2)
        finally:
            self.receiver.close()
            self._links.close()
            self._http.server_close()
        return 0

    def _stored(self, payload, ticket) -> None:
        """On the receiver's thread: a payload stored is held here (acked at once), and
        reported to its pipeline request's endpoint when it came from one; refused while
        the stage stops (its sender fails it at once rather than at its deadline)."""
        if self._draining.is_set():
            self.inbox.discard(payload.request_id)
            self.receiver.settle(ticket, ("stopping", f"stage {self.config.stage} is "
                                                      "stopping"))
            return
        self.receiver.settle(ticket)
        try:
            found, token = parse_origin(payload.origin), origin_token(payload.origin)
        except ProtocolError as exc:
            logger.warning("payload of request %s: its pipeline context is malformed: %s",
                           payload.request_id, exc)
            return
        if found is not None:
            request_id, endpoint = found
            self._links.report(endpoint, request_id, [
                ("taken", {"offered_at": payload.sent_at, "taken_at": payload.received_at}),
                ("payload", {"payload": payload.summary()})], token)

    # ------------------------------------------------------------------ streamed inputs
    def _stream_message(self, message, ticket) -> None:
        """On the receiver's thread: a stream's chunk (with its ticket) or its early end."""
        if ticket is None:
            self.streams.end(message)
        else:
            self.streams.arrive(message, ticket)

    def _stream_started(self, record, chunk) -> None:
        """A stream's first chunk taken: its pipeline request's link opens now, saying so,
        and stays open while the stream runs, answering the endpoint's pings (this stage
        stopped or hung mid-stream is seen there, named, within the links' heartbeat)."""
        record.offered_at = chunk.sent_at
        found = self._origin_of(record)
        if found is not None:
            (request_id, endpoint), token = found
            self._links.hold((record.request_id, record.from_stage), endpoint, request_id,
                             [self._taken(record)], token)

    @staticmethod
    def _taken(record) -> tuple[str, dict[str, float]]:
        return ("taken", {"offered_at": record.offered_at or record.started_at,
                          "taken_at": record.started_at})

    def _stream_ended(self, record) -> None:
        """A stream ended: reported to its pipeline request's endpoint, once, on the link its
        start opened (closed after it: the endpoint reads a link that closes before the
        answer as lost)."""
        found = self._origin_of(record)
        if found is None:
            return
        (request_id, endpoint), token = found
        report = functools.partial(self._links.report, endpoint, request_id, token=token,
                                   key=(record.request_id, record.from_stage))
        if record.outcome == "finished":
            report([("payload", {"payload": record.summary()})], opening=[self._taken(record)])
        else:  # an error: the producer is the stage at fault where the end was its doing
            producers = record.outcome in {o.value for o in PRODUCERS_DOING}
            which = f"to stage {self.config.stage}" if producers else f"from {record.from_stage}"
            error = {"message": f"its stream {which} ended {record.outcome}: {record.reason}"}
            if producers:
                error["stage"] = record.from_stage
            report([("error", error)])

    def _origin_of(self, record):
        """((request id, endpoint), token) of a stream's origin; None without one."""
        try:
            found = parse_origin(record.origin)
            return None if found is None else (found, origin_token(record.origin))
        except ProtocolError as exc:
            logger.warning("stream of request %s: its pipeline context is malformed: %s",
                           record.request_id, exc)
            return None

    def _expire_streams(self) -> None:
        """The streams' deadlines (a chunk that never comes), on a timer."""
        every = check_interval(self.streams.settings.values())
        while not self._stopping.wait(every):
            self.streams.expire()
            self._stream_metrics.refresh(self.streams.ledger)

    def health_problem(self) -> str | None:
        """Why the stage is not healthy, or None."""
        if self._draining.is_set():
            return "stopping"
        if not self.receiver.running:
            died = self.receiver.died
            return f"KV receiver thread died: {died}" if died else "KV receiver stopped"
        return None

    def _begin_stop(self) -> None:
        # Health turns 503 first, so a load balancer stops routing; the rest off the signal
        # handler (the drain waits, and shutdown() blocks until serve_forever returns).
        if self._draining.is_set():
            return
        if self.streams is not None:  # before health says so: no new stream after a 503
            self.streams.stop_taking(f"stage {self.config.stage} is stopping")
        self._draining.set()
        threading.Thread(target=self._drain_and_close, name="omni-stage-stop",
                         daemon=True).start()

    def _drain_and_close(self) -> None:
        """A stop: no new work (a whole hand-off or a stream's first chunk is refused, the
        stage is stopping), the streams open here run on to their end, their last chunk,
        their producer's end or a deadline, for up to the grace period (which covers the
        edges' longest streamSeconds: omni_contract.edges.drain_seconds), so that a stop (a
        rollout's, a scale-in's) never cuts a stream it could let finish; then the receiver
        closes and the HTTP loop stops. A whole transfer has nothing in flight here once
        stored (acked at once)."""
        if self.streams is not None:
            open_now = len(self.streams.open_streams())
            if open_now:
                logger.info("stopping: %d open stream(s) may run on for up to %.0fs",
                            open_now, self.grace_seconds)
            left = self.streams.wait_drained(self.grace_seconds)
            if left:
                logger.warning(
                    "stopping: %d stream(s) still open after the %.0fs grace period are cut: %s",
                    len(left), self.grace_seconds,
                    ", ".join(f"request {r.request_id} from {r.from_stage}" for r in left))
            elif open_now:
                logger.info("stopping: every open stream ended")
            if open_now:
                # The last chunks' acks are sent at once, but a sender that has not read one
                # when the connection goes loses it (ZeroMQ drops what its peer did not read),
                # and would fail a chunk this stage took: their readers get a moment.
                self._stopping.wait(LAST_ANSWERS_S)
        self.receiver.close()
        self._stopping.set()  # the deadline timer ends
        self._http.shutdown()

    def _handler_class(self):
        stage = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "omni-stage"

            def log_message(self, fmt, *args):  # request ids are in paths: keep them at debug
                logger.debug("http: " + fmt, *args)

            def _not_allowed(self):
                """Every other method: 405 naming what the stage's API takes (it was the
                standard library's HTML 501)."""
                self._send(HTTPStatus.METHOD_NOT_ALLOWED, b"this stage's HTTP API takes GET only",
                           "text/plain", {"Allow": "GET"})

            do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed

            def do_HEAD(self):
                self._send(HTTPStatus.METHOD_NOT_ALLOWED, b"", "text/plain", {"Allow": "GET"})

            def do_GET(self):
                url = urlparse(self.path)
                if url.path == "/health":
                    problem = stage.health_problem()
                    return self._send(HTTPStatus.SERVICE_UNAVAILABLE if problem else HTTPStatus.OK,
                                      (problem or "ok").encode(), "text/plain")
                if url.path == "/metrics":
                    from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

                    return self._send(HTTPStatus.OK, generate_latest(REGISTRY), CONTENT_TYPE_LATEST)
                if url.path == "/v1/kv":
                    body = json.dumps({"stage": stage.config.stage, "payloads": stage.inbox.list()})
                    return self._send(HTTPStatus.OK, body.encode(), "application/json")
                if url.path == "/v1/streams":
                    streams = stage.streams.list() if stage.streams is not None else []
                    body = json.dumps({"stage": stage.config.stage, "streams": streams})
                    return self._send(HTTPStatus.OK, body.encode(), "application/json")
                if url.path.startswith("/v1/streams/") and stage.streams is not None:
                    return self._stream(unquote(url.path[len("/v1/streams/"):]),
                                        parse_qs(url.query))
                if url.path.startswith("/v1/kv/"):
                    return self._payload(unquote(url.path[len("/v1/kv/"):]), parse_qs(url.query))
                return self._send(HTTPStatus.NOT_FOUND, b"not found", "text/plain")

            def _stream(self, request_id, query):
                wait = wait_seconds(query)
                if wait is None:
                    return self._send(HTTPStatus.BAD_REQUEST, WAIT_REFUSED, "text/plain")
                record = stage.streams.get(request_id, wait)
                if record is None:
                    return self._send(HTTPStatus.NOT_FOUND, b"no such stream (or not ended)", "text/plain")
                return self._send(HTTPStatus.OK, json.dumps(record.summary()).encode(),
                                  "application/json")

            def _payload(self, request_id, query):
                import numpy as np

                wait = wait_seconds(query)
                if wait is None:
                    return self._send(HTTPStatus.BAD_REQUEST, WAIT_REFUSED, "text/plain")
                payload = stage.inbox.get(request_id, wait, remove=False)
                if payload is None:
                    return self._send(HTTPStatus.NOT_FOUND, b"no such payload", "text/plain")
                buf = io.BytesIO()
                np.save(buf, payload.kv, allow_pickle=False)
                headers = {
                    "X-Omni-Request-Id": payload.request_id,
                    "X-Omni-Seq-Len": str(payload.seq_len),
                    "X-Omni-From-Stage": payload.from_stage,
                    # bfloat16 travels as uint16 bits: the array's dtype alone would mislead.
                    "X-Omni-Dtype": payload.dtype_name,
                }
                return self._send(HTTPStatus.OK, buf.getvalue(), "application/octet-stream", headers)

            def _send(self, status, body, content_type, headers=None):
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", content_type)
                    self.send_header("Content-Length", str(len(body)))
                    for key, value in (headers or {}).items():
                        self.send_header(key, header_value(value))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):  # the client went away
                    logger.debug("http: the client of %s went away before its answer",
                                 urlparse(self.path).path)

        return Handler
