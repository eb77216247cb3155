"""The fence: a read racing the end of its transfer never stores bytes of re-used blocks.

The AR side (KVSender) answers each receiver's ``read_done`` with a verdict: ``commit`` only
while the transfer is current (not cancelled, resolved or superseded) and before its deadline;
the receiver stores a payload only on ``commit``. Here a real receiver reads a synthetic AR's
registered cache with NIXL and the test makes the read lose its race: the scheduler withdraws
the transfer (``cancel``) and the blocks are re-used (overwritten) before the read, or between
the read and its ``read_done``; or the transfer's deadline passes during the read. The
receiver's slowness is the only thing mocked (transport_fixtures.Hold blocks the receiver
thread at one step until the test says go); the sockets, NIXL and both sides are real.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from transport_fixtures import (  # noqa: F401 (fixtures)
    STAGE,
    WAIT,
    RawDealer,
    ar,
    at_read_done,
    collect,
    fake,
    hold,
    make_ar,
    make_receiver,
    make_sender,
    receiver,
    registry,
    rejected_counts,
    wait_for,
    zctx,
)

MARK = 12345.0  # what the re-used blocks hold afterwards


def holds_mark(kv: np.ndarray) -> bool:
    return bool((kv == MARK).any())


def assert_nothing_stored(receiver, rid: str) -> None:
    assert rid not in receiver.inbox
    assert not any(holds_mark(receiver.inbox.get(p["request_id"], remove=False).kv)
                   for p in receiver.inbox.list())


@pytest.mark.parametrize("where", ["_post", "read_done"], ids=["before-the-read",
                                                               "after-the-read"])
def test_a_read_of_a_withdrawn_transfer_is_aborted_and_never_stored(receiver, ar, make_sender,
                                                                    hold, registry, where):
    """The worker withdraws the transfer (the scheduler resolved it: the request was
    preempted or reset) and its blocks are re-used, while the receiver's read is queued
    (it then reads the new bytes) or done but not yet confirmed: the AR answers abort, the
    receiver stores nothing and answers ``deadline``, and no answer reaches the caller."""
    held = hold(receiver, "_post") if where == "_post" else hold(receiver, "_reply",
                                                                 at_read_done)
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    blocks = [2, 3, 4]
    sender.submit(ar.offer("r", blocks, 11))
    held.wait_entered()
    assert sender.cancel("r", 0) is True
    ar.overwrite(blocks, MARK)  # the scheduler re-used the blocks
    held.release()
    wait_for(lambda: receiver.num_aborted == 1, what="the aborted read")
    assert_nothing_stored(receiver, "r")
    assert rejected_counts(registry) == {"deadline": 1}
    assert sender.pending() == 0 and sender.wait(0.2) is False  # withdrawn: never answered
    wait_for(lambda: receiver._staging.available == receiver.slots, what="the slot back")
    # The same blocks, offered again (a new attempt), are read as they are now.
    sender.submit(ar.offer("r", blocks, 11, attempt=1))
    assert collect(sender, 1) == (["r"], {})
    got = receiver.inbox.get("r")
    assert got.extra["attempt"] == 1 and (got.kv == MARK).all()


def test_a_read_whose_deadline_passes_before_it_is_confirmed_is_aborted(receiver, ar,
                                                                        make_sender, hold,
                                                                        registry):
    """The receiver is slow (held after its read, before read_done) until the AR's deadline
    has passed and the AR reported the failure: the late read_done gets abort (the
    scheduler may free the blocks at its own deadline), nothing is stored."""
    held = hold(receiver, "_reply", at_read_done)
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    sender.submit(ar.offer("slow", [5, 6], 8), timeout_s=0.5)
    held.wait_entered()
    acked, failed = collect(sender, 1)
    assert not acked and "no ack from stage talker" in failed["slow"]
    ar.overwrite([5, 6], MARK)  # freed at the deadline, re-used
    held.release()
    wait_for(lambda: receiver.num_aborted == 1, what="the aborted read")
    assert_nothing_stored(receiver, "slow")
    assert rejected_counts(registry) == {"deadline": 1}
    assert sender.wait(0.2) is False  # one answer only


def test_the_receiver_gives_up_a_read_its_time_ran_out_for(receiver, ar, make_sender, hold,
                                                          registry):
    """The receiver is held before it posts the READ until the transfer's time is over on
    its side too: it does not read on (its own deadline), releases its slot and answers
    ``deadline``; the next transfer is read as usual."""
    held = hold(receiver, "_post")
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    sender.submit(ar.offer("late", [1], 4), timeout_s=0.4)
    held.wait_entered()
    assert "no ack" in collect(sender, 1)[1]["late"]
    wait_for(lambda: receiver._reads, what="the read")
    read_by = next(iter(receiver._reads.values())).read_by
    wait_for(lambda: time.monotonic() > read_by, what="the receiver's deadline")
    held.release()
    wait_for(lambda: rejected_counts(registry) == {"deadline": 1}, what="the refusal")
    assert "late" not in receiver.inbox and receiver.num_aborted == 0
    wait_for(lambda: receiver._staging.available == receiver.slots, what="the slot back")
    sender.submit(ar.offer("next", [1], 4))
    assert collect(sender, 1) == (["next"], {})


def test_a_committed_read_stores_the_bytes_that_were_there_when_it_read(receiver, ar,
                                                                       make_sender, hold):
    """The payload is what the READ took from the blocks, not a later look at them: blocks
    changed after the read (which the block guarantee forbids while the transfer is
    current; done here to tell the two apart) do not change what is stored."""
    held = hold(receiver, "_reply", at_read_done)
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    blocks = [9, 1, 12]
    want = ar.expected(blocks, 12)
    sender.submit(ar.offer("r", blocks, 12))
    held.wait_entered()
    ar.overwrite(blocks, MARK)
    held.release()
    assert collect(sender, 1) == (["r"], {})
    got = receiver.inbox.get("r")
    assert np.array_equal(got.kv, want) and not holds_mark(got.kv)


def test_a_cancel_of_an_older_attempt_leaves_the_newer_one(receiver, ar, make_sender):
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    assert sender.cancel("nothing", 0) is False
    sender.submit(ar.offer("r", [1], 2, attempt=2))
    assert sender.cancel("r", 1) is False  # an earlier attempt's withdrawal
    assert collect(sender, 1) == (["r"], {})


def test_the_verdict_says_abort_for_a_withdrawn_and_commit_for_a_current_transfer(fake, ar,
                                                                                  make_sender):
    """The fence as the AR answers it, seen on the wire (a fake receiver)."""
    sender = make_sender(ar, {STAGE: fake.endpoint})
    sender.submit(ar.offer("withdrawn", [1], 2))
    sender.submit(ar.offer("current", [2], 2))
    (id1, r1), (id2, r2) = fake.recv(), fake.recv()
    assert sender.cancel("withdrawn", 0)
    fake.send(id1, "read_done", r1)
    fake.send(id2, "read_done", r2)
    verdicts = {v["transfer_id"]: v for _, v in (fake.recv(), fake.recv())}
    assert verdicts[r1["transfer_id"]]["commit"] is False
    assert "withdrawn" in verdicts[r1["transfer_id"]]["reason"]
    assert verdicts[r2["transfer_id"]]["commit"] is True
    assert verdicts[r2["transfer_id"]]["agent"] == ar.name
    fake.send(id2, "ok", r2)
    assert collect(sender, 1) == (["current"], {})
    fake.send(id1, "ok", r1)  # an ack of the withdrawn transfer resolves nothing
    assert sender.wait(0.2) is False


def test_a_verdict_that_never_comes_ends_the_read_after_its_grace(receiver, ar, zctx,
                                                                  registry):
    """An AR that said nothing after read_done (it died, or is cut off): the receiver gives
    up at the transfer's deadline plus the verdict's grace, stores nothing, and a verdict
    arriving later changes nothing."""
    from omni_runtime.kv.transport.receiver import VERDICT_GRACE_S

    dealer = RawDealer(zctx, receiver.endpoint, ar)
    dealer.hello(ar)
    dealer.read(ar, 4, "silent", [1], 3, deadline_in_s=0.2)
    assert dealer.reply()["type"] == "read_done"
    answer = dealer.reply(timeout=0.2 + VERDICT_GRACE_S + WAIT)
    assert (answer["type"], answer["code"], answer["transfer_id"]) == ("rejected", "deadline", 4)
    assert "no verdict" in answer["reason"]
    dealer.verdict(ar, 4, commit=True)  # too late
    dealer.read(ar, 5, "after", [1], 3)
    assert dealer.reply()["type"] == "read_done"  # the late verdict got no answer
    dealer.verdict(ar, 5)
    assert dealer.reply()["type"] == "ok"
    assert "silent" not in receiver.inbox and "after" in receiver.inbox
    assert rejected_counts(registry) == {"deadline": 1}
