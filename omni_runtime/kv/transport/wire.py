"""The connector's wire format: one ZeroMQ multipart message per KV transfer, one JSON reply.

Transfer (sender DEALER -> receiver ROUTER; the ROUTER prepends the peer identity frame):

    frame 0  header: UTF-8 JSON object, at most MAX_HEADER_BYTES (fields: HEADER_FIELDS)
    frame 1  data:   the KV tensor's raw bytes, C order, exactly header["nbytes"] bytes

Reply (receiver -> sender), one frame of JSON: ``{"v", "transfer_id", "request_id",
"status": "ok" | "rejected", "code", "reason"}``. ``ok`` is sent only after the payload is
stored in the receiver's inbox.

Everything here is pure (no sockets): :func:`encode_header` builds what the sender sends and
:func:`decode_transfer` turns received frames into a :class:`KVPayload` or raises
:class:`Rejected` with a bounded ``code`` (the metric label) and a free-text reason (the log
line and the reply). The invariant a decoded payload satisfies: its header passed every check
below, its data frame has exactly ``prod(shape) * itemsize`` bytes, and the checksum named in
the header matches those bytes.
"""

from __future__ import annotations

import json
import math
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

WIRE_VERSION = 1
MAX_HEADER_BYTES = 64 * 1024
#: The KV layout: [num_layers, 2 (K, V), num_kv_heads, seq_len, head_dim].
KV_NDIM = 5
SEQ_AXIS = 3
#: The axis a tensor-parallel shard splits: each rank holds its own KV heads.
HEAD_AXIS = 2
#: Upper bound on ``num_shards`` a receiver accepts (tensor-parallel degrees are small).
MAX_SHARDS = 64

#: Wire dtype name -> numpy dtype of the carried array. bfloat16 travels as its raw 16 bits
#: (numpy has no bfloat16): the array is uint16 and ``KVPayload.dtype`` says "bfloat16".
DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
}


# ---------------------------------------------------------------------- checksums
def _crc32(data: memoryview) -> str:
    # zlib.crc32 releases the GIL on large buffers, so it overlaps with other threads.
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


CHECKSUMS: dict[str, Callable[[memoryview], str]] = {"crc32": _crc32}
try:
    # xxh3 runs at ~20 GB/s here against ~2 GB/s for zlib.crc32, which on a 16 MiB payload
    # is the difference between a throughput ratio of ~0.4 and ~0.8 against raw ZeroMQ
    # (benchmarks/transfer_throughput.py). A base dependency; crc32 stays accepted.
    import xxhash as _xxhash

    CHECKSUMS["xxh3_64"] = _xxhash.xxh3_64_hexdigest
except ImportError:  # pragma: no cover - an install without the declared dependency
    pass
DEFAULT_CHECKSUM = "xxh3_64" if "xxh3_64" in CHECKSUMS else "crc32"


def checksum(algo: str, data: memoryview) -> str:
    """``"<algo>:<hex digest>"`` of ``data``."""
    return f"{algo}:{CHECKSUMS[algo](data)}"


