"""The control protocol between an AR stage's KV sender and a receiving stage (its version:
``omni_contract.kv_wire.KV_WIRE_VERSION``).

The KV bytes never travel here: the receiving stage reads them with NIXL straight out of the
AR's registered KV cache. What travels are small messages, each one UTF-8 JSON object: the
``hello`` and its answer over one ZeroMQ DEALER (AR rank) -> ROUTER (receiver) connection per
endpoint, each with a second frame (the sending agent's NIXL metadata); every other message as
a NIXL notification between the two agents:

AR -> receiver
  ``hello``   who the agent is, where its KV cache is registered (one region per layer), the
              block format (how K and V fill a block) and the compatibility fields with their
              hash. Sent on every new connection, before any ``read``.
  ``read``    the descriptor of one transfer: ids, attempt, time left, trace context, the
              blocks (as runs of consecutive ids) and the compatibility hash.
  ``verdict`` the fence: after the receiver said ``read_done``, whether the blocks were held
              for the whole read (``commit``) or not (``abort``). Only a committed read is
              stored.
  ``chunk``   a chunk of a streamed edge's stream: its tokens, numbered in the stream; no
              KV. Answered ``ok`` once the consumer's request holds it, or ``rejected``.
  ``stream_end`` a stream the producer ended before its last chunk (answered ``ok``).
receiver -> AR
  ``hello_ok`` the hello was accepted (reads may follow, as notifications to the agent whose
              metadata it carries);
  ``read_done`` the blocks of a ``read`` were read (all of them); the AR answers a verdict;
  ``ok``       the payload is stored in the inbox: the transfer's ack;
  ``rejected`` a ``hello`` or ``read`` refused, with a code from :data:`REJECT_CODES`.

Everything here is pure (no sockets, no NIXL): ``encode_*`` build what is sent, ``parse_*``
turn received frames into typed messages or raise :class:`Rejected` with a bounded code (the
metric label) and a reason (the log line and the reply). Any input whatever gives one of the
two, never another exception (fuzzed: tests/fuzz/receiver_fuzz.py).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from omni_contract.edges import MAX_DEADLINE_SECONDS
from omni_contract.kv_wire import KV_WIRE_VERSION as WIRE_VERSION
from omni_contract.kv_wire import REJECT_CODES
from omni_runtime.kv.transport.payload import DTYPES, MAX_SHARDS

#: A message's JSON frame; a hello with a full block index (a layout that is no affine map)
#: is the largest: 2 x blocks' elements ints.
MAX_MESSAGE_BYTES = 4 << 20
#: A NIXL agent's metadata (UCX worker addresses and the registered regions' keys).
MAX_AGENT_METADATA_BYTES = 1 << 20
#: Bounds on what a hello or read may describe (far above real models, so a typo or an
#: attack is refused before any memory is sized from it).
MAX_LAYERS = 4096
MAX_RUNS = 1 << 16
MAX_BLOCK_ID = 1 << 40
MAX_TOKENS = 1 << 24
MAX_NAME_CHARS = 256
#: Token ids a read may carry are below this (vocabularies are far smaller).
MAX_TOKEN_ID = 1 << 31
#: A read's pipeline context (ReadRequest.origin): its keys and their values' length.
ORIGIN_KEYS = frozenset({"request_id", "endpoint", "token"})
MAX_ORIGIN_CHARS = 2048


class Rejected(Exception):
    """A message refused by the receiver: ``code`` one of REJECT_CODES. ``transfer_id`` and
    ``request_id`` address the reply when the message got that far."""

    def __init__(self, code: str, reason: str, *, transfer_id: int | None = None,
                 request_id: str | None = None) -> None:
        assert code in REJECT_CODES, code
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason
        self.transfer_id = transfer_id
        self.request_id = request_id


# ---------------------------------------------------------------------- the block format
@dataclass(frozen=True)
class Affine:
    """Element (head h, token t, dim d) of K or V sits at ``offset + h*head + t*token +
    d*dim`` elements into its block of plane ``plane``."""

    offset: int
    head: int
    token: int
    dim: int
    plane: int = 0


@dataclass(frozen=True)
class BlockFormat:
    """How one layer's blocks hold its K and V: what the receiver needs to assemble the
    payload from blocks read as they are. A layer's cache is ``planes`` runs of blocks (one
    when K and V share a block, as on vLLM's CPU backend; two when they are split, as with
    FlashAttention's ``[2, blocks, ...]``); a block is ``block_numel`` contiguous elements of
    ``dtype``, block ``i`` of a plane at ``i * block_bytes`` into the plane's region.
    ``k``/``v``: the affine map when the layout is one (every layout vLLM 0.32 writes), else
    ``k_index``/``v_index``: per (h, t, d) element, flattened in that order, its offset into
    one block of each plane side by side (``plane * block_numel + offset``)."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    block_numel: int
    planes: int = 1
    k: Affine | None = None
    v: Affine | None = None
    k_index: tuple[int, ...] | None = None
    v_index: tuple[int, ...] | None = None

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def block_bytes(self) -> int:
        """One block of one plane."""
        return self.block_numel * self.itemsize

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("k_index", "v_index"):
            if out[key] is not None:
                out[key] = list(out[key])
        return out

    def digest(self) -> str:
        """A short digest of the format (part of the compatibility hash)."""
        raw = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(raw).hexdigest()[:16]


