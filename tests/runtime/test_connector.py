"""KVSender and KVReceiver on the NIXL data plane, end to end in one process: a synthetic AR
rank (torch CPU tensors laid out as vLLM's KV cache, registered with a real NIXL agent,
transport_fixtures.SyntheticAR) offers transfers over real ZeroMQ sockets on 127.0.0.1 to
real receivers, which read the blocks with NIXL and assemble the payload. Every payload is
compared with the one computed from the tensors by indexing them.

Here: delivery and acks, fan-out to several stages, every block layout and dtype, chunked
reads through small staging slots, tensor-parallel shards, rejections (sizes, destinations,
compatibility), the sender's timeouts, in-flight cap and supersession, restarts, bad and
fuzzed control messages from a raw DEALER, metrics (also in multiprocess mode) and the
receive span. The fence: test_connector_fence.py; processes killed and stopped:
test_connector_faults.py; the protocol without sockets: test_connector_wire.py."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

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

from omni_runtime.kv.transport import REJECT_CODES, KVInbox, KVReceiver
from omni_runtime.kv.transport.protocol import MAX_MESSAGE_BYTES, WIRE_VERSION, encode_hello
from omni_runtime.kv.transport.nixl_agent import IN_PROGRESS
from omni_runtime.kv.transport.sender import Unanswered
from omni_runtime.observability.receiver_metrics import ReceiverMetrics

from transport_fixtures import (  # noqa: F401 (fixtures)
    MODEL,
    REPO,
    STAGE,
    WAIT,
    RawDealer,
    ar,
    at_read_done,
    collect,
    fake,
    hold,
    make_ar,
    make_receiver,
    make_sender,
    read_body,
    receiver,
    registry,
    rejected_counts,
    sample,
    wait_for,
    zctx,
)
from procs import free_port


def count_posts(receiver: KVReceiver) -> list[int]:
    """Observe (not change) the receiver: one entry per NIXL READ it posts."""
    posts: list[int] = []
    original = receiver._post

    def post(router, job):
        posts.append(job.next_chunk)
        return original(router, job)

    receiver._post = post
    return posts


# ---------------------------------------------------------------------- delivery
def test_ack_means_the_payload_is_already_in_the_inbox(receiver, ar, make_sender, registry):
    sizes: list[int] = []
    sender = make_sender(ar, {STAGE: receiver.endpoint}, observe_bytes=sizes.append)
    offer = ar.offer("req-1", [5, 6, 9], 10)  # blocks 5, 6 and the first 2 tokens of 9
    sender.submit(offer)
    assert collect(sender, 1) == (["req-1"], {})
    assert sender.pending() == 0
    got = receiver.inbox.get("req-1", timeout_s=0)  # no wait: stored before the ack
    assert got is not None and got.kv.dtype == np.float32
    assert got.kv.shape == (2, 2, 2, 10, 8)
    assert np.array_equal(got.kv, ar.expected([5, 6, 9], 10))
    assert (got.from_stage, got.to_stage, got.pipeline, got.seq_len) == ("ar", STAGE, "p", 10)
    assert got.extra == {"attempt": 0, "block_size": 4}
    assert sizes == [offer.nbytes] == [got.kv.nbytes]
    assert sample(registry, "omni_kv_received_total", outcome="delivered") == 1
    assert sample(registry, "omni_kv_received_bytes_sum") == got.kv.nbytes
    assert receiver.num_delivered == 1 and receiver.num_rejected == 0


def test_many_transfers_all_arrive_intact(make_receiver, ar, make_sender):
    receiver = make_receiver(slots=2)  # more transfers than slots: they queue for one
    sender = make_sender(ar, {STAGE: receiver.endpoint}, max_in_flight=3)
    rng = np.random.default_rng(0)
    sent = {}
    for i in range(30):
        seq_len = int(rng.integers(1, 4 * 6))
        blocks = [int(b) for b in rng.permutation(ar.blocks)[: -(-seq_len // 4)]]
        sent[f"r{i}"] = (blocks, seq_len)
        sender.submit(ar.offer(f"r{i}", blocks, seq_len))
    acked, failed = collect(sender, len(sent))
    assert acked == sorted(sent) and not failed
    for rid, (blocks, seq_len) in sent.items():
        assert np.array_equal(receiver.inbox.get(rid).kv, ar.expected(blocks, seq_len)), rid


@pytest.mark.parametrize("layout, dtype", [
    ("cpu", "float16"), ("cpu", "bfloat16"),
    ("flash", "float32"), ("flash", "bfloat16"),  # two planes: K and V in separate regions
    ("index", "float32"),  # no affine map: the receiver gathers through the element index
])
def test_every_block_layout_and_dtype_assembles_the_exact_payload(receiver, make_ar,
                                                                  make_sender, layout, dtype):
    ar = make_ar(layout=layout, dtype=dtype, heads=3, head_size=4)
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    sender.submit(ar.offer("x", [7, 2, 3], 11))
    assert collect(sender, 1) == (["x"], {})
    got = receiver.inbox.get("x")
    assert got.dtype_name == dtype and got.kv.shape == (2, 2, 3, 11, 4)
    assert np.array_equal(got.kv, ar.expected([7, 2, 3], 11))
    if dtype == "bfloat16":  # the bits widen to the float32 the cache holds
        f32 = ar.caches[0].float()
        assert np.isin(got.as_float32()[0], f32.numpy()).all()


@pytest.mark.parametrize("slot_bytes, layers, num_blocks, reads", [
    (1 << 20, 4, 10, 1),  # the whole transfer in one slot
    (4096, 4, 4, 2),      # 8 blocks of 512 B fit a slot: 2 layers of 4 blocks per chunk
    (4096, 2, 10, 4),     # 10 blocks of one layer do not fit: 8 then 2 blocks per layer
])
@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_a_transfer_larger_than_a_staging_slot_is_read_in_chunks(make_receiver, make_ar,
                                                                 make_sender, slot_bytes,
                                                                 layers, num_blocks, reads,
                                                                 layout):
    ar = make_ar(layers=layers, layout=layout, blocks=32)  # a block: 2x4x2x8x4 B = 512 B
    receiver = make_receiver(slot_bytes=slot_bytes, slots=1)
    posts = count_posts(receiver)
    blocks = [3, 4, 5, 11, 20, 21, 22, 23, 30, 31][:num_blocks]
    seq_len = 4 * len(blocks) - 1
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    sender.submit(ar.offer("big", blocks, seq_len))
    assert collect(sender, 1) == (["big"], {})
    assert len(posts) == reads
    assert np.array_equal(receiver.inbox.get("big").kv, ar.expected(blocks, seq_len))
    assert receiver._staging.available == 1  # the slot is back


def test_by_default_the_host_reads_a_transfer_in_one_read_and_a_device_in_64_mib_chunks(
        make_receiver, make_ar, make_sender):
    """On the host a slot bounds only the size of a READ (UCX's cma copies inside the post):
    the default lets a whole 7B request's KV through in one; on a device the slots are VRAM
    staging and keep 64 MiB."""
    assert KVReceiver("tcp://127.0.0.1:0", staging_device="cuda:0").slot_bytes == 64 << 20
    receiver = make_receiver(slot_bytes=None)
    assert receiver.slot_bytes == 256 << 20 >= 117 << 20
    ar = make_ar(layers=8, blocks=64)
    posts = count_posts(receiver)
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    sender.submit(ar.offer("whole", list(range(3, 40)), 4 * 37))
    assert collect(sender, 1) == (["whole"], {})
    assert posts == [0]
    assert np.array_equal(receiver.inbox.get("whole").kv, ar.expected(list(range(3, 40)), 4 * 37))


def test_offers_that_arrive_together_are_answered_read_by_read(make_receiver, make_ar,
                                                               make_sender):
    """Four offers queued at once, four slots free: each read is answered (``read_done``)
    before the next is posted, so the AR's verdict and the ack of the first transfer travel
    while the next one is read; started all together, the first ack waited for every copy
    (on the host UCX's cma copies inside the post). The receiver's post and reply are
    observed; its real agent's READ is made to return only once done, as cma's does when
    it is not split up (on a loaded machine UCX may finish some of it in a later progress
    call: reads then overlap, as a GPU's do)."""
    receiver = make_receiver(slot_bytes=None, slots=4)
    ar = make_ar(layers=2, blocks=1024)  # 1024 blocks of 512 B a layer: 1 MiB a transfer
    events: list[tuple[str, str]] = []
    post, reply, agent = receiver._post, receiver._reply, receiver._agent
    read = agent.read

    def read_done_in_the_post(*args):
        handle = read(*args)
        wait_for(lambda: agent.state(handle) != IN_PROGRESS, what="the READ", interval=0)
        return handle

    agent.read = read_done_in_the_post

    def logged_post(router, job):
        events.append(("post", job.request.request_id))
        return post(router, job)

    def logged_reply(router, identity, answer):
        events.append((answer.kind, answer.request_id))
        return reply(router, identity, answer)

    receiver._post, receiver._reply = logged_post, logged_reply
    sender = make_sender(ar, {STAGE: receiver.endpoint}, max_in_flight=4)
    # Wired up first (hello, UCX endpoint), so the four offers below arrive together.
    sender.submit(ar.offer("warm", [0], 4))
    assert collect(sender, 1) == (["warm"], {})
    ids = [f"r{i}" for i in range(4)]
    for i, rid in enumerate(ids):
        blocks = list(range(1 + i * 250, 1 + (i + 1) * 250))
        sender.submit(ar.offer(rid, blocks, 4 * 250))
    assert collect(sender, 4) == (ids, {})
    order = [e for e in events if e[1] in ids and e[0] in ("post", "read_done")]
    assert [e[0] for e in order] == ["post", "read_done"] * 4, order
    for rid in ids:
        assert np.array_equal(receiver.inbox.get(rid).kv[0, 0, 0, :4],
                              ar.expected([1 + ids.index(rid) * 250], 4)[0, 0, 0])


def test_the_tokens_and_pipeline_context_a_hand_off_carries_arrive_with_its_payload(
        receiver, make_ar, make_sender):
    """The next stage's input travels with the KV, whole or as tensor-parallel shards."""
    origin = {"request_id": "p-1", "endpoint": "http://127.0.0.1:1"}
    ranks = [make_ar(heads=2, shard=r, num_shards=2, seed=r) for r in range(2)]
    for rank in ranks:
        sender = make_sender(rank, {STAGE: receiver.endpoint})
        sender.submit(rank.offer("tp", [1, 2], 7, token_ids=tuple(range(8)), prompt_len=5,
                                 origin=origin))
        assert collect(sender, 1) == (["tp"], {})
    got = receiver.inbox.get("tp")
    assert (got.token_ids, got.prompt_len, got.origin) == (tuple(range(8)), 5, origin)


def test_tensor_parallel_shards_assemble_into_one_payload(receiver, make_ar, make_sender):
    """Two ranks, each with its half of the KV heads in its own cache, agent and sender:
    the inbox shows the transfer only once both halves are in, heads in rank order."""
    ranks = [make_ar(heads=2, shard=r, num_shards=2, seed=10 + r) for r in range(2)]
    senders = [make_sender(a, {STAGE: receiver.endpoint}) for a in ranks]
    blocks = [[1, 2, 3], [8, 9, 10]]  # each rank's own block ids
    senders[0].submit(ranks[0].offer("tp", blocks[0], 10))
    assert collect(senders[0], 1) == (["tp"], {})
    assert "tp" not in receiver.inbox  # half a transfer is never visible
    senders[1].submit(ranks[1].offer("tp", blocks[1], 10))
    assert collect(senders[1], 1) == (["tp"], {})
    got = receiver.inbox.get("tp")
    assert (got.shard, got.num_shards, got.kv.shape) == (0, 1, (2, 2, 4, 10, 8))
    want = np.concatenate([ranks[r].expected(blocks[r], 10) for r in (0, 1)], axis=2)
    assert np.array_equal(got.kv, want)


def test_a_shard_withdrawn_after_the_other_was_stored_drops_the_assembly(
        receiver, make_ar, make_sender, hold, registry):
    """Rank 0's shard is stored (in its assembly), then rank 1's transfer is withdrawn while
    its read waits for the verdict (the scheduler resolved it: another rank failed it, its
    deadline, a reset): the receiver stores nothing, gives the reserved room back at once, and refuses
    rank 1's shard of that attempt if it comes again."""
    ranks = [make_ar(heads=2, shard=r, num_shards=2, seed=20 + r) for r in range(2)]
    senders = [make_sender(a, {STAGE: receiver.endpoint}) for a in ranks]
    senders[0].submit(ranks[0].offer("tp", [1, 2, 3], 10))
    assert collect(senders[0], 1) == (["tp"], {})
    assert receiver.inbox.bytes > 0 and "tp" not in receiver.inbox
    held = hold(receiver, "_reply", at_read_done)
    senders[1].submit(ranks[1].offer("tp", [4, 5, 6], 10))
    held.wait_entered()
    assert senders[1].cancel("tp", 0)
    held.release()
    wait_for(lambda: receiver.num_aborted == 1, what="the aborted read")
    assert "tp" not in receiver.inbox and receiver.inbox.bytes == 0
    assert sample(registry, "omni_kv_receiver_evicted_total", reason="abandoned") == 1
    senders[1].submit(ranks[1].offer("tp", [4, 5, 6], 10))  # the same attempt, again
    acked, failed = collect(senders[1], 1)
    assert acked == [] and "shard_mismatch" in failed["tp"] and "cannot be assembled" in \
        failed["tp"]
    assert "tp" not in receiver.inbox and receiver.inbox.bytes == 0


def test_a_shard_refused_first_keeps_the_others_of_its_attempt_out(receiver, make_ar,
                                                                    make_sender, hold):
    """Rank 0's read of an attempt is withdrawn (aborted) before rank 1's shard of it comes:
    rank 1's shard, read and committed, is refused, and nothing is stored."""
    ranks = [make_ar(heads=2, shard=r, num_shards=2, seed=30 + r) for r in range(2)]
    senders = [make_sender(a, {STAGE: receiver.endpoint}) for a in ranks]
    held = hold(receiver, "_reply", at_read_done)
    senders[0].submit(ranks[0].offer("tp", [1], 4))
    held.wait_entered()
    assert senders[0].cancel("tp", 0)
    held.release()
    wait_for(lambda: receiver.num_aborted == 1, what="the aborted read")
    senders[1].submit(ranks[1].offer("tp", [2], 4))
    acked, failed = collect(senders[1], 1)
    assert acked == [] and "shard_mismatch" in failed["tp"]
    assert "tp" not in receiver.inbox and receiver.inbox.bytes == 0


def test_the_second_shard_uses_the_room_its_transfer_reserved(make_receiver, make_ar,
                                                              make_sender):
    """The first shard reserves the whole payload in the inbox; the second must not be
    refused for want of that same room (fixed: the receiver counted it twice)."""
    ranks = [make_ar(heads=1, shard=r, num_shards=2, seed=r) for r in range(2)]
    whole = 7 * ranks[0].token_bytes * 2
    receiver = make_receiver(inbox=KVInbox(max_bytes=whole + whole // 2))
    for r in (0, 1):
        sender = make_sender(ranks[r], {STAGE: receiver.endpoint})
        sender.submit(ranks[r].offer("tp", [1, 2], 7))
        assert collect(sender, 1) == (["tp"], {})
    assert receiver.inbox.get("tp").kv.shape == (2, 2, 2, 7, 8)


def test_a_resend_replaces_its_stored_payload_in_a_nearly_full_inbox(make_receiver, ar,
                                                                     make_sender):
    """A re-sent transfer of a stored request (a preemption's new attempt) replaces it; the
    receiver must count the bytes the replacement frees (fixed: it refused inbox_full)."""
    nbytes = 7 * ar.token_bytes
    receiver = make_receiver(inbox=KVInbox(max_bytes=nbytes + nbytes // 2))
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    sender.submit(ar.offer("r", [1, 2], 7))
    assert collect(sender, 1) == (["r"], {})
    sender.submit(ar.offer("r", [3, 4], 7, attempt=1))
    assert collect(sender, 1) == (["r"], {})
    got = receiver.inbox.get("r")
    assert got.extra["attempt"] == 1 and np.array_equal(got.kv, ar.expected([3, 4], 7))


def test_acked_only_when_every_endpoint_acked(make_receiver, ar, make_sender, hold):
    talker, vocoder = make_receiver(), make_receiver(stage="vocoder")
    held = hold(vocoder, "_reply", at_read_done)
    sender = make_sender(ar, {STAGE: talker.endpoint, "vocoder": vocoder.endpoint})
    sender.submit(ar.offer("both", [1], 3))
    assert talker.inbox.get("both", timeout_s=WAIT, remove=False) is not None
    held.wait_entered()
    # The talker has it and acked; the vocoder has read it but not said so yet.
    assert sender.poll() == {} and sender.pending() == 1
    held.release()
    assert collect(sender, 1) == (["both"], {})
    for r in (talker, vocoder):
        assert np.array_equal(r.inbox.get("both").kv, ar.expected([1], 3))


def test_a_rejection_from_any_endpoint_fails_the_transfer_with_its_reason(make_receiver, ar,
                                                                         make_sender):
    talker, vocoder = make_receiver(), make_receiver(stage="vocoder", max_payload_bytes=1000)
    sender = make_sender(ar, {STAGE: talker.endpoint, "vocoder": vocoder.endpoint})
    sender.submit(ar.offer("r", [1, 2], 8))  # 2048 bytes
    acked, failed = collect(sender, 1)
    assert acked == [] and failed["r"].startswith("stage vocoder rejected: oversized: 2048")


def test_oversized_payload_is_rejected_before_any_read(make_receiver, ar, make_sender,
                                                       registry):
    receiver = make_receiver(max_payload_bytes=1000)
    posts = count_posts(receiver)
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    sender.submit(ar.offer("big", [1, 2], 8))  # 2048 bytes
    sender.submit(ar.offer("small", [1], 3))  # 768 bytes
    acked, failed = collect(sender, 2)
    assert acked == ["small"] and "oversized" in failed["big"]
    assert len(posts) == 1
    assert sample(registry, "omni_kv_receiver_rejected_total", reason="oversized") == 1


def test_a_block_larger_than_a_staging_slot_is_refused_oversized(make_receiver, make_ar,
                                                                 make_sender, spans):
    tracer, exporter = spans
    ar = make_ar(block_size=64, head_size=32)  # a block: 2 x 64 x 64 x 4 B = 32 KiB
    receiver = make_receiver(slot_bytes=8192, tracer=tracer)
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    sender.submit(ar.offer("r", [1], 10))
    assert "oversized" in collect(sender, 1)[1]["r"]
    # The receive span of the refused read ends, with the refusal (fixed: it never ended).
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "omni.kv_receive"]
    assert span.attributes["omni.kv_receive.reason"] == "oversized"


def test_a_message_beyond_zeromqs_limit_drops_that_peer_and_the_receiver_serves_on(
        receiver, ar, make_sender, zctx):
    dealer = RawDealer(zctx, receiver.endpoint)
    dealer.send([b"{}", b"\0" * (9 << 20)])  # over the ROUTER's 8 MiB MAXMSGSIZE: no answer
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    sender.submit(ar.offer("after", [1], 2))
    assert collect(sender, 1) == (["after"], {})
    assert receiver.running


def test_full_inbox_rejects_new_and_keeps_what_it_acked(make_receiver, ar, make_sender,
                                                        registry):
    receiver = make_receiver(inbox=KVInbox(max_bytes=5000))
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    for rid in ("a", "b", "c"):  # 2048 bytes each: the third does not fit
        sender.submit(ar.offer(rid, [1, 2], 8))
    acked, failed = collect(sender, 3)
    assert acked == ["a", "b"] and "inbox_full" in failed["c"]
    assert receiver.inbox.get("a") is not None and receiver.inbox.get("b") is not None
    assert sample(registry, "omni_kv_receiver_rejected_total", reason="inbox_full") == 1


def test_a_sender_for_another_stage_is_refused_at_its_hello(receiver, ar, make_sender,
                                                            registry):
    sender = make_sender(ar, {"vocoder": receiver.endpoint})  # the receiver is "talker"
    sender.submit(ar.offer("r", [1], 2))
    why = collect(sender, 1)[1]["r"]
    assert why.startswith("stage vocoder refused this sender: wrong_destination")
    assert sample(registry, "omni_kv_receiver_rejected_total", reason="wrong_destination") == 1
    assert len(receiver.inbox) == 0


# ---------------------------------------------------------------------- compatibility
def test_an_ar_of_another_model_is_refused_incompatible_and_every_offer_fails(
        make_receiver, ar, make_sender, registry):
    receiver = make_receiver(expect={"model": "another/model"})
    posts = count_posts(receiver)
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    sender.submit(ar.offer("a", [1], 2))
    sender.submit(ar.offer("b", [2], 2))
    acked, failed = collect(sender, 2)
    assert not acked and set(failed) == {"a", "b"}
    for why in failed.values():
        assert why.startswith("stage talker refused this sender: incompatible: ")
        assert "model is 'm', this stage expects 'another/model'" in why
    # Refused once (the hello), nothing read; a later offer fails at once, loudly.
    assert rejected_counts(registry) == {"incompatible": 1}
    sender.submit(ar.offer("c", [3], 2))
    assert "incompatible" in collect(sender, 1)[1]["c"]
    assert posts == [] and len(receiver.inbox) == 0 and receiver.known_agents == []


def test_an_ar_of_another_pipeline_revision_is_refused_incompatible(make_receiver, make_ar,
                                                                   make_sender, registry):
    """A rollout's old sender that reaches a receiver of the new revision (a Service misrouted,
    a stale endpoint) fails loudly at its hello: nothing is read or stored. A sender of the
    receiver's own revision is served."""
    receiver = make_receiver(expect={"model": MODEL, "revision": "5c0ffee"})
    old = make_ar(revision="0ld0ld")
    sender = make_sender(old, {STAGE: receiver.endpoint})
    sender.submit(old.offer("a", [1], 2))
    why = collect(sender, 1)[1]["a"]
    assert why.startswith("stage talker refused this sender: incompatible: ")
    assert "revision is '0ld0ld', this stage expects '5c0ffee'" in why
    assert rejected_counts(registry) == {"incompatible": 1} and len(receiver.inbox) == 0
    same = make_ar(revision="5c0ffee")
    sender = make_sender(same, {STAGE: receiver.endpoint})
    sender.submit(same.offer("b", [1], 2))
    assert collect(sender, 1)[0] == ["b"] and len(receiver.inbox) == 1


def test_a_hello_whose_hash_does_not_match_its_fields_is_refused(receiver, ar, make_sender,
                                                                 registry):
    forged = dataclasses.replace(ar.hello, compat_hash="0" * 32)
    sender = make_sender(ar, {STAGE: receiver.endpoint}, hello=forged)
    sender.submit(ar.offer("r", [1], 2))
    why = collect(sender, 1)[1]["r"]
    assert "incompatible: compat_hash does not match the compatibility fields" in why
    assert rejected_counts(registry) == {"incompatible": 1}


def test_a_hello_with_another_agents_metadata_is_refused(make_receiver, ar, make_sender,
                                                         zctx, registry):
    """A peer saying hello under one name with another agent's NIXL metadata is refused
    (fixed: it was accepted; the receiver then had two peers on one NIXL remote agent, and
    forgetting the idle impostor unloaded the real agent: its reads all failed)."""
    receiver = make_receiver(agent_idle_ttl_s=0.3)
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    sender.submit(ar.offer("first", [1], 2))
    assert collect(sender, 1) == (["first"], {})
    answer = RawDealer(zctx, receiver.endpoint).hello(ar, agent="impostor")
    assert (answer["type"], answer["code"]) == ("rejected", "malformed")
    assert f"is agent {ar.name}'s" in answer["reason"]
    # The real agent stays busy past the impostor's idle TTL: its reads go on.
    until, i = time.monotonic() + 1.0, 0
    while time.monotonic() < until:
        sender.submit(ar.offer(f"r{i}", [i % 8], 3))
        assert collect(sender, 1) == ([f"r{i}"], {})
        i += 1
    assert rejected_counts(registry) == {"malformed": 1}


def test_a_read_whose_compat_hash_differs_from_its_hello_is_refused(receiver, ar, zctx,
                                                                    registry):
    dealer = RawDealer(zctx, receiver.endpoint, ar)
    assert dealer.hello(ar)["type"] == "hello_ok"
    dealer.read(ar, 3, "r", [1, 2], 6, compat_hash="f" * 32)
    answer = dealer.reply()
    assert (answer["type"], answer["code"], answer["transfer_id"]) == (
        "rejected", "incompatible", 3)
    assert rejected_counts(registry) == {"incompatible": 1} and "r" not in receiver.inbox


# ---------------------------------------------------------------------- timeouts, restarts
def test_no_ack_within_the_timeout_fails(fake, ar, make_sender):
    sender = make_sender(ar, {STAGE: fake.endpoint}, send_timeout_s=0.5)
    sender.submit(ar.offer("r", [1], 2))
    fake.recv()  # it arrived; the fake never answers
    acked, failed = collect(sender, 1)
    assert "no ack from stage talker" in failed["r"] and "within 0.5s" in failed["r"]
    # No answer before the deadline: the transfer's outcome is expired, not failed (a hung
    # receiver was counted failed, against the metrics' and the runbooks' meaning).
    assert isinstance(failed["r"], Unanswered)


def test_late_answers_after_the_timeout_are_ignored(fake, ar, make_sender):
    sender = make_sender(ar, {STAGE: fake.endpoint}, send_timeout_s=0.5)
    sender.submit(ar.offer("r", [1], 2))
    identity, read = fake.recv()
    assert "no ack" in collect(sender, 1)[1]["r"]
    fake.send(identity, "read_done", read)
    _, verdict = fake.recv()  # the fence: a resolved transfer's read is never committed
    assert (verdict["type"], verdict["transfer_id"], verdict["commit"]) == (
        "verdict", read["transfer_id"], False)
    fake.send(identity, "ok", read)
    sender.submit(ar.offer("next", [1], 2))
    identity2, read2 = fake.recv()
    fake.send(identity2, "read_done", read2)
    _, verdict2 = fake.recv()
    assert verdict2["commit"] is True
    fake.send(identity2, "ok", read2)
    assert collect(sender, 1) == (["next"], {})  # and nothing for "r"
    assert sender.poll() == {}


def test_unreachable_receiver_fails_and_nothing_is_queued_toward_it(make_receiver, ar,
                                                                    make_sender):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sender = make_sender(ar, {STAGE: endpoint})
    sender.submit(ar.offer("early", [1], 2), timeout_s=0.3)
    assert "unreachable" in collect(sender, 1)[1]["early"]
    receiver = make_receiver(endpoint)
    sender.submit(ar.offer("later", [1], 2))
    assert collect(sender, 1) == (["later"], {})
    # The failed transfer was never queued, so it did not arrive later.
    assert "early" not in receiver.inbox and "later" in receiver.inbox


def test_a_new_receiver_on_the_same_port_gets_a_new_hello_and_new_transfers(
        make_receiver, ar, make_sender):
    first = make_receiver()
    endpoint = first.endpoint
    sender = make_sender(ar, {STAGE: endpoint}, send_timeout_s=1.0)
    sender.submit(ar.offer("one", [1], 2))
    assert collect(sender, 1) == (["one"], {})
    assert first.known_agents == [ar.name]
    first.close()
    sender.submit(ar.offer("while-down", [1], 2))
    acked, failed = collect(sender, 1)
    assert "while-down" in failed
    second = make_receiver(endpoint)  # a new NIXL agent: the sender must say hello again
    sender.submit(ar.offer("two", [2, 3], 6))
    assert collect(sender, 1) == (["two"], {})
    assert second.known_agents == [ar.name]
    assert np.array_equal(second.inbox.get("two").kv, ar.expected([2, 3], 6))
    assert "while-down" not in second.inbox


def test_a_short_per_submit_timeout_expires_even_behind_a_long_one(fake, ar, make_sender):
    sender = make_sender(ar, {STAGE: fake.endpoint})  # default timeout: WAIT
    sender.submit(ar.offer("long", [1], 2))
    sender.submit(ar.offer("short", [2], 2), timeout_s=0.2)
    identity, read = fake.recv()
    assert fake.recv()[1]["request_id"] == "short"  # offered too, never answered
    acked, failed = collect(sender, 1, timeout=WAIT / 2)
    assert list(failed) == ["short"] and "within 0.2s" in failed["short"]
    fake.send(identity, "read_done", read)
    assert fake.recv()[1]["commit"] is True
    fake.send(identity, "ok", read)
    assert collect(sender, 1) == (["long"], {})


def test_in_flight_cap_holds_back_offers_until_answers_come(fake, ar, make_sender):
    sender = make_sender(ar, {STAGE: fake.endpoint}, max_in_flight=2)
    for rid in ("a", "b", "c"):
        sender.submit(ar.offer(rid, [1], 2))
    first, second = fake.recv(), fake.recv()
    assert [first[1]["request_id"], second[1]["request_id"]] == ["a", "b"]
    assert fake.nothing_within(0.3)  # "c" waits for a free slot
    fake.send(first[0], "ok", first[1])
    third = fake.recv()
    assert third[1]["request_id"] == "c"
    fake.send(second[0], "ok", second[1])
    fake.send(third[0], "ok", third[1])
    assert collect(sender, 3) == (["a", "b", "c"], {})


def test_queued_behind_the_cap_past_the_deadline_says_so(fake, ar, make_sender):
    sender = make_sender(ar, {STAGE: fake.endpoint}, max_in_flight=1, send_timeout_s=0.5)
    sender.submit(ar.offer("a", [1], 2))
    sender.submit(ar.offer("b", [1], 2))
    assert fake.recv()[1]["request_id"] == "a"  # never answered
    acked, failed = collect(sender, 2)
    assert "no ack" in failed["a"] and "queued" in failed["b"]


def test_a_transfer_whose_time_ran_out_in_the_queue_is_never_offered(fake, ar, make_sender):
    """The cap frees (an ack) after a queued transfer's deadline passed but before the I/O
    thread expired it: it is not offered with no time left, and its failure says it was
    queued (fixed: it was offered, then failed "no ack"). The I/O thread is made slow in the
    ack's metrics callback until the deadline has passed: a mock of the delay only."""
    gate = threading.Event()
    sender = make_sender(ar, {STAGE: fake.endpoint}, max_in_flight=1,
                         observe_bytes=lambda _n: gate.wait(WAIT))
    sender.submit(ar.offer("a", [1], 2))
    sender.submit(ar.offer("b", [2], 2), timeout_s=0.3)
    identity, read = fake.recv()
    fake.send(identity, "ok", read)
    assert collect(sender, 1) == (["a"], {})  # reported; the thread is in the callback now
    deadline = sender._latest["b"].deadline
    wait_for(lambda: time.monotonic() > deadline, what="b's deadline")
    gate.set()
    acked, failed = collect(sender, 1)
    assert failed["b"].startswith("still queued for stage talker")
    assert fake.nothing_within(0.2)


def test_a_resubmit_supersedes_the_older_transfer_of_the_request(fake, ar, make_sender):
    sender = make_sender(ar, {STAGE: fake.endpoint})
    sender.submit(ar.offer("r", [1], 4))
    old = fake.recv()
    sender.submit(ar.offer("r", [1, 2], 6, attempt=1))
    new = fake.recv()
    assert (new[1]["seq_len"], new[1]["attempt"]) == (6, 1)
    assert new[1]["transfer_id"] != old[1]["transfer_id"]
    assert sender.pending() == 1
    fake.send(old[0], "read_done", old[1])  # the old one's read is not committed...
    assert fake.recv()[1]["commit"] is False
    fake.send(old[0], "ok", old[1])  # ...and its ack resolves nothing
    fake.send(new[0], "rejected", new[1], code="inbox_full", reason="x")
    assert collect(sender, 1) == ([], {"r": "stage talker rejected: inbox_full: x"})
    assert sender.poll() == {}


def test_wait_times_out_without_answers_and_close_fails_what_is_left(fake, ar, make_sender):
    sender = make_sender(ar, {STAGE: fake.endpoint})
    assert sender.wait(0.05) is False
    sender.submit(ar.offer("r", [1], 2, attempt=3))
    fake.recv()
    sender.close(linger_s=0)
    assert sender.poll() == {"r": (3, "sender closed")}
    sender.submit(ar.offer("after", [1], 2))
    assert sender.poll() == {"after": (0, "sender closed")} and sender.pending() == 0


def test_close_lingers_for_acks(receiver, ar, make_sender):
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    for i in range(5):
        sender.submit(ar.offer(f"r{i}", [i], 3))
    sender.close(linger_s=WAIT)
    answers = sender.poll()
    assert answers == {f"r{i}": (0, None) for i in range(5)}


def test_a_transfer_submitted_right_after_construction_is_acked_within_a_short_deadline(
        receiver, ar, make_sender):
    """No wake-up is lost whatever the order in which the threads start (issue 25): the
    first submit() comes before the I/O thread may even run; a lost wake-up would leave
    it queued until the thread's idle timeout (1 s), past the 0.3 s deadline."""
    for i in range(5):
        sender = make_sender(ar, {STAGE: receiver.endpoint})
        sender.submit(ar.offer(f"w{i}", [1, 2], 7), timeout_s=0.3)
        assert collect(sender, 1, timeout=WAIT) == ([f"w{i}"], {})
        sender.close()


def test_bind_conflict_raises_at_start(receiver, registry):
    other = KVReceiver(receiver.endpoint, KVInbox(), stage=STAGE, slot_bytes=8192, slots=1,
                       metrics=ReceiverMetrics(stage=STAGE, registry=registry))
    with pytest.raises(zmq.ZMQError):
        other.start()


# ---------------------------------------------------------------------- bad input
def _msg(body: dict, *rest: bytes) -> list[bytes]:
    return [json.dumps(body).encode(), *rest]


def bad_messages(ar, stranger) -> list[tuple[str, list[bytes], str]]:
    """(what, frames, the code it must be answered with). ``ar`` said hello on this
    connection; ``stranger`` never did."""
    hello = json.loads(encode_hello(dataclasses.replace(ar.hello, to_stage=STAGE))[0])
    meta = ar.agent.metadata()

    def read(**changes):
        body = read_body(ar, 9, "bad", [1, 2], 7)
        for k, v in changes.items():
            if v is ...:
                del body[k]
            else:
                body[k] = v
        return _msg(body)

    def changed_hello(**changes):
        return _msg({**hello, **changes}, meta)

    compat = dict(hello["compat"], model="other")
    from omni_runtime.kv.transport.protocol import Compat
    other_model = Compat(**compat)
    return [
        ("not JSON", [b"{not json"], "malformed"),
        ("a JSON list", [b"[1, 2]"], "malformed"),
        ("an old version", _msg({"v": 1, "type": "read"}), "unsupported_version"),
        ("no version", _msg({"type": "read"}), "unsupported_version"),
        ("no type", _msg({"v": WIRE_VERSION}), "malformed"),
        ("an unknown type", _msg({"v": WIRE_VERSION, "type": "push"}), "malformed"),
        ("a message over 4 MiB", [b" " * (MAX_MESSAGE_BYTES + 1)], "malformed"),
        ("a hello without metadata", _msg(hello), "bad_frames"),
        ("a hello with empty metadata", _msg(hello, b""), "malformed"),
        ("a hello without regions", _msg({k: v for k, v in hello.items() if k != "regions"},
                                         meta), "malformed"),
        ("a hello with one region short", changed_hello(regions=hello["regions"][:-1]),
         "malformed"),
        ("a hello whose hash is not its fields'", changed_hello(compat_hash="0" * 32),
         "incompatible"),
        ("a hello of another model", changed_hello(compat=compat,
                                                   compat_hash=other_model.hash()),
         "incompatible"),
        ("a hello whose block format is not its layout",
         changed_hello(block_format={**hello["block_format"], "block_numel": 1 << 20}),
         "incompatible"),
        ("a hello for another stage", changed_hello(to_stage="vocoder"), "wrong_destination"),
        ("a hello with garbage agent metadata",
         _msg({**hello, "agent": "garbage"}, b"\x01garbage"), "malformed"),
        ("a read with two frames", read() + [b"x"], "bad_frames"),
        ("a read without seq_len", read(seq_len=...), "malformed"),
        ("a read of a zero length", read(seq_len=0), "malformed"),
        ("a read with a string seq_len", read(seq_len="7"), "malformed"),
        ("a read outside the registered blocks", read(runs=[[ar.blocks - 1, 2]]), "malformed"),
        ("a read whose runs do not cover seq_len", read(runs=[[1, 1]]), "malformed"),
        ("a read whose runs cover more than seq_len", read(runs=[[1, 3]]), "malformed"),
        ("a read of a negative block", read(runs=[[-1, 2]]), "malformed"),
        ("a read from an agent with no hello", read(agent=stranger.name,
                                                    compat_hash=stranger.compat.hash()),
         "unknown_agent"),
        ("a read of another shard than its hello's", read(shard=1, num_shards=2), "malformed"),
        ("a read whose hash is not its hello's", read(compat_hash="a" * 32), "incompatible"),
        ("a read for another pipeline", read(pipeline="other"), "wrong_destination"),
        ("a read for another stage", read(to_stage="vocoder"), "wrong_destination"),
        ("a read too big for this stage", read(seq_len=60, runs=[[0, 15]]), "oversized"),
        ("a read with no time left", read(deadline_in_s=0), "deadline"),
        ("a read with a NaN deadline", [read()[0].replace(b'"deadline_in_s": 10.0',
                                                          b'"deadline_in_s": NaN')],
         "malformed"),
        ("a trace context of non-strings", read(trace_context={"traceparent": 5}), "malformed"),
        ("a trace context that is a list", read(trace_context=["00-x"]), "malformed"),
        ("an external request id that is no string", read(external_request_id=5), "malformed"),
        ("a verdict without commit", _msg({"v": WIRE_VERSION, "type": "verdict", "agent": ar.name,
                                           "transfer_id": 1}), "malformed"),
        ("a verdict with two frames", _msg({"v": WIRE_VERSION, "type": "verdict", "agent": ar.name,
                                            "transfer_id": 1, "commit": True}, b"x"),
         "bad_frames"),
    ]


def test_every_kind_of_bad_message_is_answered_with_its_code_counted_and_good_transfers_go_on(
        make_receiver, make_ar, make_sender, zctx, registry):
    receiver = make_receiver(max_payload_bytes=4096)
    ar, stranger = make_ar(), make_ar()
    dealer = RawDealer(zctx, receiver.endpoint, ar)
    assert dealer.hello(ar)["type"] == "hello_ok"
    other = make_ar(seed=3)
    sender = make_sender(other, {STAGE: receiver.endpoint})
    bad = bad_messages(ar, stranger)
    sent = []
    for i, (what, frames, code) in enumerate(bad):
        sender.submit(other.offer(f"good-{i}", [i % 8, 8 + i % 8], 7))  # between the bad ones
        sent.append(f"good-{i}")
        dealer.send(frames)
        answer = dealer.reply()
        assert (answer["type"], answer["code"]) == ("rejected", code), (what, answer)
        assert answer["reason"], what
    acked, failed = collect(sender, len(sent))
    assert acked == sorted(sent) and not failed
    for i in range(len(bad)):
        got = receiver.inbox.get(f"good-{i}")
        assert np.array_equal(got.kv, other.expected([i % 8, 8 + i % 8], 7))
    assert receiver.running and receiver.num_internal_errors == 0
    expected = {}
    for _, _, code in bad:
        expected[code] = expected.get(code, 0) + 1
    assert rejected_counts(registry) == expected
    assert sample(registry, "omni_kv_received_total", outcome="rejected") == len(bad)
    assert sample(registry, "omni_kv_received_total", outcome="delivered") == len(sent)
    # The agent that said hello is still known and its reads are served.
    dealer.read(ar, 77, "raw-after", [3], 2)
    assert dealer.reply()["type"] == "read_done"
    dealer.verdict(ar, 77)
    assert dealer.reply()["type"] == "ok"


def test_a_rejection_names_the_transfer_when_the_read_parsed(receiver, ar, zctx):
    dealer = RawDealer(zctx, receiver.endpoint, ar)
    dealer.hello(ar)
    dealer.read(ar, 42, "named", [1, 2], 6, seq_len="6")
    answer = dealer.reply()
    assert (answer["transfer_id"], answer["request_id"], answer["code"]) == (
        42, "named", "malformed")
    assert "seq_len" in answer["reason"]


def test_a_raw_peer_speaking_for_an_agent_gets_the_exact_blocks(receiver, ar, zctx):
    """The protocol by hand: hello, read, read_done, verdict commit, ok; an aborted read
    of the same blocks is answered and stores nothing."""
    dealer = RawDealer(zctx, receiver.endpoint, ar)
    assert dealer.hello(ar) == {"v": WIRE_VERSION, "type": "hello_ok", "transfer_id": None,
                                "request_id": None, "conn": 0, "code": "", "reason": ""}
    dealer.read(ar, 5, "raw", [3, 4], 7)
    assert dealer.reply()["type"] == "read_done"
    dealer.verdict(ar, 5)
    assert dealer.reply() == {"v": WIRE_VERSION, "type": "ok", "transfer_id": 5, "request_id": "raw",
                              "conn": None, "code": "", "reason": ""}
    assert np.array_equal(receiver.inbox.get("raw").kv, ar.expected([3, 4], 7))
    dealer.read(ar, 6, "aborted", [3, 4], 7)
    assert dealer.reply()["type"] == "read_done"
    dealer.verdict(ar, 6, commit=False)
    answer = dealer.reply()
    assert (answer["type"], answer["code"], answer["transfer_id"]) == ("rejected", "deadline", 6)
    assert "aborted" not in receiver.inbox and receiver.num_aborted == 1


# A hypothesis fuzz of whole control messages at a live receiver: the JSON values a field
# may be replaced with, and the messages to mutate.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 1 << 64) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=10,
)


@pytest.fixture
def live(receiver, ar, zctx):
    """A raw peer that said hello for ``ar`` to a live receiver."""
    dealer = RawDealer(zctx, receiver.endpoint, ar)
    assert dealer.hello(ar)["type"] == "hello_ok"
    return receiver, ar, dealer


def exchange(dealer: RawDealer, frames: list[bytes], tag: int) -> list[dict]:
    """Send ``frames``, then a marker message; the replies before the marker's are the
    frames' own (a verdict for nothing gets none). A read the receiver took on is answered
    after the marker: it gets its verdict (commit) and its final answer."""
    channel = dealer.channel(frames)  # the marker goes the same way, so it is answered after
    dealer.send(frames, channel)
    dealer.send(_msg({"v": WIRE_VERSION, "type": f"marker-{tag}"}), channel)
    replies = []
    while True:
        reply = dealer.reply()
        if reply["type"] == "rejected" and f"marker-{tag}" in reply["reason"]:
            break
        replies.append(reply)
    try:
        body = json.loads(frames[0])
    except ValueError:
        return replies
    if not isinstance(body, dict):
        return replies
    tid = body.get("transfer_id")
    if body.get("type") != "read" or not isinstance(tid, int) or isinstance(tid, bool):
        return replies
    mine = [r for r in replies if r["transfer_id"] == tid]
    if not mine:  # taken on: its answer comes once it is read
        mine.append(dealer.reply())
        replies.append(mine[-1])
    if mine[-1]["type"] == "read_done":
        dealer.send(_msg({"v": WIRE_VERSION, "type": "verdict", "agent": body["agent"],
                          "transfer_id": tid, "commit": True}))
        replies.append(dealer.reply())
        assert replies[-1]["transfer_id"] == tid, replies
    return replies


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_control_messages_at_a_live_receiver(live, data):
    receiver, ar, dealer = live
    kind = data.draw(st.sampled_from(["raw", "hello", "read", "verdict"]))
    if kind == "raw":
        frames = data.draw(st.lists(st.binary(max_size=64), min_size=1, max_size=3))
    else:
        if kind == "hello":
            frames = encode_hello(dataclasses.replace(ar.hello, to_stage=STAGE))
        elif kind == "read":
            tid = data.draw(st.integers(1000, 1 << 30))
            frames = _msg(read_body(ar, tid, f"f{tid}", [1, 2], 7))
        else:
            frames = _msg({"v": WIRE_VERSION, "type": "verdict", "agent": ar.name, "transfer_id": 1,
                           "commit": True})
        body = json.loads(frames[0])
        changes = data.draw(st.dictionaries(st.sampled_from(sorted(body) + ["extra"]),
                                            json_values, max_size=3))
        body.update(changes)
        frames = [json.dumps(body).encode(), *frames[1:]]
    replies = exchange(dealer, frames, data.draw(st.integers(0, 1 << 30)))
    for reply in replies:
        assert reply["type"] in ("hello_ok", "read_done", "ok", "rejected"), reply
        if reply["type"] == "rejected":
            assert reply["code"] in REJECT_CODES and reply["code"] != "internal_error", reply
    if kind != "verdict":
        assert replies, "a hello or read went unanswered"
    assert receiver.running and receiver.num_internal_errors == 0


def test_after_fuzzing_the_receiver_still_delivers(receiver, ar, make_sender, zctx):
    rng = np.random.default_rng(1)
    dealer = RawDealer(zctx, receiver.endpoint)
    for _ in range(50):
        dealer.send([rng.bytes(int(rng.integers(0, 300))) for _ in range(rng.integers(1, 4))])
    for _ in range(50):
        assert dealer.reply()["type"] == "rejected"
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    sender.submit(ar.offer("after-fuzz", [1], 2))
    assert collect(sender, 1) == (["after-fuzz"], {})


class FlakyInbox(KVInbox):
    """An inbox whose store raises (a bug) for one request id."""

    def put(self, payload):
        if payload.request_id == "boom":
            raise RuntimeError("disk on fire")
        super().put(payload)


def test_a_bug_while_storing_is_answered_internal_error_and_serving_goes_on(
        make_receiver, ar, make_sender, registry):
    receiver = make_receiver(inbox=FlakyInbox(max_bytes=1 << 20))
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    for rid in ("before", "boom", "after"):
        sender.submit(ar.offer(rid, [1], 2))
    acked, failed = collect(sender, 3)
    assert acked == ["after", "before"]
    assert "internal_error: RuntimeError: disk on fire" in failed["boom"]
    assert rejected_counts(registry) == {"internal_error": 1}
    assert receiver.running and receiver.num_internal_errors == 1


# ---------------------------------------------------------------------- observability
def test_acked_sizes_feed_the_contracts_transfer_bytes_histogram(make_receiver, ar,
                                                                 make_sender):
    from omni_runtime.observability.metrics import TransferMetrics

    receiver = make_receiver(max_payload_bytes=1000)
    reg = CollectorRegistry()
    metrics = TransferMetrics(stage="ar", model_name="m", registry=reg)
    sender = make_sender(ar, {STAGE: receiver.endpoint},
                         observe_bytes=metrics.observe_transfer_bytes)
    sender.submit(ar.offer("a", [1], 3))  # 768 bytes
    sender.submit(ar.offer("big", [1, 2], 8))  # refused: not observed
    assert collect(sender, 2)[0] == ["a"]
    labels = {"stage": "ar", "model_name": "m"}
    assert reg.get_sample_value("omni_kv_transfer_bytes_count", labels) == 1
    assert reg.get_sample_value("omni_kv_transfer_bytes_sum", labels) == 768


def test_inbox_gauges_follow_the_receiver(receiver, ar, make_sender, registry):
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    sender.submit(ar.offer("g1", [1, 2], 8))
    sender.submit(ar.offer("g2", [1, 2], 8))
    collect(sender, 2)
    assert sample(registry, "omni_kv_receiver_buffered_payloads") == 2
    assert sample(registry, "omni_kv_receiver_buffered_bytes") == 2 * 2048
    receiver.inbox.get("g1")
    assert sample(registry, "omni_kv_receiver_buffered_payloads") == 1
    assert sample(registry, "omni_kv_receiver_buffered_bytes") == 2048


def test_metric_labels_are_bounded_and_never_carry_request_ids(receiver, ar, make_sender,
                                                               zctx, registry):
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    sender.submit(ar.offer("secret-request-id", [1], 2))
    collect(sender, 1)
    dealer = RawDealer(zctx, receiver.endpoint)
    dealer.read(ar, 1, "secret-rejected-id", [1], 2, agent="nobody")  # no hello from it
    assert dealer.reply()["code"] == "unknown_agent"
    receiver.inbox.get("nope", timeout_s=0)
    allowed = {"stage", "model_name", "outcome", "reason", "thread", "from_stage", "le"}
    for family in registry.collect():
        for s in family.samples:
            assert set(s.labels) <= allowed, s
            assert "secret" not in json.dumps(s.labels), s
            assert s.labels.get("reason", "delivered") in REJECT_CODES + (
                "delivered", "expired", "replaced", "abandoned"), s


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("test"), exporter
    provider.shutdown()


def test_receive_span_is_a_child_of_and_linked_to_the_senders_span(make_receiver, ar,
                                                                   make_sender, spans):
    tracer, exporter = spans
    receiver = make_receiver(tracer=tracer)
    with tracer.start_as_current_span("omni.kv_transfer") as parent:
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier)
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    sender.submit(ar.offer("traced", [1, 2, 3], 10, trace_context=carrier))
    sender.submit(ar.offer("untraced", [1], 2))
    assert collect(sender, 2)[0] == ["traced", "untraced"]
    # A span ends before its reply is sent, and SimpleSpanProcessor exports on end.
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "omni.kv_receive"
               and s.attributes["gen_ai.request.id"] == "traced"]
    pctx = parent.get_span_context()
    assert span.kind == SpanKind.CONSUMER
    assert span.context.trace_id == pctx.trace_id and span.parent.span_id == pctx.span_id
    assert [link.context.span_id for link in span.links] == [pctx.span_id]
    assert span.attributes["omni.stage"] == STAGE
    assert span.attributes["omni.kv_receive.outcome"] == "delivered"
    assert span.attributes["omni.kv_receive.seq_len"] == 10
    assert span.attributes["omni.kv_receive.blocks"] == 3
    assert span.attributes["omni.kv_receive.from_stage"] == "ar"
    (root,) = [s for s in exporter.get_finished_spans()
               if s.attributes.get("gen_ai.request.id") == "untraced"]
    assert root.parent is None and not root.links


def test_rejected_transfer_span_has_error_status(make_receiver, ar, make_sender, spans):
    tracer, exporter = spans
    receiver = make_receiver(tracer=tracer, max_payload_bytes=1000)
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    sender.submit(ar.offer("r", [1, 2], 8))
    assert "oversized" in collect(sender, 1)[1]["r"]
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "omni.kv_receive"]
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["omni.kv_receive.reason"] == "oversized"
    assert span.attributes["omni.kv_receive.outcome"] == "rejected"


def test_metrics_in_multiprocess_mode(tmp_path):
    """The receiving stage's process writes to PROMETHEUS_MULTIPROC_DIR; a reader process
    aggregates the files like the stage's /metrics does."""
    mp_dir = tmp_path / "prom"
    mp_dir.mkdir()
    script = textwrap.dedent("""
        from transport_fixtures import SyntheticAR, SLOT_BYTES
        from omni_runtime.kv.transport import KVInbox, KVReceiver, KVSender
        from omni_runtime.observability.receiver_metrics import ReceiverMetrics
        ar = SyntheticAR()
        with KVReceiver("tcp://127.0.0.1:0", KVInbox(max_bytes=1 << 20), stage="talker",
                        metrics=ReceiverMetrics(stage="talker"), slot_bytes=SLOT_BYTES,
                        slots=1) as r:
            with KVSender({"talker": r.endpoint}, hello=ar.hello, agent=ar.agent,
                          send_timeout_s=10) as s:
                for rid in ("a", "b"):
                    s.submit(ar.offer(rid, [1], 4))
                got = {}
                while len(got) < 2:
                    assert s.wait(10)
                    got.update(s.poll())
                assert all(why is None for _, why in got.values()), got
            r.inbox.get("a")
            assert r.inbox.get("missing", timeout_s=0) is None
        ar.close()
    """)
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mp_dir),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests" / "runtime"), str(REPO / "tests")])}
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
                                               if k in ("outcome", "reason", "thread")})
                    out[key] = s.value
        print(json.dumps(out))
    """)
    res = subprocess.run([sys.executable, "-c", read], env=env, cwd=REPO, check=True,
                         timeout=60, capture_output=True, text=True)
    got = json.loads(res.stdout)
    assert got['omni_kv_received_total{"outcome": "delivered"}'] == 2
    assert got['omni_kv_receiver_rejected_total{"reason": "oversized"}'] == 0
    assert got["omni_kv_receiver_buffered_payloads{}"] == 1
    assert got["omni_kv_receiver_buffered_bytes{}"] == 1024  # 4 tokens x 256 bytes
    assert got['omni_kv_receiver_wait_seconds_count{"outcome": "timeout"}'] == 1
    assert got['omni_kv_transport_thread_up{"thread": "receiver"}'] == 0  # it stopped


# ---------------------------------------------------------------------- per edge
def test_each_edge_of_a_fan_out_resolves_once_with_its_own_outcome(make_receiver, ar,
                                                                    make_sender):
    """Issue 22's per-edge families are fed from here: the sender says, once per transfer
    and endpoint, how that edge ended (acked with its bytes, failed, expired), whatever the
    transfer's overall fate; the receiving side counts deliveries and refusals per
    ``from_stage``."""
    from omni_runtime.observability.receiver_metrics import ReceiverMetrics

    reg = CollectorRegistry()
    good = make_receiver(stage="talker", metrics=ReceiverMetrics(
        stage="talker", registry=reg, from_stages=("ar",)))
    picky = make_receiver(stage="vocoder", expect={"model": "another-model"})
    edges: list[tuple] = []
    sender = make_sender(ar, {"talker": good.endpoint, "vocoder": picky.endpoint},
                         on_edge=lambda *edge: edges.append(edge))
    offer = ar.offer("r", [1, 2], 6)
    sender.submit(offer)
    acked, failed = collect(sender, 1)
    assert acked == [] and "vocoder refused this sender: incompatible" in failed["r"]
    # Each edge once: the refusing one failed; the other acked if its ack came first, else
    # failed with the transfer (a commit is refused once the transfer failed).
    by_stage = {e[2]: e for e in edges}
    assert len(edges) == 2 and by_stage["vocoder"] == ("r", 0, "vocoder", "failed", 0)
    assert by_stage["talker"] in (("r", 0, "talker", "acked", offer.nbytes),
                                  ("r", 0, "talker", "failed", 0))

    edges.clear()
    sender.close()
    sender = make_sender(ar, {"talker": good.endpoint}, on_edge=lambda *e: edges.append(e))
    sender.submit(offer)
    assert collect(sender, 1) == (["r"], {})
    assert edges == [("r", 0, "talker", "acked", offer.nbytes)]
    assert sample(reg, "omni_kv_received_total", "talker", from_stage="ar",
                  outcome="delivered") >= 1
    assert sample(reg, "omni_kv_received_bytes_count", "talker", from_stage="ar") >= 1

    edges.clear()
    sender.close()  # one sender an agent: the agent's answers are the next one's
    with zmq.Context() as ctx:
        silent = ctx.socket(zmq.ROUTER)  # accepts the connection, never answers the hello
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        late = make_sender(ar, {"talker": good.endpoint, "mute": f"tcp://127.0.0.1:{port}"},
                           on_edge=lambda *edge: edges.append(edge))
        late.submit(ar.offer("s", [3], 2), timeout_s=0.5)
        acked, failed = collect(late, 1)
        silent.close(linger=0)
    assert "no ack from stage mute" in failed["s"]
    assert sorted(e[2:4] for e in edges) == [("mute", "expired"), ("talker", "acked")]


def test_a_read_refused_counts_its_sending_stage(make_receiver, ar, make_sender):
    from omni_runtime.observability.receiver_metrics import ReceiverMetrics

    reg = CollectorRegistry()
    rx = make_receiver(stage=STAGE, max_payload_bytes=64,
                       metrics=ReceiverMetrics(stage=STAGE, registry=reg, from_stages=("ar",)))
    sender = make_sender(ar, {STAGE: rx.endpoint})
    sender.submit(ar.offer("big", [1, 2], 8))
    acked, failed = collect(sender, 1)
    assert "oversized" in failed["big"]
    assert sample(reg, "omni_kv_received_total", from_stage="ar", outcome="rejected") == 1
    assert sample(reg, "omni_kv_receiver_rejected_total", reason="oversized") == 1


# ---------------------------------------------------------------------- a consuming stage


class Consumer:
    """What a downstream vLLM stage's input does with the receiver (stages/stage_input.py),
    reduced to its answers: it records each stored payload's ticket, the test settles it."""

    def __init__(self):
        self.tickets = []
        self.arrived = threading.Event()

    def __call__(self, payload, ticket):
        self.tickets.append((payload.request_id, ticket))
        self.arrived.set()


