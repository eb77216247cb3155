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

from omni_runtime.sched.handoff import Answer, HandOff


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


@dataclass
class OmniKVWorkerMetadata(KVConnectorWorkerMetadata):
    #: One worker's answers: request id -> its answer about one attempt.
    answers: dict[str, Answer] = field(default_factory=dict)
    #: Its tensor-parallel rank (it answers for that rank's KV-head shard).
    rank: int = 0
    #: The other ranks' answers, folded in by :meth:`aggregate` (vLLM's KVOutputAggregator
    #: merges the workers' metadata of one step this way before the scheduler sees it).
    other_ranks: dict[int, dict[str, Answer]] = field(default_factory=dict)

    def by_rank(self) -> dict[int, dict[str, Answer]]:
        return {**self.other_ranks, self.rank: self.answers}

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = {rank: dict(answers) for rank, answers in self.other_ranks.items()}
        if isinstance(other, OmniKVWorkerMetadata):
            for rank, answers in other.by_rank().items():
                merged.setdefault(rank, {}).update(answers)
        return OmniKVWorkerMetadata(dict(self.answers), self.rank, merged)


class ShardAnswers:
    """The scheduler half's view of the ranks' answers (tensor parallelism).

    Each rank's KV-head shard is read by the receivers from that rank's cache, and the rank
    answers for it, in whatever step its answer comes, so the answers of one transfer arrive
    over several steps. A transfer is delivered when every rank's shard was acked; it failed
    as soon as any rank's failed (reported once, the remaining answers of that attempt are
    then only counted). State per request: the attempt being answered and the ranks' answers
    so far; an answer for a newer attempt starts over, one for an older attempt is ignored. An
    entry leaves when every rank answered, so the state is bounded by the transfers in flight.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        #: request id -> (attempt, {rank: its answer}, failure already reported)
        self._partial: dict[str, tuple[int, dict[int, Answer], bool]] = {}

    def combine(self, by_rank: Mapping[int, Mapping[str, Answer]]) -> dict[str, Answer]:
        if self.world_size == 1:
            return dict(by_rank.get(0, {}))
        result: dict[str, Answer] = {}
        for rank, answers in sorted(by_rank.items()):
            for rid, answer in answers.items():
                attempt = answer.attempt
                current = self._partial.get(rid)
                if current is None or attempt > current[0]:
                    current = (attempt, {}, False)
                elif attempt < current[0]:
                    continue  # a superseded attempt: resolves nothing
                seen, reported = current[1], current[2]
                seen[rank] = answer
                if answer.reason is not None and not reported:
                    result[rid] = Answer(attempt, f"tensor-parallel rank {rank}: {answer.reason}",
                                         seconds=answer.seconds)
                    reported = True
                if len(seen) < self.world_size:
                    self._partial[rid] = (attempt, seen, reported)
                    continue
                self._partial.pop(rid, None)
                if not reported:  # every rank's shard was acked
                    result[rid] = Answer(attempt, nbytes=sum(a.nbytes for a in seen.values()),
                                         seconds=max(a.seconds for a in seen.values()))
        return result

    def __len__(self) -> int:
        return len(self._partial)
