"""The transfer ledger alone: no vLLM, a fake clock."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from omni_runtime.transfers.ledger import (
    Outcome,
    Phase,
    Transfer,
    TransferLedger,
    TransferObserver,
    Trigger,
)


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


class RecordingObserver(TransferObserver):
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def on_marked(self, ledger, transfer):
        self.events.append(("marked", transfer.request_id))

    def on_handed_off(self, ledger, transfer):
        self.events.append(("handed_off", transfer.request_id))

    def on_held(self, ledger, transfer):
        self.events.append(("held", transfer.request_id))

    def on_resolved(self, ledger, transfer):
        self.events.append((f"resolved:{transfer.outcome.value}", transfer.request_id))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def ledger(clock) -> TransferLedger:
    return TransferLedger(10.0, clock=clock)


def test_lifecycle_mark_hand_off_ack(ledger, clock):
    obs = RecordingObserver()
    ledger.add_observer(obs)
    t = ledger.mark("a", Trigger.PREFILL_FINISHED, 40, [1, 2, 3])
    assert (t.phase, ledger.num_pending, ledger.oldest_entered("pending")) == (
        Phase.PENDING,
        1,
        1000.0,
    )
    clock.advance(1)
    assert [x.request_id for x in ledger.hand_off_pending()] == ["a"]
    assert (ledger.num_pending, ledger.num_active, ledger.oldest_entered("active")) == (0, 1, 1001.0)
    assert ledger.resolve("a", Outcome.ACKED, only_active=True) is t
    assert t.outcome is Outcome.ACKED and t.phase is Phase.RESOLVED
    assert not ledger.has_unresolved()
    assert ledger.resolve("a", Outcome.ACKED) is None, "a transfer resolves exactly once"
    assert obs.events == [("marked", "a"), ("handed_off", "a"), ("resolved:acked", "a")]
    ledger.check_invariants()


def test_marking_many_is_all_or_nothing_and_observed_change_by_change(ledger):
    """A step's marks in one call: each its own attempt, in order; a request that already
    started a transfer, or is named twice, refuses the whole call before any is marked; a
    per-change observer sees the ledger after each mark, as with one call per mark."""
    seen = []

    class Counts(TransferObserver):
        def on_marked(self, ledger, transfer):
            seen.append((transfer.request_id, ledger.num_pending, ledger.has_triggered("c")))

    ledger.add_observer(Counts())
    first = ledger.mark("a", Trigger.PREFILL_FINISHED, 4, (1,))
    for marks, named in ([("b", 4, (2,), None), ("a", 4, (3,), None)], "a"),\
                        ([("c", 4, (2,), None), ("c", 4, (3,), None)], "c"):
        with pytest.raises(RuntimeError, match=f"request '{named}' already started"):
            ledger.mark_many(Trigger.PREFILL_FINISHED, marks)
        assert ledger.num_pending == 1 and not ledger.has_triggered("b")
        assert not ledger.has_triggered("c")
    made = ledger.mark_many(Trigger.PREFILL_FINISHED,
                            [("b", 4, (2,), None), ("c", 20, (4, 5), {"traceparent": "x"})])
    assert [t.request_id for t in made] == ["b", "c"]
    assert [t.attempt for t in made] == [first.attempt + 1, first.attempt + 2]
    assert made[1].block_ids == (4, 5) and made[1].trace_headers == {"traceparent": "x"}
    assert made[0].marked_at == made[1].marked_at and made[0].deadline == made[1].deadline
    assert seen == [("a", 1, False), ("b", 2, False), ("c", 3, True)]
    assert ledger.mark_many(Trigger.PREFILL_FINISHED, []) == []
    ledger.check_invariants()


def test_trigger_fires_once_per_request_until_it_finishes(ledger):
    ledger.mark("a", Trigger.SPECIAL_TOKEN, 5, [1])
    ledger.hand_off_pending()
    ledger.resolve("a", Outcome.ACKED)
    assert ledger.has_triggered("a")
    with pytest.raises(RuntimeError, match="already started"):
        ledger.mark("a", Trigger.REQUEST_FINISHED, 9, [1])
    assert ledger.request_finished("a", 2, aborted=False) is False
    assert not ledger.has_triggered("a"), "no state survives the request"


def test_finished_request_holds_blocks_until_resolution(ledger, clock):
    ledger.mark("a", Trigger.PREFILL_FINISHED, 16, [4])
    ledger.hand_off_pending()
    clock.advance(2)
    assert ledger.request_finished("a", 3, aborted=False) is True
    assert (ledger.num_held, ledger.num_held_blocks, ledger.oldest_entered("held")) == (1, 3, 1002.0)
    t = ledger.resolve("a", Outcome.FAILED, "receiver said no", only_active=True)
    assert t.held and t.held_blocks == 3 and t.reason == "receiver said no"
    assert (ledger.num_held, ledger.num_held_blocks) == (0, 0)
    ledger.check_invariants()


def test_a_request_finished_twice_is_held_once_from_its_first_finish(ledger, clock):
    ledger.mark("a", Trigger.PREFILL_FINISHED, 16, [4])
    clock.advance(1)
    assert ledger.request_finished("a", 3, aborted=False) is True
    clock.advance(5)
    assert ledger.request_finished("a", 3, aborted=True) is True, "still held: keep the blocks"
    assert (ledger.num_held, ledger.num_held_blocks, ledger.oldest_entered("held")) == (1, 3, 1001.0)
    ledger.check_invariants()


def test_abort_before_hand_off_cancels(ledger):
    ledger.mark("a", Trigger.PREFILL_FINISHED, 16, [4])
    assert ledger.request_finished("a", 1, aborted=True) is False, "blocks may be freed now"
    assert not ledger.has_unresolved()
    assert ledger.hand_off_pending() == [], "never hand a cancelled transfer to the runner"


def test_abort_while_active_keeps_blocks_held(ledger):
    ledger.mark("a", Trigger.PREFILL_FINISHED, 16, [4])
    ledger.hand_off_pending()
    assert ledger.request_finished("a", 1, aborted=True) is True
    assert ledger.num_held == 1


def test_completed_request_with_pending_transfer_is_held_and_handed_off(ledger):
    ledger.mark("a", Trigger.REQUEST_FINISHED, 16, [4])
    assert ledger.request_finished("a", 1, aborted=False) is True
    assert [t.request_id for t in ledger.hand_off_pending()] == ["a"]
    assert ledger.get("a").held


def test_runner_answers_only_resolve_active_transfers(ledger):
    ledger.mark("a", Trigger.PREFILL_FINISHED, 16, [4])
    assert ledger.resolve("a", Outcome.ACKED, only_active=True) is None
    assert ledger.num_pending == 1


def test_expiry_is_in_deadline_order_and_costs_only_the_expired(ledger, clock):
    for i in range(5):
        ledger.mark(f"r{i}", Trigger.PREFILL_FINISHED, 1, [i])
        clock.advance(1)
    ledger.hand_off_pending()
    clock.t = 1000.0 + 10.0 + 1.5  # r0 and r1 are past their deadline (1010, 1011)
    expired = ledger.expire_due()
    assert [t.request_id for t in expired] == ["r0", "r1"]
    assert all(t.outcome is Outcome.EXPIRED and "no answer within 10s" in t.reason for t in expired)
    assert ledger.expire_due() == []
    assert ledger.num_active == 3
    ledger.check_invariants()


def test_the_finish_queries_are_the_live_containers_own_methods(ledger):
    """get, has_triggered and finished_resolved are bound to the containers the ledger keeps
    (no Python frame per finish): they answer from the live state, as the methods do."""
    assert ledger.get.__self__ is ledger._by_deadline
    assert ledger.has_triggered.__self__ is ledger._triggered
    assert ledger.finished_resolved.__self__ is ledger._triggered
    t = ledger.mark("a", Trigger.PREFILL_FINISHED, 8, [1])
    assert ledger.get("a") is t is TransferLedger.get(ledger, "a")
    assert ledger.has_triggered("a") and TransferLedger.has_triggered(ledger, "a")
    ledger.resolve("a", Outcome.ACKED)
    ledger.finished_resolved("a")
    assert ledger.get("a") is None and not ledger.has_triggered("a")


def test_a_steps_answers_resolve_one_at_a_time_as_the_caller_goes(ledger):
    """resolve_answers takes an answer when the iteration reaches it: the caller gives back
    one transfer's blocks before the next resolves, so a failure in between leaves the rest
    unresolved (and so still expired, reset or shut down later), never resolved unreleased."""
    for rid in ("a", "b"):
        ledger.mark(rid, Trigger.PREFILL_FINISHED, 8, [1])
    ledger.hand_off_pending()
    answers = {rid: SimpleNamespace(attempt=ledger.get(rid).attempt, reason=None)
               for rid in ("a", "b")}
    it = ledger.resolve_answers(answers)
    first = next(it)
    assert first.request_id == "a" and first.outcome is Outcome.ACKED
    assert ledger.get("b") is not None, "not taken yet"
    assert [t.request_id for t in it] == ["b"] and not ledger.has_unresolved()


def test_invalid_timeout_is_rejected():
    with pytest.raises(ValueError, match="timeout_seconds"):
        TransferLedger(0)


def test_wall_time_maps_ledger_time_to_unix_time():
    import time

    clock = FakeClock(5.0)
    ledger = TransferLedger(1.0, clock=clock)
    assert abs(ledger.wall_time(5.0) - time.time()) < 1.0


# ---------------------------------------------------------------------------- stateful


class LedgerMachine(RuleBasedStateMachine):
    """Random sequences of what a scheduler does to the ledger: add requests, trigger,
    hand off, ack, fail, abort, preempt, finish, jump the clock. After every step: each
    transfer resolves exactly once, held blocks are released exactly once, no id is in two
    states, and nothing is left once every request has finished and every transfer has
    resolved."""

    @initialize()
    def setup(self):
        self.clock = FakeClock()
        self.ledger = TransferLedger(5.0, clock=self.clock)
        self.resolutions: dict[int, int] = {}  # id(transfer) -> times resolved
        self.released_blocks = 0
        self.held_blocks_total = 0
        self.transfers: list[Transfer] = []
        self.live: set[str] = set()  # requests added and not finished
        self.next_id = 0
        outer = self

        class Counting(TransferObserver):
            def on_held(self, ledger, transfer):
                outer.held_blocks_total += transfer.held_blocks

            def on_resolved(self, ledger, transfer):
                outer.resolutions[id(transfer)] = outer.resolutions.get(id(transfer), 0) + 1
                if transfer.held:
                    outer.released_blocks += transfer.held_blocks

        self.ledger.add_observer(Counting())

    @rule()
    def add(self):
        self.live.add(f"r{self.next_id}")
        self.next_id += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data(), trigger=st.sampled_from(list(Trigger)))
    def trigger(self, data, trigger):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        if self.ledger.has_triggered(rid):
            with pytest.raises(RuntimeError):
                self.ledger.mark(rid, trigger, 8, [1])
            return
        self.transfers.append(self.ledger.mark(rid, trigger, 8, [1]))

    @rule()
    def hand_off(self):
        for t in self.ledger.hand_off_pending():
            assert t.phase is Phase.ACTIVE

    @rule(data=st.data(), failed=st.booleans())
    def answer(self, data, failed):
        unresolved = self.ledger.unresolved()
        if not unresolved:
            return
        t = data.draw(st.sampled_from(unresolved))
        was_active = t.phase is Phase.ACTIVE
        outcome = Outcome.FAILED if failed else Outcome.ACKED
        got = self.ledger.resolve(t.request_id, outcome, only_active=True)
        # The runner's answer resolves exactly the active transfer it is about, and no other.
        assert (got is t) == was_active and (got is None) == (not was_active)
        assert (t.outcome is outcome) == was_active

    @rule(data=st.data())
    def answers(self, data):
        """A step's answers (resolve_answers): each resolves exactly the active transfer of
        the attempt it names, in answer order, acked or failed as it says; an answer about
        another attempt, a pending transfer or no transfer resolves nothing."""
        known = sorted({t.request_id for t in self.transfers} | {"nobody"})
        rids = data.draw(st.lists(st.sampled_from(known), unique=True, max_size=6))
        answers, expected = {}, []
        for rid in rids:
            t = self.ledger.get(rid)
            attempt = t.attempt if t is not None else 1
            if data.draw(st.booleans()):
                attempt += data.draw(st.sampled_from([-1, 1]))
            reason = data.draw(st.sampled_from([None, "receiver busy"]))
            answers[rid] = SimpleNamespace(attempt=attempt, reason=reason)
            if t is not None and t.phase is Phase.ACTIVE and t.attempt == attempt:
                expected.append((t, Outcome.ACKED if reason is None else Outcome.FAILED, reason))
        got = list(self.ledger.resolve_answers(answers))
        assert got == [t for t, _, _ in expected]
        assert all((t.outcome, t.reason) == (o, r) for t, o, r in expected)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), aborted=st.booleans(), blocks=st.integers(1, 9))
    def finish(self, data, aborted, blocks):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.live.discard(rid)
        before = self.ledger.get(rid)
        if before is None and data.draw(st.booleans()):
            # The scheduler's shortcut for a finish with nothing unresolved.
            self.ledger.finished_resolved(rid)
            assert not self.ledger.has_triggered(rid)
            return
        hold = self.ledger.request_finished(rid, blocks, aborted=aborted)
        if before is None:
            assert not hold
        elif aborted and before.handed_off_at is None:
            assert not hold and before.outcome is Outcome.CANCELLED
        else:
            assert hold and before.held

    @rule(dt=st.floats(0, 8))
    def tick(self, dt):
        self.clock.advance(dt)
        for t in self.ledger.expire_due():
            assert t.outcome is Outcome.EXPIRED
            assert self.clock.t >= t.deadline

    @invariant()
    def invariants(self):
        self.ledger.check_invariants()
        assert all(n == 1 for n in self.resolutions.values()), "resolved more than once"
        resolved = sum(1 for t in self.transfers if t.phase is Phase.RESOLVED)
        assert resolved == len(self.resolutions)
        assert self.released_blocks + self.ledger.num_held_blocks == self.held_blocks_total
        # Requests that finished have no trigger state left.
        finished = {t.request_id for t in self.transfers} - self.live
        assert not any(
            self.ledger.has_triggered(r) for r in finished if self.ledger.get(r) is None
        )

    def teardown(self):
        # Quiescence: finish every request, let every deadline pass: nothing is left.
        for rid in sorted(self.live):
            self.ledger.request_finished(rid, 1, aborted=False)
        self.clock.advance(10)
        self.ledger.expire_due()
        assert not self.ledger.has_unresolved()
        assert (self.ledger.num_pending, self.ledger.num_active, self.ledger.num_held) == (0, 0, 0)
        assert self.ledger.num_held_blocks == 0
        assert not self.ledger._triggered, "no state left at quiescence"
        assert all(t.phase is Phase.RESOLVED for t in self.transfers)
        assert all(n == 1 for n in self.resolutions.values())


LedgerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_ledger_state_machine = LedgerMachine.TestCase


def test_a_failing_batched_observer_loses_its_figures_not_the_step_nor_the_others(
        ledger, caplog):
    class Failing(TransferObserver):
        batched = True

        def on_batch(self, ledger, batch):
            raise RuntimeError("disk full")

    class Counting(TransferObserver):
        batched = True
        marked = 0

        def on_batch(self, ledger, batch):
            self.marked += len(batch.marked)

    counting = Counting()
    ledger.add_observer(Failing())
    ledger.add_observer(counting)
    with caplog.at_level(logging.ERROR, logger="omni_runtime.transfers.ledger"):
        for i in range(1000):
            ledger.begin_batch()
            ledger.mark(f"r{i}", Trigger.PREFILL_FINISHED, 16, [4])
            ledger.end_batch()
    assert counting.marked == 1000 and ledger.num_pending == 1000
    failures = [r for r in caplog.records if "Failing failed" in r.getMessage()]
    assert [r.getMessage().split("(")[1].split(" ")[0] for r in failures] == ["1", "1000"]
