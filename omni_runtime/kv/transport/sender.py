"""KVSender: an AR rank's control side of the KV data plane.

The bytes stay where they are: the receiving stages read them with NIXL from this rank's
registered KV cache. The sender says hello to each receiver over one ZeroMQ connection (the
handshake: the answer carries the receiver's NIXL metadata, and the connection's events tell
a receiver lost or restarted); then it offers each transfer to every downstream stage (a
``read`` descriptor, a NIXL notification, protocol.py), answers each receiver's ``read_done``
with the fence's verdict, and reports each transfer's outcome to the caller (the connector's
worker half).

Delivery semantics (docs/connector.md):
* ``acked``: every endpoint's receiver read the blocks, was told ``commit``, stored the payload
  and said ``ok``. Nothing else acks.
* ``failed`` (with a reason): an endpoint refused it (its code and reason) or refused this
  rank's hello (an incompatible AR: every transfer to that stage fails, loudly), an endpoint
  stayed unreachable until the deadline, or no ack came before the deadline
  (``send_timeout_s`` from submit(), queueing included), or the sender was closed first.
* Each submitted transfer is reported exactly once, with its attempt, unless a newer
  submit() of the same request id supersedes it or :meth:`cancel` withdraws it.

The fence (the block guarantee at a distance): a receiver's ``read_done`` is answered
``commit`` only if the transfer is still current (not resolved, superseded or cancelled) and
before its deadline, under the same lock as :meth:`cancel`. The scheduler frees a transfer's
blocks only after this rank answered it, at its own (later) deadline, or after cancelling it
here before the blocks can be written again; the read was complete before ``read_done`` was
sent. So a committed read read blocks that were held, unchanged, for all of it.

Replicas: a downstream stage's address may name several receivers (a headless Service's name
resolves to every ready pod). Each resolved address is an endpoint of its own, with its own
connection and hello, and each transfer goes to one replica of each stage: the one that
rendezvous hashing of its request id picks among the stage's replicas, so every tensor-parallel
rank of the request picks the same one (the receiver assembles its shards) and a stage's
replicas share the requests. A stream goes where its first chunk went, for its life. The name
is resolved again every ``RESOLVE_INTERVAL_S`` on a thread of its own (DNS may be slow; the
I/O thread never waits for it): a new replica takes new requests at once; one no longer
resolved (scaled in, or not ready) takes nothing new and is closed once nothing of it is left
(a draining pod finishes its streams); one whose connection is lost gives its queued whole
transfers to the others. An IP address is its one replica, as before.

Threads: the caller's API may be called from any thread. Only the I/O thread touches the
DEALER sockets and the NIXL agent. The receivers' answers are notifications, which NIXL
offers to poll, not to wait on: the I/O thread polls the agent every ``NOTIFY_POLL_MS`` while
anything is in flight (nothing comes unasked otherwise). UCX's TCP transport serves remote
reads only while the agent makes progress: NIXL's own thread makes it for an agent that has
one (the AR's, ``KVAgent(progress_thread=True)``); for one without, that polling does, and
the thread progresses the agent while a hello waits. submit() hands it work through a deque
and wakes it over an inproc PAIR whose two ends are connected before the thread starts, so no
wake-up is lost, whatever the threads' start order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import ipaddress
import itertools
import logging
import os
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping

import zmq
from zmq.utils.monitor import recv_monitor_message

from omni_runtime.kv.transport.protocol import (
    Hello,
    ReadRequest,
    Reply,
    StreamChunk,
    StreamEnd,
    Verdict,
    decode_reply,
    encode_chunk,
    encode_hello,
    encode_read,
    encode_stream_end,
    encode_verdict,
)

logger = logging.getLogger(__name__)

DEFAULT_SEND_TIMEOUT_S = 10.0
DEFAULT_MAX_IN_FLIGHT = 64
RECONNECT_IVL_MS = 100
# Detects a peer that vanished without closing its connection (a node lost), so its queued
# sends stop waiting for it: ZMTP heartbeats every second, dead after ten missed. A peer that
# only pauses (a long GC pause, a frozen cgroup) for less keeps its connection, and so its
# streams, which go on only on the connection their first chunk took; its transfers'
# deadlines, not this, bound how long a send waits for it.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 10_000
#: While anything is in flight, the I/O thread polls the agent for the receivers' answers this
#: often (which also progresses an agent without a thread of its own: UCX's TCP transport
#: serves reads of this rank's memory only then). Each poll costs the AR's CPU and a longer
#: period delays every answer (docs/connector.md, "The control plane and NIXL notifications").
NOTIFY_POLL_MS = 1
#: ... and this long after a transfer in flight expired: a receiver's late ``read_done`` still
#: gets its verdict (``abort``), so the receiver lets the read go at once rather than when its
#: own time runs out. (A transfer answered, or withdrawn while in flight, stays in flight
#: until its answer comes: nothing else comes late.)
LATE_ANSWER_S = 2.0
#: How long close() waits for the I/O thread beyond the linger time.
CLOSE_JOIN_S = 10.0
#: How often a stage's address (a name) is resolved again for its replicas: about how long a
#: replica scaled out waits for its first request, and one gone for its last.
RESOLVE_INTERVAL_S = 5.0
_MONITOR_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED


@dataclass(frozen=True)
class Offer:
    """One transfer, as the receivers are told of it (the blocks stay in the cache)."""

    request_id: str
    attempt: int
    seq_len: int
    runs: tuple[tuple[int, int], ...]  # (first block id, count), in payload order
    nbytes: int  # the payload's size (for the bytes histogram)
    external_request_id: str = ""
    trace_context: dict[str, str] | None = None
    #: What the hand-off carries besides the KV (protocol.ReadRequest's fields of the names).
    token_ids: tuple[int, ...] = ()
    prompt_len: int = 0
    origin: dict[str, str] | None = None


@dataclass(frozen=True)
class ChunkOffer:
    """One chunk of a stream to one stage (protocol.StreamChunk's fields of the names), or,
    with ``end`` set to an outcome, the stream's early end (protocol.StreamEnd)."""

    request_id: str
    seq: int
    last: bool = False
    token_ids: tuple[int, ...] = ()
    prompt_len: int = 0
    produced_at: float = 0.0
    external_request_id: str = ""
    trace_context: dict[str, str] | None = None
    origin: dict[str, str] | None = None
    end: str | None = None
    reason: str = ""


@dataclass(eq=False)
class _Transfer:
    tid: int
    offer: Offer | ChunkOffer
    deadline: float  # monotonic
    timeout: float
    waiting: set[str]  # stages that have not said ok yet
    sent_at: float = 0.0  # unix, when first offered
    sent_to: set[str] = field(default_factory=set)
    done: bool = False  # reported, superseded or cancelled: no further report, no commit
    placed: dict[str, _Endpoint] = field(default_factory=dict)  # stage -> its replica

    @property
    def chunk(self) -> bool:
        """A stream's message to its one stage (answered in poll_chunks()), not a transfer."""
        return isinstance(self.offer, ChunkOffer)


@dataclass(eq=False)
class _Endpoint:
    """One replica of a downstream stage: its resolved address and connection."""

    stage: str
    address: str
    socket: zmq.Socket
    monitor: zmq.Socket | None = None
    queue: deque[_Transfer] = field(default_factory=deque)  # not yet offered, submit order
    in_flight: dict[int, _Transfer] = field(default_factory=dict)  # offered, no final answer
    connections: int = 0  # handshakes so far; the current hello names it
    ready: bool = False  # the receiver accepted this connection's hello
    refused: str | None = None  # why the receiver refused this connection's hello
    #: No longer resolved: takes nothing new, closed once nothing of it is left.
    retiring: bool = False
    #: It said it is stopping (a ``stopping`` refusal): takes nothing new until a new
    #: connection's hello (a new process there).
    stopping: bool = False
    #: The receiver's NIXL agent (from this connection's hello_ok): where messages go.
    peer: str | None = None
    #: (stage, request id) of the streams pinned here.
    streams: set[tuple[str, str]] = field(default_factory=set)


@dataclass(eq=False)
class _Stage:
    """A downstream stage: its address as configured and its replicas as resolved."""

    name: str
    address: str  # tcp://host:port
    replicas: dict[str, _Endpoint] = field(default_factory=dict)  # address -> endpoint
    #: Transfers that wait for a replica (the name has resolved to none yet).
    unplaced: deque[_Transfer] = field(default_factory=deque)
    #: Why the name did not resolve, the last time it did not.
    unresolved: str | None = None


class Unanswered(str):
    """The reason of a transfer given up because no answer came before its deadline (the
    receiver unreachable, hung or stopped): its outcome is ``expired``, not ``failed``."""

    __slots__ = ()


def split_address(address: str) -> tuple[str, int]:
    """(host, port) of ``tcp://host:port`` or ``host:port`` (an IPv6 host in brackets);
    ValueError naming the form otherwise (another scheme too: the hello rides ZeroMQ over
    TCP, and any other would fail only on the I/O thread)."""
    scheme, sep, rest = address.partition("://")
    host, _, port = (rest if sep else address).rpartition(":")
    if (sep and scheme != "tcp") or not host.strip("[]") or not port.isdigit() \
            or not 0 < int(port) < 65536 or any(c.isspace() or c in "/?#@" for c in host):
        raise ValueError(f"a KV address must be tcp://HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def resolve_replicas(address: str) -> list[str]:
    """The replicas' addresses of ``tcp://host:port``: the address itself for an IP, else
    one for each address the name resolves to (a headless Service: every ready pod);
    OSError when it does not resolve."""
    host, port = split_address(address)
    try:
        ipaddress.ip_address(host)
        return [address]
    except ValueError:
        pass
    found = sorted({info[4][0] for info in socket.getaddrinfo(host, port,
                                                              type=socket.SOCK_STREAM)})
    return [f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}" for ip in found]


def _weight(request_id: str, replica: str) -> bytes:
    return hashlib.blake2b(f"{request_id}\0{replica}".encode(), digest_size=8).digest()


class KVSender:
    """Offers each submitted transfer to every stage of ``endpoints`` ({stage: zmq
    address}); ``hello``: this rank's hello (its ``to_stage`` and ``conn`` are filled in per
    endpoint and connection); ``agent``: the NIXL agent whose memory the receivers read and whose
    notifications carry the control messages. ``max_in_flight``: offered, unanswered transfers per
    endpoint. ``observe_bytes``: called with each acked transfer's size; ``on_edge``: called
    once per transfer and endpoint as that edge resolves, with ``(request id, attempt, stage,
    outcome, payload bytes)``, outcome ``acked``, ``failed`` or ``expired`` (the per-edge
    metrics); ``on_thread_state``: True when the I/O thread starts, False when it ends (all
    from that thread). ``io_cpus``: the CPUs of the I/O thread and ZeroMQ's (keep them off
    the engine's OpenMP cores). ``resolve``: a stage's address -> its replicas' addresses
    (:func:`resolve_replicas`; OSError when it does not resolve), called again every
    ``resolve_interval_s`` for an address that names a host."""

    def __init__(
        self,
        endpoints: Mapping[str, str],
        *,
        hello: Hello,
        agent: Any = None,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
        observe_bytes: Callable[[int], None] | None = None,
        on_edge: Callable[[str, int, str, str, int], None] | None = None,
        on_thread_state: Callable[[bool], None] | None = None,
        io_cpus: Collection[int] | None = None,
        resolve: Callable[[str], list[str]] = resolve_replicas,
        resolve_interval_s: float = RESOLVE_INTERVAL_S,
    ) -> None:
        if not endpoints:
            raise ValueError("KVSender needs at least one endpoint")
        if agent is None:
            raise ValueError("KVSender needs the NIXL agent whose memory the receivers read "
                             "(its control messages travel as that agent's notifications)")
        if max_in_flight < 1 or send_timeout_s <= 0:
            raise ValueError("max_in_flight must be >= 1 and send_timeout_s > 0")
        self.endpoints = dict(endpoints)
        self.hello = hello
        self.agent = agent
        self.stage = hello.from_stage
        self.max_in_flight = max_in_flight
        self.send_timeout_s = send_timeout_s
        self._observe_bytes = observe_bytes
        self._on_edge = on_edge
        self._on_thread_state = on_thread_state
        self._tids = itertools.count(1)
        #: (deadline, transfer id, transfer) of unresolved transfers; the I/O thread's only.
        self._deadlines: list[tuple[float, int, _Transfer]] = []
        # Caller-side state, all under _lock.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._submitted: deque[_Transfer] = deque()
        self._latest: dict[str, _Transfer] = {}  # unresolved request id -> its newest transfer
        self._answers: dict[str, tuple[int, str | None]] = {}
        #: Streams' chunks sent and unanswered (by transfer id), and their answers not polled.
        self._chunks: dict[int, _Transfer] = {}
        self._chunk_answers: list[tuple[str, str, int, str | None]] = []
        #: (stage, request id) -> the replica the stream's first chunk went to, and the
        #: connection (that endpoint's handshake count) it went on (_keeps_its_replica).
        self._stream_ep: dict[tuple[str, str], _Endpoint] = {}
        self._stream_conn: dict[tuple[str, str], int] = {}
        # Replicas: the resolver thread's answers for the I/O thread, under _lock.
        self._resolve = resolve
        self.resolve_interval_s = resolve_interval_s
        self._resolved: dict[str, tuple[list[str] | None, str | None]] = {}
        self._resolved_version = 1  # counts the resolver's changes
        self._taken_version = 0  # the I/O thread's: the version it has followed
        self._resolve_stop = threading.Event()
        names = {}
        for stage, address in self.endpoints.items():
            host, _ = split_address(address)  # a malformed address fails here, named
            try:
                ipaddress.ip_address(host)
                self._resolved[stage] = ([address], None)
            except ValueError:
                names[stage] = address
        #: The I/O thread's own: the stages, every replica's endpoint, its poller.
        self._stages: dict[str, _Stage] = {}
        self._eps: list[_Endpoint] = []
        self._poller: zmq.Poller | None = None
        self._by_socket: dict[zmq.Socket, _Endpoint] = {}
        self._by_monitor: dict[zmq.Socket, _Endpoint] = {}
        #: The receivers' agents: name -> the endpoint whose hello_ok named it.
        self._by_peer: dict[str, _Endpoint] = {}
        self._closing_deadline: float | None = None
        self._late_until = 0.0  # monotonic: answers are polled for until then (LATE_ANSWER_S)
        self._dead: str | None = None  # why the I/O thread is gone (then submit fails at once)
        # Its notifications are this sender's answers (one sender an agent); before any socket,
        # so that a refusal leaves nothing open.
        agent.claim(self)
        self._ctx = zmq.Context(io_threads=1)
        self.io_cpus = sorted(io_cpus) if io_cpus else None
        if self.io_cpus:
            # Before the first socket: ZeroMQ starts its I/O thread with the first socket.
            for cpu in self.io_cpus:
                self._ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)
        # Both ends of the wake-up pipe exist before the thread starts (a wake-up sent to a
        # PAIR with no peer yet would be dropped); the thread owns its end from then on.
        wake_addr = f"inproc://omni-kv-sender-wake-{id(self)}"
        self._wake = self._ctx.socket(zmq.PAIR)
        self._wake.setsockopt(zmq.SNDHWM, 0)  # wake-ups never block or drop
        self._wake.bind(wake_addr)
        self._wake_rx = self._ctx.socket(zmq.PAIR)
        self._wake_rx.connect(wake_addr)
        self._wake_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"omni-kv-sender-{self.stage}",
                                        daemon=True)
        self._thread.start()
        self._resolver = None
        if names:
            self._resolver = threading.Thread(target=self._resolve_loop, args=(names,),
                                              name=f"omni-kv-resolver-{self.stage}", daemon=True)
            self._resolver.start()

    # ------------------------------------------------------------------ caller API
    def submit(self, offer: Offer, timeout_s: float | None = None,
               to_stages: Collection[str] | None = None) -> None:
        """Offer a transfer to every endpoint (or those of ``to_stages``: a stage fed by a
        stream takes no whole transfer); returns at once, never raises for network trouble
        (poll() reports it). ``timeout_s`` overrides ``send_timeout_s``."""
        with self._lock:
            tid = next(self._tids)
            timeout = self.send_timeout_s if timeout_s is None else max(0.0, timeout_s)
            stages = set(self.endpoints) if to_stages is None else set(to_stages) & set(
                self.endpoints)
            t = _Transfer(tid, offer, time.monotonic() + timeout, timeout, stages)
            old = self._latest.get(offer.request_id)
            if old is not None:
                old.done = True  # superseded: never reported, never committed
            self._answers.pop(offer.request_id, None)  # an unpolled answer of an older attempt
            self._latest[offer.request_id] = t
            queued = self._queue_locked(t)
        if queued:
            self._kick()
            return
        for stage in sorted(t.waiting):  # refused at once: every edge failed
            self._edge(t, stage, "failed")

    def _queue_locked(self, t: _Transfer) -> bool:
        """Hand ``t`` to the I/O thread (the caller kicks it), or answer it at once when the
        sender is closing or its thread is gone; whether it was queued."""
        if self._dead or self._closing_deadline is not None:
            self._report_locked(t, self._dead or "sender closed")
            return False
        self._submitted.append(t)
        return True

    def submit_chunk(self, chunk: ChunkOffer, to_stage: str, timeout_s: float) -> None:
        """Send a stream's chunk (or its early end) to ``to_stage``; its answer comes from
        poll_chunks(): acked once the stage's request holds it, else why not (a refusal,
        no ack within ``timeout_s``, the sender closing)."""
        with self._lock:
            t = _Transfer(next(self._tids), chunk, time.monotonic() + max(0.0, timeout_s),
                          max(0.0, timeout_s), {to_stage} & set(self.endpoints))
            if not t.waiting:
                self._report_locked(t, f"no endpoint for stage {to_stage}")
                return
            self._chunks[t.tid] = t
            queued = self._queue_locked(t)
        if queued:
            self._kick()

    def poll_chunks(self) -> list[tuple[str, str, int, str | None]]:
        """Chunk answers since the last call: (request id, stage, seq, None when acked else
        the reason); an early end's answer is not reported."""
        with self._lock:
            answers, self._chunk_answers = self._chunk_answers, []
            return answers

    def cancel(self, request_id: str, attempt: int) -> bool:
        """Withdraw the transfer of ``request_id`` (attempt ``attempt`` or earlier): the
        scheduler resolved it itself and may re-use its blocks. From now on no receiver's
        read of it is committed. True if one was withdrawn."""
        with self._lock:
            t = self._latest.get(request_id)
            if t is None or t.offer.attempt > attempt:
                return False
            t.done = True
            del self._latest[request_id]
            return True

    def poll(self) -> dict[str, tuple[int, str | None]]:
        """Answers since the last poll(), without blocking: {request id: (attempt, None when
        acked else the reason)}; a reason that is :class:`Unanswered` means no answer came
        before the deadline."""
        with self._lock:
            answers, self._answers = self._answers, {}
            return answers

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until an answer is ready for poll(); whether one is."""
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._answers or self._chunk_answers),
                                       timeout_s)

    def pending(self) -> int:
        """Transfers and chunks submitted and not yet resolved (reported answers not
        counted)."""
        with self._lock:
            return len(self._latest) + len(self._chunks)

    def replicas(self) -> dict[str, list[str]]:
        """Each stage's replicas as last resolved (what new transfers are spread over)."""
        with self._lock:
            return {stage: list(found or ()) for stage, (found, _) in self._resolved.items()}

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def died(self) -> str | None:
        """Why the I/O thread ended abnormally, or None (running, or closed on purpose)."""
        with self._lock:
            dead = self._dead
        return dead if dead is not None and dead != "sender closed" else None

    def close(self, linger_s: float = 0.0) -> None:
        """Stop taking transfers, give unresolved ones up to ``linger_s`` to resolve, then
        fail the rest ("sender closed") and close the sockets. Idempotent, never raises."""
        with self._lock:
            if self._closing_deadline is None:
                self._closing_deadline = time.monotonic() + max(0.0, linger_s)
        self._resolve_stop.set()
        self._kick()
        self._thread.join(max(0.0, linger_s) + CLOSE_JOIN_S)
        if self._thread.is_alive():  # pragma: no cover - a hung I/O thread: leave its sockets
            logger.error("KV sender I/O thread did not stop; leaving its sockets open")
            return
        with self._wake_lock:
            if not self._wake.closed:
                self._wake.close(linger=0)
                # destroy, not term: a thread that died mid-way may have left sockets open.
                self._ctx.destroy(linger=0)

    def __enter__(self) -> KVSender:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ caller helpers
    def _kick(self) -> None:
        with self._wake_lock:
            if not self._wake.closed:
                try:
                    self._wake.send(b"", zmq.NOBLOCK)
                except zmq.ZMQError:
                    # The I/O thread's end is gone (it ended): its exit resolved every transfer.
                    pass

    def _report_locked(self, t: _Transfer, failure: str | None) -> bool:
        """Record ``t``'s answer once, unless superseded or cancelled; whether it was."""
        if t.done:
            return False
        t.done = True
        rid = t.offer.request_id
        if t.chunk:
            self._chunks.pop(t.tid, None)
            if t.offer.end is None:
                stage = next(iter(t.waiting), "") if t.waiting else next(iter(t.sent_to), "")
                self._chunk_answers.append((rid, stage, t.offer.seq, failure))
                self._cond.notify_all()
            return True
        if self._latest.get(rid) is t:
            del self._latest[rid]
        self._answers[rid] = (t.offer.attempt, failure)
        self._cond.notify_all()
        return True

    def _report(self, t: _Transfer, failure: str | None, edges: str = "failed") -> None:
        """Report ``t``'s answer (once); a failure also ends each edge still waiting, as
        ``edges`` (another edge's failure, the deadline, the sender closing)."""
        with self._lock:
            reported = self._report_locked(t, failure)
        if reported and t.chunk and (failure is not None or t.offer.last or t.offer.end):
            for stage in t.sent_to | t.waiting:  # the stream is over on this edge
                key = (stage, t.offer.request_id)
                self._stream_conn.pop(key, None)
                ep = self._stream_ep.pop(key, None)
                if ep is not None:
                    ep.streams.discard(key)
        if not reported or t.chunk:
            return
        if failure is not None:
            for stage in sorted(t.waiting):
                self._edge(t, stage, edges)
            t.waiting.clear()
            # The scheduler logs the transfer's resolution (once, however many ranks).
            logger.debug("KV transfer of request %s failed: %s", t.offer.request_id, failure)
        elif self._observe_bytes is not None:
            try:
                self._observe_bytes(t.offer.nbytes)
            except Exception:  # metrics must never break delivery
                logger.exception("observe_bytes failed")

    def _edge(self, t: _Transfer, stage: str, outcome: str) -> None:
        """One edge of ``t`` resolved (once per edge: callers drop it from ``t.waiting``)."""
        if self._on_edge is None or t.chunk:  # a stream's figures are its ledger's
            return
        try:
            self._on_edge(t.offer.request_id, t.offer.attempt, stage, outcome,
                          t.offer.nbytes if outcome == "acked" else 0)
        except Exception:  # metrics must never break delivery
            logger.exception("on_edge failed")

    def _current(self, t: _Transfer) -> bool:
        with self._lock:
            return not t.done

    # ------------------------------------------------------------------ the I/O thread
    def _run(self) -> None:
        if self.io_cpus:
            try:
                os.sched_setaffinity(0, self.io_cpus)  # this thread only (Linux)
            except (OSError, AttributeError) as e:
                logger.warning("KV sender: cannot bind the I/O thread to CPUs %s: %s",
                               self.io_cpus, e)
        wake = self._wake_rx
        self._report_thread(True)
        reason = "sender closed"
        try:
            self._poller = zmq.Poller()
            self._poller.register(wake, zmq.POLLIN)
            self._stages = {stage: _Stage(stage, address)
                            for stage, address in self.endpoints.items()}
            self._take_resolved()
            self._loop(wake)
        except BaseException as e:  # a bug; fail everything, loudly, and say so
            logger.exception("KV sender I/O thread died")
            reason = f"sender I/O thread died: {type(e).__name__}: {e}"
        finally:
            # Whatever broke above, every unresolved transfer is resolved and the sockets are
            # closed, so close() and the caller's poll() still work.
            self._resolve_stop.set()
            with self._lock:
                self._dead = reason
                leftovers = list(self._submitted) + list(self._latest.values()) + list(
                    self._chunks.values())
                self._submitted.clear()
            for t in leftovers:
                try:
                    self._report(t, reason)
                except Exception:  # pragma: no cover - keep resolving the rest
                    logger.exception("KV sender: resolving a transfer at exit failed")
            eps, self._eps = self._eps, []
            for ep in eps:
                if ep.peer is not None:
                    self._unload(ep.peer)
                if ep.monitor is not None:
                    ep.monitor.close(linger=0)
                ep.socket.close(linger=0)
            wake.close(linger=0)
            self.agent.unclaim(self)
            self._report_thread(False)

    # ------------------------------------------------------------------ replicas
    def _resolve_loop(self, names: Mapping[str, str]) -> None:
        """The resolver thread: each named stage's replicas now, then every
        ``resolve_interval_s``; a change goes to the I/O thread. A name that does not
        resolve keeps the replicas it had (a DNS hiccup is not a scale-in)."""
        while True:
            changed = False
            for stage, address in names.items():
                try:
                    found: list[str] | None = list(self._resolve(address))
                    why = None
                except Exception as e:  # noqa: BLE001 - any failure to resolve is an answer
                    found, why = None, f"{type(e).__name__}: {e}"
                if found is not None and not found:
                    found, why = None, "it resolved to no address"
                with self._lock:
                    before = self._resolved.get(stage)
                    if found is None and before is not None and before[0] is not None:
                        found = before[0]  # keep what was resolved, and say why not now
                    if before != (found, why):
                        self._resolved[stage] = (found, why)
                        self._resolved_version += 1
                        changed = True
            if changed:
                self._kick()
            if self._resolve_stop.wait(self.resolve_interval_s):
                return

    def _take_resolved(self) -> None:
        """Follow the resolver: an endpoint for each new replica, retire those no longer
        resolved, then place what waited for a replica."""
        with self._lock:
            if self._resolved_version == self._taken_version:
                return  # nothing new (the usual wake-up: a submit)
            self._taken_version = self._resolved_version
            resolved = dict(self._resolved)
        for stage, (found, why) in resolved.items():
            st = self._stages[stage]
            st.unresolved = why
            if found is None:
                continue
            for address in found:
                ep = st.replicas.get(address)
                if ep is None:
                    self._add_replica(st, address)
                elif ep.retiring:
                    ep.retiring = False
                    logger.info("KV sender: replica %s of stage %s resolved again", address,
                                stage)
            for address, ep in list(st.replicas.items()):
                if address not in found and not ep.retiring:
                    ep.retiring = True
                    logger.info("KV sender: replica %s of stage %s no longer resolved: it "
                                "takes no new transfers", address, stage)
                    self._rehome(ep, lost=False)
            if st.unplaced and self._live(st):
                waiting, st.unplaced = st.unplaced, deque()
                for t in waiting:
                    self._place(st, t)

    def _add_replica(self, st: _Stage, address: str) -> _Endpoint:
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IMMEDIATE, 1)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        s.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        s.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        ep = _Endpoint(st.name, address, s)
        ep.monitor = s.get_monitor_socket(_MONITOR_EVENTS)
        st.replicas[address] = ep
        self._eps.append(ep)
        self._by_socket[s] = ep
        self._by_monitor[ep.monitor] = ep
        self._poller.register(s, zmq.POLLIN)
        self._poller.register(ep.monitor, zmq.POLLIN)
        s.connect(address)
        if len(st.replicas) > 1:
            logger.info("KV sender: stage %s has %d replicas (new: %s)", st.name,
                        len(st.replicas), address)
        return ep

    def _drop_replica(self, ep: _Endpoint) -> None:
        st = self._stages[ep.stage]
        st.replicas.pop(ep.address, None)
        self._eps.remove(ep)
        if ep.peer is not None:
            self._unload(ep.peer)
        for sock, table in ((ep.socket, self._by_socket), (ep.monitor, self._by_monitor)):
            table.pop(sock, None)
            self._poller.unregister(sock)
            sock.close(linger=0)
        logger.info("KV sender: replica %s of stage %s closed", ep.address, ep.stage)

    @staticmethod
    def _live(st: _Stage) -> list[_Endpoint]:
        """The replicas that take new transfers."""
        return [ep for ep in st.replicas.values()
                if not ep.retiring and not ep.stopping and ep.refused is None]

    def _place(self, st: _Stage, t: _Transfer) -> None:
        """Queue ``t`` at one replica of ``st``: a stream's chunk where its first went; else
        the replica rendezvous hashing picks for the request among those that take new work
        (every rank picks the same); every replica stopping: one of them (it refuses at once,
        naming why); no replica yet: it waits (``unplaced``) until one resolves or its
        deadline."""
        if not self._current(t):
            return
        rid = t.offer.request_id
        if t.chunk and t.offer.seq > 0 or t.chunk and t.offer.end is not None:
            ep = self._stream_ep.get((st.name, rid))
            if ep is not None:
                if st.replicas.get(ep.address) is not ep or ep.retiring and not ep.ready:
                    self._report(t, f"replica {ep.address} of stage {st.name}, which holds "
                                    "this stream, is gone")
                    return
                t.placed[st.name] = ep
                ep.queue.append(t)
                return
            if t.offer.end is None:
                self._report(t, f"this stream's first chunk did not go to stage {st.name}")
                return
        live = self._live(st)
        if not live:
            refused = [ep.refused for ep in st.replicas.values()
                       if not ep.retiring and ep.refused is not None]
            if refused:
                self._report(t, f"stage {st.name} refused this sender: {refused[0]}")
                return
            # Every replica is stopping: one refuses it at once, naming why, rather than it
            # wait for a replica to its deadline.
            live = [ep for ep in st.replicas.values() if ep.stopping and not ep.retiring]
            if not live:
                st.unplaced.append(t)
                return
        ep = max(live, key=lambda e: _weight(rid, e.address))
        if t.chunk and t.offer.end is None:  # a stream's first chunk: the stream lives here
            key = (st.name, rid)
            self._stream_ep[key] = ep
            ep.streams.add(key)
        t.placed[st.name] = ep
        ep.queue.append(t)

    def _rehome(self, ep: _Endpoint, lost: bool) -> None:
        """Give ``ep``'s queued whole transfers to the stage's other replicas; its chunks
        stay (their streams live there and a draining replica finishes them). ``lost``: its
        connection is gone for good, so its transfers in flight go too, and its chunks fail."""
        st = self._stages[ep.stage]
        moving = [t for t in ep.queue if lost or not t.chunk]
        kept = deque(t for t in ep.queue if not lost and t.chunk)
        ep.queue = kept
        if lost:
            moving += [ep.in_flight.pop(tid) for tid in sorted(ep.in_flight)]
        for t in moving:
            if not self._current(t):
                continue
            if t.chunk:
                self._report(t, f"the connection to replica {ep.address} of stage {ep.stage}, "
                                "which holds this stream, was lost")
                continue
            t.placed.pop(ep.stage, None)
            t.sent_to.discard(ep.stage)
            self._place(st, t)

    def _elsewhere(self, ep: _Endpoint, t: _Transfer) -> bool:
        """A replica that is stopping refused ``t`` (a whole hand-off, or a new stream's
        first chunk; it finishes the streams it holds): it takes nothing new from now on,
        and ``t`` goes to another replica of the stage, if there is one. Whether it did."""
        if not ep.stopping:
            ep.stopping = True
            logger.info("KV sender: replica %s of stage %s is stopping: it takes no new "
                        "transfers", ep.address, ep.stage)
        st = self._stages[ep.stage]
        if t.chunk and t.offer.seq > 0 or not self._live(st):
            return False
        del ep.in_flight[t.tid]
        if t.chunk:  # the stream had not begun there: it begins where it goes now
            key = (ep.stage, t.offer.request_id)
            ep.streams.discard(key)
            self._stream_ep.pop(key, None)
            self._stream_conn.pop(key, None)
        t.placed.pop(ep.stage, None)
        t.sent_to.discard(ep.stage)
        self._place(st, t)
        return True

    def _retire_idle(self) -> None:
        """Close each retiring replica with nothing of it left."""
        for ep in [e for e in self._eps if e.retiring]:
            if not ep.queue and not ep.in_flight and not ep.streams:
                self._drop_replica(ep)

    def _report_thread(self, up: bool) -> None:
        if self._on_thread_state is None:
            return
        try:
            self._on_thread_state(up)
        except Exception:  # metrics must never decide whether the thread runs
            logger.exception("on_thread_state failed")

    def _loop(self, wake: zmq.Socket) -> None:
        # One poller for the thread's life; replicas come and go (_add_replica, _drop_replica).
        poller = self._poller
        while True:
            eps = self._eps
            waiting = any(ep.in_flight for ep in eps) or time.monotonic() < self._late_until
            events = dict(poller.poll(NOTIFY_POLL_MS if waiting else self._next_timeout_ms()))
            if waiting:
                self._collect()
            elif not self.agent.progresses_itself and any(not ep.ready and ep.connections
                                                          for ep in eps):
                # A hello's wire-up: UCX answers a peer's connection only while this agent
                # makes progress.
                self.agent.progress()
            if wake in events:
                while True:
                    try:
                        wake.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                self._take_resolved()
                with self._lock:
                    new = list(self._submitted)
                    self._submitted.clear()
                for t in new:
                    heapq.heappush(self._deadlines, (t.deadline, t.tid, t))
                    for stage in sorted(t.waiting):
                        self._place(self._stages[stage], t)
            for sock in events:
                ep = self._by_monitor.get(sock)
                if ep is not None:
                    self._connection_events(ep)
            for sock, ev in events.items():
                ep = self._by_socket.get(sock)
                if ep is not None and ev & zmq.POLLIN:
                    self._read_replies(ep)
            for ep in self._eps:  # _pump never adds or drops a replica
                if ep.queue:
                    self._pump(ep)
            now = time.monotonic()
            if self._deadlines and self._deadlines[0][0] <= now:
                self._expire(now)
            self._retire_idle()
            with self._lock:
                closing = self._closing_deadline
            if closing is not None and (now >= closing or not self.pending()):
                return

    def _next_timeout_ms(self) -> int:
        heap = self._deadlines
        deadlines = [heap[0][0]] if heap else []
        with self._lock:
            if self._closing_deadline is not None:
                deadlines.append(self._closing_deadline)
        if not deadlines:
            return 1000
        return max(0, min(1000, int((min(deadlines) - time.monotonic()) * 1000) + 1))

    def _pump(self, ep: _Endpoint) -> None:
        """Offer queued transfers while the endpoint accepted our hello and is under its cap."""
        while ep.ready and ep.queue and len(ep.in_flight) < self.max_in_flight:
            t = ep.queue[0]
            if not self._current(t):
                ep.queue.popleft()  # answered elsewhere, superseded or cancelled
                continue
            if time.monotonic() >= t.deadline:
                # Its time ran out while it waited here (the loop expires after it pumps):
                # an offer now would only be refused; _expire reports it as queued.
                ep.queue.popleft()
                continue
            if t.chunk and not self._keeps_its_replica(t, ep):
                ep.queue.popleft()
                self._report(t, f"the connection to stage {ep.stage} at {ep.address} was "
                                "lost in the middle of this stream: a new connection may reach "
                                "another replica of the stage, which does not hold the stream")
                continue
            if not t.sent_at:
                t.sent_at = time.time()
            if t.chunk:
                frames = self._chunk_frames(t, ep)
            else:
                frames = encode_read(ReadRequest(
                transfer_id=t.tid, agent=self.hello.agent, compat_hash=self.hello.compat_hash,
                request_id=t.offer.request_id, external_request_id=t.offer.external_request_id,
                attempt=t.offer.attempt, seq_len=t.offer.seq_len, runs=t.offer.runs,
                deadline_in_s=max(0.0, t.deadline - time.monotonic()),
                trace_context=t.offer.trace_context, pipeline=self.hello.pipeline,
                from_stage=self.hello.from_stage, to_stage=ep.stage, shard=self.hello.shard,
                num_shards=self.hello.num_shards, sent_at=t.sent_at,
                token_ids=t.offer.token_ids, prompt_len=t.offer.prompt_len,
                origin=t.offer.origin))
            if not self._notify(ep, frames[0]):
                return  # the endpoint says hello again; the transfer waits for its answer
            ep.queue.popleft()
            ep.in_flight[t.tid] = t
            t.sent_to.add(ep.stage)

    def _keeps_its_replica(self, t: _Transfer, ep: _Endpoint) -> bool:
        """Whether a stream's chunk may go on the endpoint's current connection. A stream
        stays with the consumer replica its first chunk reached: the endpoint is a Service
        (a revision's KV Service), which balances connections, not messages, so one
        connection is one replica, and every chunk of a stream goes on the connection its
        first chunk went on. Once that connection is lost (the replica gone, or the network
        between), a new one may reach another replica, which does not hold the stream: its
        next chunk fails here, naming why, and the stream ends, rather than go on where it
        would be refused or wait out a deadline. A stream's first chunk pins it; its end
        (``end``) goes anyway."""
        c = t.offer
        key = (ep.stage, c.request_id)
        if c.end is not None:
            return True
        if c.seq == 0:
            self._stream_conn[key] = ep.connections
            return True
        began = self._stream_conn.get(key)
        return began is None or began == ep.connections

    def _chunk_frames(self, t: _Transfer, ep: _Endpoint) -> list[bytes]:
        c, h = t.offer, self.hello
        if c.end is not None:
            return encode_stream_end(StreamEnd(t.tid, h.agent, c.request_id, h.pipeline,
                                               h.from_stage, ep.stage, c.end, c.reason))
        return encode_chunk(StreamChunk(
            transfer_id=t.tid, agent=h.agent, compat_hash=h.compat_hash,
            request_id=c.request_id, external_request_id=c.external_request_id,
            pipeline=h.pipeline, from_stage=h.from_stage, to_stage=ep.stage, seq=c.seq,
            last=c.last, token_ids=c.token_ids, prompt_len=c.prompt_len,
            deadline_in_s=max(0.0, t.deadline - time.monotonic()), produced_at=c.produced_at,
            sent_at=t.sent_at, trace_context=c.trace_context, origin=c.origin))

    def _notify(self, ep: _Endpoint, message: bytes) -> bool:
        """Send a message to the endpoint's receiver agent; whether NIXL took it. When it
        does not (the receiver's agent went away), the endpoint says hello again: the
        answer names the agent there now."""
        try:
            self.agent.notify(ep.peer, message)
            return True
        except Exception as e:
            logger.info("KV sender: a message to stage %s at %s was not sent (%s: %s); saying "
                        "hello again", ep.stage, ep.address, type(e).__name__, e)
            self._requeue(ep)
            self._say_hello(ep)
            return False

    def _say_hello(self, ep: _Endpoint) -> None:
        ep.ready, ep.refused = False, None
        hello = dataclasses.replace(self.hello, to_stage=ep.stage, conn=ep.connections)
        try:
            ep.socket.send_multipart(encode_hello(hello), zmq.NOBLOCK)
        except zmq.ZMQError as e:  # the connection is gone: the monitor says so next
            logger.info("KV sender: a hello to stage %s was not sent: %s", ep.stage, e)

    def _connection_events(self, ep: _Endpoint) -> None:
        """Follow the endpoint's connection: a new one starts with our hello; a lost one
        loses what was in flight on it, which goes back to the front of the queue (in offer
        order) for the next connection."""
        while True:
            try:
                event = recv_monitor_message(ep.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = event.get("event")
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                ep.connections += 1
                ep.stopping = False
                if ep.connections > 1:
                    logger.info("KV sender: reconnected to stage %s at %s", ep.stage, ep.address)
                self._say_hello(ep)
            elif kind == zmq.EVENT_DISCONNECTED:
                # Answers that came before the connection went are answers: read them before
                # what is still in flight goes back to the queue (a stopping receiver's last
                # acks and the disconnect can be seen in one wake-up).
                self._read_replies(ep)
                self._collect()
                ep.ready = False
                if ep.retiring:  # gone for good: what it had goes to the other replicas
                    self._rehome(ep, lost=True)
                elif ep.in_flight:
                    self._requeue(ep)
                    logger.warning("KV sender: connection to stage %s at %s lost; re-offering "
                                   "its transfers on the next connection", ep.stage, ep.address)

    def _requeue(self, ep: _Endpoint) -> None:
        lost = [ep.in_flight.pop(tid) for tid in sorted(ep.in_flight)]
        ep.queue.extendleft(reversed([t for t in lost if self._current(t)]))

    def _read_replies(self, ep: _Endpoint) -> None:
        """The handshake connection's answers: a hello's, or an ``unknown_agent`` of a
        receiver that forgot this agent."""
        while True:
            try:
                frames = ep.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply = decode_reply(frames[0])
            if reply is not None and reply.kind == "hello_ok":
                if reply.conn == ep.connections:
                    self._accepted(ep, frames[1] if len(frames) == 2 else b"")
                continue
            self._answer(ep, reply, frames[0])

    def _accepted(self, ep: _Endpoint, metadata: bytes) -> None:
        """The receiver accepted this connection's hello: its agent is loaded (again, on a
        new connection: NIXL takes it), and messages may go to it."""
        try:
            name = self.agent.add_remote(metadata)
        except Exception as e:
            self._refused(ep, f"its hello_ok carried NIXL metadata this agent cannot load: "
                              f"{type(e).__name__}: {e}")
            return
        old, ep.peer, ep.ready = ep.peer, name, True
        self._by_peer[name] = ep
        if old is not None and old != name:
            self._unload(old)  # the receiver restarted: a new agent there

    def _unload(self, name: str) -> None:
        """Forget a receiver's agent no endpoint names any more (a restarted receiver, a
        replica gone): the AR's agent keeps no peer it will not talk to again."""
        if any(ep.peer == name for ep in self._eps):
            return
        self._by_peer.pop(name, None)
        self.agent.remove_remote(name)

    def _collect(self) -> None:
        """The receivers' answers that came as notifications."""
        for source, raw in self.agent.notifications():
            ep = self._by_peer.get(source)
            if ep is None:
                logger.info("KV sender: ignored a notification from agent %s", source)
                continue
            self._answer(ep, decode_reply(raw), raw)

    def _answer(self, ep: _Endpoint, reply: Reply | None, raw: bytes) -> None:
        """One answer of ``ep``'s receiver (a hello's is _accepted's)."""
        if reply is None or reply.kind == "hello_ok":
            logger.info("KV sender: ignored a message from stage %s: %r", ep.stage, raw[:200])
            return
        t = ep.in_flight.get(reply.transfer_id) if reply.transfer_id is not None else None
        if reply.kind == "read_done":
            self._fence(ep, t, reply.transfer_id)
            return
        if reply.kind == "rejected" and reply.transfer_id is None:
            if reply.code == "incompatible" or not ep.ready:
                self._refused(ep, f"{reply.code}: {reply.reason}")
            else:
                logger.warning("KV sender: stage %s rejected a message: %s: %s", ep.stage,
                               reply.code, reply.reason)
            return
        if t is None:
            # A late answer to a transfer that already timed out, or garbage.
            logger.info("KV sender: ignored a %s from stage %s for transfer %s", reply.kind,
                        ep.stage, reply.transfer_id)
            return
        if reply.kind == "ok":
            del ep.in_flight[t.tid]
            if ep.stage in t.waiting:
                t.waiting.discard(ep.stage)
                self._edge(t, ep.stage, "acked")
            if not t.waiting:
                self._report(t, None)
        elif reply.code == "unknown_agent":
            # The receiver forgot this agent (idle, or restarted behind a proxy): say hello
            # again and offer the transfer anew.
            del ep.in_flight[t.tid]
            ep.queue.appendleft(t)
            self._requeue(ep)
            self._say_hello(ep)
        elif reply.code == "stopping" and self._elsewhere(ep, t):
            pass  # offered to another replica
        else:
            del ep.in_flight[t.tid]
            self._report(t, f"stage {ep.stage} rejected: {reply.code}: {reply.reason}")

    def _fence(self, ep: _Endpoint, t: _Transfer | None, tid: int | None) -> None:
        """Answer a receiver's read_done: commit only a read of a transfer still current and
        within its deadline (see the module docstring)."""
        if tid is None:
            return
        with self._lock:
            commit = t is not None and not t.done and time.monotonic() < t.deadline
        reason = "" if commit else ("the transfer was resolved or withdrawn before the read "
                                    "was confirmed" if t is None or t.done
                                    else "the transfer's deadline passed during the read")
        self._notify(ep, encode_verdict(Verdict(self.hello.agent, tid, commit, reason))[0])
        if not commit and t is not None:
            ep.in_flight.pop(tid, None)

    def _refused(self, ep: _Endpoint, why: str) -> None:
        """The receiver refused this rank's hello: nothing can be sent there until a new
        connection's hello is accepted."""
        ep.ready, ep.refused = False, why
        logger.error("KV sender: stage %s at %s refused this sender: %s", ep.stage, ep.address,
                     why)
        failed = list(ep.queue) + list(ep.in_flight.values())
        ep.queue.clear()
        ep.in_flight.clear()
        for t in failed:
            self._report(t, f"stage {ep.stage} refused this sender: {why}")

    def _expire(self, now: float) -> None:
        """Fail every transfer past its deadline, naming the first replica it waits for."""
        heap = self._deadlines
        expired: list[tuple[_Transfer, str | None]] = []
        while heap and heap[0][0] <= now:
            t = heapq.heappop(heap)[2]
            expired.append((t, self._timeout_reason(t) if self._current(t) else None))
        for t, why in expired:
            for ep in t.placed.values():  # frees its in-flight slots; _pump skips queued ones
                if ep.in_flight.pop(t.tid, None) is not None:
                    self._late_until = now + LATE_ANSWER_S
            for stage in t.waiting:
                st = self._stages.get(stage)
                if st is not None and t in st.unplaced:
                    st.unplaced.remove(t)
            if why is not None:
                self._report(t, Unanswered(why), edges="expired")

    def _timeout_reason(self, t: _Transfer) -> str:
        stage = next((s for s in self.endpoints if s in t.waiting), "")
        ep = t.placed.get(stage)
        if ep is None:
            st = self._stages.get(stage)
            address = st.address if st is not None else "?"
            why = f" ({st.unresolved})" if st is not None and st.unresolved else ""
            return (f"stage {stage} unreachable at {address}: its name resolved to no replica "
                    f"within {t.timeout:g}s{why}")
        if ep.stage in t.sent_to:
            return f"no ack from stage {ep.stage} at {ep.address} within {t.timeout:g}s"
        if ep.ready or len(ep.in_flight) >= self.max_in_flight:
            # Connected and accepted: it waited for room under max_in_flight (the unacked
            # transfers ahead of it may have just expired too: their count is no test).
            return (f"still queued for stage {ep.stage} behind {len(ep.in_flight)} unacked "
                    f"transfers after {t.timeout:g}s")
        if ep.connections:
            # Connected, but the receiver never accepted this connection's hello (it hangs).
            return (f"no ack from stage {ep.stage} at {ep.address} to this sender's hello "
                    f"within {t.timeout:g}s")
        return (f"stage {ep.stage} unreachable at {ep.address}: not connected within "
                f"{t.timeout:g}s")
