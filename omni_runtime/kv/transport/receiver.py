"""KVReceiver: a ZeroMQ ROUTER on a background thread that validates incoming transfers,
stores them in a KVInbox and answers each one.

Invariants:
* The ``ok`` reply for a transfer is sent only after ``inbox.put`` returned: an acked payload
  is in the inbox (until consumed, expired or replaced, each counted).
* Every message gets at most one reply: ``ok``, or ``rejected`` with a code from
  ``wire.REJECT_CODES`` and a reason. Bad input of any kind (and even a bug while handling
  it) is logged, counted and answered; it never ends the thread, so transfers before,
  between and after bad ones are served.
* Only the receiver thread touches the ROUTER socket (ZeroMQ sockets are not thread-safe);
  other threads talk to it through an inproc PAIR socket (start/stop).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import zmq
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from omni_runtime.kv.transport.inbox import InboxFull, KVInbox
from omni_runtime.kv.transport.observer import NullReceiverObserver, ReceiverObserver
from omni_runtime.kv.transport.wire import Limits, Rejected, decode_transfer, encode_reply

logger = logging.getLogger(__name__)

SPAN_NAME = "omni.kv_receive"
INSTRUMENTATION_NAME = "omni_runtime.kv_connector"
DEFAULT_MAX_PAYLOAD_BYTES = 2 << 30
#: Messages queued per connected sender inside ZeroMQ before TCP back-pressure: small, so
#: the bytes buffered outside the inbox's bound stay a few payloads.
RCVHWM = 4
#: A reason is logged and answered, capped so one bad peer cannot flood the log.
MAX_REASON_CHARS = 512
_MAX_BATCH = 64  # messages handled per wake-up before timers are checked
_propagator = TraceContextTextMapPropagator()


class KVReceiver:
    """Serves ``bind`` (e.g. ``tcp://0.0.0.0:9600``; port 0 picks a free one, see
    :attr:`endpoint`) and stores valid transfers in ``inbox``.

    ``max_payload_bytes``: larger transfers are rejected ``oversized`` (with an answer);
    frames larger than ``hard_max_frame_bytes`` (default twice that) make ZeroMQ drop the
    connection before they are buffered whole, which protects memory but cannot be answered:
    the sender's timeout resolves those. ``stage``/``pipeline``: when set, transfers for
    another destination are rejected ``wrong_destination``.
    """

    def __init__(
        self,
        bind: str,
        inbox: KVInbox | None = None,
        *,
        pipeline: str = "",
        stage: str = "",
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        hard_max_frame_bytes: int | None = None,
        metrics: ReceiverObserver | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        self.bind = bind
        self.inbox = inbox if inbox is not None else KVInbox()
        self.stage = stage
        self.pipeline = pipeline
        self.limits = Limits(max_payload_bytes=max_payload_bytes, stage=stage, pipeline=pipeline)
        self.hard_max_frame_bytes = (hard_max_frame_bytes if hard_max_frame_bytes is not None
                                     else 2 * max_payload_bytes + 65536)
        self.metrics = metrics if metrics is not None else NullReceiverObserver()
        self.inbox.bind_metrics(self.metrics)
        # A no-op tracer unless a tracer provider is installed globally (or one is passed).
        self._tracer = tracer if tracer is not None else trace.get_tracer(INSTRUMENTATION_NAME)
        self._ctx = zmq.Context(io_threads=1)
        self._ctrl_addr = f"inproc://omni-kv-receiver-ctrl-{id(self)}"
        self._ctrl: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._endpoint: str | None = None
        self._closed = False
        #: Counts of what the thread did (tests and the stage's status page read them).
        self.num_delivered = 0
        self.num_rejected = 0
        self.num_replies_lost = 0
        self.num_internal_errors = 0
        #: Why the thread died (None while it runs or after a normal close()).
        self.died: str | None = None

    @property
    def endpoint(self) -> str:
        """The bound endpoint with the real port (after start())."""
        if self._endpoint is None:
            raise RuntimeError("receiver not started")
        return self._endpoint

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> KVReceiver:
        """Bind and serve on a background thread; raises here if the bind fails."""
        if self._thread is not None:
            raise RuntimeError("receiver already started")
        self._ctrl = self._ctx.socket(zmq.PAIR)
        self._ctrl.bind(self._ctrl_addr)
        self._thread = threading.Thread(target=self._run, name=f"omni-kv-receiver-{self.stage}",
                                        daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._start_error is not None:
            self._thread.join()
            self._cleanup_caller_side()
            raise self._start_error
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop serving and close the socket (idempotent). Stored payloads stay in the inbox."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None and self._thread.is_alive() and self._ctrl is not None:
            self._ctrl.send(b"stop")
            self._thread.join(timeout_s)
            if self._thread.is_alive():  # pragma: no cover - a hung handler
                logger.error("KV receiver thread did not stop within %.1fs", timeout_s)
                return
        self._cleanup_caller_side()

    def __enter__(self) -> KVReceiver:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _cleanup_caller_side(self) -> None:
        if self._ctrl is not None:
            self._ctrl.close(linger=0)
            self._ctrl = None
        self._ctx.term()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        router = ctrl = None
        try:
            router = self._ctx.socket(zmq.ROUTER)
            # Replies to a sender that went away raise (and are counted) instead of vanishing.
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            router.setsockopt(zmq.RCVHWM, RCVHWM)
            router.setsockopt(zmq.MAXMSGSIZE, self.hard_max_frame_bytes)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(self.bind)
            self._endpoint = router.getsockopt(zmq.LAST_ENDPOINT).decode()
            ctrl = self._ctx.socket(zmq.PAIR)
            ctrl.connect(self._ctrl_addr)
        except BaseException as e:  # reported to start()
            self._start_error = e
            for s in (router, ctrl):
                if s is not None:
                    s.close(linger=0)
            self._ready.set()
            return
        self._ready.set()
        logger.info("KV receiver of stage %r serving %s", self.stage, self._endpoint)
        self._report_thread(True)
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(ctrl, zmq.POLLIN)
        try:
            while True:
                wake_in = self.inbox.next_expiry_in()
                timeout_ms = 1000 if wake_in is None else min(1000, int(wake_in * 1000) + 1)
                events = dict(poller.poll(timeout_ms))
                if ctrl in events:
                    break  # the only control message is "stop"
                if router in events:
                    for _ in range(_MAX_BATCH):
                        try:
                            frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._handle(router, frames)  # never raises
                self.inbox.expire()  # TTL evictions happen even without consumer calls
        except BaseException as e:
            # Not a message's fault (those are answered in _handle): the socket or the inbox
            # broke. Say so loudly; /health and omni_kv_transport_thread_up report it.
            self.died = f"{type(e).__name__}: {e}"
            logger.exception("KV receiver thread of stage %r died", self.stage)
        finally:
            router.close(linger=0)
            ctrl.close(linger=0)
            self._report_thread(False)

    def _report_thread(self, up: bool) -> None:
        try:
            self.metrics.thread_up(up)
        except Exception:  # an observer must not decide whether the thread runs
            logger.exception("KV receiver: reporting the thread state failed")

    def _handle(self, router: zmq.Socket, frames: list[zmq.Frame]) -> None:
        """Answer one message, whatever it holds, exactly once, and never raise: a bug while
        handling one message is answered ``internal_error``, counted, and serving goes on."""
        received = time.time()
        identity = frames[0].bytes
        replied = [False]

        def reply(raw: bytes) -> None:
            if not replied[0]:
                replied[0] = True
                self._reply(router, identity, raw)

        try:
            self._handle_message(frames[1:], received, reply)
        except Exception as e:  # a bug outside the decode/store step (rejection path, span)
            self.num_internal_errors += 1
            logger.exception("KV receiver of stage %r: error handling a message", self.stage)
            if replied[0]:
                return  # answered already; the error came after (tracing): nothing to redo
            try:
                self.num_rejected += 1
                self.metrics.rejected("internal_error")
            except Exception:
                logger.exception("KV receiver: counting an internal error failed")
            # Nothing of the message is trusted here: it may be what broke the first answer.
            reply(encode_reply(transfer_id=None, request_id=None, ok=False,
                               code="internal_error",
                               reason=f"{type(e).__name__}: {e}"[:MAX_REASON_CHARS]))

    def _handle_message(self, frames: list[zmq.Frame], received: float, reply) -> None:
        header: dict | None = None
        span = None
        try:
            try:
                payload, header = decode_transfer(frames, self.limits)
                span = self._start_span(header, received)
                payload.received_at = received
                try:
                    self.inbox.put(payload)
                except InboxFull as e:
                    raise Rejected("inbox_full", str(e), header) from None
            except Rejected:
                raise
            except Exception as e:  # a bug: still answer, count, keep serving
                self.num_internal_errors += 1
                logger.exception("KV receiver: error handling a transfer")
                raise Rejected("internal_error", f"{type(e).__name__}: {e}", header) from None
        except Rejected as r:
            # The header here may be one that failed its checks: only fields read through
            # _str_field/_int_field/_trace_carrier (type-checked) are used from it.
            header = r.header if r.header is not None else header
            reason = r.reason[:MAX_REASON_CHARS]
            self.num_rejected += 1
            self.metrics.rejected(r.code)
            rid = _str_field(header, "request_id")
            logger.warning("KV receiver of stage %r rejected transfer of request %s: %s: %s",
                           self.stage, rid, r.code, reason)
            if span is None and header is not None:
                span = self._start_span(header, received)
            # Spans end before the answer (a reader of the answer sees them); never raises.
            self._end_span(span, "rejected", f"{r.code}: {reason}", r.code)
            reply(encode_reply(
                transfer_id=_int_field(header, "transfer_id"), request_id=rid, ok=False,
                code=r.code, reason=reason))
            return
        self.num_delivered += 1
        self.metrics.delivered(payload.nbytes)
        self._end_span(span, "delivered")
        reply(encode_reply(transfer_id=header["transfer_id"], request_id=payload.request_id,
                           ok=True))

    def _reply(self, router: zmq.Socket, identity: bytes, reply: bytes) -> None:
        try:
            router.send_multipart([identity, reply], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # EHOSTUNREACH: the sender is gone; Again: it reads no replies
            self.num_replies_lost += 1
            logger.warning("KV receiver: reply to a sender lost: %s", e)

    def _start_span(self, header: dict, received: float):
        """The receive span, or None if tracing fails: tracing never decides an answer."""
        try:
            carrier = _trace_carrier(header)
            parent = _propagator.extract(carrier) if carrier else None
            links = []
            if parent is not None:
                sc = trace.get_current_span(parent).get_span_context()
                if sc.is_valid:
                    links.append(Link(sc))
            attrs = {
                "gen_ai.request.id": _str_field(header, "request_id") or "",
                "omni.stage": self.stage,
                "omni.kv_receive.from_stage": _str_field(header, "from_stage") or "",
                "omni.kv_receive.pipeline": _str_field(header, "pipeline") or "",
            }
            for key in ("seq_len", "nbytes"):
                v = _int_field(header, key)
                if v is not None:
                    attrs[f"omni.kv_receive.{key}"] = v
            # A child of the sender's transfer span (same trace) and linked to it, as messaging
            # consumers do, so either view finds the sender.
            return self._tracer.start_span(SPAN_NAME, context=parent, kind=SpanKind.CONSUMER,
                                           links=links, start_time=int(received * 1e9),
                                           attributes=attrs)
        except Exception:
            logger.exception("KV receiver: starting the receive span failed")
            return None

    @staticmethod
    def _end_span(span, outcome: str, error: str | None = None, code: str | None = None) -> None:
        if span is None:
            return
        try:
            span.set_attribute("omni.kv_receive.outcome", outcome)
            if code is not None:
                span.set_attribute("omni.kv_receive.reason", code)
            if error is not None:
                span.set_status(Status(StatusCode.ERROR, error))
            span.end()
        except Exception:
            logger.exception("KV receiver: ending the receive span failed")


def _trace_carrier(header: dict | None) -> dict[str, str] | None:
    """The header's W3C trace context as str -> str entries only (an unchecked header may
    carry anything there: a rejected one is exactly such a header)."""
    ctx = header.get("trace_context") if isinstance(header, dict) else None
    if not isinstance(ctx, dict):
        return None
    carrier = {k: v for k, v in ctx.items() if isinstance(k, str) and isinstance(v, str)}
    return carrier or None


def _str_field(header: dict | None, key: str) -> str | None:
    v = header.get(key) if isinstance(header, dict) else None
    return v if isinstance(v, str) else None


def _int_field(header: dict | None, key: str) -> int | None:
    v = header.get(key) if isinstance(header, dict) else None
    return v if isinstance(v, int) and not isinstance(v, bool) else None