def test_with_a_consumer_the_transfer_is_acked_only_once_the_input_is_taken(
        make_receiver, ar, make_sender, registry):
    consumer = Consumer()
    receiver = make_receiver(consumer=consumer)
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    sender.submit(ar.offer("r", [1, 2], 7))
    assert consumer.arrived.wait(WAIT)
    ((rid, ticket),) = consumer.tickets
    assert rid == "r" and "r" in receiver.inbox  # stored, waiting for its consumer
    assert sender.wait(0.3) is False, "not acked before the stage holds the input"
    receiver.settle(ticket)
    assert collect(sender, 1) == (["r"], {})
    assert sample(registry, "omni_kv_received_total", outcome="delivered") == 1


def test_an_input_the_stage_refuses_fails_its_transfer_with_the_reason(make_receiver, ar,
                                                                      make_sender, registry):
    consumer = Consumer()
    receiver = make_receiver(consumer=consumer)
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    sender.submit(ar.offer("r", [1, 2], 7))
    assert consumer.arrived.wait(WAIT)
    receiver.settle(consumer.tickets[0][1], ("input_refused", "prompt of 300 tokens is over "
                                                              "max-model-len 256"))
    acked, failed = collect(sender, 1)
    assert acked == [] and failed["r"] == ("stage talker rejected: input_refused: prompt of "
                                           "300 tokens is over max-model-len 256")
    assert "r" not in receiver.inbox, "a refused input is not kept"
    assert rejected_counts(registry) == {"input_refused": 1}


