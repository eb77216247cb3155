"""What the omni KV connector's two halves tell each other, per step, typed.

* :class:`OmniKVConnectorMetadata` (scheduler half -> workers): the transfers handed off in
  this step and the ones the scheduler withdrew (it resolved them itself: their blocks may be
  written again from this step on, so no read of them may be committed any more); for a stage
  that fans out, the handed-off transfers whose request finished (held), for the per-edge
  families its data path feeds;
* :class:`OmniKVWorkerMetadata` (each worker -> scheduler half): that worker's answers, per
  tensor-parallel rank, folded together by vLLM's KVOutputAggregator;
* :class:`ShardAnswers`: the scheduler half's view of the ranks' answers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from omni_runtime.kv.load import Load
from omni_runtime.sched.handoff import Answer, ChunkAnswer, ChunkOut, HandOff


@dataclass
class OmniKVConnectorMetadata(KVConnectorMetadata):
    hand_offs: list[HandOff] = field(default_factory=list)
    #: request id -> attempt: handed-off transfers the scheduler resolved on its own.
    withdrawn: dict[str, int] = field(default_factory=dict)
    #: Nothing is scheduled in this step: the worker may wait briefly for answers.
    idle: bool = False
    #: request id -> (attempt, KV blocks kept, unix time it finished): handed-off transfers
    #: whose request finished since the last step, its blocks held (a stage that fans out
    #: only: its workers' per-edge families count them held on each edge until that edge
    #: answers).
    held: dict[str, tuple[int, int, float]] = field(default_factory=dict)
    #: KV prefixes to load into this step's newly allocated blocks before its forward (a
    #: downstream stage: kv/load.py).
    loads: list[Load] = field(default_factory=list)
    #: Streamed edges' chunks (and early ends) cut in this step: rank 0 sends them (they
    #: carry tokens only, the same for every rank).
    chunks: list[ChunkOut] = field(default_factory=list)


@dataclass
class OmniKVWorkerMetadata(KVConnectorWorkerMetadata):
    #: One worker's answers: request id -> its answer about one attempt.
    answers: dict[str, Answer] = field(default_factory=dict)
    #: Its tensor-parallel rank (it answers for that rank's KV-head shard).
    rank: int = 0
    #: The other ranks' answers, folded in by :meth:`aggregate` (vLLM's KVOutputAggregator
    #: merges the workers' metadata of one step this way before the scheduler sees it).
    other_ranks: dict[int, dict[str, Answer]] = field(default_factory=dict)
    #: Rank 0's answers about chunks (only rank 0 sends them).
    chunk_answers: list[ChunkAnswer] = field(default_factory=list)

    def by_rank(self) -> dict[int, dict[str, Answer]]:
        return {**self.other_ranks, self.rank: self.answers}

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = {rank: dict(answers) for rank, answers in self.other_ranks.items()}
        if isinstance(other, OmniKVWorkerMetadata):
            for rank, answers in other.by_rank().items():
                merged.setdefault(rank, {}).update(answers)
        chunk_answers = list(self.chunk_answers)
        if isinstance(other, OmniKVWorkerMetadata):
            chunk_answers += other.chunk_answers
        return OmniKVWorkerMetadata(dict(self.answers), self.rank, merged, chunk_answers)


class ShardAnswers:
    """The scheduler half's view of the ranks' answers (tensor parallelism).

    Each rank's KV-head shard is read by the receivers from that rank's cache, and the rank
    answers for it, in whatever step its answer comes, so the answers of one transfer arrive
    over several steps. A transfer is delivered when every rank's shard was acked; it failed
    as soon as any rank's failed.

    State per transfer handed off and not resolved (:meth:`expect` at its hand-off): the
    attempt and the ranks' answers so far. It leaves when the transfer resolves: by the
    answers (every rank acked, or one failed) or by the scheduler (:meth:`forget`: expiry,
    reset, shutdown). An answer about anything else (another attempt, a transfer not handed
    off or already resolved, a rank outside the world) is ignored and kept nowhere, so the
    state is bounded by the transfers in flight whatever the ranks send.

    A failure resolves a transfer while the ranks that have not answered may still let the
    receivers read their shards: :meth:`combine` names those transfers too, for the scheduler
    half to withdraw from every rank in the next step's metadata, which reaches the workers
    before anything writes the blocks the failure gives back (the block guarantee, as for an
    expired transfer).
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        #: request id -> (attempt, {rank: its answer}) of each transfer in flight
        self._expected: dict[str, tuple[int, dict[int, Answer]]] = {}

    def expect(self, request_id: str, attempt: int) -> None:
        """A transfer handed off: its ranks' answers are awaited (a newer attempt of the same
        request replaces an older one's, as the workers' offers do)."""
        self._expected[request_id] = (attempt, {})

    def forget(self, request_id: str, attempt: int) -> None:
        """The scheduler resolved the transfer itself (and withdraws it from every rank): its
        answers, come or to come, resolve nothing."""
        current = self._expected.get(request_id)
        if current is not None and current[0] <= attempt:
            del self._expected[request_id]

    def combine(self, by_rank: Mapping[int, Mapping[str, Answer]]
                ) -> tuple[dict[str, Answer], dict[str, int]]:
        """The transfers the ranks' answers of one step resolve, and (request id -> attempt)
        those of them failed before every rank answered: the ranks still holding them must
        have them withdrawn."""
        resolved: dict[str, Answer] = {}
        withdraw: dict[str, int] = {}
        expected = self._expected
        world = self.world_size
        for rank, answers in sorted(by_rank.items()):
            if not 0 <= rank < world:
                continue
            for rid, answer in answers.items():
                current = expected.get(rid)
                if current is not None and current[0] == answer.attempt:
                    current[1][rank] = answer  # else: resolved, superseded, or unknown
        for rid in [rid for answers in by_rank.values() for rid in answers]:
            current = expected.get(rid)
            if current is None:
                continue  # ignored above, or decided already in this loop
            attempt, seen = current
            failed = next((r for r in sorted(seen) if seen[r].reason is not None), None)
            if failed is not None:
                del expected[rid]
                answer = seen[failed]
                resolved[rid] = Answer(attempt, f"tensor-parallel rank {failed}: "
                                                f"{answer.reason}", seconds=answer.seconds,
                                       expired=answer.expired)
                if len(seen) < world:
                    withdraw[rid] = attempt
            elif len(seen) == world:  # every rank's shard was acked
                del expected[rid]
                resolved[rid] = Answer(attempt, nbytes=sum(a.nbytes for a in seen.values()),
                                       seconds=max(a.seconds for a in seen.values()))
        return resolved, withdraw

    def __len__(self) -> int:
        return len(self._expected)
