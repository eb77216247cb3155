"""The KV data plane's control protocol (protocol.py) and payload assembly (assemble.py),
without sockets or NIXL: encode/parse round trips, every rejection the parsers make, the
compatibility hash, a fuzz of the parsers (they answer Rejected, never raise anything else),
assembly of staged blocks of every layout into the exact payload, and the tests' synthetic
AR layout checked against vLLM's own CPU kernel."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_runtime.kv.transport.assemble import assemble_chunk, assemble_host, payload_view
from omni_runtime.kv.transport.payload import DTYPES, KVPayload, vllm_external_request_id
from omni_runtime.kv.transport.protocol import (
    MAX_MESSAGE_BYTES,
    REJECT_CODES,
    WIRE_VERSION,
    Compat,
    ReadRequest,
    Rejected,
    Reply,
    Verdict,
    decode_reply,
    encode_hello,
    encode_read,
    encode_reply,
    encode_verdict,
    incompatibility,
    parse_hello,
    parse_message,
    parse_read,
    parse_verdict,
)

from transport_fixtures import SyntheticAR

AR = SyntheticAR(agent=False, layers=3, heads=2, block_size=4, head_size=8, blocks=8)
HELLO = dataclasses.replace(AR.hello, to_stage="talker", conn=3, metadata=b"agent-metadata")
READ = ReadRequest(
    transfer_id=7, agent=AR.name, compat_hash=AR.compat.hash(), request_id="req-1-abcdef12",
    external_request_id="req-1", attempt=2, seq_len=10, runs=((5, 2), (1, 1)),
    deadline_in_s=4.5, trace_context={"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"},
    pipeline="p", from_stage="ar", to_stage="talker", shard=1, num_shards=2, sent_at=1.7e9)


def parse(frames):
    """The receiver's parse of one message."""
    kind, body, rest = parse_message(frames)
    parsers = {"hello": parse_hello, "read": parse_read, "verdict": parse_verdict}
    if kind not in parsers:
        raise Rejected("malformed", f"unknown message type {kind!r}")
    return parsers[kind](body, rest)


def rejected(frames) -> Rejected:
    with pytest.raises(Rejected) as e:
        parse(frames)
    assert e.value.code in REJECT_CODES
    return e.value


def hello_frames(**changes) -> list[bytes]:
    frames = encode_hello(HELLO)
    body = json.loads(frames[0])
    for k, v in changes.items():
        if v is ...:
            del body[k]
        else:
            body[k] = v
    return [json.dumps(body).encode(), frames[1]]


def read_frames(**changes) -> list[bytes]:
    body = json.loads(encode_read(READ)[0])
    for k, v in changes.items():
        if v is ...:
            del body[k]
        else:
            body[k] = v
    return [json.dumps(body).encode()]


# ---------------------------------------------------------------------- round trips
def test_a_hello_round_trips_with_its_metadata_frame():
    assert parse(encode_hello(HELLO)) == HELLO
    assert HELLO.compat_hash == HELLO.compat.hash()


@pytest.mark.parametrize("layout", ["flash", "index"])
def test_a_hello_of_every_block_format_round_trips(layout):
    ar = SyntheticAR(agent=False, layout=layout, heads=2, head_size=4)
    hello = dataclasses.replace(ar.hello, metadata=b"m")
    assert parse(encode_hello(hello)) == hello


def test_a_read_round_trips_and_its_defaults_stay_off_the_wire():
    assert parse(encode_read(READ)) == READ
    plain = dataclasses.replace(READ, external_request_id="", trace_context=None, shard=0,
                                num_shards=1)
    body = json.loads(encode_read(plain)[0])
    assert not {"external_request_id", "trace_context", "shard", "num_shards"} & set(body)
    got = parse(encode_read(plain))
    assert got == plain and (got.shard, got.num_shards) == (0, 1) and got.num_blocks == 3


def test_a_read_carries_the_requests_tokens_and_pipeline_context_within_bounds():
    """What a hand-off carries besides the KV (the next stage's input): the tokens, how
    many were the prompt, the pipeline context; absent when empty; bad values refused,
    naming the field."""
    carrying = dataclasses.replace(READ, token_ids=(5, 6, 7, 0), prompt_len=2,
                                   origin={"request_id": "p-1", "endpoint": "http://e:8000"})
    assert parse(encode_read(carrying)) == carrying
    assert not {"token_ids", "prompt_len", "origin"} & set(json.loads(encode_read(READ)[0]))
    for changes, words in (
        ({"token_ids": [1, -2]}, "token_ids must be token ids"),
        ({"token_ids": [1, True]}, "token_ids must be token ids"),
        ({"token_ids": [1 << 31]}, "token_ids must be token ids"),
        ({"token_ids": "1,2"}, "token_ids must be a list"),
        ({"token_ids": [1, 2], "prompt_len": 3}, "prompt_len must be in [0, 2]"),
        ({"origin": {"request_id": "x", "url": "http://a"}}, "origin must map some of"),
        ({"origin": {"endpoint": ""}}, "origin must map some of"),
        ({"origin": {"endpoint": "x" * 2049}}, "origin must map some of"),
        ({"origin": "http://a"}, "origin must be an object"),
    ):
        r = rejected(read_frames(**changes))
        assert r.code == "malformed" and words in r.reason and r.transfer_id == 7, (changes, r)