@dataclass(frozen=True)
class Compat:
    """What must match between the AR and the receiver for the bytes to mean what the
    receiver thinks: the model, the cache's dtype and shape, the block format, the pipeline
    revision the sender belongs to and the protocol version. ``num_kv_heads`` is the whole
    model's (all shards). ``revision``: the stage config's ``revision`` (the hash of everything
    a pipeline's stages must agree on), "" for a sender outside an operator-made pipeline; a
    receiving stage of a revision refuses a sender of another, so that a transfer misrouted
    across a rollout fails loudly instead of delivering bytes its reader misreads."""

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    layout: str  # BlockFormat.digest()
    revision: str = ""
    wire_version: int = WIRE_VERSION

    def hash(self) -> str:
        raw = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(raw).hexdigest()[:32]


def incompatibility(compat: Compat, expect: dict[str, Any]) -> str | None:
    """Why ``compat`` fails the receiver's expectation (fields it knows, e.g. ``{"model":
    ...}``), naming the first field that differs; None when it passes."""
    for name, wanted in expect.items():
        if wanted is None:
            continue
        got = getattr(compat, name, None)
        if got != wanted:
            return f"{name} is {got!r}, this stage expects {wanted!r}"
    return None


@dataclass(frozen=True)
class Region:
    """One layer's registered KV cache: ``length`` bytes at ``addr`` on device ``device``."""

    addr: int
    length: int
    device: int = 0


# ---------------------------------------------------------------------- messages
@dataclass(frozen=True)
class Hello:
    agent: str
    conn: int  # the sender's connection count: replies name it, a stale one is ignored
    pipeline: str
    from_stage: str
    to_stage: str
    shard: int
    num_shards: int
    mem_type: str  # "DRAM" or "VRAM": where the regions are
    compat: Compat
    compat_hash: str
    block_format: BlockFormat
    #: Per layer, per plane (layer-major): where that plane's blocks are.
    regions: tuple[Region, ...]
    metadata: bytes = field(repr=False, default=b"")  # the NIXL agent's (second frame)


