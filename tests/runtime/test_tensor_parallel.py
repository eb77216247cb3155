"""Tensor parallelism on the real vLLM 0.32 scheduler: a transfer one rank fails is withdrawn
from the others before its blocks serve another request, and no rank's answer outlives its
transfer.

The scheduler is vLLM's own, stepped with hand-made ModelRunnerOutputs as vLLM's scheduler
tests do; the two ranks are modelled (what each rank's sender holds current: offered, not
answered, not withdrawn, the blocks a receiver may read while it is) and their outputs are
merged by vLLM's own KVOutputAggregator, as the multiprocess executor merges its workers'.
No worker process runs: the ranks' senders and receivers are the transport tests'
(test_connector.py, with two synthetic ranks; the engine at tensor_parallel_size 2:
test_kv_connector_engine.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from omni_runtime.devtools.sched_harness import (
    free_blocks,
    handed_off,
    make_request,
    make_scheduler,
    make_vllm_config,
    runner_output,
    withdrawn,
)
from omni_runtime.kv.metadata import OmniKVWorkerMetadata, ShardAnswers
from omni_runtime.sched.handoff import Answer
from omni_runtime.sched.scheduler import OmniARScheduler
from omni_runtime.transfers.ledger import Outcome, TransferObserver

PREFILL = {"need_send_cache": True, "kv_transfer_criteria": {"type": "prefill_finished"},
           "timeout_seconds": 30}
ON_FINISH = {"need_send_cache": True, "timeout_seconds": 30}
RANKS = (0, 1)


class Resolutions(TransferObserver):
    def __init__(self) -> None:
        self.transfers: list = []

    def on_resolved(self, ledger, transfer) -> None:
        self.transfers.append(transfer)


@dataclass
class Rank:
    """One rank's sender as the scheduler's contract sees it: the transfers it holds current
    (a receiver's read of their blocks may still be committed) and its answers on their way
    to the scheduler (an answer made in one step may reach it steps later)."""

    rank: int
    current: dict[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    outbox: list[tuple[int, str, Answer]] = field(default_factory=list)  # (due step, rid, answer)

    def bind(self, so) -> None:
        """The step's metadata reaches this rank's worker (before its forward writes)."""
        for rid, attempt in withdrawn(so).items():
            if rid in self.current and self.current[rid][0] <= attempt:
                del self.current[rid]  # KVSender.cancel: no read committed from now on
        for rid, h in handed_off(so).items():
            self.current[rid] = (h.attempt, h.block_ids)

    def answer(self, rid: str, reason: str | None, due: int) -> None:
        """The sender answers (it is done with the transfer: no more commits)."""
        attempt, _ = self.current.pop(rid)
        self.outbox.append((due, rid, Answer(attempt, reason)))

    def due(self, now: int) -> dict[str, Answer]:
        ready = {rid: a for d, rid, a in self.outbox if d <= now}
        self.outbox = [o for o in self.outbox if o[0] > now]
        return ready


class TP2:
    """The scheduler of a tensor_parallel_size 2 engine and its two ranks, on a clock of its
    own (the ledger's: expiry without waiting)."""

    def __init__(self, kv_config, **kw) -> None:
        self.s = make_scheduler(OmniARScheduler,
                                make_vllm_config(kv_config, tensor_parallel_size=2, **kw))
        self.now = [1000.0]
        self.s.transfer_ledger._clock = lambda: self.now[0]
        self.ranks = [Rank(r) for r in RANKS]
        self.start = free_blocks(self.s)
        recorder = Resolutions()
        self.s.transfer_ledger.add_observer(recorder)
        self.resolved = recorder.transfers  # the transfers as they resolved, in order

    @property
    def shard_answers(self) -> ShardAnswers:
        return self.s._omni.scheduler_half.shard_answers

    def schedule(self):
        so = self.s.schedule()
        for rank in self.ranks:
            rank.bind(so)
        return so

    def update(self, so, answers: dict[int, dict[str, Answer]] | None = None):
        """The step's output, each rank's answers in its own worker's metadata, merged by
        vLLM's KVOutputAggregator."""
        outputs = []
        for r in RANKS:
            out = runner_output(so, scheduler=self.s)
            mine = (answers or {}).get(r) or {}
            if mine:
                out.kv_connector_output = KVConnectorOutput(
                    kv_connector_worker_meta=OmniKVWorkerMetadata(mine, r))
            outputs.append(out)
        merged = KVOutputAggregator(expected_finished_count=len(RANKS)).aggregate(outputs)
        return self.s.update_from_output(so, merged)

    def step(self, answers=None):
        so = self.schedule()
        self.update(so, answers)
        return so

    def drain(self, max_steps: int = 200) -> None:
        """Steps, every rank acking what it holds at once, until nothing is left."""
        for _ in range(max_steps):
            if not self.s.has_requests():
                return
            so = self.schedule()
            for rank in self.ranks:
                for rid in list(rank.current):
                    rank.answer(rid, None, due=0)
            self.update(so, {rank.rank: rank.due(0) for rank in self.ranks})
        raise AssertionError(f"still busy after {max_steps} steps")

    def readable_blocks(self) -> dict[int, str]:
        """Every block a rank's sender may still let a receiver read: block id -> request."""
        return {b: rid for rank in self.ranks for rid, (_, blocks) in rank.current.items()
                for b in blocks}

    def assert_no_readable_block_serves_another(self) -> None:
        """The block guarantee at a distance, once the step's metadata reached the ranks: a
        block any rank may still let a receiver read is allocated (out of the free pool) and
        held for its own transfer only, by its request or the transfer's pin."""
        s = self.s
        pool = s.kv_cache_manager.block_pool.blocks
        owners: dict[int, set[str]] = {}
        manager = s.kv_cache_manager.coordinator.single_type_managers[0]
        for rid, blocks in manager.req_to_blocks.items():
            for b in blocks:
                owners.setdefault(b.block_id, set()).add(rid)
        for rid, blocks in s._pinned.items():
            for b in blocks:
                owners.setdefault(b.block_id, set()).add(rid)
        for block, rid in self.readable_blocks().items():
            assert pool[block].ref_cnt > 0, f"block {block} of {rid}'s transfer is free"
            assert owners.get(block, set()) <= {rid} and rid in owners.get(block, set()), (
                f"block {block} of {rid}'s transfer, still readable, is held by "
                f"{sorted(owners.get(block, ()))}")

    def assert_state_bounded(self) -> None:
        """Per-rank answer state only for transfers in flight (handed off, unresolved)."""
        assert len(self.shard_answers) <= self.s.transfer_ledger.num_active


def hand_off_one(tp: TP2, kv_config_blocks: int = 40, max_tokens: int = 6) -> tuple[str, int]:
    """A request whose prefill's transfer is handed off to both ranks: (id, attempt)."""
    tp.s.add_request(make_request(kv_config_blocks, max_tokens=max_tokens, request_id="r"))
    tp.step()  # the prefill: marked
    so = tp.step()  # handed off
    attempt = handed_off(so)["r"].attempt
    assert all(rank.current["r"][0] == attempt for rank in tp.ranks)
    return "r", attempt


def test_a_rank_failing_while_the_other_reads_withdraws_it_from_every_rank_before_reuse():
    """Rank 1 fails the transfer while rank 0's receivers are still reading rank 0's shard:
    the transfer fails and its blocks go back, and the next step's metadata, the step in
    which another request is given those blocks, withdraws it from every rank (rank 0 then
    commits no read of them); rank 0's late answer resolves nothing and is kept nowhere."""
    tp = TP2(ON_FINISH, num_blocks=8)  # 8 blocks of 16: the next request needs the freed ones
    s = tp.s
    s.add_request(make_request(40, max_tokens=2, request_id="r"))
    while not s.requests["r"].is_finished():
        tp.step()
    so = tp.step()  # the finished request's transfer is handed off, its 4 blocks held
    attempt = handed_off(so)["r"].attempt
    blocks = set(handed_off(so)["r"].block_ids)
    tp.ranks[1].answer("r", "stage next rejected: inbox_full", due=0)
    tp.update(tp.schedule(), {1: tp.ranks[1].due(0)})
    assert [(t.outcome, t.reason) for t in tp.resolved] == [
        (Outcome.FAILED, "tensor-parallel rank 1: stage next rejected: inbox_full")]
    assert "r" in tp.ranks[0].current, "rank 0 has not heard of it yet"
    s.add_request(make_request(100, max_tokens=2, request_id="next"))
    so = tp.schedule()
    reused = blocks & {b.block_id for b in s.kv_cache_manager.coordinator
                       .single_type_managers[0].req_to_blocks["next"]}
    assert reused, "the test needs the freed blocks given to the next request"
    assert withdrawn(so) == {"r": attempt}, "withdrawn in the step that re-uses its blocks"
    assert "r" not in tp.ranks[0].current
    tp.assert_no_readable_block_serves_another()
    tp.ranks[0].outbox.append((0, "r", Answer(attempt)))  # sent before the withdrawal came
    tp.update(so, {0: tp.ranks[0].due(0)})
    assert not tp.shard_answers, "a late answer of a resolved transfer is kept nowhere"
    tp.drain()
    assert free_blocks(s) == tp.start


@pytest.mark.parametrize("how", ["reset", "expiry"])
def test_a_transfer_the_scheduler_resolves_after_one_rank_answered_leaves_no_answer_state(how):
    """A prefix-cache reset (sleep, weight update) or the deadline resolves a transfer one
    rank has acked and the other not: it is withdrawn from every rank, and the acked rank's
    answer is dropped with it (the withdrawn rank never answers)."""
    tp = TP2(ON_FINISH)
    s = tp.s
    s.add_request(make_request(40, max_tokens=2, request_id="r"))
    while not s.requests["r"].is_finished():
        tp.step()
    so = tp.step()
    attempt = handed_off(so)["r"].attempt
    tp.ranks[0].answer("r", None, due=0)
    tp.update(tp.schedule(), {0: tp.ranks[0].due(0)})
    assert s.transfer_ledger.get("r") is not None and len(tp.shard_answers) == 1
    if how == "reset":
        assert s.reset_prefix_cache()
    else:
        tp.now[0] += 31.0
    so = tp.schedule()
    assert withdrawn(so) == {"r": attempt} and not tp.ranks[1].current
    assert [t.outcome for t in tp.resolved] == [
        Outcome.FAILED if how == "reset" else Outcome.EXPIRED]
    assert not tp.shard_answers, "no answer state outlives its transfer"
    tp.update(so)
    assert free_blocks(s) == tp.start and not s.has_requests()


def test_a_late_answer_after_a_withdrawal_resolves_nothing_and_is_kept_nowhere():
    """Both ranks' answers come after the scheduler expired the transfer (the ranks
    answered before the withdrawal reached them): nothing resolves again, nothing is kept."""
    tp = TP2(PREFILL)
    s = tp.s
    rid, attempt = hand_off_one(tp)
    tp.ranks[0].answer(rid, None, due=10**9)  # answered, its answer slow to arrive
    tp.now[0] += 31.0
    so = tp.schedule()
    assert withdrawn(so) == {rid: attempt}
    tp.update(so, {0: {rid: Answer(attempt)}})
    assert not tp.shard_answers, "rank 0's late ack must not start an entry"
    tp.update(tp.schedule(), {1: {rid: Answer(attempt, "deadline passed")}})
    assert not tp.shard_answers
    assert [t.outcome for t in tp.resolved] == [Outcome.EXPIRED]
    tp.drain()
    assert free_blocks(s) == tp.start and not tp.shard_answers


def test_shard_answers_keep_only_transfers_handed_off_and_unresolved():
    """The combination itself: an attempt starts when handed off; answers about anything
    else (an older or unknown attempt, a rank outside the world) are dropped; a failure is
    reported once and names the ranks to withdraw it from; every rank's ack delivers."""
    answers = ShardAnswers(2)
    assert answers.combine({0: {"r": Answer(1)}}) == ({}, {}), "not handed off: ignored"
    assert not answers
    answers.expect("r", 1)
    answers.expect("r", 2)  # a newer attempt replaces the older one
    assert answers.combine({0: {"r": Answer(1)}, 1: {"r": Answer(2)}}) == ({}, {})
    assert answers.combine({5: {"r": Answer(2)}}) == ({}, {}), "no rank 5 in a world of 2"
    assert answers.combine({0: {"r": Answer(2, nbytes=3, seconds=0.5)}}) == (
        {"r": Answer(2, nbytes=3, seconds=0.5)}, {})
    assert not answers
    answers.expect("f", 3)
    assert answers.combine({1: {"f": Answer(3, "boom")}}) == (
        {"f": Answer(3, "tensor-parallel rank 1: boom")}, {"f": 3})
    assert answers.combine({0: {"f": Answer(3)}}) == ({}, {}), "reported once"
    answers.expect("g", 4)
    both = answers.combine({0: {"g": Answer(4, "x")}, 1: {"g": Answer(4)}})
    assert both == ({"g": Answer(4, "tensor-parallel rank 0: x")}, {}), \
        "every rank answered in the step: nothing left to withdraw"
    answers.expect("h", 5)
    answers.forget("h", 4)
    assert len(answers) == 1, "forgetting an older attempt keeps the newer"
    answers.forget("h", 5)
    assert not answers


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, 2**32 - 1))
def test_random_rank_answers_losses_delays_resets_and_expiries_keep_the_block_guarantee(seed):
    """The scheduler half under random per-rank answers (acks, failures, each delayed 0-3
    steps or lost), arrivals, aborts, preemptions (a small cache), prefix-cache resets and
    expiries (a 3 s deadline on a 0.25 s step): after every step's metadata reached the
    ranks, no block a rank may still let a receiver read is free or held by another request;
    the answer state never outlives its transfer; and once everything is done, nothing is
    left and every block is back. (Hypothesis picks the seeds: a run's thousands of choices
    overflow the buffer its own draws would need.)"""
    rng = random.Random(seed)
    tp = TP2({"need_send_cache": True, "timeout_seconds": 3.0}, num_blocks=24,
             max_num_seqs=8, max_num_batched_tokens=64)
    s = tp.s
    for i in range(400):
        tp.now[0] += 0.25
        if i < 320 and rng.random() < 0.35:
            s.add_request(make_request(rng.randint(1, 60), max_tokens=rng.randint(1, 12),
                                       request_id=f"r{i}"))
        live = [r.request_id for r in s.requests.values() if not r.is_finished()]
        roll = rng.random()
        if live and roll < 0.03:
            s.finish_requests(rng.choice(live), RequestStatus.FINISHED_ABORTED)
        elif roll < 0.05:
            s.reset_prefix_cache(reset_running_requests=bool(live) and rng.random() < 0.5)
        so = tp.schedule()
        tp.assert_no_readable_block_serves_another()
        for rank in tp.ranks:
            for rid in list(rank.current):
                roll = rng.random()
                if roll < 0.25:
                    rank.answer(rid, None, due=i + rng.choice((0, 0, 1, 3)))
                elif roll < 0.30:
                    rank.answer(rid, "receiver rejected: inbox_full", due=i + rng.randint(0, 3))
                elif roll < 0.31:
                    rank.answer(rid, None, due=10**9)  # lost: the deadline resolves it
        tp.update(so, {rank.rank: rank.due(i) for rank in tp.ranks})
        tp.assert_state_bounded()
        s.transfer_ledger.check_invariants()
    for i in range(400, 800):  # drain: every rank answers at once, nothing new arrives
        if not s.has_requests():
            break
        tp.now[0] += 0.25
        so = tp.schedule()
        tp.assert_no_readable_block_serves_another()
        for rank in tp.ranks:
            for rid in list(rank.current):
                rank.answer(rid, None, due=i)
        tp.update(so, {rank.rank: rank.due(i) for rank in tp.ranks})
        tp.assert_state_bounded()
    assert not s.has_requests() and not s.requests
    assert not tp.shard_answers and not s._pinned
    assert free_blocks(s) == tp.start