def test_an_input_never_taken_fails_at_the_transfers_deadline_and_a_late_answer_is_ignored(
        make_receiver, ar, make_sender, registry):
    consumer = Consumer()
    receiver = make_receiver(consumer=consumer)
    sender = make_sender(ar, {STAGE: receiver.endpoint}, send_timeout_s=0.5)
    sender.submit(ar.offer("r", [1, 2], 7))
    assert consumer.arrived.wait(WAIT)
    acked, failed = collect(sender, 1)
    assert acked == [] and "r" in failed
    wait_for(lambda: rejected_counts(registry).get("deadline") == 1, what="the receiver's "
             "own deadline")
    assert "r" not in receiver.inbox
    receiver.settle(consumer.tickets[0][1])  # too late: nothing is sent, nothing breaks
    sender.submit(ar.offer("s", [3], 2))
    wait_for(lambda: len(consumer.tickets) == 2, what="the next input")
    receiver.settle(consumer.tickets[1][1])
    assert collect(sender, 1) == (["s"], {})


# ---------------------------------------------------------------------- the two ways messages come
def test_one_agent_cannot_speak_for_another_and_a_hello_comes_on_the_handshake_alone(
        receiver, make_ar, zctx, registry):
    """After the hello, messages are NIXL notifications, and a notification's sender is its
    NIXL agent: one whose body names another agent known here is refused ``malformed`` (it
    could commit that agent's reads); a hello as a notification is refused ``bad_frames``; a
    read on the handshake connection is refused ``unknown_agent`` (say hello, then notify).
    The agent spoken for is served on."""
    a, b = make_ar(seed=1), make_ar(seed=2)
    dealer_a, dealer_b = RawDealer(zctx, receiver.endpoint, a), RawDealer(zctx, receiver.endpoint, b)
    assert dealer_a.hello(a)["type"] == "hello_ok" and dealer_b.hello(b)["type"] == "hello_ok"
    dealer_b.read(b, 7, "b-read", [1, 2], 6)
    assert dealer_b.reply()["type"] == "read_done"
    # a commits b's read: refused, and b's read still waits for b's own verdict.
    dealer_a.send([json.dumps({"v": WIRE_VERSION, "type": "verdict", "agent": b.name,
                               "transfer_id": 7, "commit": True}).encode()], "notify")
    answer = dealer_a.reply()
    assert (answer["type"], answer["code"]) == ("rejected", "malformed")
    assert f"agent {a.name} sent a verdict of agent {b.name}" in answer["reason"]
    assert "b-read" not in receiver.inbox
    dealer_b.verdict(b, 7)
    assert dealer_b.reply()["type"] == "ok"
    assert np.array_equal(receiver.inbox.get("b-read").kv, b.expected([1, 2], 6))
    # A hello as a notification, a read on the connection.
    dealer_a.send(encode_hello(dataclasses.replace(a.hello, to_stage=STAGE))[:1], "notify")
    answer = dealer_a.reply()
    assert (answer["type"], answer["code"]) == ("rejected", "bad_frames")
    dealer_a.read(a, 8, "on-the-connection", [3], 2)  # read() goes the way channel() says...
    dealer_a.send([json.dumps(read_body(a, 9, "handshake-read", [3], 2)).encode()], "handshake")
    answers = [dealer_a.reply(), dealer_a.reply()]
    by_tid = {r["transfer_id"]: r for r in answers}
    assert by_tid[8]["type"] == "read_done"  # ... as a notification: taken on
    assert (by_tid[9]["type"], by_tid[9]["code"]) == ("rejected", "unknown_agent")
    assert rejected_counts(registry) == {"malformed": 1, "bad_frames": 1, "unknown_agent": 1}


def test_one_sender_per_agent(ar, make_sender, fake):
    """An agent's notifications are one stream: a second sender on an agent that has one is
    refused at once, and a closed sender gives the agent back."""
    first = make_sender(ar, {STAGE: fake.endpoint})
    with pytest.raises(RuntimeError, match="one sender per agent"):
        make_sender(ar, {STAGE: fake.endpoint})
    first.close()
    second = make_sender(ar, {STAGE: fake.endpoint})
    second.submit(ar.offer("r", [1], 2))
    identity, read = fake.recv()
    assert read["type"] == "read" and identity == ar.name
