"""A request's KV cache as the next stage gets it: :class:`KVPayload`, one array
``[layers, 2 (K, V), kv_heads, seq_len, head_size]`` (Hugging Face ``past_key_values`` order per
layer), and the checks on it. Pure data (NumPy), no transport.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

#: The KV layout: [num_layers, 2 (K, V), num_kv_heads, seq_len, head_dim].
KV_NDIM = 5
SEQ_AXIS = 3
#: The axis a tensor-parallel shard splits: each rank holds its own KV heads.
HEAD_AXIS = 2
#: Upper bound on ``num_shards`` a receiver accepts (tensor-parallel degrees are small).
MAX_SHARDS = 64

#: Payload dtype name -> numpy dtype of the carried array. bfloat16 is carried as its raw 16
#: bits (numpy has no bfloat16): the array is uint16 and ``KVPayload.dtype`` says "bfloat16".
DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
}


# ---------------------------------------------------------------------- payload
@dataclass
class KVPayload:
    """One request's KV cache cut to ``seq_len``, as the receiving stage stores it.

    ``kv``: one C-contiguous array of shape [num_layers, 2 (K, V), num_kv_heads, seq_len,
    head_dim] (Hugging Face ``past_key_values`` order per layer), dtype float32, float16, or
    uint16 holding bfloat16 bits. ``dtype`` names the dtype; None derives it from ``kv.dtype``
    (uint16 means bfloat16). The receiver assembles it from the blocks it read (NIXL).
    """

    request_id: str
    seq_len: int
    kv: np.ndarray
    pipeline: str = ""
    from_stage: str = ""
    trace_context: dict[str, str] | None = None
    extra: dict | None = None
    dtype: str | None = None
    #: Receiver side only: the destination stage, and when the transfer was offered (the
    #: sender's unix clock) and the payload stored (the receiver's unix clock).
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

