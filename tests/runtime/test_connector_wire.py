"""The connector's wire format, without sockets: encode/decode round trips, every rejection
code, and a fuzz of the decoder (it must answer Rejected, never raise anything else)."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_runtime.kv.transport.wire import (
    CHECKSUMS,
    MAX_HEADER_BYTES,
    REJECT_CODES,
    WIRE_VERSION,
    KVPayload,
    Limits,
    Rejected,
    checksum,
    data_view,
    decode_reply,
    decode_transfer,
    encode_header,
    encode_reply,
    validate_payload,
)

LIMITS = Limits(max_payload_bytes=1 << 20, stage="talker", pipeline="p")


def kv(seq_len: int = 5, dtype=np.float32, layers: int = 2, heads: int = 3, dim: int = 4):
    rng = np.random.default_rng(seq_len)
    return rng.standard_normal((layers, 2, heads, seq_len, dim)).astype(dtype)


def frames_for(payload: KVPayload, *, to_stage: str = "talker", tid: int = 7) -> list[bytes]:
    data = data_view(payload.kv)
    header = encode_header(payload, transfer_id=tid, to_stage=to_stage,
                           digest=checksum("crc32", data))
    return [header, bytes(data)]


def header_of(frames: list[bytes]) -> dict:
    return json.loads(frames[0])


def with_header(frames: list[bytes], **changes) -> list[bytes]:
    h = header_of(frames)
    for k, v in changes.items():
        if v is ...:
            del h[k]
        else:
            h[k] = v
    return [json.dumps(h).encode(), frames[1]]


def rejected(frames, limits=LIMITS) -> Rejected:
    with pytest.raises(Rejected) as e:
        decode_transfer(frames, limits)
    assert e.value.code in REJECT_CODES
    return e.value


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.uint16])
def test_round_trip_keeps_every_field_and_the_exact_bytes(dtype):
    p = KVPayload("req-1", 5, kv(5, dtype), pipeline="p", from_stage="ar",
                  trace_context={"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"},
                  extra={"trigger": "prefill_finished", "block_size": 16})
    got, header = decode_transfer(frames_for(p), LIMITS)
    assert header["v"] == WIRE_VERSION and header["transfer_id"] == 7
    assert (got.request_id, got.seq_len, got.pipeline, got.from_stage, got.to_stage) == (
        "req-1", 5, "p", "ar", "talker")
    assert got.dtype_name == {np.float32: "float32", np.float16: "float16",
                              np.uint16: "bfloat16"}[dtype]
    assert got.kv.dtype == p.kv.dtype and got.kv.shape == p.kv.shape
    assert np.array_equal(got.kv, p.kv)
    assert got.trace_context == p.trace_context and got.extra == p.extra
    assert header["checksum"] == f"crc32:{zlib.crc32(p.kv.tobytes()):08x}"


def test_bfloat16_bits_widen_to_the_float32_they_came_from():
    f32 = kv(3)
    bf16_bits = (f32.view(np.uint32) >> 16).astype(np.uint16)  # truncation to bfloat16
    got, _ = decode_transfer(frames_for(KVPayload("r", 3, bf16_bits)), LIMITS)
    assert got.dtype_name == "bfloat16"
    np.testing.assert_allclose(got.as_float32(), f32, rtol=2 ** -7)


def test_zero_length_sequence_is_a_valid_payload():
    got, _ = decode_transfer(frames_for(KVPayload("r", 0, kv(0))), LIMITS)
    assert got.kv.shape == (2, 2, 3, 0, 4)


def test_stray_trace_headers_are_dropped_not_fatal():
    p = KVPayload("r", 2, kv(2), trace_context={"traceparent": "x", "n": 3})
    got, _ = decode_transfer(frames_for(p), LIMITS)
    assert got.trace_context == {"traceparent": "x"}


def test_non_contiguous_arrays_are_sent_as_their_c_order_bytes():
    a = np.asfortranarray(kv(4))
    got, _ = decode_transfer(frames_for(KVPayload("r", 4, a)), LIMITS)
    assert np.array_equal(got.kv, a)


@pytest.mark.parametrize("payload, problem", [
    (KVPayload("", 1, kv(1)), "request_id"),
    (KVPayload("r", -1, kv(1)), "seq_len"),
    (KVPayload("r", 1.0, kv(1)), "seq_len"),
    (KVPayload("r", 1, [1, 2]), "numpy"),
    (KVPayload("r", 1, kv(1, np.float64)), "dtype"),
    (KVPayload("r", 1, kv(1), dtype="float16"), "dtype"),
    (KVPayload("r", 1, np.zeros((2, 3, 1, 1, 1), np.float32)), "K, V"),
    (KVPayload("r", 1, np.zeros((2, 2, 1, 1), np.float32)), "shape"),
    (KVPayload("r", 2, kv(1)), "seq_len"),
    (KVPayload("r", 1, kv(1), extra={"x": object()}), "JSON"),
    (KVPayload("r", 1, kv(1), extra=[1]), "extra"),
    (KVPayload("r", 1, kv(1), pipeline=None), "pipeline"),
    ("not a payload", "KVPayload"),
])
def test_invalid_payloads_are_named_before_sending(payload, problem):
    why = validate_payload(payload)
    assert why is not None and problem in why


def test_valid_payload_passes_validation():
    assert validate_payload(KVPayload("r", 1, kv(1), extra={"a": 1})) is None


# ---------------------------------------------------------------------- rejections
GOOD = frames_for(KVPayload("req", 5, kv(5), pipeline="p"))


@pytest.mark.parametrize("frames, code", [
    ([], "bad_frames"),
    ([GOOD[0]], "bad_frames"),
    (GOOD + [b"extra"], "bad_frames"),
    ([b"not json", GOOD[1]], "malformed_header"),
    ([b"\xff\xfe", GOOD[1]], "malformed_header"),
    ([b"[1, 2]", GOOD[1]], "malformed_header"),
    ([b" " * (MAX_HEADER_BYTES + 1), GOOD[1]], "malformed_header"),
    (with_header(GOOD, v=2), "unsupported_version"),
    (with_header(GOOD, v=...), "unsupported_version"),
    (with_header(GOOD, v=True), "unsupported_version"),
    (with_header(GOOD, request_id=...), "malformed_header"),
    (with_header(GOOD, request_id=""), "malformed_header"),
    (with_header(GOOD, seq_len="5"), "malformed_header"),
    (with_header(GOOD, seq_len=True), "malformed_header"),
    (with_header(GOOD, shape="2,2,3,5,4"), "malformed_header"),
    (with_header(GOOD, shape=[2, 2, 3, 5]), "malformed_header"),
    (with_header(GOOD, shape=[2, 2, 3, 6, 4]), "malformed_header"),
    (with_header(GOOD, shape=[2, 2, 3, 5, -4]), "malformed_header"),
    (with_header(GOOD, dtype="float64"), "malformed_header"),
    (with_header(GOOD, trace_context={"traceparent": 1}), "malformed_header"),
    (with_header(GOOD, extra=[1]), "malformed_header"),
    (with_header(GOOD, sent_at="now"), "malformed_header"),
    (with_header(GOOD, nbytes=GOOD[1].__len__() + 4), "size_mismatch"),
    (with_header(GOOD, dtype="float16"), "size_mismatch"),
    ([GOOD[0], GOOD[1][:-1]], "size_mismatch"),
    ([GOOD[0], GOOD[1] + b"\0"], "size_mismatch"),
    ([GOOD[0], b"\1" + GOOD[1][1:]], "checksum_mismatch"),
    (with_header(GOOD, checksum="crc32:00000000"), "checksum_mismatch"),
    (with_header(GOOD, checksum="md5:abc"), "unsupported_checksum"),
    (with_header(GOOD, to_stage="vocoder"), "wrong_destination"),
    (with_header(GOOD, pipeline="other"), "wrong_destination"),
])
def test_each_kind_of_bad_input_is_rejected_with_its_code(frames, code):
    r = rejected(frames)
    assert r.code == code, r


def test_oversized_payload_is_rejected_before_its_checksum_is_computed():
    big = frames_for(KVPayload("req", 64, kv(64, layers=4, heads=8, dim=64)))  # 1 MiB + ...
    calls = []
    limits = Limits(max_payload_bytes=len(big[1]) - 1,
                    checksums={"crc32": lambda d: calls.append(1) or "x"})
    r = rejected(big, limits)
    assert r.code == "oversized" and not calls
    assert r.header["request_id"] == "req"  # so the reply can name the transfer


def test_rejection_keeps_the_parsed_header_to_address_the_reply():
    r = rejected([GOOD[0], GOOD[1][:-1]])
    assert r.header["transfer_id"] == 7 and r.header["request_id"] == "req"
    assert rejected([b"{", GOOD[1]]).header is None


def test_receiver_without_a_stage_name_accepts_any_destination():
    got, _ = decode_transfer(with_header(GOOD, to_stage="any"), Limits(1 << 20))
    assert got.to_stage == "any"


def test_replies_round_trip_and_garbage_is_no_reply():
    r = decode_reply(encode_reply(transfer_id=3, request_id="a", ok=False, code="oversized",
                                  reason="too big"))
    assert (r.transfer_id, r.request_id, r.ok, r.code, r.reason) == (3, "a", False, "oversized",
                                                                      "too big")
    assert decode_reply(encode_reply(transfer_id=None, request_id=None, ok=True)).ok
    for raw in (b"", b"{}", b"[]", b'{"status": "maybe"}', b'{"status": "ok", "transfer_id": "1"}',
                b"\xff"):
        assert decode_reply(raw) is None, raw


def test_crc32_is_always_available():
    assert "crc32" in CHECKSUMS


# ---------------------------------------------------------------------- fuzz
header_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 1 << 40) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(frames=st.lists(st.binary(max_size=256), max_size=4))
def test_fuzz_random_frames_are_rejected_never_raised(frames):
    try:
        decode_transfer(frames, LIMITS)
    except Rejected as r:
        assert r.code in REJECT_CODES


@settings(max_examples=300, deadline=None)
@given(changes=st.dictionaries(st.sampled_from(sorted(header_of(GOOD))), header_values,
                               min_size=1, max_size=4),
       data=st.binary(max_size=512) | st.just(GOOD[1]))
def test_fuzz_mutated_headers_are_rejected_or_decode_consistently(changes, data):
    h = header_of(GOOD)
    h.update(changes)
    try:
        payload, header = decode_transfer([json.dumps(h).encode(), data], LIMITS)
    except Rejected as r:
        assert r.code in REJECT_CODES
        return
    # Accepted: then it is self-consistent, whatever the mutation was.
    assert payload.kv.nbytes == len(data) == header["nbytes"]
    assert list(payload.kv.shape) == header["shape"]
    assert header["checksum"] == checksum("crc32", memoryview(data))


@pytest.mark.parametrize("algo", sorted(CHECKSUMS))
def test_every_offered_checksum_round_trips_and_catches_a_flipped_bit(algo):
    p = KVPayload("r", 5, kv(5))
    data = data_view(p.kv)
    header = encode_header(p, transfer_id=1, to_stage="talker", digest=checksum(algo, data))
    got, h = decode_transfer([header, bytes(data)], LIMITS)
    assert h["checksum"].startswith(f"{algo}:") and np.array_equal(got.kv, p.kv)
    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 0x10
    assert rejected([header, bytes(flipped)]).code == "checksum_mismatch"


def test_default_checksum_is_the_fast_one():
    """xxhash is a base dependency (pyproject); the sender defaults to it."""
    from omni_runtime.kv.transport.wire import DEFAULT_CHECKSUM

    assert DEFAULT_CHECKSUM == "xxh3_64"


# ---------------------------------------------------------------------- tensor-parallel shards


def test_an_unsharded_header_is_as_before_and_a_shard_round_trips():
    whole = KVPayload("r", 5, kv(), pipeline="p", from_stage="ar")
    assert "shard" not in header_of(frames_for(whole)), "unsharded headers carry no shard fields"
    payload, header = decode_transfer(frames_for(whole), LIMITS)
    assert (payload.shard, payload.num_shards) == (0, 1)
    shard = KVPayload("r", 5, kv(heads=1), pipeline="p", from_stage="ar", shard=1, num_shards=3)
    assert (header_of(frames_for(shard))["shard"], header_of(frames_for(shard))["num_shards"]) == (1, 3)
    payload, _ = decode_transfer(frames_for(shard), LIMITS)
    assert (payload.shard, payload.num_shards) == (1, 3)


@pytest.mark.parametrize(
    "changes",
    [{"shard": 2, "num_shards": 2}, {"shard": -1, "num_shards": 2}, {"num_shards": 0},
     {"num_shards": 65}, {"shard": "0"}, {"num_shards": True}, {"num_shards": 2.0}],
)
def test_bad_shard_fields_are_malformed_headers(changes):
    frames = with_header(frames_for(KVPayload("r", 5, kv(), pipeline="p")), **changes)
    r = rejected(frames)
    assert r.code == "malformed_header" and ("shard" in r.reason)


def test_the_sender_refuses_a_payload_with_a_bad_shard():
    assert "shard must be in" in validate_payload(KVPayload("r", 5, kv(), shard=2, num_shards=2))
    assert "num_shards" in validate_payload(KVPayload("r", 5, kv(), num_shards=0))
