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

STAGE = "talker"
WAIT = 10.0  # upper bound of every wait; the events themselves come in milliseconds


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


def collect(sender: KVSender, n: int, timeout: float = WAIT):
    acked: list[str] = []
    failed: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while len(acked) + len(failed) < n:
        left = deadline - time.monotonic()
        assert left > 0, f"only {acked} {failed} of {n} results within {timeout}s"
        sender.wait(left)
        a, f = sender.poll()
        acked += a
        failed.update(f)
    return acked, failed


def sample(registry, name, **labels):
    return registry.get_sample_value(name, {"stage": STAGE, "model_name": "", **labels})


@pytest.fixture
def registry():
    return CollectorRegistry()


@pytest.fixture
def make_receiver(registry):
    made: list[KVReceiver] = []

    def make(bind: str = "tcp://127.0.0.1:0", *, inbox: KVInbox | None = None, **kw):
        kw.setdefault("metrics", ReceiverMetrics(stage=STAGE, registry=registry))
        r = KVReceiver(bind, inbox if inbox is not None else KVInbox(max_bytes=16 << 20),
                       stage=STAGE, pipeline="p", **kw)
        made.append(r)
        return r.start()

    yield make
    for r in made:
        r.close()


@pytest.fixture
def receiver(make_receiver):
    return make_receiver()


@pytest.fixture
def make_sender():
    made: list[KVSender] = []

    def make(endpoints, **kw) -> KVSender:
        kw.setdefault("send_timeout_s", WAIT)
        s = KVSender(endpoints, pipeline="p", stage="ar", **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


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