# ---------------------------------------------------------------------- payload
@dataclass
class KVPayload:
    """One request's KV cache cut to ``seq_len``, as sent and as stored in the inbox.

    ``kv``: one C-contiguous array of shape [num_layers, 2 (K, V), num_kv_heads, seq_len,
    head_dim] (Hugging Face ``past_key_values`` order per layer), dtype float32, float16, or
    uint16 holding bfloat16 bits. ``dtype`` names the wire dtype; None derives it from
    ``kv.dtype`` (uint16 means bfloat16). On the receiving side ``kv`` is a read-only
    zero-copy view of the received ZeroMQ frame.
    """

    request_id: str
    seq_len: int
    kv: np.ndarray
    pipeline: str = ""
    from_stage: str = ""
    trace_context: dict[str, str] | None = None
    extra: dict | None = None
    dtype: str | None = None
    #: Receiver side only: the header's destination stage, and when the payload was sent
    #: (sender's unix clock) and stored (receiver's unix clock).
    to_stage: str = ""
    sent_at: float | None = None
    received_at: float | None = None
    #: The request id the client knows (vLLM's ``external_req_id``: ``request_id`` without
    #: the ``-<8 random chars>`` vLLM appends), when the producer knows it; "" if not. The
    #: receiver's inbox finds the payload by either id. See vllm_external_request_id().
    external_request_id: str = ""
    #: Tensor parallelism: this payload is KV-head shard ``shard`` of ``num_shards`` (rank
    #: ``shard``'s heads, the head axis cut in ``num_shards`` equal consecutive parts). The
    #: receiver's inbox assembles the shards of a transfer into one payload (shard 0 of 1).
    shard: int = 0
    num_shards: int = 1

    @property
    def dtype_name(self) -> str:
        if self.dtype is not None:
            return self.dtype
        for name, dt in DTYPES.items():
            if self.kv.dtype == dt:
                return name
        return str(self.kv.dtype)

    @property
    def nbytes(self) -> int:
        return int(self.kv.nbytes)

    def as_float32(self) -> np.ndarray:
        """The KV tensor as float32 (bfloat16 bits widened: they are float32's top half)."""
        if self.dtype_name == "bfloat16":
            return (self.kv.astype(np.uint32) << 16).view(np.float32)
        return self.kv.astype(np.float32)


def validate_payload(p: Any) -> str | None:
    """Why ``p`` cannot be sent (the sender's submit-time check), or None when it can."""
    if not isinstance(p, KVPayload):
        return f"not a KVPayload: {type(p).__name__}"
    if not isinstance(p.request_id, str) or not p.request_id:
        return "request_id must be a non-empty string"
    if not isinstance(p.seq_len, int) or isinstance(p.seq_len, bool) or p.seq_len < 0:
        return "seq_len must be an int >= 0"
    if not isinstance(p.kv, np.ndarray):
        return f"kv must be a numpy array, not {type(p.kv).__name__}"
    name = p.dtype_name
    if name not in DTYPES or p.kv.dtype != DTYPES[name]:
        return f"unsupported dtype {name!r} for array dtype {p.kv.dtype} (one of {sorted(DTYPES)})"
    shape_problem = _shape_problem(list(p.kv.shape), p.seq_len)
    if shape_problem:
        return shape_problem
    shard_problem = _shard_problem(p.shard, p.num_shards)
    if shard_problem:
        return shard_problem
    for key, value in (("trace_context", p.trace_context), ("extra", p.extra)):
        if value is not None and not isinstance(value, dict):
            return f"{key} must be a dict or None"
    for key in ("pipeline", "from_stage", "external_request_id"):
        if not isinstance(getattr(p, key), str):
            return f"{key} must be a string"
    if p.extra:
        try:
            json.dumps(p.extra)
        except (TypeError, ValueError) as e:
            return f"extra is not JSON-able: {e}"
    return None


def _shape_problem(shape: list[Any], seq_len: int) -> str | None:
    if len(shape) != KV_NDIM or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        return f"shape must be {KV_NDIM} ints >= 0 [layers, 2, kv_heads, seq_len, head_dim], got {shape}"
    if shape[1] != 2:
        return f"shape[1] must be 2 (K, V), got {shape[1]}"
    if shape[SEQ_AXIS] != seq_len:
        return f"shape[{SEQ_AXIS}] = {shape[SEQ_AXIS]} does not match seq_len {seq_len}"
    return None


def _shard_problem(shard: Any, num_shards: Any) -> str | None:
    for name, value in (("shard", shard), ("num_shards", num_shards)):
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{name} must be an int, got {type(value).__name__}"
    if not 1 <= num_shards <= MAX_SHARDS:
        return f"num_shards must be in [1, {MAX_SHARDS}], got {num_shards}"
    if not 0 <= shard < num_shards:
        return f"shard must be in [0, num_shards={num_shards}), got {shard}"
    return None


