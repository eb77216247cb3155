"""The omni KV connector's scheduler half, next to OmniARScheduler in the engine core.

* :meth:`hand_off` / :meth:`withdraw` take what the scheduler decided in this step, and
  :meth:`build_connector_meta` passes it to the workers in the step's metadata;
* :meth:`request_finished` answers "delay the free" for a finished request whose transfer is
  unresolved (the "held" state); the scheduler frees the blocks when the transfer resolves
  (acked, failed, expired, or at shutdown / a prefix-cache reset);
* :meth:`take_answers` hands the workers' answers (per attempt) to the scheduler.
"""

from __future__ import annotations

from typing import Any

from omni_runtime.kv.metadata import OmniKVConnectorMetadata, OmniKVWorkerMetadata, ShardAnswers
from omni_runtime.sched.handoff import Answer, HandOff


class OmniKVConnectorScheduler:
    def __init__(self, world_size: int) -> None:
        self._hand_offs: list[HandOff] = []
        self._withdrawn: dict[str, int] = {}
        self._hold: set[str] = set()
        self.shard_answers = ShardAnswers(world_size)

    def hand_off(self, hand_offs: list[HandOff]) -> None:
        """The scheduler's hand-offs for the step being scheduled."""
        self._hand_offs.extend(hand_offs)

    def withdraw(self, request_id: str, attempt: int) -> None:
        """A handed-off transfer the scheduler resolved itself (expiry, reset, shutdown): its
        blocks may be re-used from the next step on; the workers refuse to commit any read of
        it from that step's start (the fence, kv/transport/sender.py)."""
        self._withdrawn[request_id] = attempt

    def hold_on_finish(self, request_id: str) -> None:
        """The next request_finished() of this request keeps its blocks (held)."""
        self._hold.add(request_id)

    def take_answers(self, output: Any) -> dict[str, Answer]:
        """The transfers the workers' answers of this step resolve; with tensor parallelism
        a transfer is acked once every rank's shard was (:class:`ShardAnswers`)."""
        meta = getattr(output, "kv_connector_worker_meta", None) if output else None
        if meta is not None and not isinstance(meta, OmniKVWorkerMetadata):
            # A MultiConnector's: ours is the one of our type.
            meta = next((m for m in getattr(meta, "metadata", ())
                         if isinstance(m, OmniKVWorkerMetadata)), None)
        if meta is None:
            return {}
        return self.shard_answers.combine(meta.by_rank())

    def build_connector_meta(self, scheduler_output: Any) -> OmniKVConnectorMetadata:
        hand_offs, self._hand_offs = self._hand_offs, []
        withdrawn, self._withdrawn = self._withdrawn, {}
        return OmniKVConnectorMetadata(
            hand_offs=hand_offs, withdrawn=withdrawn,
            idle=scheduler_output.total_num_scheduled_tokens == 0,
        )

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        rid = request.request_id
        if rid in self._hold:
            self._hold.discard(rid)
            return True, None
        return False, None
