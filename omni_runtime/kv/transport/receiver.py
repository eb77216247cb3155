"""KVReceiver: the receiving stage's side of the KV data plane.

One background thread owns a ZeroMQ ROUTER (the handshake: each AR rank's ``hello``,
answered with this agent's metadata) and a NIXL agent, over which every other control message
travels as a NIXL notification (protocol.py). For each ``read`` an AR rank offers, it reads the
transfer's blocks straight out of the AR's registered KV cache (NIXL READ; the AR does no
work), says ``read_done``, and stores the payload in the inbox only when the AR's verdict says
the blocks were held for the whole read (``commit``); then it answers ``ok``: the transfer's
ack. Where the bytes land:

* on the host (``staging_device="cpu"``), in the payload's own registered memory
  (landing.py), stored as read; the payload's ``[layers, 2, H, seq_len, D]`` array is
  assembled when a consumer takes it (assemble.StagedKV): on a CPU that conversion costs
  about as much as the read, and the AR's blocks need not wait for it;
* on a GPU, in a registered device staging slot a chunk at a time, each chunk assembled on
  the device into the host payload (assemble.py) before the next is read.

Invariants:
* ``ok`` is sent only after ``inbox.put`` returned: an acked payload is in the inbox (until
  consumed, expired or replaced, each counted).
* Nothing read is stored without the AR's ``commit`` for that read: bytes read from blocks
  the AR had freed (its deadline passed, a reset) are never stored (the fence; the AR decides
  after the read is complete, so a commit covers every byte of it).
* Every ``hello`` and ``read`` gets one answer (``hello_ok``; ``read_done`` then ``ok``; or
  ``rejected`` with a code from ``omni_contract.kv_wire.REJECT_CODES``), unless the transfer's time runs
  out while waiting for the verdict. Bad input of any kind (and even a bug while handling
  it) is logged, counted and answered; it never ends the thread.
* A staging slot (or landing slab) is reused only once the read into it is released; a read
  past its time is released (NIXL stops it) and its memory reused, or retired when NIXL
  refuses the release.
* Only the receiver thread touches the ROUTER, the NIXL agent and the staging slots (NIXL's
  agent is created without locking); other threads talk to it through an inproc PAIR socket.
* A message is answered where it came from: a hello on its connection, a notification with a
  notification to its agent. An agent this receiver no longer knows (forgotten while idle)
  cannot be notified: it is answered ``unknown_agent`` on the connection of its last hello,
  and says hello again.

NIXL offers nothing to wait on for notifications, only to poll: the thread polls its agent
every ``NOTIFY_POLL_MS`` while peers are active and every ``IDLE_NOTIFY_POLL_MS`` once they
have been quiet for ``NOTIFY_HOT_S`` (docs/connector.md, "The control plane and NIXL
notifications").
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import zmq
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from omni_runtime.kv.transport.assemble import StagedKV, assemble_chunk, payload_view
from omni_runtime.kv.transport.inbox import InboxFull, KVInbox
from omni_runtime.kv.transport.landing import LandingPool, LandingSlab
from omni_runtime.kv.transport.nixl_agent import DONE, ERROR, KVAgent
from omni_runtime.kv.transport.observer import NullReceiverObserver, ReceiverObserver
from omni_runtime.kv.transport.memory import PayloadPool
from omni_runtime.kv.transport.payload import DTYPES, KVPayload
from omni_runtime.kv.transport.protocol import (
    Hello,
    ReadRequest,
    Rejected,
    Reply,
    Verdict,
    addressing,
    blocks_needed,
    encode_reply,
    incompatibility,
    StreamChunk,
    StreamEnd,
    parse_chunk,
    parse_hello,
    parse_message,
    parse_read,
    parse_stream_end,
    parse_verdict,
)
from omni_runtime.kv.transport.staging import (DEFAULT_SLOTS, Slot, StagingPool,
                                               default_slot_bytes)

logger = logging.getLogger(__name__)

SPAN_NAME = "omni.kv_receive"
INSTRUMENTATION_NAME = "omni_runtime.kv_connector"
DEFAULT_MAX_PAYLOAD_BYTES = 2 << 30
#: Control messages queued per connected sender inside ZeroMQ (they are small).
RCVHWM = 1000
#: A reason is logged and answered, capped so one bad peer cannot flood the log.
MAX_REASON_CHARS = 512
_MAX_BATCH = 64  # messages handled per wake-up before reads and timers are looked at
#: How long the answers given just before a stop may take to leave the socket when it closes.
STOP_LINGER_MS = 1000
#: How often an in-flight read's state is polled (polling is what progresses it).
READ_POLL_MS = 1
#: How long a read's verdict may come after its time ran out (the AR refuses to commit past
#: its own deadline, which ends before ours: this only bounds a verdict that never comes).
VERDICT_GRACE_S = 1.0
#: A peer agent that sent nothing for this long (and has nothing in flight) is forgotten: a
#: restarted AR is a new agent, its predecessor goes.
DEFAULT_AGENT_IDLE_TTL_S = 600.0
MAX_AGENTS = 1024
#: How often the thread polls its agent for notifications while a peer spoke within
#: ``NOTIFY_HOT_S``, and after.
NOTIFY_POLL_MS = 1
IDLE_NOTIFY_POLL_MS = 10
NOTIFY_HOT_S = 1.0
#: Connections of hellos remembered (agent -> ROUTER identity), to answer an agent forgotten
#: since: a bound whatever peers send.
MAX_ROUTES = 4 * 1024
_propagator = TraceContextTextMapPropagator()

#: Where an answer goes: a ROUTER identity (bytes: the handshake connection) or a NIXL agent's
#: name (str: a notification).
Route = bytes | str


@dataclass(eq=False)
class _Peer:
    """An AR rank's NIXL agent, as its accepted hello describes it."""

    hello: Hello
    remote_name: str  # NIXL's name of the loaded agent
    regions: np.ndarray  # [layers x planes, 3]: addr, length, device
    blocks_per_region: int
    last_seen: float
    jobs: int = 0  # reads of this peer not yet finished