def test_verdicts_and_replies_round_trip_and_garbage_is_no_reply():
    v = Verdict(AR.name, 9, False, "the transfer's deadline passed during the read")
    assert parse(encode_verdict(v)) == v
    for reply in (Reply("hello_ok", conn=4), Reply("read_done", 3, "r"), Reply("ok", 3, "r"),
                  Reply("rejected", 3, "r", code="oversized", reason="too big")):
        assert decode_reply(encode_reply(reply)) == reply
    for raw in (b"", b"{}", b"[]", b'{"type": "maybe"}', b"\xff", b"null"):
        assert decode_reply(raw) is None, raw
    odd = decode_reply(b'{"type": "ok", "transfer_id": "1", "request_id": 5}')
    assert (odd.transfer_id, odd.request_id) == (None, None)  # mistyped ids are dropped


# ---------------------------------------------------------------------- rejections
@pytest.mark.parametrize("frames, code", [
    ([], "bad_frames"),
    ([b"not json"], "malformed"),
    ([b"\xff\xfe"], "malformed"),
    ([b"[1, 2]"], "malformed"),
    ([b"[" * 100_000], "malformed"),  # nesting deeper than the JSON parser's recursion
    ([b" " * (MAX_MESSAGE_BYTES + 1)], "malformed"),
    ([b'{"v": 1, "type": "read"}'], "unsupported_version"),
    ([b'{"type": "read"}'], "unsupported_version"),
    ([b'{"v": true, "type": "read"}'], "unsupported_version"),
    ([b'{"v": %d}' % WIRE_VERSION], "malformed"),
    ([b'{"v": %d, "type": 5}' % WIRE_VERSION], "malformed"),
])
def test_each_bad_envelope_is_rejected_with_its_code(frames, code):
    with pytest.raises(Rejected) as e:
        parse_message(frames)
    assert e.value.code == code


def test_an_old_version_is_refused_naming_the_transfer():
    r = rejected([b'{"v": 1, "type": "read", "transfer_id": 4, "request_id": "x"}'])
    assert (r.code, r.transfer_id, r.request_id) == ("unsupported_version", 4, "x")


@pytest.mark.parametrize("frames, code, words", [
    (hello_frames()[:1], "bad_frames", "2 frames"),
    (hello_frames() + [b"x"], "bad_frames", "2 frames"),
    ([hello_frames()[0], b""], "malformed", "agent metadata"),
    (hello_frames(agent=""), "malformed", "agent"),
    (hello_frames(agent=...), "malformed", "agent missing"),
    (hello_frames(num_shards=0), "malformed", "num_shards"),
    (hello_frames(shard=2, num_shards=2), "malformed", "shard"),
    (hello_frames(mem_type="HBM"), "malformed", "mem_type"),
    (hello_frames(regions=[[1, 2]]), "malformed", "regions[0]"),
    (hello_frames(regions=[[-1, 2, 0]] * 3), "malformed", "regions[0]"),
    (hello_frames(regions="x"), "malformed", "regions"),
    (hello_frames(compat="x"), "malformed", "compat"),
    (hello_frames(compat_hash="0" * 32), "incompatible", "compat_hash"),
    (hello_frames(compat={**dataclasses.asdict(HELLO.compat), "dtype": "float64"}),
     "malformed", "dtype"),
    (hello_frames(compat={**dataclasses.asdict(HELLO.compat), "num_layers": 0}),
     "malformed", "num_layers"),
    (hello_frames(block_format={**HELLO.block_format.to_json(), "block_numel": 1}),
     "malformed", "cannot hold"),
    (hello_frames(block_format={**HELLO.block_format.to_json(), "k": None}),
     "malformed", "exactly one of k"),
    (hello_frames(block_format={**HELLO.block_format.to_json(), "k_index": list(range(64))}),
     "malformed", "exactly one of k"),
    (hello_frames(block_format={**HELLO.block_format.to_json(), "k_index": [0]}),
     "malformed", "k_index must be 64 element offsets"),
    (hello_frames(block_format={**HELLO.block_format.to_json(),
                                "v": {"offset": 1 << 20, "head": 0, "token": 0, "dim": 0}}),
     "malformed", "reaches element"),
    (hello_frames(block_format={**HELLO.block_format.to_json(),
                                "v": {"offset": 0, "head": 0, "token": 0, "dim": 0,
                                      "plane": 1}}),
     "malformed", "plane"),
    (hello_frames(block_format={**HELLO.block_format.to_json(), "head_size": 4}),
     "incompatible", "block format does not match"),
])
def test_each_bad_hello_is_rejected_with_its_code(frames, code, words):
    r = rejected(frames)
    assert r.code == code and words in r.reason, r


