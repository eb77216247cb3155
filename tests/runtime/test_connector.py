"""KVSender and KVReceiver over real ZeroMQ sockets on 127.0.0.1 (free ports picked at run
time): delivery acks, multi-stage fan-out, rejections, timeouts, unreachable receivers,
reconnection after a receiver restart, bad and fuzzed input from a raw DEALER, metrics (also
in prometheus_client's multiprocess mode) and the receive span."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry

from omni_runtime.kv.transport import REJECT_CODES, KVInbox, KVPayload, KVReceiver, KVSender
from omni_runtime.observability.receiver_metrics import ReceiverMetrics
from omni_runtime.kv.transport.wire import checksum, data_view, encode_header, encode_reply

REPO = Path(__file__).resolve().parents[2]
from transport_fixtures import STAGE, WAIT, collect, make_receiver, make_sender, receiver, registry  # noqa: F401 (fixtures)


def kv(seq_len: int = 8, seed: int = 0, dtype=np.float32) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((2, 2, 2, seq_len, 16)).astype(dtype)


def payload(rid: str, seq_len: int = 8, **kw) -> KVPayload:
    return KVPayload(rid, seq_len, kv(seq_len, seed=hash(rid) % 1000), pipeline="p",
                     from_stage="ar", **kw)


def value(registry, name, **labels):
    """Sum of the samples of ``name`` with these labels (over any others, e.g. the receiver
    families' ``from_stage``)."""
    want = {"stage": STAGE, "model_name": "", **labels}
    found = [s.value for m in registry.collect() for s in m.samples
             if s.name == name and all(s.labels.get(k) == v for k, v in want.items())]
    assert found, (name, labels)
    return sum(found)


def free_port() -> int:
    """A port nothing listens on (a plain socket closes synchronously, unlike ZeroMQ's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------- fixtures
@pytest.fixture
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


class RawDealer:
    """A test peer that sends arbitrary frames to a receiver and reads its replies."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def reply(self, timeout: float = WAIT) -> dict:
        assert self.sock.poll(int(timeout * 1000)), "no reply from the receiver"
        return json.loads(self.sock.recv())


class FakeReceiver:
    """A raw ROUTER standing in for a receiver the test controls (ack, reject, or silence)."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"

    def recv(self, timeout: float = WAIT) -> tuple[bytes, dict]:
        assert self.sock.poll(int(timeout * 1000)), "nothing arrived"
        identity, header, _data = self.sock.recv_multipart()
        return identity, json.loads(header)

    def nothing_within(self, seconds: float) -> bool:
        return self.sock.poll(int(seconds * 1000)) == 0

    def answer(self, identity: bytes, header: dict, ok: bool = True, code: str = "",
               reason: str = "") -> None:
        self.sock.send_multipart([identity, encode_reply(
            transfer_id=header["transfer_id"], request_id=header["request_id"], ok=ok,
            code=code, reason=reason)])


@pytest.fixture
def dealer(zctx, receiver):
    return RawDealer(zctx, receiver.endpoint)


@pytest.fixture
def fake(zctx):
    return FakeReceiver(zctx)


def good_frames(rid: str, seq_len: int = 4, to_stage: str = STAGE, tid: int = 1) -> list[bytes]:
    p = payload(rid, seq_len)
    data = data_view(p.kv)
    return [encode_header(p, transfer_id=tid, to_stage=to_stage,
                          digest=checksum("crc32", data)), bytes(data)]


# ---------------------------------------------------------------------- delivery
def test_ack_means_the_payload_is_already_in_the_inbox(receiver, make_sender, registry):
    sizes: list[int] = []
    sender = make_sender({STAGE: receiver.endpoint}, observe_bytes=sizes.append)
    p = payload("req-1", extra={"trigger": "prefill_finished"})
    sender.submit(p)
    assert collect(sender, 1) == (["req-1"], {})
    assert sender.pending() == 0
    got = receiver.inbox.get("req-1", timeout_s=0)  # no wait: stored before the ack
    assert got is not None and np.array_equal(got.kv, p.kv) and got.kv.dtype == np.float32
    assert (got.from_stage, got.to_stage, got.pipeline, got.extra) == (
        "ar", STAGE, "p", {"trigger": "prefill_finished"})
    assert sizes == [p.kv.nbytes]
    assert value(registry, "omni_kv_received_total", outcome="delivered") == 1
    assert value(registry, "omni_kv_received_bytes_sum") == p.kv.nbytes


@pytest.mark.parametrize("algo", ["xxh3_64", "crc32"])
def test_many_transfers_all_arrive_intact(receiver, make_sender, algo):
    sender = make_sender({STAGE: receiver.endpoint}, max_in_flight=3, checksum_algo=algo)
    sent = {f"r{i}": payload(f"r{i}", seq_len=1 + i) for i in range(40)}
    for p in sent.values():
        sender.submit(p)
    acked, failed = collect(sender, len(sent))
    assert sorted(acked) == sorted(sent) and not failed
    for rid, p in sent.items():
        assert np.array_equal(receiver.inbox.get(rid).kv, p.kv)


def test_bfloat16_and_float16_payloads(receiver, make_sender):
    sender = make_sender({STAGE: receiver.endpoint})
    bits = (kv(3).view(np.uint32) >> 16).astype(np.uint16)
    sender.submit(KVPayload("bf", 3, bits))
    sender.submit(KVPayload("h", 3, kv(3, dtype=np.float16)))
    assert sorted(collect(sender, 2)[0]) == ["bf", "h"]
    bf = receiver.inbox.get("bf")
    assert bf.dtype_name == "bfloat16" and np.array_equal(bf.kv, bits)
    assert receiver.inbox.get("h").kv.dtype == np.float16


def test_acked_only_when_every_endpoint_acked(receiver, fake, make_sender):
    sender = make_sender({STAGE: receiver.endpoint, "vocoder": fake.endpoint})
    sender.submit(payload("both"))
    identity, header = fake.recv()
    assert header["to_stage"] == "vocoder" and header["request_id"] == "both"
    assert receiver.inbox.get("both", timeout_s=WAIT, remove=False) is not None
    # The real receiver has it and acked; the fake one has not answered yet.
    assert sender.poll() == ([], {}) and sender.pending() == 1
    fake.answer(identity, header)
    assert collect(sender, 1) == (["both"], {})


def test_a_rejection_from_any_endpoint_fails_the_transfer_with_its_reason(receiver, fake,
                                                                         make_sender):
    sender = make_sender({STAGE: receiver.endpoint, "vocoder": fake.endpoint})
    sender.submit(payload("r"))
    identity, header = fake.recv()
    fake.answer(identity, header, ok=False, code="inbox_full", reason="no room")
    acked, failed = collect(sender, 1)
    assert acked == [] and failed == {"r": "stage vocoder rejected: inbox_full: no room"}


def test_invalid_payload_fails_without_raising(receiver, make_sender):
    sender = make_sender({STAGE: receiver.endpoint})
    sender.submit(KVPayload("bad", 3, kv(4)))
    acked, failed = collect(sender, 1)
    assert "seq_len" in failed["bad"] and len(receiver.inbox) == 0


def test_oversized_payload_is_rejected_with_an_answer(make_receiver, make_sender, registry):
    receiver = make_receiver(max_payload_bytes=1000)
    sender = make_sender({STAGE: receiver.endpoint})
    sender.submit(payload("big", 8))  # 4096 bytes
    sender.submit(payload("small", 1))  # 512 bytes
    acked, failed = collect(sender, 2)
    assert acked == ["small"] and "oversized" in failed["big"]
    assert value(registry, "omni_kv_receiver_rejected_total", reason="oversized") == 1


def test_frames_beyond_the_hard_limit_drop_the_connection_and_the_receiver_serves_on(
        make_receiver, make_sender, zctx):
    receiver = make_receiver(max_payload_bytes=1000, hard_max_frame_bytes=4096)
    dealer = RawDealer(zctx, receiver.endpoint)
    dealer.send([b"{}", b"\0" * 100_000])  # ZeroMQ disconnects this peer: no answer
    sender = make_sender({STAGE: receiver.endpoint})
    sender.submit(payload("after", 1))
    assert collect(sender, 1) == (["after"], {})
    assert receiver.running


def test_full_inbox_rejects_new_and_keeps_what_it_acked(make_receiver, make_sender, registry):
    receiver = make_receiver(inbox=KVInbox(max_bytes=10000))
    sender = make_sender({STAGE: receiver.endpoint})
    for rid in ("a", "b", "c"):  # 4096 bytes each: the third does not fit
        sender.submit(payload(rid))
    acked, failed = collect(sender, 3)
    assert acked == ["a", "b"] and "inbox_full" in failed["c"]
    assert receiver.inbox.get("a") is not None and receiver.inbox.get("b") is not None
    assert value(registry, "omni_kv_receiver_rejected_total", reason="inbox_full") == 1


def test_wrong_destination_is_rejected(receiver, make_sender):
    sender = make_sender({"vocoder": receiver.endpoint})  # receiver is "talker"
    sender.submit(payload("r"))
    assert "wrong_destination" in collect(sender, 1)[1]["r"]


# ---------------------------------------------------------------------- timeouts, restarts
def test_no_ack_within_the_timeout_fails(fake, make_sender):
    sender = make_sender({STAGE: fake.endpoint}, send_timeout_s=1.0)
    sender.submit(payload("r"))
    fake.recv()  # it arrived; the fake never answers
    acked, failed = collect(sender, 1)
    assert "no ack from stage talker" in failed["r"]


def test_late_ack_after_timeout_is_ignored(fake, make_sender):
    sender = make_sender({STAGE: fake.endpoint}, send_timeout_s=1.0)
    sender.submit(payload("r"))
    identity, header = fake.recv()
    assert "no ack" in collect(sender, 1)[1]["r"]
    fake.answer(identity, header)
    sender.submit(payload("next"))
    identity2, header2 = fake.recv()
    fake.answer(identity2, header2)
    assert collect(sender, 1) == (["next"], {})  # and nothing for "r"
    assert sender.poll() == ([], {})


def test_unreachable_receiver_fails_and_nothing_is_queued_toward_it(make_receiver,
                                                                    make_sender):
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    sender = make_sender({STAGE: endpoint})
    sender.submit(payload("early"), timeout_s=0.3)
    assert "unreachable" in collect(sender, 1)[1]["early"]
    receiver = make_receiver(endpoint)
    sender.submit(payload("later"))
    assert collect(sender, 1) == (["later"], {})
    # ZMQ_IMMEDIATE: the failed transfer was never queued, so it did not arrive later.
    assert "early" not in receiver.inbox and "later" in receiver.inbox


def test_new_receiver_on_the_same_port_gets_new_transfers(make_receiver, make_sender):
    first = make_receiver()
    endpoint = first.endpoint
    sender = make_sender({STAGE: endpoint}, send_timeout_s=1.0)
    sender.submit(payload("one"))
    assert collect(sender, 1) == (["one"], {})
    first.close()
    sender.submit(payload("while-down"))
    acked, failed = collect(sender, 1)
    assert "while-down" in failed
    second = make_receiver(endpoint)
    sender.submit(payload("two"))
    assert collect(sender, 1) == (["two"], {})
    assert "two" in second.inbox and "while-down" not in second.inbox


def test_a_short_per_submit_timeout_expires_even_behind_a_long_one(fake, make_sender):
    sender = make_sender({STAGE: fake.endpoint})  # default timeout: WAIT
    sender.submit(payload("long"))
    sender.submit(payload("short"), timeout_s=0.2)
    identity, header = fake.recv()
    acked, failed = collect(sender, 1, timeout=WAIT / 2)
    assert list(failed) == ["short"] and "within 0.2s" in failed["short"]
    fake.answer(identity, header)
    assert collect(sender, 1) == (["long"], {})


RECEIVER_PROCESS = textwrap.dedent("""
    import sys
    from omni_runtime.kv.transport import KVInbox, KVReceiver
    receiver = KVReceiver(sys.argv[1], KVInbox(), stage="talker")
    receiver.start()
    print("ready", flush=True)
    sys.stdin.read()  # serve until the test closes stdin (or kills this process)
    receiver.close()
""")


@pytest.fixture
def receiver_process():
    procs: list[subprocess.Popen] = []

    def start(endpoint: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", RECEIVER_PROCESS, endpoint], cwd=REPO,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "ready", "receiver process did not start"
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        proc.stdin.close()
        proc.stdout.close()


def test_receiver_process_killed_and_restarted_on_the_same_port(receiver_process,
                                                                make_sender):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    first = receiver_process(endpoint)
    sender = make_sender({STAGE: endpoint}, send_timeout_s=WAIT)
    sender.submit(payload("one"))
    assert collect(sender, 1) == (["one"], {})
    first.kill()
    first.wait(WAIT)
    sender.submit(payload("while-dead"), timeout_s=0.5)
    assert "while-dead" in collect(sender, 1)[1]
    receiver_process(endpoint)  # a new process on the same port
    sender.submit(payload("two"))
    assert collect(sender, 1) == (["two"], {})


def test_in_flight_cap_holds_back_sends_until_acks_come(fake, make_sender):
    sender = make_sender({STAGE: fake.endpoint}, max_in_flight=2)
    for rid in ("a", "b", "c"):
        sender.submit(payload(rid))
    first = fake.recv()
    second = fake.recv()
    assert [first[1]["request_id"], second[1]["request_id"]] == ["a", "b"]
    assert fake.nothing_within(0.3)  # "c" waits for a free slot
    fake.answer(*first)
    third = fake.recv()
    assert third[1]["request_id"] == "c"
    fake.answer(*second)
    fake.answer(*third)
    assert sorted(collect(sender, 3)[0]) == ["a", "b", "c"]


def test_queued_behind_the_cap_past_the_deadline_says_so(fake, make_sender):
    sender = make_sender({STAGE: fake.endpoint}, max_in_flight=1, send_timeout_s=1.0)
    sender.submit(payload("a"))
    sender.submit(payload("b"))
    acked, failed = collect(sender, 2)
    assert "no ack" in failed["a"] and "queued" in failed["b"]


def test_a_resubmit_supersedes_the_older_transfer_of_the_request(fake, make_sender):
    sender = make_sender({STAGE: fake.endpoint})
    sender.submit(payload("r", seq_len=4))
    old = fake.recv()
    sender.submit(payload("r", seq_len=6))
    new = fake.recv()
    assert new[1]["seq_len"] == 6 and new[1]["transfer_id"] != old[1]["transfer_id"]
    assert sender.pending() == 1
    fake.answer(*old)  # the old one's ack resolves nothing
    fake.answer(*new, ok=False, code="inbox_full", reason="x")
    acked, failed = collect(sender, 1)
    assert acked == [] and list(failed) == ["r"]
    assert sender.poll() == ([], {})


def test_wait_times_out_without_results_and_close_fails_what_is_left(fake, make_sender):
    sender = make_sender({STAGE: fake.endpoint})
    assert sender.wait(0.05) is False
    sender.submit(payload("r"))
    fake.recv()
    sender.close(linger_s=0)
    assert sender.poll() == ([], {"r": "sender closed"})
    sender.submit(payload("after"))
    assert sender.poll() == ([], {"after": "sender closed"}) and sender.pending() == 0


def test_close_lingers_for_acks(receiver, make_sender):
    sender = make_sender({STAGE: receiver.endpoint})
    for i in range(5):
        sender.submit(payload(f"r{i}"))
    sender.close(linger_s=WAIT)
    acked, failed = sender.poll()
    assert sorted(acked) == [f"r{i}" for i in range(5)] and not failed


def test_bind_conflict_raises_at_start(receiver, registry):
    other = KVReceiver(receiver.endpoint, KVInbox(), stage=STAGE,
                       metrics=ReceiverMetrics(stage=STAGE, registry=registry))
    with pytest.raises(zmq.ZMQError):
        other.start()


# ---------------------------------------------------------------------- bad input
BAD_INPUTS = [
    ([b"only one frame"], "bad_frames"),
    ([b"a", b"b", b"c"], "bad_frames"),
    ([b"{not json", b"x"], "malformed_header"),
    ([b'{"v": 1}', b"x"], "malformed_header"),
    ([b'{"v": 99}', b"x"], "unsupported_version"),
]


def _corrupt(frames, **changes):
    h = json.loads(frames[0])
    h.update(changes)
    return [json.dumps(h).encode(), frames[1]]


def test_bad_input_is_rejected_answered_counted_and_good_transfers_survive(
        receiver, dealer, make_sender, registry):
    good = good_frames("x")
    bad = BAD_INPUTS + [
        ([good[0], bytes([good[1][0] ^ 1]) + good[1][1:]], "checksum_mismatch"),
        ([good[0], good[1][:-4]], "size_mismatch"),
        (_corrupt(good, request_id="frames", shape=[2, 2, 2, 4, 8]), "size_mismatch"),
        (_corrupt(good, seq_len="4"), "malformed_header"),
    ]
    sender = make_sender({STAGE: receiver.endpoint})
    sent = []
    for i, (frames, code) in enumerate(bad):
        sender.submit(payload(f"good-{i}"))  # before, between and after the bad ones
        sent.append(f"good-{i}")
        dealer.send(frames)
        answer = dealer.reply()
        assert (answer["status"], answer["code"]) == ("rejected", code), answer
        assert answer["reason"]
    sender.submit(payload("good-last"))
    sent.append("good-last")
    acked, failed = collect(sender, len(sent))
    assert sorted(acked) == sorted(sent) and not failed
    assert all(rid in receiver.inbox for rid in sent) and receiver.running
    counts = {c: value(registry, "omni_kv_receiver_rejected_total", reason=c)
              for c in REJECT_CODES}
    expected = {c: sum(1 for _, code in bad if code == c) for c in REJECT_CODES}
    assert counts == expected
    assert value(registry, "omni_kv_received_total", outcome="rejected") == len(bad)
    assert value(registry, "omni_kv_received_total", outcome="delivered") == len(sent)


def test_reject_answer_names_the_transfer_when_the_header_parsed(receiver, dealer):
    frames = _corrupt(good_frames("named", tid=42), checksum="crc32:0")
    dealer.send(frames)
    answer = dealer.reply()
    assert (answer["transfer_id"], answer["request_id"], answer["code"]) == (
        42, "named", "checksum_mismatch")


def test_a_good_raw_transfer_is_acked_by_transfer_id(receiver, dealer):
    dealer.send(good_frames("raw", tid=5))
    assert dealer.reply() == {"v": 1, "transfer_id": 5, "request_id": "raw", "status": "ok",
                              "code": "", "reason": ""}
    assert receiver.inbox.get("raw").seq_len == 4


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(st.binary(max_size=128), min_size=1, max_size=5)
       | st.lists(st.sampled_from([b"{}", b"null", b'{"v": 1}', b"\0" * 64,
                                   json.dumps({"v": 1, "shape": [1] * 5}).encode()]),
                  min_size=1, max_size=3))
def test_fuzz_random_frames_never_kill_the_receiver(receiver, dealer, frames):
    dealer.send(frames)
    answer = dealer.reply()
    assert answer["status"] == "rejected" and answer["code"] in REJECT_CODES
    assert receiver.running


def test_after_fuzzing_the_receiver_still_delivers(receiver, dealer, make_sender):
    rng = np.random.default_rng(1)
    for _ in range(50):
        dealer.send([rng.bytes(int(rng.integers(0, 300))) for _ in range(rng.integers(1, 4))])
    for _ in range(50):
        assert dealer.reply()["status"] == "rejected"
    sender = make_sender({STAGE: receiver.endpoint})
    sender.submit(payload("after-fuzz"))
    assert collect(sender, 1) == (["after-fuzz"], {})


class FlakyInbox(KVInbox):
    """An inbox whose store raises (a bug) for one request id."""

    def put(self, payload):
        if payload.request_id == "boom":
            raise RuntimeError("disk on fire")
        super().put(payload)


def test_a_bug_while_storing_is_answered_internal_error_and_serving_goes_on(
        make_receiver, make_sender, registry):
    receiver = make_receiver(inbox=FlakyInbox(max_bytes=1 << 20))
    sender = make_sender({STAGE: receiver.endpoint})
    for rid in ("before", "boom", "after"):
        sender.submit(payload(rid))
    acked, failed = collect(sender, 3)
    assert sorted(acked) == ["after", "before"]
    assert "internal_error: RuntimeError: disk on fire" in failed["boom"]
    assert value(registry, "omni_kv_receiver_rejected_total", reason="internal_error") == 1
    assert receiver.running


# ---------------------------------------------------------------------- observability
def test_delivered_sizes_feed_the_contracts_transfer_bytes_histogram(receiver, make_sender):
    from omni_runtime.observability.metrics import TransferMetrics

    reg = CollectorRegistry()
    metrics = TransferMetrics(stage="ar", model_name="m", registry=reg)
    sender = make_sender({STAGE: receiver.endpoint},
                         observe_bytes=metrics.observe_transfer_bytes)
    sender.submit(payload("a"))
    sender.submit(KVPayload("bad", 1, kv(2)))  # fails: not observed
    collect(sender, 2)
    labels = {"stage": "ar", "model_name": "m"}
    assert reg.get_sample_value("omni_kv_transfer_bytes_count", labels) == 1
    assert reg.get_sample_value("omni_kv_transfer_bytes_sum", labels) == 4096

def test_inbox_gauges_follow_the_receiver(receiver, make_sender, registry):
    sender = make_sender({STAGE: receiver.endpoint})
    sender.submit(payload("g1"))
    sender.submit(payload("g2"))
    collect(sender, 2)
    assert value(registry, "omni_kv_receiver_buffered_payloads") == 2
    assert value(registry, "omni_kv_receiver_buffered_bytes") == 2 * 4096
    receiver.inbox.get("g1")
    assert value(registry, "omni_kv_receiver_buffered_payloads") == 1
    assert value(registry, "omni_kv_receiver_buffered_bytes") == 4096


def test_metric_labels_are_bounded_and_never_carry_request_ids(receiver, dealer, make_sender,
                                                               registry):
    sender = make_sender({STAGE: receiver.endpoint})
    sender.submit(payload("secret-request-id"))
    collect(sender, 1)
    dealer.send([b"junk"])
    dealer.reply()
    receiver.inbox.get("nope", timeout_s=0)
    allowed = {"stage", "model_name", "outcome", "reason", "thread", "from_stage", "le"}
    for family in registry.collect():
        for s in family.samples:
            assert set(s.labels) <= allowed, s
            assert "secret" not in json.dumps(s.labels), s


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("test"), exporter
    provider.shutdown()


def test_receive_span_is_a_child_of_and_linked_to_the_senders_span(make_receiver,
                                                                   make_sender, spans):
    tracer, exporter = spans
    receiver = make_receiver(tracer=tracer)
    with tracer.start_as_current_span("omni.kv_transfer") as parent:
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier)
    sender = make_sender({STAGE: receiver.endpoint})
    sender.submit(payload("traced", trace_context=carrier))
    sender.submit(payload("untraced"))
    assert sorted(collect(sender, 2)[0]) == ["traced", "untraced"]
    # A span ends before its reply is sent, and SimpleSpanProcessor exports on end.
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "omni.kv_receive"
               and s.attributes["gen_ai.request.id"] == "traced"]
    pctx = parent.get_span_context()
    assert span.kind == SpanKind.CONSUMER
    assert span.context.trace_id == pctx.trace_id and span.parent.span_id == pctx.span_id
    assert [link.context.span_id for link in span.links] == [pctx.span_id]
    assert span.attributes["omni.stage"] == STAGE
    assert span.attributes["omni.kv_receive.outcome"] == "delivered"
    assert span.attributes["omni.kv_receive.seq_len"] == 8
    (root,) = [s for s in exporter.get_finished_spans()
               if s.attributes.get("gen_ai.request.id") == "untraced"]
    assert root.parent is None and not root.links


def test_rejected_transfer_span_has_error_status(make_receiver, spans, zctx):
    tracer, exporter = spans
    receiver = make_receiver(tracer=tracer)
    dealer = RawDealer(zctx, receiver.endpoint)
    dealer.send(_corrupt(good_frames("r"), checksum="crc32:0"))
    dealer.reply()
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "omni.kv_receive"]
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["omni.kv_receive.reason"] == "checksum_mismatch"


def test_metrics_in_multiprocess_mode(tmp_path):
    """The receiving stage's process writes to PROMETHEUS_MULTIPROC_DIR; a reader process
    aggregates the files like the stage's /metrics does."""
    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    script = textwrap.dedent("""
        import numpy as np
        from omni_runtime.kv.transport import KVInbox, KVPayload, KVReceiver, KVSender
        from omni_runtime.observability.receiver_metrics import ReceiverMetrics
        with KVReceiver("tcp://127.0.0.1:0", KVInbox(max_bytes=1 << 20), stage="talker",
                        metrics=ReceiverMetrics(stage="talker")) as r:
            with KVSender({"talker": r.endpoint}, send_timeout_s=10) as s:
                for rid in ("a", "b"):
                    s.submit(KVPayload(rid, 4, np.zeros((1, 2, 1, 4, 8), np.float32)))
                got = []
                while len(got) < 2:
                    assert s.wait(10)
                    got += s.poll()[0]
            r.inbox.get("a")
            assert r.inbox.get("missing", timeout_s=0) is None
    """)
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mp_dir)}
    subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, check=True, timeout=60)
    read = textwrap.dedent("""
        import json
        from prometheus_client import CollectorRegistry, multiprocess
        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg)
        out = {}
        for fam in reg.collect():
            for s in fam.samples:
                if s.labels.get("stage") == "talker":
                    key = s.name + json.dumps({k: v for k, v in sorted(s.labels.items())
                                               if k in ("outcome", "reason")})
                    out[key] = s.value
        print(json.dumps(out))
    """)
    res = subprocess.run([sys.executable, "-c", read], env=env, cwd=REPO, check=True,
                         timeout=60, capture_output=True, text=True)
    got = json.loads(res.stdout)
    assert got['omni_kv_received_total{"outcome": "delivered"}'] == 2
    assert got['omni_kv_receiver_rejected_total{"reason": "oversized"}'] == 0
    assert got["omni_kv_receiver_buffered_payloads{}"] == 1
    assert got["omni_kv_receiver_buffered_bytes{}"] == 256
    assert got['omni_kv_receiver_wait_seconds_count{"outcome": "timeout"}'] == 1