@dataclass(eq=False)
class _Chunk:
    layers: tuple[int, int]  # [first, end)
    blocks: tuple[int, int]  # [first, end) of the transfer's blocks, in payload order


@dataclass(frozen=True)
class Ticket:
    """A stored payload awaiting the stage that takes it as a request's input: the read it
    came by (its sender's agent and transfer id), the request, and until when (monotonic)
    the sender waits for the answer."""

    agent: str
    transfer_id: int
    request_id: str
    deadline: float

    @property
    def key(self) -> tuple[str, int]:
        return self.agent, self.transfer_id


@dataclass(eq=False)
class _Awaiting:
    """A transfer stored (or a stream's chunk) handed to the consumer, not yet answered."""

    identity: Route
    request: ReadRequest | StreamChunk
    span: Any
    nbytes: int


@dataclass(eq=False)
class _Read:
    identity: Route
    request: ReadRequest
    peer: _Peer
    read_by: float  # monotonic: the transfer's time on this side
    received: float  # unix
    span: Any
    chunks: list[_Chunk]
    kv: np.ndarray | None = None  # the payload's array (GPU staging)
    landing: LandingSlab | None = None  # where the reads land, the payload's (host)
    raw: np.ndarray | None = None  # the landing slab's array for this transfer
    next_chunk: int = 0
    slot: Slot | None = None
    handle: Any = None
    phase: str = "queued"  # queued -> reading -> verdict
    started: float = 0.0  # monotonic, when the first chunk was posted
    posted: float = 0.0  # perf_counter, when the current chunk was posted

    @property
    def key(self) -> tuple[str, int]:
        return self.request.agent, self.request.transfer_id