def _consistent_hello(**compat_changes):
    """A hello whose hash and layout agree with changed compatibility fields."""
    compat = dataclasses.replace(HELLO.compat, **compat_changes)
    return hello_frames(compat=dataclasses.asdict(compat), compat_hash=compat.hash())


@pytest.mark.parametrize("frames, code, words", [
    (_consistent_hello(layout="0" * 16), "incompatible", "block format does not match"),
    (_consistent_hello(num_layers=2), "malformed", "regions for 2 layers"),
    (_consistent_hello(dtype="float16"), "incompatible", "disagrees"),
    (_consistent_hello(num_kv_heads=3), "incompatible", "disagrees"),
])
def test_a_hello_that_disagrees_with_itself_is_refused(frames, code, words):
    r = rejected(frames)
    assert r.code == code and words in r.reason, r


def test_a_region_that_is_no_whole_number_of_blocks_is_refused():
    regions = [[r.addr, r.length - 1, 0] for r in HELLO.regions]
    r = rejected(hello_frames(regions=regions))
    assert r.code == "malformed" and "whole number" in r.reason


@pytest.mark.parametrize("changes, code, words", [
    ({"transfer_id": ...}, "malformed", "transfer_id"),
    ({"transfer_id": -1}, "malformed", "transfer_id"),
    ({"seq_len": "10"}, "malformed", "seq_len"),
    ({"seq_len": True}, "malformed", "seq_len"),
    ({"seq_len": 0}, "malformed", "seq_len"),
    ({"attempt": -1}, "malformed", "attempt"),
    ({"runs": "5,2"}, "malformed", "runs"),
    ({"runs": [[5]]}, "malformed", "runs[0]"),
    ({"runs": [[5, 0]]}, "malformed", "runs[0]"),
    ({"runs": [[-5, 2]]}, "malformed", "runs[0]"),
    ({"runs": [[5, 2.0]]}, "malformed", "runs[0]"),
    ({"runs": [[5, 2]] * 70_000}, "malformed", "more than"),
    ({"deadline_in_s": -1}, "malformed", "deadline_in_s"),
    ({"deadline_in_s": "soon"}, "malformed", "deadline_in_s"),
    ({"deadline_in_s": 1e9}, "malformed", "deadline_in_s"),
    ({"trace_context": {"traceparent": 5}}, "malformed", "trace_context"),
    ({"trace_context": ["00-x"]}, "malformed", "trace_context"),
    ({"trace_context": {"traceparent": "x" * 2000}}, "malformed", "trace_context"),
    ({"external_request_id": 5}, "malformed", "external_request_id"),
    ({"request_id": ""}, "malformed", "request_id"),
    ({"request_id": "x" * 2000}, "malformed", "request_id"),
    ({"agent": None}, "malformed", "agent"),
    ({"shard": 2}, "malformed", "shard"),
    ({"num_shards": 65}, "malformed", "num_shards"),
    ({"sent_at": "now"}, "malformed", "sent_at"),
    ({"pipeline": 3}, "malformed", "pipeline"),
])
def test_each_bad_read_is_rejected_with_its_code_and_names_its_transfer(changes, code, words):
    r = rejected(read_frames(**changes))
    assert r.code == code and words in r.reason, r
    if "transfer_id" not in changes:
        assert r.transfer_id == 7
    if not {"transfer_id", "request_id"} & set(changes):
        assert r.request_id == "req-1-abcdef12"


def test_a_read_with_a_second_frame_is_refused():
    r = rejected(read_frames() + [b"data"])
    assert (r.code, r.transfer_id) == ("bad_frames", 7)


