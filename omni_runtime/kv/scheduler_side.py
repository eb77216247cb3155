"""The omni KV connector's scheduler half, next to OmniARScheduler in the engine core.

* :meth:`hand_off` / :meth:`withdraw` take what the scheduler decided in this step, and
  :meth:`build_connector_meta` passes it to the workers in the step's metadata;
* :meth:`request_finished` answers "delay the free" for a finished request whose transfer is
  unresolved (the "held" state); the scheduler frees the blocks when the transfer resolves
  (acked, failed, expired, or at shutdown / a prefix-cache reset);
* :meth:`take_answers` hands the workers' answers (per attempt) to the scheduler, and
  :meth:`record_answers` records in the stats those that resolved a transfer (the scheduler's
  ledger decides which: one bookkeeping of what is in flight, not two).
"""

from __future__ import annotations

from collections.abc import Mapping
from operator import attrgetter
from typing import Any

from omni_runtime.kv.metadata import OmniKVConnectorMetadata, OmniKVWorkerMetadata, ShardAnswers
from omni_runtime.kv.stats import OTHER_STAGE, KVStatsRecorder
from omni_runtime.sched.handoff import Answer, ChunkAnswer, ChunkOut, HandOff

#: An answer's outcome in the stats: acked without a reason, else failed.
_OUTCOME, _NBYTES, _SECONDS = attrgetter("outcome"), attrgetter("nbytes"), attrgetter("seconds")