@dataclass(frozen=True)
class ReadRequest:
    transfer_id: int
    agent: str
    compat_hash: str
    request_id: str
    external_request_id: str
    attempt: int
    seq_len: int
    #: (first block id, count) in payload order; together they cover ceil(seq_len / B) blocks.
    runs: tuple[tuple[int, int], ...]
    deadline_in_s: float
    trace_context: dict[str, str] | None
    pipeline: str
    from_stage: str
    to_stage: str
    shard: int
    num_shards: int
    sent_at: float
    #: What the hand-off carries besides the KV (sched/handoff.py's Carried): the request's
    #: tokens at its trigger (the KV covers the first seq_len), how many are its prompt,
    #: and its pipeline context ({"request_id", "endpoint"}: the pipeline's endpoint
    #: awaiting the request's output); empty / None when there is none.
    token_ids: tuple[int, ...] = ()
    prompt_len: int = 0
    origin: dict[str, str] | None = None

    @property
    def num_blocks(self) -> int:
        return sum(count for _, count in self.runs)


@dataclass(frozen=True)
class StreamChunk:
    """One chunk of a streamed edge's stream (omni_runtime/transfers/streams.py): the
    producer's output tokens ``token_ids`` (on chunk 0 after the request's prompt, the first
    ``prompt_len`` of them), numbered ``seq`` from 0 in its stream, ``last`` when nothing
    follows. Answered ``ok`` once the consumer's request holds it, or ``rejected``. No KV
    travels with it. ``transfer_id`` is the sender's, unique per message."""

    transfer_id: int
    agent: str
    compat_hash: str
    request_id: str
    external_request_id: str
    pipeline: str
    from_stage: str
    to_stage: str
    seq: int
    last: bool
    token_ids: tuple[int, ...]
    prompt_len: int
    deadline_in_s: float
    produced_at: float
    sent_at: float
    trace_context: dict[str, str] | None = None
    origin: dict[str, str] | None = None


@dataclass(frozen=True)
class StreamEnd:
    """The producer ended a stream before its last chunk (its request failed or was
    aborted): the consumer ends its request with ``reason``."""

    transfer_id: int
    agent: str
    request_id: str
    pipeline: str
    from_stage: str
    to_stage: str
    outcome: str
    reason: str


#: How a producer's stream may end early (the stream ledger's outcomes a StreamEnd carries;
#: ``consumer_error``: the producer gave up waiting for the consumer's answer to a chunk).
STREAM_END_OUTCOMES = ("producer_error", "aborted", "expired", "consumer_error")
#: Chunks of a stream a message may number (far above any request's output).
MAX_CHUNK_SEQ = 1 << 24


@dataclass(frozen=True)
class Verdict:
    agent: str
    transfer_id: int
    commit: bool
    reason: str = ""


@dataclass(frozen=True)
class Reply:
    """receiver -> AR: ``kind`` one of hello_ok, read_done, ok, rejected."""

    kind: str
    transfer_id: int | None = None
    request_id: str | None = None
    conn: int | None = None
    code: str = ""
    reason: str = ""


REPLY_KINDS = ("hello_ok", "read_done", "ok", "rejected")


