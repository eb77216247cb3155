"""A request's KV cache as the next stage gets it: :class:`KVPayload`, one array
``[layers, 2 (K, V), kv_heads, seq_len, head_size]`` (Hugging Face ``past_key_values`` order per
layer). Pure data (NumPy), no transport.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

#: The axis of the payload a tensor-parallel shard splits: each rank holds its own KV heads.
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

    A payload a receiver stored may not be assembled yet: ``kv`` is None and ``staged``
    holds the bytes as read (see :meth:`materialize`; the inbox's ``get`` returns payloads
    materialized). ``shape`` and ``nbytes`` are the assembled array's either way.
    """

    request_id: str
    seq_len: int
    kv: np.ndarray | None
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
    #: What the hand-off carried besides the KV: the producing request's tokens at its
    #: trigger (the KV covers the first ``seq_len``; the rest is output after them), how
    #: many of them were its prompt, and its pipeline context ({"request_id", "endpoint"},
    #: or None).
    token_ids: tuple[int, ...] = ()
    prompt_len: int = 0
    origin: dict[str, str] | None = None
    #: The model whose KV this is (the sender's, as its hello names it), "" if unknown.
    model: str = ""
    #: Not assembled yet (``kv`` is None): anything with the array's ``shape`` and
    #: ``dtype`` and ``into(out)`` writing it (assemble.StagedKV, shards.ShardAssembly).
    staged: Any = field(default=None, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False,
                                  compare=False)

    def materialize(self, allocate: Callable[[tuple[int, ...], np.dtype], np.ndarray]
                    = np.empty) -> np.ndarray:
        """``kv``, assembling it from ``staged`` into ``allocate(shape, dtype)`` the first
        time (once, whichever threads ask; the staged bytes are let go then)."""
        with self._lock:
            if self.kv is None:
                kv = allocate(self.staged.shape, self.staged.dtype)
                self.staged.into(kv)
                self.kv, self.staged = kv, None
            return self.kv

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.kv.shape if self.kv is not None else self.staged.shape)

    @property
    def array_dtype(self) -> np.dtype:
        return self.kv.dtype if self.kv is not None else np.dtype(self.staged.dtype)

    @property
    def dtype_name(self) -> str:
        if self.dtype is not None:
            return self.dtype
        for name, dt in DTYPES.items():
            if self.array_dtype == dt:
                return name
        return str(self.array_dtype)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.array_dtype.itemsize

    def summary(self) -> dict[str, Any]:
        """What a listing or a pipeline's answer says of the payload (never its bytes)."""
        return {
            "request_id": self.request_id,
            "external_request_id": self.external_request_id or None,
            "seq_len": self.seq_len,
            "bytes": self.nbytes,
            "dtype": self.dtype_name,
            "shape": list(self.shape),
            "received_at": self.received_at,
            "from_stage": self.from_stage,
            "pipeline": self.pipeline,
            "token_ids": list(self.token_ids),
            "prompt_len": self.prompt_len,
        }

    def as_float32(self) -> np.ndarray:
        """The KV tensor as float32 (bfloat16 bits widened: they are float32's top half)."""
        kv = self.materialize()
        if self.dtype_name == "bfloat16":
            return (kv.astype(np.uint32) << 16).view(np.float32)
        return kv.astype(np.float32)


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