@pytest.mark.parametrize("body, code", [
    ({"agent": "a", "transfer_id": 1}, "malformed"),
    ({"agent": "a", "transfer_id": 1, "commit": 1}, "malformed"),
    ({"agent": "", "transfer_id": 1, "commit": True}, "malformed"),
    ({"agent": "a", "transfer_id": "1", "commit": True}, "malformed"),
])
def test_each_bad_verdict_is_rejected(body, code):
    r = rejected([json.dumps({"v": WIRE_VERSION, "type": "verdict", **body}).encode()])
    assert r.code == code
    r = rejected([json.dumps({"v": WIRE_VERSION, "type": "verdict", "agent": "a", "transfer_id": 1,
                              "commit": True}).encode(), b"x"])
    assert r.code == "bad_frames"


# ---------------------------------------------------------------------- compatibility
def test_every_compatibility_field_changes_the_hash():
    base = AR.compat
    variants = [dataclasses.replace(base, **{f.name: v}) for f, v in zip(
        dataclasses.fields(Compat),
        ["other", "float16", 4, 3, 16, 8, "0" * 16, "rev2", WIRE_VERSION + 1])]
    hashes = {c.hash() for c in variants} | {base.hash()}
    assert len(hashes) == len(variants) + 1
    fmt = AR.fmt
    assert dataclasses.replace(fmt, block_numel=fmt.block_numel + 1).digest() != fmt.digest()
    assert SyntheticAR(agent=False, layout="index").fmt.digest() != fmt.digest()


def test_incompatibility_names_the_first_field_that_differs():
    assert incompatibility(AR.compat, {"model": "m", "dtype": None}) is None
    assert incompatibility(AR.compat, {"model": "q"}) == "model is 'm', this stage expects 'q'"
    assert "num_layers is 3" in incompatibility(AR.compat, {"num_layers": 4})


# ---------------------------------------------------------------------- fuzz
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 1 << 65) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(frames=st.lists(st.binary(max_size=256), max_size=4))
def test_fuzz_random_frames_are_rejected_never_raised(frames):
    try:
        parse(frames)
    except Rejected as r:
        assert r.code in REJECT_CODES


def _mutated(frames: list[bytes], changes: dict, nested: str | None) -> list[bytes]:
    body = json.loads(frames[0])
    if nested is not None and isinstance(body.get(nested), dict):
        body[nested] = {**body[nested], **changes}
    else:
        body.update(changes)
    return [json.dumps(body).encode(), *frames[1:]]


@settings(max_examples=400, deadline=None)
@given(which=st.sampled_from(["hello", "read", "verdict"]),
       nested=st.sampled_from([None, "compat", "block_format", "trace_context"]),
       data=st.data())
def test_fuzz_mutated_messages_are_rejected_or_parse_consistently(which, nested, data):
    frames = {"hello": encode_hello(HELLO), "read": encode_read(READ),
              "verdict": encode_verdict(Verdict(AR.name, 1, True))}[which]
    body = json.loads(frames[0])
    keys = sorted(body.get(nested) if isinstance(body.get(nested), dict) else body)
    changes = data.draw(st.dictionaries(st.sampled_from(keys + ["extra"]), json_values,
                                        min_size=1, max_size=4))
    try:
        got = parse(_mutated(frames, changes, nested))
    except Rejected as r:
        assert r.code in REJECT_CODES
        return
    # Accepted: then it is a well-typed message that agrees with itself.
    if isinstance(got, ReadRequest):
        assert got.seq_len >= 1 and all(c >= 1 for _, c in got.runs)
        assert 0 <= got.shard < got.num_shards and got.deadline_in_s >= 0
    elif got.__class__.__name__ == "Hello":
        assert got.compat.hash() == got.compat_hash
        assert got.block_format.digest() == got.compat.layout
        assert len(got.regions) == got.compat.num_layers * got.block_format.planes
    else:
        assert isinstance(got.commit, bool)


# ---------------------------------------------------------------------- assembly
def staged_bytes(ar: SyntheticAR, layers: range, blocks: list[int]) -> torch.Tensor:
    """What the receiver's READs put in a staging slot: per layer, per plane, the blocks in
    payload order, each as the bytes the cache holds."""
    parts = []
    for layer in layers:
        cache = ar.caches[layer]
        planes = cache.reshape(ar.fmt.planes, ar.blocks, -1)
        for p in range(ar.fmt.planes):
            for b in blocks:
                parts.append(planes[p, b].contiguous().view(torch.uint8))
    return torch.cat(parts)