def data_view(kv: np.ndarray) -> memoryview:
    """The array's bytes as a flat byte memoryview, without a copy when it is C-contiguous
    (a byte view exports through the buffer protocol whatever the element type)."""
    return memoryview(np.ascontiguousarray(kv).reshape(-1).view(np.uint8))


def vllm_external_request_id(request_id: str, *, randomized: bool = True) -> str:
    """The client-facing id of a vLLM request from the engine's internal id.

    vLLM 0.32 makes the internal id ``f"{external_req_id}-{random_uuid():.8}"``
    (``InputProcessor.assign_request_id``, vllm/v1/engine/input_processor.py) unless
    ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION`` is set (pass ``randomized=False``). The
    engine-core ``Request`` the scheduler sees keeps only the internal id (the
    ``EngineCoreRequest.external_req_id`` field is not copied into it), so a producer derives
    the external one here. The external id is what the OpenAI server built from the client's
    ``X-Request-Id`` (or a random id): ``cmpl-<X-Request-Id>-<prompt index>`` for
    /v1/completions, ``chatcmpl-<X-Request-Id>`` for /v1/chat/completions."""
    if not randomized:
        return request_id
    base, sep, suffix = request_id.rpartition("-")
    return base if sep and base and len(suffix) == 8 else request_id


# ---------------------------------------------------------------------- header
#: Field -> accepted JSON types. All are required (None where the type allows it).
HEADER_FIELDS: dict[str, tuple[type, ...]] = {
    "v": (int,),
    "transfer_id": (int,),
    "request_id": (str,),
    "pipeline": (str,),
    "from_stage": (str,),
    "to_stage": (str,),
    "seq_len": (int,),
    "dtype": (str,),
    "shape": (list,),
    "nbytes": (int,),
    "checksum": (str,),
    "trace_context": (dict, type(None)),
    "sent_at": (int, float),
    "extra": (dict, type(None)),
}
#: Optional fields (added in wire version 1 without a version change: receivers ignore fields
#: they do not know, absent means the default, and a sender leaves them out at their default,
#: so headers without them are as before). ``external_request_id``: the client's id of the
#: request; ``shard``/``num_shards``: this message carries KV-head shard ``shard`` of
#: ``num_shards``.
OPTIONAL_HEADER_FIELDS: dict[str, tuple[tuple[type, ...], Any]] = {
    "external_request_id": ((str, type(None)), ""),
    "shard": ((int,), 0),
    "num_shards": ((int,), 1),
}


def encode_header(payload: KVPayload, *, transfer_id: int, to_stage: str, digest: str,
                  sent_at: float | None = None) -> bytes:
    header = {
        "v": WIRE_VERSION,
        "transfer_id": transfer_id,
        "request_id": payload.request_id,
        "pipeline": payload.pipeline,
        "from_stage": payload.from_stage,
        "to_stage": to_stage,
        "seq_len": payload.seq_len,
        "dtype": payload.dtype_name,
        "shape": list(payload.kv.shape),
        "nbytes": payload.nbytes,
        "checksum": digest,
        # Only str -> str entries travel: a stray header must not fail the transfer.
        "trace_context": {k: v for k, v in payload.trace_context.items()
                          if isinstance(k, str) and isinstance(v, str)} or None
        if payload.trace_context else None,
        "sent_at": time.time() if sent_at is None else sent_at,
        "extra": payload.extra or None,
    }
    if payload.external_request_id and payload.external_request_id != payload.request_id:
        header["external_request_id"] = payload.external_request_id
    if payload.num_shards != 1:
        header["shard"], header["num_shards"] = payload.shard, payload.num_shards
    return json.dumps(header, separators=(",", ":")).encode()