# ---------------------------------------------------------------------- encoding
def _dumps(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def encode_hello(h: Hello) -> list[bytes]:
    body = {
        "v": WIRE_VERSION, "type": "hello", "agent": h.agent, "conn": h.conn,
        "pipeline": h.pipeline, "from_stage": h.from_stage, "to_stage": h.to_stage,
        "shard": h.shard, "num_shards": h.num_shards, "mem_type": h.mem_type,
        "compat": asdict(h.compat), "compat_hash": h.compat_hash,
        "block_format": h.block_format.to_json(),
        "regions": [[r.addr, r.length, r.device] for r in h.regions],
    }
    return [_dumps(body), h.metadata]


def encode_read(r: ReadRequest) -> list[bytes]:
    body = {
        "v": WIRE_VERSION, "type": "read", "transfer_id": r.transfer_id, "agent": r.agent,
        "compat_hash": r.compat_hash, "request_id": r.request_id, "attempt": r.attempt,
        "seq_len": r.seq_len, "runs": [list(run) for run in r.runs],
        "deadline_in_s": r.deadline_in_s, "pipeline": r.pipeline,
        "from_stage": r.from_stage, "to_stage": r.to_stage, "sent_at": r.sent_at,
    }
    # Optional at their defaults (a header stays small for the common case).
    if r.external_request_id and r.external_request_id != r.request_id:
        body["external_request_id"] = r.external_request_id
    if r.trace_context:
        body["trace_context"] = {k: v for k, v in r.trace_context.items()
                                 if isinstance(k, str) and isinstance(v, str)}
    if r.num_shards != 1:
        body["shard"], body["num_shards"] = r.shard, r.num_shards
    if r.token_ids:
        body["token_ids"] = list(r.token_ids)
        body["prompt_len"] = r.prompt_len
    if r.origin:
        body["origin"] = dict(r.origin)
    return [_dumps(body)]


def encode_chunk(c: StreamChunk) -> list[bytes]:
    body = {
        "v": WIRE_VERSION, "type": "chunk", "transfer_id": c.transfer_id, "agent": c.agent,
        "compat_hash": c.compat_hash, "request_id": c.request_id, "pipeline": c.pipeline,
        "from_stage": c.from_stage, "to_stage": c.to_stage, "seq": c.seq, "last": c.last,
        "token_ids": list(c.token_ids), "prompt_len": c.prompt_len,
        "deadline_in_s": c.deadline_in_s, "produced_at": c.produced_at, "sent_at": c.sent_at,
    }
    if c.external_request_id and c.external_request_id != c.request_id:
        body["external_request_id"] = c.external_request_id
    if c.trace_context:
        body["trace_context"] = dict(c.trace_context)
    if c.origin:
        body["origin"] = dict(c.origin)
    return [_dumps(body)]


def encode_stream_end(e: StreamEnd) -> list[bytes]:
    return [_dumps({"v": WIRE_VERSION, "type": "stream_end", "transfer_id": e.transfer_id,
                    "agent": e.agent, "request_id": e.request_id, "pipeline": e.pipeline,
                    "from_stage": e.from_stage, "to_stage": e.to_stage,
                    "outcome": e.outcome, "reason": e.reason})]


def encode_verdict(v: Verdict) -> list[bytes]:
    return [_dumps({"v": WIRE_VERSION, "type": "verdict", "agent": v.agent,
                    "transfer_id": v.transfer_id, "commit": v.commit, "reason": v.reason})]


def encode_reply(r: Reply) -> bytes:
    return _dumps({"v": WIRE_VERSION, "type": r.kind, "transfer_id": r.transfer_id,
                   "request_id": r.request_id, "conn": r.conn, "code": r.code,
                   "reason": r.reason})


# ---------------------------------------------------------------------- decoding
class _Fields:
    """Type-checked access to a message's fields; every miss raises Rejected("malformed")."""

    def __init__(self, body: dict[str, Any], where: str = "") -> None:
        self.body = body
        self.where = where

    def _bad(self, key: str, why: str) -> Rejected:
        return Rejected("malformed", f"{self.where}{key} {why}")

    def str(self, key: str, *, default: str | None = None, empty: bool = True,
            max_chars: int = MAX_NAME_CHARS) -> str:
        value = self.body.get(key, default)
        if not isinstance(value, str):
            raise self._bad(key, "missing" if key not in self.body else "must be a string")
        if not empty and not value:
            raise self._bad(key, "must not be empty")
        if len(value) > max_chars:
            raise self._bad(key, f"is longer than {max_chars} characters")
        return value

    def int(self, key: str, lo: int, hi: int, *, default: int | None = None) -> int:
        value = self.body.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self._bad(key, "missing" if key not in self.body else "must be an integer")
        if not lo <= value <= hi:
            raise self._bad(key, f"must be in [{lo}, {hi}], got {value}")
        return value

    def number(self, key: str, lo: float, hi: float) -> float:
        value = self.body.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self._bad(key, "missing" if key not in self.body else "must be a number")
        value = float(value)
        if not (lo <= value <= hi) or math.isnan(value):
            raise self._bad(key, f"must be in [{lo}, {hi}], got {value}")
        return value

    def bool(self, key: str) -> bool:
        value = self.body.get(key)
        if not isinstance(value, bool):
            raise self._bad(key, "missing" if key not in self.body else "must be a boolean")
        return value

    def obj(self, key: str, *, optional: bool = False) -> dict[str, Any] | None:
        value = self.body.get(key)
        if value is None and optional:
            return None
        if not isinstance(value, dict):
            raise self._bad(key, "missing" if key not in self.body else "must be an object")
        return value

    def list(self, key: str, max_len: int) -> list[Any]:
        value = self.body.get(key)
        if not isinstance(value, list):
            raise self._bad(key, "missing" if key not in self.body else "must be a list")
        if len(value) > max_len:
            raise self._bad(key, f"has more than {max_len} entries")
        return value


def parse_message(frames: list[bytes | memoryview]) -> tuple[str, dict[str, Any], list]:
    """The message's type and JSON body (version and size checked), with its other frames."""
    if not frames:
        raise Rejected("bad_frames", "no frames")
    raw = frames[0]
    if len(raw) > MAX_MESSAGE_BYTES:
        raise Rejected("malformed", f"message of {len(raw)} bytes > {MAX_MESSAGE_BYTES}")
    try:
        body = json.loads(bytes(raw))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise Rejected("malformed", f"message is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise Rejected("malformed", f"message is a JSON {type(body).__name__}, not an object")
    version = body.get("v")
    if version != WIRE_VERSION or isinstance(version, bool):
        raise Rejected("unsupported_version",
                       f"protocol version {version!r}, this receiver speaks {WIRE_VERSION}",
                       transfer_id=_opt_int(body.get("transfer_id")),
                       request_id=_opt_str(body.get("request_id")))
    kind = body.get("type")
    if not isinstance(kind, str):
        raise Rejected("malformed", "type missing or not a string")
    return kind, body, list(frames[1:])


def _opt_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _opt_str(value: Any) -> str | None:
    return value if isinstance(value, str) and len(value) <= MAX_NAME_CHARS else None


def addressing(body: dict[str, Any]) -> tuple[int | None, str | None]:
    """The transfer and request ids of a (maybe malformed) body, when they are well typed:
    what a rejection may echo back."""
    return _opt_int(body.get("transfer_id")), _opt_str(body.get("request_id"))


def parse_hello(body: dict[str, Any], rest: list) -> Hello:
    if len(rest) != 1:
        raise Rejected("bad_frames", f"a hello has 2 frames [body, agent metadata], got "
                                     f"{len(rest) + 1}")
    metadata = bytes(rest[0])
    if not metadata or len(metadata) > MAX_AGENT_METADATA_BYTES:
        raise Rejected("malformed", f"agent metadata of {len(metadata)} bytes (1.."
                                    f"{MAX_AGENT_METADATA_BYTES})")
    f = _Fields(body)
    num_shards = f.int("num_shards", 1, MAX_SHARDS)
    compat = _parse_compat(_Fields(f.obj("compat"), "compat."))
    fmt = _parse_block_format(_Fields(f.obj("block_format"), "block_format."))
    regions = []
    for i, entry in enumerate(f.list("regions", 2 * MAX_LAYERS)):
        if (not isinstance(entry, list) or len(entry) != 3 or not all(
                isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 64
                for x in entry)):
            raise Rejected("malformed", f"regions[{i}] must be [addr, length, device] of "
                                        "unsigned 64-bit integers")
        regions.append(Region(*entry))
    hello = Hello(
        agent=f.str("agent", empty=False), conn=f.int("conn", 0, 1 << 62),
        pipeline=f.str("pipeline"), from_stage=f.str("from_stage"),
        to_stage=f.str("to_stage"), shard=f.int("shard", 0, num_shards - 1),
        num_shards=num_shards, mem_type=f.str("mem_type"), compat=compat,
        compat_hash=f.str("compat_hash", empty=False), block_format=fmt,
        regions=tuple(regions), metadata=metadata,
    )
    if hello.mem_type not in ("DRAM", "VRAM"):
        raise Rejected("malformed", f"mem_type must be DRAM or VRAM, got {hello.mem_type!r}")
    # What the bytes mean must agree with itself before anything is read with it.
    if compat.hash() != hello.compat_hash:
        raise Rejected("incompatible", "compat_hash does not match the compatibility fields "
                                       "it was sent with")
    if fmt.digest() != compat.layout:
        raise Rejected("incompatible", "the block format does not match compat.layout")
    if len(regions) != compat.num_layers * fmt.planes:
        raise Rejected("malformed", f"{len(regions)} regions for {compat.num_layers} layers of "
                                    f"{fmt.planes} planes")
    if fmt.dtype != compat.dtype or fmt.block_size != compat.block_size \
            or fmt.head_size != compat.head_size \
            or fmt.num_kv_heads * num_shards != compat.num_kv_heads:
        raise Rejected("incompatible", "the block format disagrees with the compatibility "
                                       "fields (dtype, block size, head size or heads per shard)")
    for i, region in enumerate(regions):
        if region.length < fmt.block_bytes or region.length % fmt.block_bytes:
            raise Rejected("malformed", f"regions[{i}] length {region.length} is not a "
                                        f"whole number of {fmt.block_bytes}-byte blocks")
    return hello


def _parse_compat(f: _Fields) -> Compat:
    return Compat(
        model=f.str("model", max_chars=4096), dtype=_dtype(f), num_layers=f.int("num_layers", 1, MAX_LAYERS),
        num_kv_heads=f.int("num_kv_heads", 1, 1 << 16), head_size=f.int("head_size", 1, 1 << 16),
        block_size=f.int("block_size", 1, 1 << 20), layout=f.str("layout", empty=False),
        revision=f.str("revision"), wire_version=f.int("wire_version", 0, 1 << 16),
    )


def _dtype(f: _Fields) -> str:
    dtype = f.str("dtype")
    if dtype not in DTYPES:
        raise Rejected("malformed", f"{f.where}dtype {dtype!r} is not one of {sorted(DTYPES)}")
    return dtype


def _parse_affine(body: Any, where: str) -> Affine | None:
    if body is None:
        return None
    if not isinstance(body, dict):
        raise Rejected("malformed", f"{where} must be an object or null")
    f = _Fields(body, where + ".")
    return Affine(*(f.int(k, 0, 1 << 40) for k in ("offset", "head", "token", "dim")),
                  plane=f.int("plane", 0, 1, default=0))


def _parse_index(body: Any, where: str, count: int, numel: int) -> tuple[int, ...] | None:
    if body is None:
        return None
    if not isinstance(body, list) or len(body) != count or not all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x < numel for x in body):
        raise Rejected("malformed", f"{where} must be {count} element offsets in [0, {numel})")
    return tuple(body)


def _parse_block_format(f: _Fields) -> BlockFormat:
    B = f.int("block_size", 1, 1 << 20)
    H = f.int("num_kv_heads", 1, 1 << 16)
    D = f.int("head_size", 1, 1 << 16)
    dtype = _dtype(f)
    numel = f.int("block_numel", 1, 1 << 34)
    planes = f.int("planes", 1, 2, default=1)
    count = H * B * D
    if 2 * count > planes * numel:
        raise Rejected("malformed", f"block_format: {planes} x {numel} elements cannot hold K "
                                    f"and V of {H} heads x {B} tokens x {D}")
    fmt = BlockFormat(
        block_size=B, num_kv_heads=H, head_size=D, dtype=dtype, block_numel=numel,
        planes=planes,
        k=_parse_affine(f.body.get("k"), "block_format.k"),
        v=_parse_affine(f.body.get("v"), "block_format.v"),
        k_index=_parse_index(f.body.get("k_index"), "block_format.k_index", count,
                             planes * numel),
        v_index=_parse_index(f.body.get("v_index"), "block_format.v_index", count,
                             planes * numel),
    )
    for name, affine, index in (("k", fmt.k, fmt.k_index), ("v", fmt.v, fmt.v_index)):
        if (affine is None) == (index is None):
            raise Rejected("malformed", f"block_format needs exactly one of {name} (affine) "
                                        f"and {name}_index")
        if affine is not None:
            if affine.plane >= planes:
                raise Rejected("malformed", f"block_format.{name}.plane {affine.plane} of "
                                            f"{planes} planes")
            last = (affine.offset + (H - 1) * affine.head + (B - 1) * affine.token
                    + (D - 1) * affine.dim)
            if last >= numel:
                raise Rejected("malformed", f"block_format.{name} reaches element {last} of a "
                                            f"{numel}-element block")
    return fmt


def parse_read(body: dict[str, Any], rest: list) -> ReadRequest:
    if rest:
        raise Rejected("bad_frames", f"a read has 1 frame, got {len(rest) + 1}",
                       transfer_id=_opt_int(body.get("transfer_id")))
    f = _Fields(body)
    tid = f.int("transfer_id", 0, 1 << 62)
    try:
        num_shards = f.int("num_shards", 1, MAX_SHARDS, default=1)
        runs = []
        for i, run in enumerate(f.list("runs", MAX_RUNS)):
            if (not isinstance(run, list) or len(run) != 2 or not all(
                    isinstance(x, int) and not isinstance(x, bool) for x in run)
                    or not 0 <= run[0] < MAX_BLOCK_ID or not 1 <= run[1] <= MAX_TOKENS):
                raise Rejected("malformed", f"runs[{i}] must be [first block id, count >= 1]")
            runs.append((run[0], run[1]))
        trace, token_ids, prompt_len, origin = _carried(f, body)
        request = ReadRequest(
            transfer_id=tid, agent=f.str("agent", empty=False),
            compat_hash=f.str("compat_hash", empty=False),
            request_id=f.str("request_id", empty=False, max_chars=1024),
            external_request_id=f.str("external_request_id", default="", max_chars=1024),
            attempt=f.int("attempt", 0, 1 << 62), seq_len=f.int("seq_len", 1, MAX_TOKENS),
            runs=tuple(runs), deadline_in_s=f.number("deadline_in_s", 0.0, MAX_DEADLINE_SECONDS),
            trace_context=trace or None, pipeline=f.str("pipeline"),
            from_stage=f.str("from_stage"), to_stage=f.str("to_stage"),
            shard=f.int("shard", 0, num_shards - 1, default=0), num_shards=num_shards,
            sent_at=f.number("sent_at", 0.0, 1e11),
            token_ids=tuple(token_ids), prompt_len=prompt_len, origin=origin or None,
        )
    except Rejected as r:
        r.transfer_id = tid
        r.request_id = _opt_str(body.get("request_id"))
        raise
    return request


def _carried(f: _Fields, body: dict[str, Any]
             ) -> tuple[dict[str, str] | None, list[int], int, dict[str, str] | None]:
    """What a read or a chunk carries besides its ids: its trace context, its tokens (how
    many of them the prompt) and its pipeline context."""
    trace = f.obj("trace_context", optional=True)
    if trace is not None and not all(isinstance(k, str) and isinstance(v, str)
                                     and len(v) <= 1024 for k, v in trace.items()):
        raise Rejected("malformed", "trace_context must map strings to strings")
    token_ids = f.list("token_ids", MAX_TOKENS) if "token_ids" in body else []
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < MAX_TOKEN_ID
               for t in token_ids):
        raise Rejected("malformed", f"token_ids must be token ids in [0, {MAX_TOKEN_ID})")
    prompt_len = f.int("prompt_len", 0, len(token_ids), default=0)
    origin = f.obj("origin", optional=True)
    if origin is not None and not (
            set(origin) <= ORIGIN_KEYS and all(
                isinstance(v, str) and 0 < len(v) <= MAX_ORIGIN_CHARS
                for v in origin.values())):
        raise Rejected("malformed", f"origin must map some of {sorted(ORIGIN_KEYS)} to "
                                    f"strings of 1 to {MAX_ORIGIN_CHARS} characters")
    return trace or None, token_ids, prompt_len, origin or None


