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

import time

from omni_runtime.kv.metadata import OmniKVConnectorMetadata, OmniKVWorkerMetadata, ShardAnswers
from omni_runtime.kv.stats import OTHER_STAGE, KVStatsRecorder
from omni_runtime.sched.handoff import Answer, HandOff


class OmniKVConnectorScheduler:
    """``stats``: where each resolution is recorded for vLLM's connector-stats path
    (kv/stats.py), once per transfer (the ranks' answers combined); ``to_stage``: the stage
    a transfer goes to, or ``other`` when it fans out to several (their per-edge figures are
    the ``omni_kv_edge_*`` families')."""

    def __init__(self, world_size: int, stats: KVStatsRecorder | None = None,
                 to_stages: tuple[str, ...] = (), fans_out: bool = False) -> None:
        self._hand_offs: list[HandOff] = []
        self._withdrawn: dict[str, int] = {}
        self._hold: set[str] = set()
        self.shard_answers = ShardAnswers(world_size)
        self._stats = stats
        self._to_stage = to_stages[0] if len(to_stages) == 1 else OTHER_STAGE
        #: A fan-out's held notices for the next step (metadata.held); None: one edge, whose
        #: per-edge families the ledger feeds (edge_metrics.LedgerEdgeObserver). ``fans_out``
        #: is decided as the workers decide whether they feed the per-edge families
        #: (edge_metrics.data_path_edge_metrics: several endpoints).
        self._held: dict[str, tuple[int, int, float]] | None = {} if fans_out else None
        #: Handed off, not resolved: request id -> (attempt, when), for the stats' durations
        #: of transfers the scheduler resolves itself.
        self._in_flight: dict[str, tuple[int, float]] = {}

    def hand_off(self, hand_offs: list[HandOff]) -> None:
        """The scheduler's hand-offs for the step being scheduled."""
        self._hand_offs.extend(hand_offs)
        if self._stats is not None:
            now = time.monotonic()
            for h in hand_offs:
                self._in_flight[h.request_id] = (h.attempt, now)

    def withdraw(self, request_id: str, attempt: int, outcome: str = "failed") -> None:
        """A handed-off transfer the scheduler resolved itself (``outcome``: expired, or
        failed at a reset or shutdown): its blocks may be re-used from the next step on; the
        workers refuse to commit any read of it from that step's start (the fence,
        kv/transport/sender.py)."""
        self._withdrawn[request_id] = attempt
        if self._held:
            self._held.pop(request_id, None)  # resolved: no notice of its hold any more
        started = self._in_flight.get(request_id)
        if started is not None and started[0] == attempt:
            del self._in_flight[request_id]
            self._stats.record(outcome, 0, time.monotonic() - started[1], self._to_stage)

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
        a transfer is acked once every rank's shard was (:class:`ShardAnswers`)."""
        meta = getattr(output, "kv_connector_worker_meta", None) if output else None
        if meta is not None and not isinstance(meta, OmniKVWorkerMetadata):
            # A MultiConnector's: ours is the one of our type.
            meta = next((m for m in getattr(meta, "metadata", ())
                         if isinstance(m, OmniKVWorkerMetadata)), None)
        if meta is None:
            return {}
        if self.shard_answers.world_size == 1 and meta.rank == 0 and not meta.other_ranks:
            answers = meta.answers  # one rank: its answers are the transfers' (read only)
        else:
            answers = self.shard_answers.combine(meta.by_rank())
        if self._held:  # resolved now: a notice of their hold, not sent yet, would be stale
            for rid in answers:
                self._held.pop(rid, None)
        if self._stats is not None:
            in_flight = self._in_flight
            outcomes, sizes, durations = [], [], []
            for rid, answer in answers.items():
                started = in_flight.pop(rid, None)
                if started is None:
                    continue
                if started[0] != answer.attempt:
                    in_flight[rid] = started  # about another attempt: this one still in flight
                    continue
                outcomes.append("acked" if answer.reason is None else "failed")
                sizes.append(answer.nbytes)
                durations.append(answer.seconds)
            if outcomes:  # the step's answers under one lock
                self._stats.record_columns(outcomes, sizes, durations, self._to_stage)
        return answers

    def build_connector_meta(self, scheduler_output: Any) -> OmniKVConnectorMetadata:
        hand_offs, self._hand_offs = self._hand_offs, []
        withdrawn, self._withdrawn = self._withdrawn, {}
        held = self._held
        if held:
            self._held = {}
        return OmniKVConnectorMetadata(
            hand_offs=hand_offs, withdrawn=withdrawn,
            idle=scheduler_output.total_num_scheduled_tokens == 0,
            held=held or {},
        )

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        rid = request.request_id
        if rid in self._hold:
            self._hold.discard(rid)
            return True, None
        return False, None
