"""The connector under faults (issue 15): malformed frames that once killed the receiver,
transport threads that die, a receiver restarted under a sender with transfers in flight,
and payloads found by the client's own request id. Real ZeroMQ sockets on 127.0.0.1; the
one stand-in is a raw DEALER/ROUTER where a test needs a peer that misbehaves."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import zmq
from prometheus_client import CollectorRegistry

from omni_runtime.kv.transport import KVInbox, KVPayload, KVReceiver, KVSender
from omni_runtime.kv.transport.observer import NullReceiverObserver
from omni_runtime.kv.transport.wire import checksum, data_view, encode_header
from omni_runtime.observability.receiver_metrics import ReceiverMetrics
from omni_runtime.observability.transport_metrics import thread_up_setter

from transport_fixtures import STAGE, WAIT, collect, make_receiver, make_sender, receiver, registry  # noqa: F401 (fixtures)


def payload(rid: str, seq_len: int = 4, **kw) -> KVPayload:
    rng = np.random.default_rng(abs(hash(rid)) % 1000)
    kv = rng.standard_normal((2, 2, 2, seq_len, 16)).astype(np.float32)
    return KVPayload(rid, seq_len, kv, pipeline="p", from_stage="ar", **kw)


def frames_of(p: KVPayload, tid: int = 1, **header_changes) -> list[bytes]:
    data = data_view(p.kv)
    header = json.loads(encode_header(p, transfer_id=tid, to_stage=STAGE,
                                      digest=checksum("crc32", data)))
    header.update(header_changes)
    return [json.dumps(header).encode(), bytes(data)]


def sample(registry, name, **labels):
    return registry.get_sample_value(name, {"stage": STAGE, "model_name": "", **labels})


@pytest.fixture
def dealer(receiver):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(receiver.endpoint)
    yield sock
    sock.close(linger=0)
    ctx.term()


def reply_of(sock: zmq.Socket) -> dict:
    assert sock.poll(int(WAIT * 1000)), "no reply from the receiver"
    return json.loads(sock.recv())


# ---------------------------------------------------------------------- malformed frames
@pytest.mark.parametrize("trace_context", [
    {"traceparent": 5},                     # the reported frame
    {"traceparent": ["00-x"], "tracestate": {"a": 1}},
    {"traceparent": None},
    {"traceparent": "00-" + "f" * 32 + "-" + "f" * 16 + "-01", "b": 3.5},
])
def test_a_trace_context_of_non_strings_is_rejected_and_the_receiver_serves_on(
        receiver, dealer, make_sender, registry, trace_context):
    dealer.send_multipart(frames_of(payload("bad"), tid=7, trace_context=trace_context))
    answer = reply_of(dealer)
    assert (answer["status"], answer["code"], answer["transfer_id"]) == (
        "rejected", "malformed_header", 7), answer
    assert receiver.running and receiver.died is None
    # Valid transfers after it are served (before the fix the thread was gone: no answer).
    sender = make_sender({STAGE: receiver.endpoint})
    sender.submit(payload("after"))
    assert collect(sender, 1) == (["after"], {})
    assert sample(registry, "omni_kv_receiver_rejected_total", reason="malformed_header") == 1


class ExplodingObserver(NullReceiverObserver):
    """An observer whose rejection counter raises (a bug on the rejection path itself)."""

    def __init__(self) -> None:
        self.calls = 0

    def rejected(self, code: str) -> None:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("counter broke")


def test_an_exception_on_the_rejection_path_is_answered_internal_error_and_serving_goes_on(
        make_receiver, make_sender):
    receiver = make_receiver(metrics=ExplodingObserver())
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(receiver.endpoint)
    try:
        sock.send_multipart([b"not json", b""])
        answer = reply_of(sock)
        assert (answer["status"], answer["code"]) == ("rejected", "internal_error")
        assert "counter broke" in answer["reason"]
        assert receiver.running and receiver.num_internal_errors == 1
        sender = make_sender({STAGE: receiver.endpoint})
        sender.submit(payload("after"))
        assert collect(sender, 1) == (["after"], {})
    finally:
        sock.close(linger=0)
        ctx.term()


def test_the_receiver_thread_reports_itself_up_then_down(make_receiver, registry):
    receiver = make_receiver()
    assert sample(registry, "omni_kv_transport_thread_up", thread="receiver") == 1
    receiver.close()
    assert sample(registry, "omni_kv_transport_thread_up", thread="receiver") == 0


# ---------------------------------------------------------------------- the sender's thread
def break_the_io_thread(sender: KVSender) -> None:
    """Make the next loop iteration raise on the I/O thread (a stand-in for a bug there)."""
    def boom(*_a, **_k):
        raise RuntimeError("bug in the I/O thread")

    sender._next_timeout_ms = boom  # called once per loop iteration, on the I/O thread
    sender._kick()


def test_close_returns_normally_after_the_io_thread_died(make_sender):
    states: list[bool] = []
    ctx_port = "tcp://127.0.0.1:1"  # nothing listens: the transfer stays queued
    sender = make_sender({STAGE: ctx_port}, on_thread_state=states.append)
    sender.submit(payload("queued"))
    break_the_io_thread(sender)
    sender._thread.join(WAIT)
    assert not sender.alive and "bug in the I/O thread" in sender.died
    acked, failed = collect(sender, 1)
    assert "bug in the I/O thread" in failed["queued"]
    sender.close()  # raised zmq.Again before: the thread's end of the wake pipe was gone
    sender.close()
    sender.submit(payload("later"))
    assert "bug in the I/O thread" in sender.poll()[1]["later"]
    assert states == [True, False]


def test_the_sender_thread_state_feeds_the_thread_up_gauge(make_sender, registry):
    set_up = thread_up_setter(stage=STAGE, model_name="", thread="sender", registry=registry)
    sender = make_sender({STAGE: "tcp://127.0.0.1:1"}, on_thread_state=set_up)
    deadline = time.monotonic() + WAIT
    while sample(registry, "omni_kv_transport_thread_up", thread="sender") != 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)  # polling the gauge the I/O thread sets as it starts
    break_the_io_thread(sender)
    sender._thread.join(WAIT)
    assert sample(registry, "omni_kv_transport_thread_up", thread="sender") == 0


def test_close_returns_when_the_io_thread_died_while_cleaning_up(make_sender):
    sender = make_sender({STAGE: "tcp://127.0.0.1:1"})
    sender.submit(payload("queued"))

    def broken_report(*_a, **_k):
        raise RuntimeError("bug while resolving")

    sender._report = broken_report  # the thread's exit path breaks too
    break_the_io_thread(sender)
    sender._thread.join(WAIT)
    closer = threading.Thread(target=sender.close)
    closer.start()
    closer.join(WAIT)  # before: ctx.term() waited forever for the sockets the thread left open
    assert not closer.is_alive(), "close() hung after the I/O thread died"


# ---------------------------------------------------------------------- receiver restart
def test_a_restarted_receiver_gets_the_in_flight_and_the_queued_transfers_at_once(
        make_receiver, make_sender):
    """Two transfers in flight to a receiver that dies without answering (a raw ROUTER that
    takes them and closes), a third queued behind the window; a new receiver on the same
    port gets all three long before their deadline (before: the window stayed full of the
    lost transfers until they expired)."""
    ctx = zmq.Context()
    dying = ctx.socket(zmq.ROUTER)
    dying.setsockopt(zmq.LINGER, 0)
    port = dying.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    try:
        sender = make_sender({STAGE: endpoint}, max_in_flight=2, send_timeout_s=30.0)
        for rid in ("a", "b", "c"):
            sender.submit(payload(rid))
        taken = []
        for _ in range(2):
            assert dying.poll(int(WAIT * 1000)), "nothing arrived"
            taken.append(json.loads(dying.recv_multipart()[1])["request_id"])
        assert taken == ["a", "b"]
        assert dying.poll(300) == 0  # "c" waits for a free slot
        dying.close(linger=0)  # the receiver's process ends: the connection drops
        ctx.term()  # returns once ZeroMQ really closed the socket and its listening port
        started = time.monotonic()
        second = make_receiver(endpoint)
        acked, failed = collect(sender, 3, timeout=5.0)
        assert sorted(acked) == ["a", "b", "c"] and not failed
        assert time.monotonic() - started < 5.0
        assert all(rid in second.inbox for rid in ("a", "b", "c"))
    finally:
        if not ctx.closed:
            ctx.destroy(linger=0)


def test_transfers_in_flight_to_a_receiver_that_dies_resolve_once(make_receiver,
                                                                  make_sender):
    """A disconnect with nothing to reconnect to: the re-queued transfers fail once, at
    their deadline, as unreachable, and nothing is reported twice."""
    ctx = zmq.Context()
    dying = ctx.socket(zmq.ROUTER)
    dying.setsockopt(zmq.LINGER, 0)
    port = dying.bind_to_random_port("tcp://127.0.0.1")
    try:
        sender = make_sender({STAGE: f"tcp://127.0.0.1:{port}"}, send_timeout_s=1.0)
        sender.submit(payload("lost"))
        assert dying.poll(int(WAIT * 1000))
        dying.close(linger=0)
        acked, failed = collect(sender, 1)
        assert not acked and ("unreachable" in failed["lost"] or "no ack" in failed["lost"])
        assert sender.pending() == 0
        assert sender.wait(0.5) is False  # no second report
    finally:
        ctx.destroy(linger=0)


# ---------------------------------------------------------------------- request ids
def test_a_payload_is_found_by_the_internal_and_by_the_client_request_id(receiver,
                                                                         make_sender):
    from omni_runtime.kv.transport.wire import vllm_external_request_id

    internal = "cmpl-my-client-id-0-1a2b3c4d"  # what vLLM's scheduler sees
    external = vllm_external_request_id(internal)
    assert external == "cmpl-my-client-id-0"
    sender = make_sender({STAGE: receiver.endpoint})
    sender.submit(payload(internal, external_request_id=external))
    assert collect(sender, 1) == ([internal], {})
    inbox = receiver.inbox
    assert internal in inbox and external in inbox
    assert inbox.list()[0]["external_request_id"] == external
    got = inbox.get(external, remove=False)
    assert got is not None and got.request_id == internal
    assert inbox.get(internal) is got  # consumed by either id: both are gone
    assert external not in inbox and internal not in inbox and inbox.bytes == 0


def test_a_newer_request_with_the_same_client_id_takes_the_alias(make_receiver, make_sender):
    receiver = make_receiver()
    sender = make_sender({STAGE: receiver.endpoint})
    sender.submit(payload("x-0-aaaaaaaa", external_request_id="x-0"))
    sender.submit(payload("x-0-bbbbbbbb", external_request_id="x-0"))
    assert sorted(collect(sender, 2)[0]) == ["x-0-aaaaaaaa", "x-0-bbbbbbbb"]
    assert receiver.inbox.get("x-0", remove=False).request_id == "x-0-bbbbbbbb"
    receiver.inbox.get("x-0-aaaaaaaa")  # consuming the older one leaves the alias alone
    assert receiver.inbox.get("x-0").request_id == "x-0-bbbbbbbb"
    assert len(receiver.inbox) == 0


def test_the_external_id_is_optional_on_the_wire_and_type_checked(receiver, dealer):
    plain = frames_of(payload("old-sender"), tid=3)
    assert "external_request_id" not in json.loads(plain[0])  # a v1 header as before
    dealer.send_multipart(plain)
    assert reply_of(dealer)["status"] == "ok"
    dealer.send_multipart(frames_of(payload("typed"), tid=4, external_request_id=5))
    answer = reply_of(dealer)
    assert (answer["status"], answer["code"]) == ("rejected", "malformed_header")
    assert "external_request_id" in answer["reason"]


@pytest.mark.parametrize("internal, randomized, external", [
    ("cmpl-abc-0-0f1e2d3c", True, "cmpl-abc-0"),
    ("chatcmpl-abc-12345678", True, "chatcmpl-abc"),
    ("no-suffix", True, "no-suffix"),
    ("cmpl-abc-0", False, "cmpl-abc-0"),
])
def test_vllms_external_id_from_its_internal_id(internal, randomized, external):
    from omni_runtime.kv.transport.wire import vllm_external_request_id

    assert vllm_external_request_id(internal, randomized=randomized) == external