class OmniKVConnectorScheduler:
    """``stats``: where each resolution is recorded for vLLM's connector-stats path
    (kv/stats.py), once per transfer (the ranks' answers combined); ``to_stage``: the stage
    a transfer goes to, or ``other`` when it fans out to several (their per-edge figures are
    the ``omni_kv_edge_*`` families')."""

    def __init__(self, world_size: int, stats: KVStatsRecorder | None = None,
                 to_stages: tuple[str, ...] = (), fans_out: bool = False) -> None:
        self._hand_offs: list[HandOff] = []
        self._chunks: list[ChunkOut] = []
        self._withdrawn: dict[str, int] = {}
        self._hold: set[str] = set()
        self.shard_answers = ShardAnswers(world_size)
        #: The ranks' answers combined, with tensor parallelism; None with one rank, whose
        #: answers are the transfers' (no state kept).
        self._ranks = self.shard_answers if world_size > 1 else None
        self._stats = stats
        self._to_stage = to_stages[0] if len(to_stages) == 1 else OTHER_STAGE
        #: A fan-out's held notices for the next step (metadata.held); None: one edge, whose
        #: per-edge families the ledger feeds (edge_metrics.LedgerEdgeObserver). ``fans_out``
        #: is decided as the workers decide whether they feed the per-edge families
        #: (edge_metrics.data_path_edge_metrics: several endpoints).
        self._held: dict[str, tuple[int, int, float]] | None = {} if fans_out else None

    def stop_stats(self) -> None:
        """Record no resolution from now on: the engine collects no stats (vLLM's
        ``log_stats`` off, ``--disable-log-stats``), and vLLM's ``make_stats`` would drop
        what a connector reports."""
        self._stats = None

    def hand_off(self, hand_offs: list[HandOff]) -> None:
        """The scheduler's hand-offs for the step being scheduled."""
        self._hand_offs.extend(hand_offs)
        if self._ranks is not None:
            for h in hand_offs:
                self._ranks.expect(h.request_id, h.attempt)

    def withdraw(self, request_id: str, attempt: int, outcome: str = "failed",
                 seconds: float = 0.0) -> None:
        """A handed-off transfer the scheduler resolved itself (``outcome``: expired, or
        failed at a reset or shutdown; ``seconds`` after its hand-off): its blocks may be
        re-used from the next step on; the workers refuse to commit any read of it from that
        step's start (the fence, kv/transport/sender.py). Recorded in the stats, no bytes
        delivered. The scheduler withdraws each handed-off transfer it resolves, once (its
        ledger resolves a transfer once)."""
        self._withdrawn[request_id] = attempt
        if self._ranks is not None:
            self._ranks.forget(request_id, attempt)
        if self._held:
            self._held.pop(request_id, None)  # resolved: no notice of its hold any more
        if self._stats is not None:
            self._stats.record(outcome, 0, seconds, self._to_stage)

    def send_chunks(self, chunks: list[ChunkOut]) -> None:
        """Streamed edges' chunks (and early ends) for the step being scheduled."""
        self._chunks.extend(chunks)

    def take_chunk_answers(self, output: Any) -> list[ChunkAnswer]:
        meta = _worker_meta(output)
        return meta.chunk_answers if meta is not None else []

    def hold_on_finish(self, request_id: str) -> None:
        """The next request_finished() of this request keeps its blocks (held)."""
        self._hold.add(request_id)

    def held_on_finish(self, request_id: str, attempt: int, blocks: int, at: float) -> None:
        """The request of a handed-off transfer finished (at unix time ``at``), ``blocks`` KV
        blocks held until it resolves: told to the workers of a fan-out (their per-edge
        families), else nothing."""
        if self._held is not None:
            self._held[request_id] = (attempt, blocks, at)

    def take_answers(self, output: Any) -> dict[str, Answer]:
        """The transfers the workers' answers of this step resolve; with tensor parallelism
        a transfer is acked once every rank's shard was (:class:`ShardAnswers`). The
        scheduler resolves them (its ledger ignores an answer about another attempt, or
        about a transfer not handed off or already resolved) and then records those that
        resolved (:meth:`record_answers`)."""
        meta = _worker_meta(output)
        if meta is None or not (meta.answers or meta.other_ranks):
            return {}
        if self._ranks is None:
            # One rank: its answers are the transfers' (read only); a rank that answered is
            # done with the transfer, so nothing is left to withdraw.
            answers = (meta.answers if meta.rank == 0 and not meta.other_ranks
                       else meta.by_rank().get(0, {}))
        else:
            answers, withdraw = self._ranks.combine(meta.by_rank())
            # Failed while other ranks may still let the receivers read their shards: the
            # next step's metadata withdraws it from every rank, before anything writes the
            # blocks this failure gives back (the resolution itself is recorded with the
            # answers, by record_answers).
            self._withdrawn.update(withdraw)
        if self._held:  # resolved now: a notice of their hold, not sent yet, would be stale
            for rid in answers:
                self._held.pop(rid, None)
        return answers

    def record_answers(self, answers: Mapping[str, Answer]) -> None:
        """The step's answers that resolved a transfer (each once: the scheduler's ledger
        resolves a transfer once), into the stats: outcome, bytes, seconds from the offer to
        the answer. The columns are read in C (the step's answers without a Python loop)."""
        if self._stats is None or not answers:
            return
        values = answers.values()
        self._stats.record_columns(
            list(map(_OUTCOME, values)),
            list(map(_NBYTES, values)), list(map(_SECONDS, values)), self._to_stage)

    def build_connector_meta(self, scheduler_output: Any) -> OmniKVConnectorMetadata:
        hand_offs, self._hand_offs = self._hand_offs, []
        withdrawn, self._withdrawn = self._withdrawn, {}
        held = self._held
        if held:
            self._held = {}
        chunks, self._chunks = self._chunks, []
        return OmniKVConnectorMetadata(
            hand_offs=hand_offs, withdrawn=withdrawn,
            idle=scheduler_output.total_num_scheduled_tokens == 0,
            held=held or {}, chunks=chunks,
        )

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        rid = request.request_id
        if rid in self._hold:
            self._hold.discard(rid)
            return True, None
        return False, None


def _worker_meta(output: Any) -> OmniKVWorkerMetadata | None:
    """Our workers' metadata of a step's output (under vLLM's MultiConnector, the one of our
    type), or None."""
    meta = getattr(output, "kv_connector_worker_meta", None) if output else None
    if meta is not None and not isinstance(meta, OmniKVWorkerMetadata):
        meta = next((m for m in getattr(meta, "metadata", ())
                     if isinstance(m, OmniKVWorkerMetadata)), None)
    return meta