# ---------------------------------------------------------------------- rejection
#: Reasons a receiver refuses a transfer: a bounded enum, the ``reason`` metric label.
REJECT_CODES: tuple[str, ...] = (
    "bad_frames",            # frame count is not [header, data]
    "malformed_header",      # not JSON, not an object, a field missing or of the wrong type
    "unsupported_version",   # header "v" is not WIRE_VERSION
    "unsupported_checksum",  # checksum algorithm unknown here
    "size_mismatch",         # data bytes do not match shape x dtype (or "nbytes")
    "checksum_mismatch",     # data bytes do not match the header's checksum
    "oversized",             # payload larger than the receiver's max_payload_bytes
    "wrong_destination",     # to_stage / pipeline name another stage or pipeline
    "inbox_full",            # storing it would exceed the inbox's memory bound
    "shard_mismatch",        # a shard that does not fit the other shards of its transfer
    "internal_error",        # a bug on the receiver (logged with its traceback)
)


class Rejected(Exception):
    """A transfer refused by the receiver. ``code`` is one of REJECT_CODES; ``header`` is
    the parsed header when parsing got that far (to address the reply), else None."""

    def __init__(self, code: str, reason: str, header: dict | None = None) -> None:
        assert code in REJECT_CODES, code
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason
        self.header = header


