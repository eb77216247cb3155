"""KVSender: ships KVPayloads to every downstream stage from a background I/O thread and
reports each transfer's outcome back to the caller (the omni KV connector's worker side).

Delivery semantics (docs/connector.md):
* ``acked``: every endpoint's receiver stored the payload and said so. Nothing else acks.
* ``failed`` (with a reason): an endpoint rejected it (the receiver's code and reason), an
  endpoint was unreachable until the deadline (ZMQ_IMMEDIATE: nothing is queued toward a
  peer that is not connected, so "unreachable" is not confused with "slow"), or no ack came
  before the deadline (``send_timeout_s`` from submit(), queueing included), or the sender
  was closed first. A failed transfer may still have reached a receiver (an ack lost with a
  dying connection); the receiver's inbox then holds a payload nobody waits for, which its
  TTL removes.
* Each submitted transfer is reported exactly once, by request id, unless a newer submit()
  of the same request id supersedes it (a re-sent snapshot after a preemption): then only
  the newer one is reported, and any unpolled result of the older one is dropped.

Threads: submit/poll/wait/pending/close may be called from any thread. Only the I/O thread
touches the DEALER sockets; submit() hands it work through a deque and wakes it over an
inproc PAIR socket. Reconnection after a receiver restart is ZeroMQ's own (every
RECONNECT_IVL_MS); with ZMQ_IMMEDIATE a send waits for the new connection, up to its deadline.

A lost connection (the receiver exited, or missed heartbeats) loses whatever was in flight
on it: the socket monitor reports the disconnect, and the endpoint's in-flight transfers go
back to the front of its queue at once, to be re-sent (same transfer id) on the next
connection, so neither they nor the transfers queued behind them wait for their deadline
to free the in-flight window. A re-sent payload the old receiver had stored before it lost
the connection replaces itself in the inbox (counted there as ``replaced``).

If the I/O thread dies (a bug), every unresolved transfer fails with the reason, submit()
fails at once, ``on_thread_state(False)`` is called and close() still returns normally.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping

import zmq
from zmq.utils.monitor import recv_monitor_message

from omni_runtime.kv.transport.wire import (
    CHECKSUMS,
    DEFAULT_CHECKSUM,
    KVPayload,
    checksum,
    data_view,
    decode_reply,
    encode_header,
    validate_payload,
)

logger = logging.getLogger(__name__)

DEFAULT_SEND_TIMEOUT_S = 10.0
DEFAULT_MAX_IN_FLIGHT = 8
RECONNECT_IVL_MS = 100
# Detects a peer that vanished without closing its connection (a node lost), so its queued
# sends stop waiting for it: ZMTP heartbeats every second, dead after three missed.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000
#: How long close() waits for the I/O thread beyond the linger time (it stops within one
#: loop iteration, at most a second).
CLOSE_JOIN_S = 10.0
#: Connection events the I/O thread follows (socket monitor).
_MONITOR_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED


@dataclass(eq=False)
class _Transfer:
    tid: int
    rid: str
    #: Dropped (None) once the transfer is resolved or superseded, so a resolved payload's
    #: memory is freed at once; ZeroMQ holds its own reference while it still sends it.
    payload: KVPayload | None
    deadline: float  # monotonic
    timeout: float
    waiting: set[str]  # stages that have not acked yet
    sent_to: set[str] | None = None  # stages it was handed to ZeroMQ for
    data: memoryview | None = None  # the payload's bytes, made once on the I/O thread
    digest: str | None = None
    done: bool = False  # reported (or superseded): no further report


@dataclass(eq=False)
class _Endpoint:
    stage: str
    address: str
    socket: zmq.Socket
    monitor: zmq.Socket | None = None  # the socket's connection events
    queue: deque[_Transfer] = field(default_factory=deque)  # not yet sent, submit order
    in_flight: dict[int, _Transfer] = field(default_factory=dict)  # sent, awaiting a reply
    connections: int = 0  # handshakes so far (a restarted receiver makes a new one)


class KVSender:
    """Sends each submitted payload to every stage of ``endpoints`` ({stage: zmq address}).

    ``max_in_flight``: unacked transfers per endpoint; more wait in the sender's queue (their
    deadline runs). ``observe_bytes``: called with the payload size of each delivered
    transfer, from the I/O thread (pass ``TransferMetrics.observe_transfer_bytes`` to feed
    the contract's ``omni_kv_transfer_bytes``). ``on_thread_state``: called with True when
    the I/O thread starts and False when it ends (died or closed), from that thread (pass
    ``omni_runtime.observability.transport_metrics.thread_up_setter(thread="sender", ...)``
    to feed ``omni_kv_transport_thread_up``). ``io_cpus``: the CPUs the sender's I/O thread and
    ZeroMQ's I/O thread run on (None: inherited from the creating thread); keep them off the
    engine's OpenMP cores (``omni_runtime.kv.cpu_affinity``).
    """

    def __init__(
        self,
        endpoints: Mapping[str, str],
        *,
        pipeline: str = "",
        stage: str = "",
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
        checksum_algo: str = DEFAULT_CHECKSUM,
        observe_bytes: Callable[[int], None] | None = None,
        on_thread_state: Callable[[bool], None] | None = None,
        io_cpus: Collection[int] | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("KVSender needs at least one endpoint")
        if max_in_flight < 1 or send_timeout_s <= 0:
            raise ValueError("max_in_flight must be >= 1 and send_timeout_s > 0")
        if checksum_algo not in CHECKSUMS:
            raise ValueError(f"unknown checksum {checksum_algo!r} (known: {sorted(CHECKSUMS)})")
        self.endpoints = dict(endpoints)
        self.pipeline = pipeline
        self.stage = stage
        self.max_in_flight = max_in_flight
        self.send_timeout_s = send_timeout_s
        self.checksum_algo = checksum_algo
        self._observe_bytes = observe_bytes
        self._on_thread_state = on_thread_state
        self._tids = itertools.count(1)
        #: (deadline, transfer id, transfer) of unresolved transfers; the I/O thread's only.
        self._deadlines: list[tuple[float, int, _Transfer]] = []
        # Caller-side state, all under _lock.
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._submitted: deque[_Transfer] = deque()
        self._latest: dict[str, int] = {}  # unresolved request id -> its newest transfer id
        self._acked: list[str] = []
        self._failed: dict[str, str] = {}
        self._closing_deadline: float | None = None
        self._dead: str | None = None  # why the I/O thread is gone (then submit fails at once)
        # The I/O thread and its wake-up pipe.
        self._ctx = zmq.Context(io_threads=1)
        self.io_cpus = sorted(io_cpus) if io_cpus else None
        if self.io_cpus:
            # Before the first socket: ZeroMQ starts its I/O thread (which does the TCP
            # sends) with the first socket, bound to these CPUs.
            for cpu in self.io_cpus:
                self._ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)
        self._wake_addr = f"inproc://omni-kv-sender-wake-{id(self)}"
        self._wake = self._ctx.socket(zmq.PAIR)
        self._wake.setsockopt(zmq.SNDHWM, 0)  # wake-ups never block or drop
        self._wake.bind(self._wake_addr)
        self._wake_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"omni-kv-sender-{stage}",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ caller API
    def submit(self, payload: KVPayload, timeout_s: float | None = None) -> None:
        """Queue ``payload`` for every endpoint; returns at once. Never raises for network
        trouble or a bad payload: both are reported by poll() as failures. The caller must
        not modify ``payload.kv`` afterwards (it is sent without a copy). ``timeout_s``
        overrides ``send_timeout_s`` for this transfer (e.g. the scheduler's time left).

        """
        problem = validate_payload(payload)
        rid = payload.request_id if isinstance(payload, KVPayload) else None
        if not isinstance(rid, str) or not rid:
            logger.error("KVSender.submit: dropped an unaddressable payload: %s", problem)
            return
        with self._lock:
            # Results of an older transfer of this request are stale once it is re-sent.
            if rid in self._failed:
                del self._failed[rid]
            if rid in self._acked:
                self._acked.remove(rid)
            tid = next(self._tids)
            self._latest[rid] = tid
            reason = problem and f"invalid payload: {problem}"
            if reason is None and (self._dead or self._closing_deadline is not None):
                reason = self._dead or "sender closed"
            timeout = self.send_timeout_s if timeout_s is None else max(0.0, timeout_s)
            transfer = _Transfer(tid, rid, payload, time.monotonic() + timeout, timeout,
                                 set(self.endpoints))
            if reason is not None:
                self._report_locked(transfer, reason)
                return
            self._submitted.append(transfer)
        self._kick()

    def poll(self) -> tuple[list[str], dict[str, str]]:
        """Results since the last poll(), without blocking: (request ids delivered to every
        endpoint, {request id: reason} of failed transfers)."""
        with self._lock:
            acked, failed = self._acked, self._failed
            self._acked, self._failed = [], {}
            return acked, failed

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until a result is ready for poll(); whether one is."""
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._acked or self._failed), timeout_s)

    def pending(self) -> int:
        """Transfers submitted and not yet resolved (reported results not counted)."""
        with self._lock:
            return len(self._latest)

    @property
    def alive(self) -> bool:
        """The I/O thread runs (False once it died or was closed)."""
        return self._thread.is_alive()

    @property
    def died(self) -> str | None:
        """Why the I/O thread ended abnormally, or None (running, or closed on purpose)."""
        with self._lock:
            dead = self._dead
        return dead if dead is not None and dead != "sender closed" else None

    def close(self, linger_s: float = 0.0) -> None:
        """Stop taking transfers, give unresolved ones up to ``linger_s`` to resolve, then
        fail the rest ("sender closed") and close the sockets. Results stay readable by
        poll(). Idempotent, and never raises, also when the I/O thread has already died."""
        with self._lock:
            if self._closing_deadline is None:
                self._closing_deadline = time.monotonic() + max(0.0, linger_s)
        self._kick()
        self._thread.join(max(0.0, linger_s) + CLOSE_JOIN_S)
        if self._thread.is_alive():  # pragma: no cover - a hung I/O thread: leave its sockets
            logger.error("KV sender I/O thread did not stop; leaving its sockets open")
            return
        with self._wake_lock:
            if not self._wake.closed:
                self._wake.close(linger=0)
                # destroy, not term: a thread that died mid-way may have left its sockets
                # open, and term() would wait for them forever. The thread is gone, so
                # closing them from here is safe.
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
                    # EAGAIN: the I/O thread's end of the pipe is gone (it ended, or died):
                    # nobody to wake. Its exit already resolved every transfer.
                    pass

    def _report_locked(self, t: _Transfer, failure: str | None) -> None:
        """Record ``t``'s outcome once, unless a newer transfer of its request superseded it."""
        if t.done:
            return
        t.done = True
        rid = t.rid
        if self._latest.get(rid) != t.tid:
            return  # superseded
        del self._latest[rid]
        if failure is None:
            self._acked.append(rid)
        else:
            self._failed[rid] = failure
        self._cond.notify_all()

    def _report(self, t: _Transfer, failure: str | None) -> None:
        nbytes = t.payload.nbytes if t.payload is not None else 0
        with self._lock:
            current = not t.done and self._latest.get(t.rid) == t.tid
            self._report_locked(t, failure)
        self._release(t)
        if not current:
            return
        if failure is not None:
            logger.warning("KV transfer of request %s failed: %s", t.rid, failure)
        elif self._observe_bytes is not None:
            try:
                self._observe_bytes(nbytes)
            except Exception:  # metrics must never break delivery
                logger.exception("observe_bytes failed")

    @staticmethod
    def _release(t: _Transfer) -> None:
        t.payload = None
        t.data = None

    def _is_current(self, t: _Transfer) -> bool:
        """Not yet resolved and not superseded; releases the payload of one that is not."""
        with self._lock:
            current = not t.done and self._latest.get(t.rid) == t.tid
        if not current:
            self._release(t)
        return current

    # ------------------------------------------------------------------ the I/O thread
    def _run(self) -> None:
        if self.io_cpus:
            try:
                os.sched_setaffinity(0, self.io_cpus)  # this thread only (Linux)
            except (OSError, AttributeError) as e:
                logger.warning("KV sender: cannot bind the I/O thread to CPUs %s: %s",
                               self.io_cpus, e)
        eps: list[_Endpoint] = []
        wake = self._ctx.socket(zmq.PAIR)
        wake.connect(self._wake_addr)
        self._report_thread(True)
        reason = "sender closed"
        try:
            for stage, address in self.endpoints.items():
                s = self._ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.IMMEDIATE, 1)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
                s.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
                s.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
                ep = _Endpoint(stage, address, s)
                eps.append(ep)
                ep.monitor = s.get_monitor_socket(_MONITOR_EVENTS)
                s.connect(address)
            self._loop(wake, eps)
        except BaseException as e:  # a bug; fail everything, loudly, and say so
            logger.exception("KV sender I/O thread died")
            reason = f"sender I/O thread died: {type(e).__name__}: {e}"
        finally:
            # Whatever broke above, every unresolved transfer is resolved and the sockets are
            # closed, so close() and the caller's poll() still work.
            with self._lock:
                self._dead = reason
                leftovers = list(self._submitted)
                self._submitted.clear()
            for ep in eps:
                leftovers.extend(ep.queue)
                leftovers.extend(ep.in_flight.values())
            for t in leftovers:
                try:
                    self._report(t, reason)
                except Exception:  # pragma: no cover - keep resolving the rest
                    logger.exception("KV sender: resolving a transfer at exit failed")
            for ep in eps:
                if ep.monitor is not None:
                    ep.monitor.close(linger=0)
                ep.socket.close(linger=0)
            wake.close(linger=0)
            self._report_thread(False)

    def _report_thread(self, up: bool) -> None:
        if self._on_thread_state is None:
            return
        try:
            self._on_thread_state(up)
        except Exception:  # metrics must never decide whether the thread runs
            logger.exception("on_thread_state failed")

    def _loop(self, wake: zmq.Socket, eps: list[_Endpoint]) -> None:
        by_socket = {ep.socket: ep for ep in eps}
        by_monitor = {ep.monitor: ep for ep in eps if ep.monitor is not None}
        while True:
            # Wait for a reply, a wake-up, a connection able to take a queued send, or the
            # next deadline, whichever is first.
            poller = zmq.Poller()
            poller.register(wake, zmq.POLLIN)
            for ep in eps:
                can_send = ep.queue and len(ep.in_flight) < self.max_in_flight
                poller.register(ep.socket, zmq.POLLIN | (zmq.POLLOUT if can_send else 0))
                if ep.monitor is not None:
                    poller.register(ep.monitor, zmq.POLLIN)
            timeout_ms = self._next_timeout_ms()
            events = dict(poller.poll(timeout_ms))
            if wake in events:
                while True:
                    try:
                        wake.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
            with self._lock:
                new = list(self._submitted)
                self._submitted.clear()
                closing = self._closing_deadline
            for t in new:
                heapq.heappush(self._deadlines, (t.deadline, t.tid, t))
                for ep in eps:
                    ep.queue.append(t)
            for sock, ev in events.items():
                ep = by_socket.get(sock)
                if ep is not None and ev & zmq.POLLIN:
                    self._read_replies(ep)
            for sock in events:
                if sock in by_monitor:
                    self._connection_events(by_monitor[sock])
            for ep in eps:
                self._pump(ep)
            now = time.monotonic()
            self._expire(eps, now)
            if closing is not None:
                if now >= closing or not self.pending():
                    return

    def _next_timeout_ms(self) -> int:
        # Resolved transfers stay in the heap until their deadline: _expire then frees any
        # in-flight slot they still hold at an endpoint that never answered.
        heap = self._deadlines
        deadlines = [heap[0][0]] if heap else []
        with self._lock:
            if self._closing_deadline is not None:
                deadlines.append(self._closing_deadline)
        if not deadlines:
            return 1000  # nothing timed; a wake-up or reply ends the wait earlier
        return max(0, min(1000, int((min(deadlines) - time.monotonic()) * 1000) + 1))

    def _pump(self, ep: _Endpoint) -> None:
        """Send queued transfers while the endpoint is connected and under its in-flight cap."""
        while ep.queue and len(ep.in_flight) < self.max_in_flight:
            t = ep.queue[0]
            if not self._is_current(t):
                ep.queue.popleft()  # already failed elsewhere, or superseded
                continue
            try:
                if t.data is None:  # once for all endpoints, on this thread (not the caller's)
                    t.data = data_view(t.payload.kv)
                    t.digest = checksum(self.checksum_algo, t.data)
                header = encode_header(t.payload, transfer_id=t.tid, to_stage=ep.stage,
                                       digest=t.digest)
            except Exception as e:  # submit() validated it; a payload changed since, say
                ep.queue.popleft()
                self._report(t, f"cannot encode payload: {type(e).__name__}: {e}")
                continue
            try:
                # copy=False: ZeroMQ sends from the array's memory, which the _Transfer (and
                # the Frame ZeroMQ holds) keeps alive.
                ep.socket.send_multipart([header, t.data], zmq.NOBLOCK,
                                         copy=False)
            except zmq.Again:
                return  # not connected (ZMQ_IMMEDIATE) or full: POLLOUT tells when to retry
            ep.queue.popleft()
            ep.in_flight[t.tid] = t
            if t.sent_to is None:
                t.sent_to = set()
            t.sent_to.add(ep.stage)

    def _connection_events(self, ep: _Endpoint) -> None:
        """Follow the endpoint's connection: on a disconnect, whatever was in flight on it
        is lost with the connection, so those transfers go back to the front of the queue
        (in send order) for the next connection instead of holding the in-flight window
        until their deadline."""
        while True:
            try:
                event = recv_monitor_message(ep.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = event.get("event")
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                ep.connections += 1
                if ep.connections > 1:
                    logger.info("KV sender: reconnected to stage %s at %s", ep.stage, ep.address)
            elif kind == zmq.EVENT_DISCONNECTED and ep.in_flight:
                lost = [ep.in_flight.pop(tid) for tid in sorted(ep.in_flight)]
                resend = [t for t in lost if self._is_current(t)]
                ep.queue.extendleft(reversed(resend))
                logger.warning("KV sender: connection to stage %s at %s lost with %d transfers "
                               "in flight; re-sending them on the next connection", ep.stage,
                               ep.address, len(resend))

    def _read_replies(self, ep: _Endpoint) -> None:
        while True:
            try:
                raw = ep.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply = decode_reply(raw)
            t = ep.in_flight.pop(reply.transfer_id, None) if reply else None
            if t is None:
                # A late answer to a transfer that already timed out, or garbage.
                logger.info("KV sender: ignored reply from stage %s: %r", ep.stage, raw[:200])
                continue
            if reply.ok:
                t.waiting.discard(ep.stage)
                if not t.waiting:
                    self._report(t, None)
            else:
                self._report(t, f"stage {ep.stage} rejected: {reply.code}: {reply.reason}")

    def _expire(self, eps: list[_Endpoint], now: float) -> None:
        """Fail every transfer past its deadline, naming the first endpoint it waits for."""
        heap = self._deadlines
        expired: list[tuple[_Transfer, str | None]] = []
        while heap and heap[0][0] <= now:
            t = heapq.heappop(heap)[2]
            # Reasons first, from the endpoints' state before any slot is freed below.
            expired.append((t, self._timeout_reason(t, eps) if self._is_current(t) else None))
        for t, why in expired:
            for ep in eps:  # frees its in-flight slots; queued copies are skipped by _pump
                ep.in_flight.pop(t.tid, None)
            if why is not None:
                self._report(t, why)

    def _timeout_reason(self, t: _Transfer, eps: list[_Endpoint]) -> str:
        ep = next(e for e in eps if e.stage in t.waiting)
        if t.sent_to is not None and ep.stage in t.sent_to:
            return f"no ack from stage {ep.stage} at {ep.address} within {t.timeout:g}s"
        if len(ep.in_flight) >= self.max_in_flight:
            return (f"still queued for stage {ep.stage} behind {len(ep.in_flight)} unacked "
                    f"transfers after {t.timeout:g}s")
        return (f"stage {ep.stage} unreachable at {ep.address}: not connected within "
                f"{t.timeout:g}s")