def parse_chunk(body: dict[str, Any], rest: list) -> StreamChunk:
    if rest:
        raise Rejected("bad_frames", f"a chunk has 1 frame, got {len(rest) + 1}",
                       transfer_id=_opt_int(body.get("transfer_id")))
    f = _Fields(body)
    tid = f.int("transfer_id", 0, 1 << 62)
    try:
        trace, token_ids, prompt_len, origin = _carried(f, body)
        seq = f.int("seq", 0, MAX_CHUNK_SEQ)
        if prompt_len and seq != 0:
            raise Rejected("malformed", "prompt_len: only chunk 0 carries the prompt")
        return StreamChunk(
            transfer_id=tid, agent=f.str("agent", empty=False),
            compat_hash=f.str("compat_hash", empty=False),
            request_id=f.str("request_id", empty=False, max_chars=1024),
            external_request_id=f.str("external_request_id", default="", max_chars=1024),
            pipeline=f.str("pipeline"), from_stage=f.str("from_stage", empty=False),
            to_stage=f.str("to_stage"), seq=seq, last=f.bool("last"),
            token_ids=tuple(token_ids), prompt_len=prompt_len,
            deadline_in_s=f.number("deadline_in_s", 0.0, MAX_DEADLINE_SECONDS),
            produced_at=f.number("produced_at", 0.0, 1e11),
            sent_at=f.number("sent_at", 0.0, 1e11), trace_context=trace, origin=origin)
    except Rejected as r:
        r.transfer_id = tid
        r.request_id = _opt_str(body.get("request_id"))
        raise