@pytest.mark.parametrize("layout", ["cpu", "flash", "index"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("seq_len", [1, 4, 11])
@pytest.mark.parametrize("where", ["device", "host"])
def test_staged_blocks_assemble_into_the_exact_payload(layout, dtype, seq_len, where):
    """The device path (torch, a staging slot a chunk at a time) and the host path (numpy,
    the landing slab's bytes) both give the payload, for every layout and dtype."""
    ar = SyntheticAR(agent=False, layout=layout, dtype=dtype, layers=3, heads=3,
                     block_size=4, head_size=5, blocks=6)
    blocks = [4, 0, 2][: -(-seq_len // 4)]
    kv = np.empty((3, 2, 3, seq_len, 5), DTYPES[dtype])
    out = payload_view(kv, dtype)
    # Two chunks: layer 0 alone, then layers 1 and 2 (how a small slot reads them).
    for first, end in ((0, 1), (1, 3)):
        staged = staged_bytes(ar, range(first, end), blocks)
        if where == "device":
            assemble_chunk(staged, ar.fmt, end - first, len(blocks), seq_len, out[first:end])
        else:
            assemble_host(staged.numpy(), ar.fmt, end - first, len(blocks), seq_len,
                          kv[first:end])
    assert np.array_equal(kv, ar.expected(blocks, seq_len))


def test_a_chunk_of_blocks_lands_in_its_tokens():
    """A layer larger than a slot is read in runs of blocks: each run fills its tokens."""
    ar = SyntheticAR(agent=False, layers=1, blocks=8)
    blocks, seq_len = [7, 1, 5], 10
    kv = np.zeros((1, 2, 2, seq_len, 8), np.float32)
    out = payload_view(kv, "float32")
    assemble_chunk(staged_bytes(ar, range(1), blocks[:2]), ar.fmt, 1, 2, 8, out[:, :, :, 0:8])
    assemble_chunk(staged_bytes(ar, range(1), blocks[2:]), ar.fmt, 1, 1, 2, out[:, :, :, 8:10])
    assert np.array_equal(kv, ar.expected(blocks, seq_len))


def test_the_synthetic_cpu_layout_is_what_vllms_cpu_kernel_writes():
    """The tests' AR lays out its cache as vLLM's CPU attention kernel does: the block format
    the probe (kv/layout.py) finds through the real kernel is the one the tests announce, and
    the tokens the kernel writes are where SyntheticAR.expected reads them."""
    ops = pytest.importorskip("vllm._custom_ops")
    from omni_runtime.kv.layout import probe_block_format

    B, H, D, N = 16, 2, 32, 2  # a head size and block size the CPU kernels support
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(torch.float32, B, D)
    except Exception:  # an older or newer vLLM: the generic kernel
        isa = "vec"

    class Impl:
        def do_kv_cache_update(self, layer, key, value, kv_cache, slots):
            n, h, b, _ = kv_cache.size()
            k_cache, v_cache = kv_cache.view(n, h, 2 * b, -1).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, isa)

    class Layer:
        impl = Impl()

    ar = SyntheticAR(agent=False, layers=1, heads=H, block_size=B, head_size=D, blocks=N)
    try:
        fmt = probe_block_format(Layer(), torch.zeros(N, H, B, 2 * D), N, B, H, D)
    except (AttributeError, RuntimeError) as e:  # a vLLM built without the CPU kernels
        pytest.skip(f"vLLM's CPU attention kernel is not available: {e}")
    assert fmt == ar.fmt
    keys, values = torch.randn(N * B, H, D), torch.randn(N * B, H, D)
    Impl().do_kv_cache_update(None, keys, values, ar.caches[0].zero_(), torch.arange(N * B))
    want = torch.stack([keys.permute(1, 0, 2), values.permute(1, 0, 2)])[None]
    assert np.array_equal(ar.expected(range(N), N * B), want.numpy())


# ---------------------------------------------------------------------- payload
def test_bfloat16_bits_widen_to_the_float32_they_came_from():
    f32 = np.random.default_rng(0).standard_normal((2, 2, 3, 4, 5)).astype(np.float32)
    bits = (f32.view(np.uint32) >> 16).astype(np.uint16)
    p = KVPayload("r", 4, bits, dtype="bfloat16")
    assert p.dtype_name == "bfloat16" and p.nbytes == bits.nbytes
    np.testing.assert_allclose(p.as_float32(), f32, rtol=2 ** -7)


@pytest.mark.parametrize("internal, randomized, external", [
    ("cmpl-abc-0-0f1e2d3c", True, "cmpl-abc-0"),
    ("chatcmpl-abc-12345678", True, "chatcmpl-abc"),
    ("no-suffix", True, "no-suffix"),
    ("cmpl-abc-0", False, "cmpl-abc-0"),
])
def test_vllms_external_id_from_its_internal_id(internal, randomized, external):
    assert vllm_external_request_id(internal, randomized=randomized) == external