def parse_header(raw: bytes | memoryview) -> dict:
    """The header as a dict whose fields all have their declared types, or Rejected."""
    if len(raw) > MAX_HEADER_BYTES:
        raise Rejected("malformed_header", f"header of {len(raw)} bytes > {MAX_HEADER_BYTES}")
    try:
        header = json.loads(bytes(raw))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise Rejected("malformed_header", f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise Rejected("malformed_header", f"header is a JSON {type(header).__name__}, not an object")
    # The version first: a future header may have other fields.
    version = header.get("v")
    if version != WIRE_VERSION or isinstance(version, bool):
        raise Rejected("unsupported_version",
                       f"wire version {version!r}, this receiver speaks {WIRE_VERSION}", header)
    for name, types in HEADER_FIELDS.items():
        if name not in header:
            raise Rejected("malformed_header", f"header field {name!r} missing", header)
        value = header[name]
        if not isinstance(value, types) or isinstance(value, bool):
            raise Rejected("malformed_header",
                           f"header field {name!r} is {type(value).__name__}", header)
    if not header["request_id"]:
        raise Rejected("malformed_header", "empty request_id", header)
    if header["seq_len"] < 0 or header["nbytes"] < 0:
        raise Rejected("malformed_header", "negative seq_len or nbytes", header)
    for key in ("trace_context",):
        ctx = header[key]
        if ctx is not None and not all(isinstance(v, str) for v in ctx.values()):
            raise Rejected("malformed_header", f"{key} values must be strings", header)
    for name, (types, default) in OPTIONAL_HEADER_FIELDS.items():
        value = header.setdefault(name, default)
        if not isinstance(value, types) or isinstance(value, bool):
            raise Rejected("malformed_header",
                           f"header field {name!r} is {type(value).__name__}", header)
    problem = _shard_problem(header["shard"], header["num_shards"])
    if problem:
        raise Rejected("malformed_header", problem, header)
    if header["dtype"] not in DTYPES:
        raise Rejected("malformed_header", f"unknown dtype {header['dtype']!r}", header)
    problem = _shape_problem(header["shape"], header["seq_len"])
    if problem:
        raise Rejected("malformed_header", problem, header)
    return header


@dataclass
class Limits:
    """What a receiver accepts. Empty ``stage`` / ``pipeline`` accept any destination."""

    max_payload_bytes: int
    stage: str = ""
    pipeline: str = ""
    checksums: dict[str, Callable[[memoryview], str]] = field(default_factory=lambda: CHECKSUMS)


def decode_transfer(frames: list[Any], limits: Limits) -> tuple[KVPayload, dict]:
    """Validate one transfer's frames (without the ROUTER identity) and build its payload.

    ``frames`` are ``zmq.Frame`` objects (zero copy: the payload's array views frame 1) or
    bytes-likes. Raises :class:`Rejected`; never anything else for bad input.
    """
    if len(frames) != 2:
        raise Rejected("bad_frames", f"{len(frames)} frames, expected 2 [header, data]")
    header = parse_header(_buffer(frames[0]))
    rid = header["request_id"]
    if limits.stage and header["to_stage"] != limits.stage:
        raise Rejected("wrong_destination",
                       f"sent to stage {header['to_stage']!r}, this is {limits.stage!r}", header)
    if limits.pipeline and header["pipeline"] and header["pipeline"] != limits.pipeline:
        raise Rejected("wrong_destination", f"sent for pipeline {header['pipeline']!r}, "
                       f"this is {limits.pipeline!r}", header)
    dtype = DTYPES[header["dtype"]]
    shape = header["shape"]
    expected = math.prod(shape) * dtype.itemsize
    if header["nbytes"] != expected:
        raise Rejected("size_mismatch", f"nbytes {header['nbytes']} != {expected} for shape "
                       f"{shape} of {header['dtype']}", header)
    if expected > limits.max_payload_bytes:
        raise Rejected("oversized", f"{expected} bytes > limit {limits.max_payload_bytes}", header)
    data = _buffer(frames[1])
    if data.nbytes != expected:
        raise Rejected("size_mismatch", f"data frame has {data.nbytes} bytes, header says "
                       f"{expected}", header)
    algo, _, digest = header["checksum"].partition(":")
    fn = limits.checksums.get(algo)
    if fn is None:
        raise Rejected("unsupported_checksum",
                       f"checksum algorithm {algo!r} (known: {sorted(limits.checksums)})", header)
    actual = fn(data)
    if actual != digest:
        raise Rejected("checksum_mismatch", f"{algo} {actual} != header {digest}", header)
    kv = np.frombuffer(data, dtype=dtype).reshape(shape) if expected else np.zeros(shape, dtype)
    payload = KVPayload(
        request_id=rid, seq_len=header["seq_len"], kv=kv, pipeline=header["pipeline"],
        from_stage=header["from_stage"], trace_context=header["trace_context"],
        extra=header["extra"], dtype=header["dtype"], to_stage=header["to_stage"],
        sent_at=float(header["sent_at"]),
        external_request_id=header["external_request_id"] or "",
        shard=header["shard"], num_shards=header["num_shards"],
    )
    return payload, header


def _buffer(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    view = memoryview(buf if buf is not None else frame)
    # A flat byte view whatever the exporter's format (cast needs a C-contiguous buffer).
    return view if (view.format == "B" and view.ndim == 1) else view.cast("B")


# ---------------------------------------------------------------------- replies
def encode_reply(*, transfer_id: int | None, request_id: str | None, ok: bool,
                 code: str = "", reason: str = "") -> bytes:
    return json.dumps({
        "v": WIRE_VERSION, "transfer_id": transfer_id, "request_id": request_id,
        "status": "ok" if ok else "rejected", "code": code, "reason": reason,
    }, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Reply:
    transfer_id: int | None
    request_id: str | None
    ok: bool
    code: str
    reason: str


def decode_reply(raw: bytes) -> Reply | None:
    """The reply, or None when it is not one (the sender logs and ignores it)."""
    try:
        msg = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(msg, dict) or msg.get("status") not in ("ok", "rejected"):
        return None
    tid = msg.get("transfer_id")
    rid = msg.get("request_id")
    if not (tid is None or (isinstance(tid, int) and not isinstance(tid, bool))):
        return None
    return Reply(tid, rid if isinstance(rid, str) else None, msg["status"] == "ok",
                 str(msg.get("code", "")), str(msg.get("reason", "")))