def parse_stream_end(body: dict[str, Any], rest: list) -> StreamEnd:
    if rest:
        raise Rejected("bad_frames", f"a stream_end has 1 frame, got {len(rest) + 1}")
    f = _Fields(body)
    outcome = f.str("outcome")
    if outcome not in STREAM_END_OUTCOMES:
        raise Rejected("malformed", f"outcome must be one of {', '.join(STREAM_END_OUTCOMES)}")
    return StreamEnd(transfer_id=f.int("transfer_id", 0, 1 << 62),
                     agent=f.str("agent", empty=False),
                     request_id=f.str("request_id", empty=False, max_chars=1024),
                     pipeline=f.str("pipeline"), from_stage=f.str("from_stage", empty=False),
                     to_stage=f.str("to_stage"), outcome=outcome,
                     reason=f.str("reason", default="", max_chars=4096))


def parse_verdict(body: dict[str, Any], rest: list) -> Verdict:
    if rest:
        raise Rejected("bad_frames", f"a verdict has 1 frame, got {len(rest) + 1}")
    f = _Fields(body)
    return Verdict(agent=f.str("agent", empty=False),
                   transfer_id=f.int("transfer_id", 0, 1 << 62), commit=f.bool("commit"),
                   reason=f.str("reason", default="", max_chars=4096))


def decode_reply(raw: bytes) -> Reply | None:
    """A receiver's reply, or None when it is not one (the sender logs and ignores it)."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(body, dict) or body.get("type") not in REPLY_KINDS:
        return None
    return Reply(kind=body["type"], transfer_id=_opt_int(body.get("transfer_id")),
                 request_id=_opt_str(body.get("request_id")), conn=_opt_int(body.get("conn")),
                 code=str(body.get("code", ""))[:64], reason=str(body.get("reason", ""))[:4096])


def blocks_needed(seq_len: int, block_size: int) -> int:
    return -(-seq_len // block_size)


def block_runs(block_ids: Any) -> tuple[tuple[int, int], ...]:
    """``block_ids`` as a read's runs of consecutive ids: ((first, count), ...)."""
    runs: list[list[int]] = []
    for b in block_ids:
        b = int(b)
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1][1] += 1
        else:
            runs.append([b, 1])
    return tuple((first, count) for first, count in runs)
