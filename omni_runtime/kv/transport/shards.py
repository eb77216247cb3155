"""Assembling a tensor-parallel transfer's KV-head shards into one payload.

With ``tensor_parallel_size`` N, each rank of the AR stage holds its own KV heads (rank r: the
heads ``[r * H/N, (r+1) * H/N)``) and ships them as shard r of N (wire header fields
``shard``/``num_shards``). The receiving inbox (:mod:`.inbox`) keeps one
:class:`ShardAssembly` per transfer, keeps each shard as it arrives, and stores the payload
``[layers, 2, H, seq_len, head_size]`` (shard 0 of 1) once every shard is in, each shard
copied into its slice of the head axis when a consumer takes it: a consumer never sees a
partial transfer.

Which shards belong together: the same request id, the same attempt (the connector's
``extra["attempt"]``; 0 when absent) and the same ``num_shards``. A shard that disagrees with
the first shard of its transfer (seq_len, dtype, shard shape, pipeline, stage) is refused
``shard_mismatch``; the same shard sent again (a resend) overwrites its slice.

Pure data handling, no locking: the inbox calls it under its own lock.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from omni_runtime.kv.transport.payload import HEAD_AXIS, KVPayload


def assembly_key(shard: KVPayload) -> tuple[str, int, int]:
    """The transfer a shard belongs to: (request id, attempt, num_shards)."""
    attempt: Any = (shard.extra or {}).get("attempt", 0)
    if not isinstance(attempt, int) or isinstance(attempt, bool):
        attempt = 0
    return shard.request_id, attempt, shard.num_shards


def assembled_nbytes(shard: KVPayload) -> int:
    """Bytes of the whole payload a shard is part of (every shard has the same shape)."""
    return shard.nbytes * shard.num_shards


class ShardAssembly:
    """One transfer's shards arriving, kept as they came; once complete it is the stored
    payload's ``staged`` KV: the shards are copied into their slices of the head axis when
    a consumer takes the payload (not on the receiver's thread, before the ack)."""

    def __init__(self, first: KVPayload, started_at: float) -> None:
        self.key = assembly_key(first)
        self.num_shards = first.num_shards
        self.shard_shape = first.shape
        shape = list(self.shard_shape)
        shape[HEAD_AXIS] *= self.num_shards
        self.shape = tuple(shape)
        self.dtype = first.array_dtype
        self.nbytes = int(np.prod(self.shape)) * self.dtype.itemsize
        self.started_at = started_at  # the inbox clock: partial assemblies expire too
        self._shards: dict[int, KVPayload] = {}
        self._meta = first  # header fields of the assembled payload: shard 0's once it came

    @property
    def received(self) -> set[int]:
        return set(self._shards)

    def mismatch(self, shard: KVPayload) -> str | None:
        """Why ``shard`` cannot be part of this transfer, or None."""
        mine = self._meta
        for name, theirs, ours in (
            ("shape", shard.shape, self.shard_shape),
            ("seq_len", shard.seq_len, mine.seq_len),
            ("dtype", shard.dtype_name, mine.dtype_name),
            ("pipeline", shard.pipeline, mine.pipeline),
            ("from_stage", shard.from_stage, mine.from_stage),
        ):
            if theirs != ours:
                return (f"shard {shard.shard} of {self.num_shards} of request "
                        f"{shard.request_id}: {name} {theirs!r}, the other shards have {ours!r}")
        return None

    def add(self, shard: KVPayload) -> None:
        """Keep ``shard`` (a resend replaces the one it resends)."""
        self._shards[shard.shard] = shard
        if shard.shard == 0:
            self._meta = shard

    @property
    def complete(self) -> bool:
        return len(self._shards) == self.num_shards

    def into(self, out: np.ndarray) -> None:
        """Each shard into its slice of the head axis of ``out`` (this shape and dtype)."""
        heads = self.shard_shape[HEAD_AXIS]
        index: list[Any] = [slice(None)] * out.ndim
        for i, shard in self._shards.items():
            index[HEAD_AXIS] = slice(i * heads, (i + 1) * heads)
            part = out[tuple(index)]
            if shard.kv is not None:
                part[...] = shard.kv
            else:
                shard.staged.into(part)

    def payload(self) -> KVPayload:
        """The assembled payload (only when complete): one transfer, shard 0 of 1, its KV
        staged in this assembly."""
        meta = self._meta
        return KVPayload(
            request_id=meta.request_id, seq_len=meta.seq_len, kv=None, staged=self,
            pipeline=meta.pipeline, from_stage=meta.from_stage,
            trace_context=meta.trace_context, extra=meta.extra, dtype=meta.dtype,
            to_stage=meta.to_stage, sent_at=meta.sent_at,
            external_request_id=meta.external_request_id, token_ids=meta.token_ids,
            prompt_len=meta.prompt_len, origin=meta.origin, model=meta.model,
        )