class KVReceiver:
    """Serves ``bind`` (e.g. ``tcp://0.0.0.0:9600``; port 0 picks a free one, see
    :attr:`endpoint`) and stores the transfers it reads in ``inbox``.

    ``max_payload_bytes``: larger transfers are refused ``oversized`` before any read.
    ``stage``/``pipeline``: when set, transfers for another destination are refused
    ``wrong_destination``. ``expect``: compatibility fields this stage knows (e.g.
    ``{"model": "Qwen/..."}``): an AR whose hello differs is refused ``incompatible``.
    ``slots``: reads in flight at once; ``slot_bytes``: the most one READ moves (on a GPU,
    ``slot_bytes`` x ``slots`` is the registered device staging; by default 64 MiB on a
    device, 256 MiB on the host, staging.py);
    ``staging_device``: ``"cpu"`` reads into host payload memory, ``"cuda:0"`` device to
    device.
    """

    def __init__(
        self,
        bind: str,
        inbox: KVInbox | None = None,
        *,
        pipeline: str = "",
        stage: str = "",
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        metrics: ReceiverObserver | None = None,
        tracer: Tracer | None = None,
        expect: dict[str, Any] | None = None,
        slot_bytes: int | None = None,
        slots: int = DEFAULT_SLOTS,
        staging_device: str = "cpu",
        agent_idle_ttl_s: float = DEFAULT_AGENT_IDLE_TTL_S,
        consumer: Callable[[KVPayload, Ticket], None] | None = None,
        streams: Callable[[StreamChunk | StreamEnd, Ticket | None], None] | None = None,
    ) -> None:
        self.bind = bind
        #: The stage that takes each stored payload (a downstream vLLM stage's input,
        #: stages/stage_input.py; a receiving stage reporting it to the pipeline): told on
        #: this thread once a whole payload is stored, with the payload (still in the inbox)
        #: and its ticket, it answers with settle(), from any thread, then or later; the
        #: transfer is acked only then ("the stage holds it"), or refused with its reason.
        #: None: acked when stored.
        self._consumer = consumer
        #: The stage that takes streamed edges' chunks (stages/stream_input.py): told on this
        #: thread of each chunk with its ticket, answered with settle() as a payload is (the
        #: chunk is acked once its request holds it); and of each stream_end (no ticket).
        #: None: chunks are refused, this stage takes no stream.
        self._streams = streams
        self._awaiting: dict[tuple[str, int], _Awaiting] = {}
        self._awaiting_deadlines: dict[tuple[str, int], float] = {}  # monotonic
        self._settled: deque[tuple[Ticket, tuple[str, str] | None]] = deque()
        self.inbox = inbox if inbox is not None else KVInbox()
        self.stage = stage
        self.pipeline = pipeline
        self.max_payload_bytes = max_payload_bytes
        self.expect = dict(expect or {})
        if slot_bytes is None:
            slot_bytes = default_slot_bytes(staging_device)
        self.slot_bytes, self.slots, self.staging_device = slot_bytes, slots, staging_device
        self.agent_idle_ttl_s = agent_idle_ttl_s
        self.metrics = metrics if metrics is not None else NullReceiverObserver()
        self.inbox.bind_metrics(self.metrics)
        #: Payload memory, re-used once consumers drop what they took (memory.py); pinned
        #: when the assembly runs on a GPU (each payload is copied to it from the device).
        self.pool = PayloadPool(max_bytes=self.inbox.max_bytes,
                                pinned=staging_device.startswith("cuda"))
        self.inbox.bind_allocator(self.pool.empty)
        # A no-op tracer unless a tracer provider is installed globally (or one is passed).
        self._tracer = tracer if tracer is not None else trace.get_tracer(INSTRUMENTATION_NAME)
        self._ctx = zmq.Context(io_threads=1)
        self._ctrl_addr = f"inproc://omni-kv-receiver-ctrl-{id(self)}"
        self._ctrl: zmq.Socket | None = None
        self._ctrl_lock = threading.Lock()  # close() and settle() share the caller's end
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._endpoint: str | None = None
        self._closed = False
        self._agent: KVAgent | None = None
        self._staging: StagingPool | None = None
        self._landing: LandingPool | None = None  # host staging only
        self._peers: OrderedDict[str, _Peer] = OrderedDict()  # least recently seen first
        #: Each agent's last hello's connection (ROUTER identity), least recent first.
        self._routes: OrderedDict[str, bytes] = OrderedDict()
        self._hot_until = 0.0  # monotonic: until when notifications are polled often
        self._reads: dict[tuple[str, int], _Read] = {}
        self._queue: deque[_Read] = deque()  # waiting for a staging slot
        #: Counts of what the thread did (tests and the stage's status page read them).
        self.num_delivered = 0
        self.num_rejected = 0
        self.num_replies_lost = 0
        self.num_internal_errors = 0
        self.num_aborted = 0
        #: Seconds the thread spent with READs posted (post to DONE seen) and assembling
        #: (on a GPU; benchmarks split a transfer's time with them).
        self.read_seconds = 0.0
        self.assemble_seconds = 0.0
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

    @property
    def known_agents(self) -> list[str]:
        return list(self._peers)

    def start(self) -> KVReceiver:
        """Set up NIXL (agent, registered staging), bind, and serve on a background thread;
        raises here if any of it fails (a receiving stage then refuses to start)."""
        if self._thread is not None:
            raise RuntimeError("receiver already started")
        name = f"{self.pipeline or 'omni'}.{self.stage or 'receiver'}.{uuid.uuid4().hex[:12]}"
        self._agent = KVAgent(name)
        self._staging = StagingPool(self._agent, slot_bytes=self.slot_bytes, slots=self.slots,
                                    device=self.staging_device)
        if not self._staging.on_device:
            self._landing = LandingPool(self._agent, max_free_bytes=self.inbox.max_bytes)
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
            with self._ctrl_lock:
                self._ctrl.send(b"stop")
            self._thread.join(timeout_s)
            if self._thread.is_alive():  # pragma: no cover - a hung handler
                logger.error("KV receiver thread did not stop within %.1fs", timeout_s)
                return
        self._cleanup_caller_side()

    def settle(self, ticket: Ticket, refusal: tuple[str, str] | None = None) -> None:
        """The consumer's answer about a stored payload (any thread): taken (None: the
        transfer is acked), or refused with (code, reason) (the transfer fails with it; the
        payload is dropped). An answer after the transfer's time ran out is ignored: the
        receiver has answered ``deadline`` then."""
        self._settled.append((ticket, refusal))
        ctrl = self._ctrl
        if ctrl is not None:
            with self._ctrl_lock:
                if not ctrl.closed:
                    ctrl.send(b"settle")

    def __enter__(self) -> KVReceiver:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _cleanup_caller_side(self) -> None:
        if self._ctrl is not None:
            with self._ctrl_lock:
                self._ctrl.close(linger=0)
            self._ctrl = None
        self._ctx.term()
        if self._agent is not None:
            self._agent.close()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        router = ctrl = None
        try:
            router = self._ctx.socket(zmq.ROUTER)
            # Replies to a sender that went away raise (and are counted) instead of vanishing.
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            router.setsockopt(zmq.RCVHWM, RCVHWM)
            router.setsockopt(zmq.MAXMSGSIZE, 8 << 20)
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
        logger.info("KV receiver of stage %r serving %s (NIXL agent %s)", self.stage,
                    self._endpoint, self._agent.name)
        self._report_thread(True)
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(ctrl, zmq.POLLIN)
        linger_ms = 0
        try:
            while True:
                events = dict(poller.poll(self._timeout_ms()))
                if ctrl in events:
                    if self._stop_asked(ctrl):
                        # The consumer's answers given before the stop still go out (a
                        # stopping stage's last acks), with a moment to leave the socket.
                        if self._settled:
                            self._answer_settled(router)
                            linger_ms = STOP_LINGER_MS
                        break
                    self._answer_settled(router)
                if router in events:
                    for _ in range(_MAX_BATCH):
                        try:
                            frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._handle(router, frames)  # never raises
                if self._routes:  # an agent that said hello may notify (even once forgotten)
                    notes = self._agent.notifications()
                    if notes:
                        self._hot_until = time.monotonic() + NOTIFY_HOT_S
                    for source, raw in notes:
                        self._on_notification(router, source, raw)  # never raises
                self._advance(router)
                if self._landing is not None:
                    self._landing.collect()  # slabs of payloads consumers assembled
                self._expire(router, time.monotonic())
                self.inbox.expire()  # TTL evictions happen even without consumer calls
            if linger_ms:
                self._flush_notifications(linger_ms)
        except BaseException as e:
            # Not a message's fault (those are answered in _handle): the socket, NIXL or the
            # inbox broke. Say so loudly; /health and omni_kv_transport_thread_up report it.
            self.died = f"{type(e).__name__}: {e}"
            logger.exception("KV receiver thread of stage %r died", self.stage)
        finally:
            self._drop_all_reads()
            if self._landing is not None:
                self._landing.close()
            router.close(linger=linger_ms)
            ctrl.close(linger=0)
            self._report_thread(False)

    def _flush_notifications(self, linger_ms: int) -> None:
        """Progress the agent for a moment so that the answers given last leave it (a
        notification goes out as its sender's agent progresses; this one has no thread)."""
        until = time.monotonic() + min(linger_ms, 50) / 1000
        while time.monotonic() < until:
            self._agent.progress()
            time.sleep(0.001)

    @staticmethod
    def _stop_asked(ctrl: zmq.Socket) -> bool:
        """Drain the control socket: whether "stop" was among its messages (the others,
        "settle", only wake the thread)."""
        stop = False
        while True:
            try:
                stop |= ctrl.recv(zmq.NOBLOCK) == b"stop"
            except zmq.Again:
                return stop

    def _answer_settled(self, router: zmq.Socket) -> None:
        """The consumer's answers: ``ok`` for a payload taken, ``rejected`` for one refused."""
        while self._settled:
            ticket, refusal = self._settled.popleft()
            waiting = self._awaiting.pop(ticket.key, None)
            self._awaiting_deadlines.pop(ticket.key, None)
            if waiting is None:
                logger.info("KV receiver of stage %r: the input of request %s was answered "
                            "after its transfer's time ran out", self.stage, ticket.request_id)
                continue
            req = waiting.request
            if isinstance(req, StreamChunk):  # counted by the stream's own figures
                self._reply(router, waiting.identity, Reply(
                    "ok", req.transfer_id, req.request_id) if refusal is None else Reply(
                    "rejected", req.transfer_id, req.request_id, code=refusal[0],
                    reason=refusal[1][:MAX_REASON_CHARS]))
                continue
            if refusal is not None:
                self.inbox.discard(req.request_id)
                self._reject(router, waiting.identity, refusal[0], refusal[1],
                             req.transfer_id, req.request_id, waiting.span, req.from_stage)
                continue
            self._delivered(router, waiting.identity, req, waiting.span, waiting.nbytes)

    def _delivered(self, router: zmq.Socket, identity: Route, req: ReadRequest, span: Any,
                   nbytes: int) -> None:
        self.num_delivered += 1
        self.metrics.delivered(nbytes, req.from_stage)
        self._end_span(span, "delivered")
        self._reply(router, identity, Reply("ok", req.transfer_id, req.request_id))

    def _timeout_ms(self) -> int:
        if self._queue and self._staging.available:
            return 0  # a read to start (one per pass: _advance)
        if any(r.phase == "reading" for r in self._reads.values()):
            return READ_POLL_MS
        now = time.monotonic()
        if self._routes and (now < self._hot_until or self._reads or self._awaiting):
            return NOTIFY_POLL_MS
        wake = [r.read_by for r in self._reads.values()]
        if self._awaiting:
            wake.append(min(self._awaiting_deadlines.values()))
        if self._peers:
            wake.append(next(iter(self._peers.values())).last_seen + self.agent_idle_ttl_s)
        expiry = self.inbox.next_expiry_in()
        if expiry is not None:
            wake.append(now + expiry)
        longest = IDLE_NOTIFY_POLL_MS if self._routes else 1000
        if not wake:
            return longest
        return max(0, min(longest, int((min(wake) - now) * 1000) + 1))

    def _report_thread(self, up: bool) -> None:
        try:
            self.metrics.thread_up(up)
        except Exception:  # an observer must not decide whether the thread runs
            logger.exception("KV receiver: reporting the thread state failed")

    # ------------------------------------------------------------------ messages
    def _handle(self, router: zmq.Socket, frames: list[zmq.Frame]) -> None:
        """A message on the handshake connection: a hello is taken; any other is checked as
        it would be as a notification, then refused ``unknown_agent`` (it comes as a
        notification from an agent whose hello was accepted)."""
        identity = frames[0].bytes
        self._message(router, identity, [f.buffer for f in frames[1:]])

    def _on_notification(self, router: zmq.Socket, source: str, raw: bytes) -> None:
        """A notification from agent ``source``: any message but a hello."""
        self._message(router, source, [raw])

    def _message(self, router: zmq.Socket, route: Route, frames: list) -> None:
        """Handle one message, answering it at most once, and never raise: a bug while
        handling one message is answered ``internal_error``, counted, and serving goes on."""
        received = time.time()
        handshake = isinstance(route, bytes)
        tid = rid = None
        try:
            kind, body, rest = parse_message(frames)
            tid, rid = addressing(body)
            if kind == "hello":
                if not handshake:
                    raise Rejected("bad_frames", "a hello comes on the handshake connection, "
                                                 "not as a notification")
                self._on_hello(router, route, parse_hello(body, rest))
                return
            parse = {"read": parse_read, "verdict": parse_verdict, "chunk": parse_chunk,
                     "stream_end": parse_stream_end}.get(kind)
            if parse is None:
                raise Rejected("malformed", f"unknown message type {kind!r}")
            message = parse(body, rest)
            if handshake:
                raise Rejected("unknown_agent", f"a {kind} comes as a NIXL notification from an "
                                                "agent whose hello was accepted; this connection "
                                                "takes hellos (say hello first)")
            if message.agent != route and message.agent in self._peers:
                # One agent may not speak for another (commit its reads, say, or end its
                # streams); one unknown here is answered unknown_agent by its handler.
                raise Rejected("malformed", f"agent {route} sent a {kind} of agent "
                                            f"{message.agent}")
            if kind == "read":
                self._on_read(router, route, message, received)
            elif kind == "verdict":
                self._on_verdict(router, route, message)
            elif kind == "chunk":
                self._on_chunk(router, route, message)
            else:
                self._on_stream_end(router, route, message)
        except Rejected as r:
            self._reject(router, route, r.code, r.reason,
                         r.transfer_id if r.transfer_id is not None else tid,
                         r.request_id if r.request_id is not None else rid)
        except Exception as e:  # a bug: still answer, count, keep serving
            self.num_internal_errors += 1
            logger.exception("KV receiver of stage %r: error handling a message", self.stage)
            self._reject(router, route, "internal_error", f"{type(e).__name__}: {e}", tid, rid)

    def _reject(self, router, identity: Route, code: str, reason: str, tid: int | None,
                rid: str | None, span: Any = None, from_stage: str | None = None,
                read: ReadRequest | None = None) -> None:
        """Refuse a message (``read``: the read it refuses, when it is one). A refused shard
        of a tensor-parallel transfer ends its attempt here (KVInbox.abandon), but for
        ``unknown_agent``, which the sender answers with a new hello and the same offer."""
        reason = reason[:MAX_REASON_CHARS]
        if read is not None and read.num_shards > 1 and code != "unknown_agent":
            self.inbox.abandon(read.request_id, read.attempt, read.num_shards,
                               f"{code}: {reason}")
        self.num_rejected += 1
        try:
            self.metrics.rejected(code, from_stage)
        except Exception:
            logger.exception("KV receiver: counting a rejection failed")
        logger.warning("KV receiver of stage %r rejected %s: %s: %s", self.stage,
                       f"transfer of request {rid}" if rid else "a message", code, reason)
        self._end_span(span, "rejected", f"{code}: {reason}", code)
        self._reply(router, identity, Reply("rejected", tid, rid, code=code, reason=reason))

    def _reply(self, router: zmq.Socket, identity: Route, reply: Reply) -> None:
        """Answer on the route the message came by: a notification to an agent known here, else
        the connection of the agent's last hello (an agent forgotten since), else nowhere."""
        if isinstance(identity, str):
            if identity in self._peers:
                try:
                    self._agent.notify(identity, encode_reply(reply))
                except Exception as e:  # the agent went away
                    self.num_replies_lost += 1
                    logger.warning("KV receiver: reply to agent %s lost: %s", identity, e)
                return
            connection = self._routes.get(identity)
            if connection is None:
                self.num_replies_lost += 1
                logger.warning("KV receiver: no way to answer agent %s (never said hello)",
                               identity)
                return
            identity = connection
        frames = [identity, encode_reply(reply)]
        if reply.kind == "hello_ok":
            frames.append(self._agent.metadata())  # so the AR can notify this agent
        try:
            router.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as e:  # EHOSTUNREACH: the sender is gone; Again: it reads no replies
            self.num_replies_lost += 1
            logger.warning("KV receiver: reply to a sender lost: %s", e)

    def _on_hello(self, router: zmq.Socket, identity: Route, hello: Hello) -> None:
        self._check_destination(hello.pipeline, hello.to_stage)
        problem = incompatibility(hello.compat, self.expect)
        if problem is not None:
            raise Rejected("incompatible", f"stage {hello.from_stage} (agent {hello.agent}): "
                                           f"{problem}")
        peer = self._peers.get(hello.agent)
        if peer is not None and (peer.hello.compat_hash != hello.compat_hash
                                 or peer.hello.metadata != hello.metadata):
            raise Rejected("incompatible", f"agent {hello.agent} said hello before with "
                                           "other memory or compatibility fields")
        if peer is None:
            self._make_room_for_a_peer()
            try:
                name = self._agent.add_remote(hello.metadata)
            except Exception as e:
                raise Rejected("malformed", f"NIXL refused the agent metadata of "
                                            f"{hello.agent}: {type(e).__name__}: {e}") from None
            if name != hello.agent:
                # Peers are kept by the hello's name, NIXL's remote agents by the metadata's:
                # two peers on one remote agent would share it, and forgetting one (idle, or
                # to make room) would unload the other's, whose reads would then all fail.
                if all(p.remote_name != name for p in self._peers.values()):
                    self._agent.remove_remote(name)
                raise Rejected("malformed", f"the agent metadata of {hello.agent} is agent "
                                            f"{name}'s")
            regions = np.array([[r.addr, r.length, r.device] for r in hello.regions],
                               dtype=np.uint64)
            peer = _Peer(hello, name, regions,
                         min(r.length for r in hello.regions) // hello.block_format.block_bytes,
                         time.monotonic())
            self._peers[hello.agent] = peer
            logger.info("KV receiver of stage %r: agent %s of stage %s (shard %d of %d) "
                        "said hello", self.stage, hello.agent, hello.from_stage, hello.shard,
                        hello.num_shards)
        self._seen(peer)
        self._routes[hello.agent] = identity
        self._routes.move_to_end(hello.agent)
        while len(self._routes) > MAX_ROUTES:
            self._routes.popitem(last=False)
        self._hot_until = time.monotonic() + NOTIFY_HOT_S
        self._reply(router, identity, Reply("hello_ok", conn=hello.conn))

    def _check_destination(self, pipeline: str, to_stage: str) -> None:
        if self.stage and to_stage != self.stage:
            raise Rejected("wrong_destination", f"sent to stage {to_stage!r}, this is "
                                                f"{self.stage!r}")
        if self.pipeline and pipeline and pipeline != self.pipeline:
            raise Rejected("wrong_destination", f"sent for pipeline {pipeline!r}, this is "
                                                f"{self.pipeline!r}")

    def _stream_peer(self, agent: str, pipeline: str, to_stage: str) -> None:
        """A stream message's sender checked as a read's is: a stage that takes streams, the
        right destination, an agent whose hello was accepted here."""
        if self._streams is None:
            raise Rejected("input_refused", f"stage {self.stage or '?'} takes no streamed "
                                            "input (its inputs are fed whole)")
        self._check_destination(pipeline, to_stage)
        peer = self._peers.get(agent)
        if peer is None:
            raise Rejected("unknown_agent", f"agent {agent} has not said hello")
        self._seen(peer)

    def _on_chunk(self, router: zmq.Socket, identity: Route, chunk: StreamChunk) -> None:
        self._stream_peer(chunk.agent, chunk.pipeline, chunk.to_stage)
        if chunk.compat_hash != self._peers[chunk.agent].hello.compat_hash:
            raise Rejected("incompatible", "the chunk's compat_hash is not its agent's")
        key = (chunk.agent, chunk.transfer_id)
        awaiting = self._awaiting.get(key)
        if awaiting is not None:  # re-sent on a new connection: answered there, once
            awaiting.identity = identity
            return
        deadline = time.monotonic() + chunk.deadline_in_s
        ticket = Ticket(chunk.agent, chunk.transfer_id, chunk.request_id, deadline)
        self._awaiting[key] = _Awaiting(identity, chunk, None, 0)
        self._awaiting_deadlines[key] = deadline + VERDICT_GRACE_S
        try:
            self._streams(chunk, ticket)
        except Exception as e:  # a bug in the consumer: this chunk alone fails
            logger.exception("KV receiver of stage %r: the stream consumer failed", self.stage)
            self._settled.append((ticket, ("internal_error", f"{type(e).__name__}: {e}")))

    def _on_stream_end(self, router: zmq.Socket, identity: Route, end: StreamEnd) -> None:
        self._stream_peer(end.agent, end.pipeline, end.to_stage)
        self._streams(end, None)
        self._reply(router, identity, Reply("ok", end.transfer_id, end.request_id))

    def _make_room_for_a_peer(self) -> None:
        if len(self._peers) < MAX_AGENTS:
            return
        for agent, peer in self._peers.items():  # least recently seen first
            if peer.jobs == 0:
                self._forget(agent, "the receiver keeps at most "
                                    f"{MAX_AGENTS} agents (least recently seen goes)")
                return
        raise Rejected("malformed", f"{MAX_AGENTS} agents have reads in flight here")

    def _seen(self, peer: _Peer) -> None:
        peer.last_seen = time.monotonic()
        self._peers.move_to_end(peer.hello.agent)

    def _forget(self, agent: str, why: str) -> None:
        peer = self._peers.pop(agent)
        self._agent.remove_remote(peer.remote_name)
        logger.info("KV receiver of stage %r forgot agent %s: %s", self.stage, agent, why)

    def _on_read(self, router: zmq.Socket, identity: Route, req: ReadRequest,
                 received: float) -> None:
        ids = {"transfer_id": req.transfer_id, "request_id": req.request_id}
        awaiting = self._awaiting.get((req.agent, req.transfer_id))
        if awaiting is not None:
            # Read, stored and with its consumer (the AR re-sends what was in flight when
            # its connection dropped): the answer goes on the new connection, once.
            awaiting.identity = identity
            return
        existing = self._reads.get((req.agent, req.transfer_id))
        if existing is not None:
            # The same read again (the AR re-sends what was in flight when its connection
            # dropped): answer on the new connection, do not read twice.
            existing.identity = identity
            if existing.phase == "verdict":
                self._reply(router, identity, Reply("read_done", req.transfer_id,
                                                    req.request_id))
            return
        span = self._start_span(req, received)
        try:
            self._check_destination(req.pipeline, req.to_stage)
            peer = self._peers.get(req.agent)
            if peer is None:
                raise Rejected("unknown_agent", f"no hello from agent {req.agent} (say hello "
                                                "again)", **ids)
            self._seen(peer)
            hello = peer.hello
            if req.compat_hash != hello.compat_hash:
                raise Rejected("incompatible", f"compat_hash {req.compat_hash} differs from "
                                               f"the hello's {hello.compat_hash}", **ids)
            if (req.shard, req.num_shards) != (hello.shard, hello.num_shards):
                raise Rejected("malformed", f"shard {req.shard} of {req.num_shards}: the "
                                            f"agent's hello says {hello.shard} of "
                                            f"{hello.num_shards}", **ids)
            fmt = hello.block_format
            needed = blocks_needed(req.seq_len, fmt.block_size)
            if req.num_blocks != needed:
                raise Rejected("malformed", f"runs cover {req.num_blocks} blocks, seq_len "
                                            f"{req.seq_len} needs {needed}", **ids)
            for first, count in req.runs:
                if first + count > peer.blocks_per_region:
                    raise Rejected("malformed", f"blocks {first}..{first + count - 1} are "
                                                f"outside the {peer.blocks_per_region} "
                                                "registered blocks", **ids)
            nbytes = (hello.compat.num_layers * 2 * fmt.num_kv_heads * req.seq_len
                      * fmt.head_size * fmt.itemsize)
            if nbytes > self.max_payload_bytes:
                raise Rejected("oversized", f"{nbytes} bytes > limit {self.max_payload_bytes}",
                               **ids)
            # Counting the room this transfer already holds there (its first shards'
            # reservation, or the stored payload a resend replaces): a shard or a resend that
            # put() would store must not be refused here.
            if not self.inbox.has_room(req.request_id, req.attempt, req.num_shards, nbytes):
                raise Rejected("inbox_full", f"{nbytes} bytes do not fit: {self.inbox.bytes} "
                                             f"of {self.inbox.max_bytes} bytes used", **ids)
            if req.deadline_in_s <= 0:
                raise Rejected("deadline", "the transfer's time ran out before it arrived",
                               **ids)
            if req.num_shards > 1 and (why := self.inbox.abandoned(
                    req.request_id, req.attempt, req.num_shards, req.shard)) is not None:
                raise Rejected("shard_mismatch", why, **ids)
            # Inside the try: a block larger than a staging slot is refused here, and the
            # refusal ends the receive span with it (outside, the span never ended).
            chunks = self._plan(hello, needed)
        except Rejected as r:
            self._reject(router, identity, r.code, r.reason, req.transfer_id, req.request_id,
                         span, req.from_stage, req)
            return
        job = _Read(identity, req, peer, time.monotonic() + req.deadline_in_s, received, span,
                    chunks)
        peer.jobs += 1
        self._reads[job.key] = job
        self._queue.append(job)

    def _plan(self, hello: Hello, blocks: int) -> list[_Chunk]:
        """The chunks a transfer is read in: as many whole layers as fit a slot, or, for a
        layer larger than a slot, as many of its blocks as fit."""
        layers = hello.compat.num_layers
        planes = hello.block_format.planes
        block_bytes = hello.block_format.block_bytes
        per_slot = self._staging.slot_bytes // (planes * block_bytes)  # blocks of every plane
        if per_slot < 1:
            raise Rejected("oversized", f"a block of {planes} x {block_bytes} bytes does not "
                                        f"fit a {self._staging.slot_bytes}-byte staging slot")
        if blocks <= per_slot:
            step = max(1, per_slot // blocks)
            return [_Chunk((l, min(l + step, layers)), (0, blocks))
                    for l in range(0, layers, step)]
        return [_Chunk((l, l + 1), (b, min(b + per_slot, blocks)))
                for l in range(layers) for b in range(0, blocks, per_slot)]

    def _on_verdict(self, router: zmq.Socket, identity: Route, verdict: Verdict) -> None:
        job = self._reads.get((verdict.agent, verdict.transfer_id))
        if job is None or job.phase != "verdict":
            # A verdict for a read this receiver gave up on (its time ran out): nothing to do.
            logger.info("KV receiver of stage %r: verdict for transfer %s of agent %s, which "
                        "waits for none", self.stage, verdict.transfer_id, verdict.agent)
            return
        payload = self._payload(job)
        self._finish(job)
        req = job.request
        if not verdict.commit:
            self.num_aborted += 1
            self._reject(router, identity, "deadline", f"the sender aborted the read: "
                         f"{verdict.reason}", req.transfer_id, req.request_id, job.span,
                         req.from_stage, req)
            return
        try:
            stored = self.inbox.put(payload)
        except InboxFull as e:
            self._reject(router, identity, "inbox_full", str(e), req.transfer_id,
                         req.request_id, job.span, req.from_stage, req)
            return
        except Rejected as r:  # a shard that does not fit its transfer's other shards
            self._reject(router, identity, r.code, r.reason, req.transfer_id, req.request_id,
                         job.span, req.from_stage, req)
            return
        if stored is not None and self._consumer is not None:
            ticket = Ticket(req.agent, req.transfer_id, req.request_id, job.read_by)
            self._awaiting[ticket.key] = _Awaiting(identity, req, job.span, payload.nbytes)
            self._awaiting_deadlines[ticket.key] = job.read_by + VERDICT_GRACE_S
            try:
                self._consumer(stored, ticket)
            except Exception as e:  # a bug in the consumer: this transfer alone fails
                logger.exception("KV receiver of stage %r: the consumer failed", self.stage)
                self._settled.append((ticket, ("internal_error", f"{type(e).__name__}: {e}")))
            self._answer_settled(router)  # what it answered at once goes out at once
            return
        self._delivered(router, identity, req, job.span, payload.nbytes)

    def _payload(self, job: _Read) -> KVPayload:
        req, hello = job.request, job.peer.hello
        staged = None
        if job.raw is not None:
            fmt = hello.block_format
            staged = StagedKV(job.raw, fmt, hello.compat.num_layers,
                              blocks_needed(req.seq_len, fmt.block_size), req.seq_len)
        return KVPayload(
            request_id=req.request_id, seq_len=req.seq_len, kv=job.kv, staged=staged,
            pipeline=req.pipeline, from_stage=req.from_stage, trace_context=req.trace_context,
            extra={"attempt": req.attempt, "block_size": hello.block_format.block_size},
            dtype=hello.block_format.dtype, to_stage=req.to_stage, sent_at=req.sent_at,
            received_at=job.received, external_request_id=req.external_request_id,
            shard=req.shard, num_shards=req.num_shards, token_ids=req.token_ids,
            prompt_len=req.prompt_len, origin=req.origin, model=hello.compat.model,
        )

    # ------------------------------------------------------------------ reads
    def _advance(self, router: zmq.Socket) -> None:
        """Move posted reads on as NIXL completes them; start the next queued read on a free
        slot.

        One read is started per pass, and its completion looked at at once: on the host,
        UCX's ``cma`` copies inside the post, so the read is done when the post returns.
        Answering it then (``read_done``), and going back to the socket before the next
        read is started (the loop polls without waiting while reads are queued), lets its
        verdict and ``ok`` travel while the next one copies. Started all together, even
        the first transfer of a burst waited for every queued read's copy (docs/connector.md,
        "Figures behind the design"). Reads the backend runs asynchronously (a GPU's) still
        overlap: the next pass starts the next one without waiting."""
        self._move_reads_on(router)
        if self._queue and self._staging.available:
            self._start(router, self._queue.popleft())
            self._move_reads_on(router)

    def _move_reads_on(self, router: zmq.Socket) -> None:
        """Each posted read NIXL completed: its next chunk posted, or ``read_done`` said."""
        for job in [j for j in self._reads.values() if j.phase == "reading"]:
            state = self._agent.state(job.handle)
            if state == DONE:
                done = time.perf_counter()
                self.read_seconds += done - job.posted
                self._agent.release(job.handle)  # done: nothing more lands, whatever it says
                job.handle = None
                try:
                    self._chunk_read(job)
                except Exception as e:
                    self.num_internal_errors += 1
                    logger.exception("KV receiver: assembling a transfer failed")
                    self._fail(router, job, "internal_error", f"{type(e).__name__}: {e}")
                    continue
                job.next_chunk += 1
                if job.next_chunk < len(job.chunks):
                    self._post(router, job)
                else:
                    self._staging.release(job.slot)
                    job.slot = None
                    job.phase = "verdict"
                    self._reply(router, job.identity, Reply("read_done",
                                                            job.request.transfer_id,
                                                            job.request.request_id))
            elif state == ERROR:
                self._fail(router, job, "read_failed",
                           f"NIXL could not read the blocks of agent {job.request.agent}")

    def _start(self, router: zmq.Socket, job: _Read) -> None:
        """The queued ``job`` takes a slot and its payload memory, and its first chunk is
        posted."""
        job.slot = self._staging.acquire()
        job.phase = "reading"
        job.started = time.monotonic()
        try:
            if self._landing is not None:
                job.landing, job.raw = self._landing.take(self._raw_bytes(job))
            else:
                job.kv = self.pool.empty(self._shape(job),
                                         DTYPES[job.peer.hello.block_format.dtype])
        except Exception as e:  # no memory, or NIXL refused to register it
            self._fail(router, job, "inbox_full", f"cannot allocate the payload: "
                                                  f"{type(e).__name__}: {e}")
            return
        self._post(router, job)

    @staticmethod
    def _shape(job: _Read) -> tuple[int, ...]:
        hello = job.peer.hello
        fmt = hello.block_format
        return (hello.compat.num_layers, 2, fmt.num_kv_heads, job.request.seq_len,
                fmt.head_size)

    @staticmethod
    def _raw_bytes(job: _Read) -> int:
        """The transfer's bytes as read: every layer's planes' blocks (a partial last block
        whole)."""
        fmt = job.peer.hello.block_format
        blocks = blocks_needed(job.request.seq_len, fmt.block_size)
        return job.peer.hello.compat.num_layers * fmt.planes * blocks * fmt.block_bytes

    def _post(self, router: zmq.Socket, job: _Read) -> None:
        """Post the READ of the job's next chunk: into its slot (device staging), or into
        its place in the transfer's landing slab (host). None once the transfer's time is
        over here: the AR's deadline ends first, so it would only answer the read abort."""
        if time.monotonic() > job.read_by:
            self._time_ran_out(router, job)
            return
        chunk = job.chunks[job.next_chunk]
        fmt = job.peer.hello.block_format
        block_bytes = fmt.block_bytes
        (l0, l1), (b0, b1) = chunk.layers, chunk.blocks
        segments = _segments(job.request.runs, b0, b1)  # (payload block, cache block, count)
        remote, local = [], []
        regions = job.peer.regions
        planes = fmt.planes
        # The staged order (layer, plane, block): of the whole transfer in its landing slab
        # (host), of this chunk in its slot (device).
        if job.landing is not None:
            base, row0, block0 = job.landing.addr, 0, 0
            blocks = blocks_needed(job.request.seq_len, fmt.block_size)
        else:
            base, blocks, row0, block0 = job.slot.addr, b1 - b0, l0 * planes, b0
        for layer in range(l0, l1):
            for plane in range(planes):
                row = layer * planes + plane
                addr, _, device = (int(x) for x in regions[row])
                for payload_block, first, count in segments:
                    remote.append((addr + first * block_bytes, count * block_bytes, device))
                    local.append((base + ((row - row0) * blocks + payload_block - block0)
                                  * block_bytes, count * block_bytes, self._staging.device_id))
        job.posted = time.perf_counter()
        try:
            job.handle = self._agent.read(
                np.array(local, dtype=np.uint64), self._staging.mem_type,
                np.array(remote, dtype=np.uint64), job.peer.hello.mem_type,
                job.peer.remote_name)
        except Exception as e:
            self._fail(router, job, "read_failed", f"NIXL refused the read of agent "
                                                   f"{job.request.agent}: {type(e).__name__}: {e}")

    def _chunk_read(self, job: _Read) -> None:
        """The job's current chunk is read: on a GPU, assemble it into the payload now (its
        slot is read into next); on the host the bytes are where they stay."""
        if job.kv is not None:
            started = time.perf_counter()
            self._assemble(job)
            self.assemble_seconds += time.perf_counter() - started

    def _assemble(self, job: _Read) -> None:
        chunk = job.chunks[job.next_chunk]
        fmt = job.peer.hello.block_format
        (l0, l1), (b0, b1) = chunk.layers, chunk.blocks
        t0, t1 = b0 * fmt.block_size, min(b1 * fmt.block_size, job.request.seq_len)
        out = payload_view(job.kv, fmt.dtype)[l0:l1, :, :, t0:t1]
        assemble_chunk(job.slot.tensor, fmt, l1 - l0, b1 - b0, t1 - t0, out)

    def _time_ran_out(self, router: zmq.Socket, job: _Read) -> None:
        where = "waiting for a staging slot" if job.phase == "queued" else "reading"
        self._fail(router, job, "deadline", f"the transfer's time ran out {where}")

    def _fail(self, router: zmq.Socket, job: _Read, code: str, reason: str) -> None:
        self._finish(job)
        self._reject(router, job.identity, code, reason, job.request.transfer_id,
                     job.request.request_id, job.span, job.request.from_stage, job.request)

    def _finish(self, job: _Read) -> None:
        """The job leaves: its slot back (or retired), its peer's count down."""
        self._reads.pop(job.key, None)
        if job in self._queue:
            self._queue.remove(job)
        if job.slot is not None:
            if job.handle is None or self._agent.release(job.handle):
                self._staging.release(job.slot)
            else:
                self._staging.retire(job.slot)
                if job.landing is not None:
                    self._landing.retire(job.landing)
            job.slot = job.handle = None
        job.kv = job.landing = job.raw = None
        job.peer.jobs -= 1

    def _expire(self, router: zmq.Socket, now: float) -> None:
        if self._awaiting_deadlines:
            for key in [k for k, at in self._awaiting_deadlines.items() if now > at]:
                waiting = self._awaiting.pop(key)
                del self._awaiting_deadlines[key]
                req = waiting.request
                if not isinstance(req, StreamChunk):
                    self.inbox.discard(req.request_id)
                self._reject(router, waiting.identity, "deadline", "the stage did not take "
                             "the input within the transfer's time", req.transfer_id,
                             req.request_id, waiting.span, req.from_stage)
        for job in list(self._reads.values()):
            if job.phase == "verdict":
                if now > job.read_by + VERDICT_GRACE_S:
                    self._fail(router, job, "deadline", "no verdict from the sender within "
                                                        "the transfer's time")
            elif now > job.read_by:
                self._time_ran_out(router, job)
        while self._peers:
            agent, peer = next(iter(self._peers.items()))
            if now - peer.last_seen < self.agent_idle_ttl_s:
                break
            if peer.jobs:
                self._peers.move_to_end(agent)
                break
            self._forget(agent, f"idle for {self.agent_idle_ttl_s:g}s")

    def _drop_all_reads(self) -> None:
        for job in list(self._reads.values()):
            try:
                self._finish(job)
                self._end_span(job.span, "rejected", "receiver stopped", "internal_error")
            except Exception:
                logger.exception("KV receiver: dropping a read at exit failed")

    # ------------------------------------------------------------------ tracing
    def _start_span(self, req: ReadRequest, received: float):
        """The receive span, or None if tracing fails: tracing never decides an answer."""
        try:
            carrier = req.trace_context
            parent = _propagator.extract(carrier) if carrier else None
            links = []
            if parent is not None:
                sc = trace.get_current_span(parent).get_span_context()
                if sc.is_valid:
                    links.append(Link(sc))
            attrs = {
                "gen_ai.request.id": req.request_id,
                "omni.stage": self.stage,
                "omni.kv_receive.from_stage": req.from_stage,
                "omni.kv_receive.pipeline": req.pipeline,
                "omni.kv_receive.seq_len": req.seq_len,
                "omni.kv_receive.blocks": req.num_blocks,
            }
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


def _segments(runs: tuple[tuple[int, int], ...], b0: int, b1: int) -> list[tuple[int, int, int]]:
    """The runs' part covering payload blocks [b0, b1): (payload block, cache block, count)."""
    out = []
    start = 0
    for first, count in runs:
        lo, hi = max(start, b0), min(start + count, b1)
        if lo < hi:
            out.append((lo, first + lo - start, hi - lo))
        start += count
        if start >= b1:
            break
    return out
