"""The KV-transfer ledger: the bookkeeping of every KV-cache transfer of one stage.

This module imports no vLLM: it is a small state machine that the scheduler drives and that
the metrics and tracing observe. One transfer per request at a time:

    mark ──> PENDING ──hand_off──> ACTIVE ──resolve──> (gone)
                │                     │
                └──────resolve────────┘        outcome: acked | failed | expired | cancelled

and, orthogonally, HELD: the request has finished while its transfer is unresolved, so its KV
blocks stay allocated; they are released exactly once, when the transfer resolves.

Invariants (checked by the tests after every operation):
  * an unresolved transfer is in exactly one of ``_pending`` / ``_active``; a held one is also
    in ``_held``; a resolved transfer is in none of them and is never resolved again;
  * ``_by_deadline`` holds exactly the unresolved transfers, in marking order; since every
    transfer gets the same timeout and the clock is monotonic, that is also deadline order, so
    the next to expire is always the first one (expiry costs O(expired), never a scan);
  * ``_triggered`` holds the requests that marked a transfer and have not finished: what makes
    a trigger fire at most once per request. Nothing about a request survives its finish and
    the resolution of its transfer.
All operations the scheduler calls per request are O(1).

Observers see the changes either one by one (the ``on_*`` hooks, right after each change) or,
if they set :attr:`TransferObserver.batched`, once per batch (:meth:`TransferObserver.on_batch`,
every change since the last batch at once). The scheduler wraps each step's two halves in a
batch (:meth:`TransferLedger.begin_batch` / :meth:`TransferLedger.end_batch`), so the metrics
write their gauges once per step and their counters and histograms once per step and label,
not once per transfer; outside a batch, every operation is a batch of its own, so an observer
sees the ledger as it is after each operation either way.

With a ``report_interval`` (the scheduler's ``telemetry_interval_seconds``), the batched
observers hear of ended batches at most once per interval while a transfer is unresolved:
the changes of several steps reach them as one batch (their writes, a multiprocess mmap write
each, and their spans then cost once per interval, not once per step). They hear at once
when no transfer is left unresolved (so an idle stage's figures are exact), and on
:meth:`TransferLedger.report`. vLLM's engine keeps stepping a scheduler with unresolved
transfers (it polls for answers), so no report waits longer than the interval and a step; an
engine stepped only on demand (an offline ``LLM``) reports at its next step.

A batched observer that raises loses that report's changes from its figures (logged, on the
first failure and every 1000th): never the scheduler's step, nor the other observers'.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, ClassVar

logger = logging.getLogger(__name__)

#: The first item of a tuple (a mark's request id, read in C).
_FIRST = itemgetter(0)

#: Default deadline for a transfer, from marking to resolution. Long enough for a large prompt's
#: KV cache over a slow link, short enough that a lost ack frees its blocks within a minute.
DEFAULT_TIMEOUT_SECONDS = 30.0


class Trigger(str, enum.Enum):
    """Why a transfer was started (the ``trigger`` label of the started counter)."""

    PREFILL_FINISHED = "prefill_finished"
    SPECIAL_TOKEN = "special_token"
    REQUEST_FINISHED = "request_finished"


class Outcome(str, enum.Enum):
    """How a transfer resolved (the ``outcome`` label)."""

    ACKED = "acked"  # the runner (and with our connector, the receiver) has it
    FAILED = "failed"  # the runner or the receiver said it failed, or marking failed
    EXPIRED = "expired"  # the deadline passed with no answer
    CANCELLED = "cancelled"  # the request went away before the transfer was handed off


class Phase(str, enum.Enum):
    """Where an unresolved transfer is (the ``state`` label, with ``held``)."""

    PENDING = "pending"
    ACTIVE = "active"
    RESOLVED = "resolved"


#: Each Trigger, Outcome and Phase member's value, by member: a dict lookup where the enum's
#: ``value`` is a property call (the output of each finish and each span read them).
VALUES: dict[enum.Enum, str] = {m: m.value for e in (Trigger, Outcome, Phase) for m in e}


@dataclass(slots=True, eq=False)
class Transfer:
    """One KV transfer. Times are on the ledger's clock (see :class:`TransferLedger`)."""

    request_id: str
    trigger: Trigger
    seq_len: int
    block_ids: Sequence[int]
    marked_at: float
    deadline: float
    trace_headers: dict[str, str] | None = None
    #: Unique per ledger (monotonic): what the runner's answer names, so that a late answer
    #: about an earlier attempt of the same request resolves nothing.
    attempt: int = 0
    phase: Phase = Phase.PENDING
    handed_off_at: float | None = None
    #: Set when the request finished while this transfer was unresolved.
    held_since: float | None = None
    #: KV blocks the finished request keeps allocated (all of its blocks, not only the
    #: ``block_ids`` being shipped).
    held_blocks: int = 0
    outcome: Outcome | None = None
    reason: str | None = None
    resolved_at: float | None = None
    #: What the hand-off carries besides the KV, set by whoever marked it (the scheduler:
    #: the request's tokens and its pipeline context, sched/handoff.py's Carried); the
    #: ledger never reads it.
    carried: Any = field(default=None, repr=False)
    #: Free slot for an observer (one of another project's: the observers here keep none).
    observer_state: Any = field(default=None, repr=False)

    @property
    def held(self) -> bool:
        return self.held_since is not None


@dataclass(slots=True)
class Batch:
    """The changes of one batch (a scheduler step's half, or one operation outside a batch),
    each list in the order the changes happened. A transfer may appear in several lists (marked
    and handed off in the same batch, say); read its fields for where it ended up."""

    marked: list[Transfer] = field(default_factory=list)
    handed_off: list[Transfer] = field(default_factory=list)
    held: list[Transfer] = field(default_factory=list)
    #: Each with its ``outcome``; if ``held``, its blocks were released.
    resolved: list[Transfer] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.marked or self.handed_off or self.held or self.resolved)


class TransferObserver:
    """Hook for metrics and tracing. Called after each state change, with the ledger already
    updated (so an observer may read its counts). Methods do nothing by default.

    An observer with ``batched = True`` gets :meth:`on_batch` instead of the ``on_*`` hooks:
    once per batch, after its last change (the scheduler's step halves are batches; outside a
    batch, each operation is one), with the ledger as it is then."""

    #: Whether the ledger calls :meth:`on_batch` (True) or the per-change hooks (False).
    batched: ClassVar[bool] = False

    def on_batch(self, ledger: TransferLedger, batch: Batch) -> None:
        """Every change since the previous batch ended (only for ``batched`` observers)."""

    def on_marked(self, ledger: TransferLedger, transfer: Transfer) -> None:
        pass

    def on_handed_off(self, ledger: TransferLedger, transfer: Transfer) -> None:
        pass

    def on_held(self, ledger: TransferLedger, transfer: Transfer) -> None:
        pass

    def on_resolved(self, ledger: TransferLedger, transfer: Transfer) -> None:
        """``transfer.outcome`` is set; if ``transfer.held`` its blocks are being released."""

    def on_engine_wait(self, ledger: TransferLedger) -> None:
        """The scheduler has handed its step to the model runner: the engine waits for the
        forward pass next, the GIL free. Work an observer does off the caller's thread is
        best started now (started while the step runs, it would slow the step). A per-change
        observer hears it at every such wait; a batched one only at the first wait after the
        ledger's latest report (it is given work only in reports: without one since the last
        wait, it has nothing new to start)."""

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until what this observer was told is written out (work it does off the
        caller's thread); False if ``timeout`` seconds passed first."""
        return True


class TransferLedger:
    """Bookkeeping of one stage's KV transfers.

    ``clock`` returns seconds on a monotonic scale (default :func:`time.monotonic`); tests
    inject a fake one. :meth:`wall_time` maps a ledger time to unix time for metrics.
    """

    def __init__(
        self,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        *,
        clock: Callable[[], float] = time.monotonic,
        observers: Iterable[TransferObserver] = (),
        report_interval: float = 0.0,
    ) -> None:
        if not timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be > 0, got {timeout_seconds!r}")
        if not report_interval >= 0:
            raise ValueError(f"report_interval must be >= 0, got {report_interval!r}")
        self.timeout_seconds = float(timeout_seconds)
        #: Seconds (of ``clock``) the batched observers may wait for ended batches while a
        #: transfer is unresolved (see the module docstring); 0: told at every batch's end.
        self.report_interval = float(report_interval)
        self._reported_at = float("-inf")
        self._clock = clock
        self._wall_offset = time.time() - clock()
        # Observers called per change, and those called per batch (see TransferObserver).
        self._observers: list[TransferObserver] = []
        self._batched: list[TransferObserver] = []
        # Those with an on_engine_wait of their own: per-change observers (told at every
        # wait), batched ones (told at the first wait after a report: _reported).
        self._waiting: list[TransferObserver] = []
        self._waiting_batched: list[TransferObserver] = []
        #: Whether the batched observers were given a report since the engine last waited.
        self._reported = False
        #: The changes of the batch under way, for the batched observers (None: there are none).
        self._batch: Batch | None = None
        self._batch_depth = 0
        #: Batched observers' failures, by class name (logged on the first and every 1000th).
        self._observer_failures: dict[str, int] = {}
        for observer in observers:
            self.add_observer(observer)
        # Insertion-ordered: the first entry of each is the oldest in that state.
        self._pending: OrderedDict[str, Transfer] = OrderedDict()
        self._active: OrderedDict[str, Transfer] = OrderedDict()
        self._held: OrderedDict[str, Transfer] = OrderedDict()
        self._by_deadline: OrderedDict[str, Transfer] = OrderedDict()
        self._triggered: set[str] = set()
        self._held_block_count = 0
        self._attempts = 0
        # What the scheduler asks on every finish, bound to the containers' own methods (no
        # Python frame per call; the methods of the same names below say what they do). Both
        # containers live as long as the ledger.
        self.get = self._by_deadline.get
        self.has_triggered = self._triggered.__contains__
        self.finished_resolved = self._triggered.discard

    # ------------------------------------------------------------------ observers
    def add_observer(self, observer: TransferObserver) -> None:
        if type(observer).on_engine_wait is not TransferObserver.on_engine_wait:
            (self._waiting_batched if observer.batched else self._waiting).append(observer)
        if observer.batched:
            self._batched.append(observer)
            if self._batch is None:
                self._batch = Batch()
        else:
            self._observers.append(observer)

    def remove_observers(self) -> None:
        """Detach every observer (benchmarks measure the ledger without them)."""
        self._observers.clear()
        self._batched.clear()
        self._waiting.clear()
        self._waiting_batched.clear()
        self._batch = None

    @property
    def observers(self) -> tuple[TransferObserver, ...]:
        return (*self._observers, *self._batched)

    # ------------------------------------------------------------------ batches
    def begin_batch(self) -> None:
        """Start (or nest) a batch: the batched observers hear of its changes at its end."""
        self._batch_depth += 1

    def end_batch(self) -> None:
        """End a batch begun with :meth:`begin_batch`; the outermost end tells the batched
        observers (when due: see ``report_interval``). Call it in a ``finally``: an unended
        batch would never be reported."""
        self._batch_depth -= 1
        if not self._batch_depth and self._batch is not None:
            self._flush()

    def report(self) -> None:
        """Tell the batched observers every change not told yet, now (outside a batch), where
        a reader needs the figures exact while transfers are in flight (a shutdown needs no
        call: resolving what is left reports at once)."""
        if not self._batch_depth and self._batch:
            self._reported_at = float("-inf")
            self._flush()

    def engine_waits(self) -> None:
        """The scheduler has handed its step to the model runner (the engine waits for the
        forward pass next): see :meth:`TransferObserver.on_engine_wait`. The batched
        observers only after a report (most steps at a telemetry interval make none: no
        call of theirs then)."""
        for observer in self._waiting:
            observer.on_engine_wait(self)
        if self._reported:
            self._reported = False
            for observer in self._waiting_batched:
                observer.on_engine_wait(self)

    def flush(self, timeout: float | None = None) -> bool:
        """Report every change not reported yet (see :meth:`report`) and wait until every
        observer has written out what it was told (the scheduler's shutdown; a reader of
        exported spans). False if an observer was not done within ``timeout`` seconds."""
        self.report()
        done = True
        for observer in self.observers:
            done = observer.flush(timeout) and done
        return done

    def _flush(self) -> None:
        """The changes since the last report, to the batched observers, if due (always
        without an interval or with nothing unresolved, else once the interval has passed)
        and if there are any. Due first: inside an interval (most of a busy stage's steps)
        the batch's lists are not looked at."""
        if self.report_interval and self._by_deadline:
            now = self._clock()
            if now - self._reported_at < self.report_interval or not self._batch:
                return
            self._reported_at = now
        elif not self._batch:
            return
        batch, self._batch = self._batch, Batch()
        self._reported = True
        for observer in self._batched:
            try:
                observer.on_batch(self, batch)
            except Exception:  # figures are lost, never the step (nor the other observers')
                self._observer_failed(observer)

    def _observer_failed(self, observer: TransferObserver) -> None:
        name = type(observer).__name__
        failures = self._observer_failures[name] = self._observer_failures.get(name, 0) + 1
        if failures == 1 or failures % 1000 == 0:  # not once per interval for ever
            logger.exception("KV transfer observer %s failed (%d times so far); the changes of "
                             "this report are missing from its figures", name, failures)

    # ------------------------------------------------------------------ queries
    def now(self) -> float:
        return self._clock()

    def wall_time(self, ledger_time: float) -> float:
        """Unix time of a ledger time."""
        return ledger_time + self._wall_offset

    def get(self, request_id: str) -> Transfer | None:
        """The request's unresolved transfer, if any. (An instance's own ``get`` is its
        container's, bound in ``__init__``: the same answer.)"""
        return self._by_deadline.get(request_id)

    def has_triggered(self, request_id: str) -> bool:
        """Whether the request has started a transfer since it was added (or re-armed). (An
        instance's own is its container's, bound in ``__init__``: the same answer.)"""
        return request_id in self._triggered

    def finished_resolved(self, request_id: str) -> None:
        """The request has finished with no unresolved transfer (:meth:`get` gives None):
        all that :meth:`request_finished` does then (its trigger state goes; nothing to
        hold). (An instance's own is its container's, bound in ``__init__``: the same.)"""
        self._triggered.discard(request_id)

    def not_triggered(self, request_ids: Iterable[str]) -> set[str]:
        """Those of ``request_ids`` that have not started a transfer since they were added
        (or re-armed): :meth:`has_triggered` for many at once (a set difference, in C)."""
        return set(request_ids).difference(self._triggered)

    def has_unresolved(self) -> bool:
        return bool(self._by_deadline)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def num_held_blocks(self) -> int:
        return self._held_block_count

    def oldest_entered(self, phase: str) -> float | None:
        """Ledger time at which the oldest transfer now in ``phase`` ('pending', 'active' or
        'held') entered it; None when there is none. O(1)."""
        if phase == "pending":
            first = next(iter(self._pending.values()), None)
            return None if first is None else first.marked_at
        if phase == "active":
            first = next(iter(self._active.values()), None)
            return None if first is None else first.handed_off_at
        if phase == "held":
            first = next(iter(self._held.values()), None)
            return None if first is None else first.held_since
        raise ValueError(f"unknown phase {phase!r}")

    def unresolved(self) -> list[Transfer]:
        """A snapshot of all unresolved transfers, oldest first (for debugging and drains)."""
        return list(self._by_deadline.values())

    # ------------------------------------------------------------------ transitions
    def mark(
        self,
        request_id: str,
        trigger: Trigger,
        seq_len: int,
        block_ids: Sequence[int],
        *,
        trace_headers: dict[str, str] | None = None,
    ) -> Transfer:
        """Start a transfer (PENDING). A request can start one transfer until it finishes or
        is re-armed; marking twice is a bug in the caller, so it raises."""
        return self.mark_many(trigger, ((request_id, seq_len, block_ids, trace_headers),))[0]

    def mark_many(
        self, trigger: Trigger,
        marks: Sequence[tuple[str, int, Sequence[int], dict[str, str] | None]],
    ) -> list[Transfer]:
        """:meth:`mark` for each ``(request_id, seq_len, block_ids, trace_headers)``, in
        order, at one time (a step's triggers fire together): the transfers, each with its
        own attempt. All or nothing: a request that already started one (or appears twice)
        raises before any is marked."""
        ids = set(map(_FIRST, marks))
        if len(ids) != len(marks) or not self._triggered.isdisjoint(ids):
            seen: set[str] = set()
            for request_id, *_ in marks:  # the first one marked twice, for the message
                if request_id in self._triggered or request_id in seen:
                    raise RuntimeError(f"request {request_id!r} already started a KV transfer")
                seen.add(request_id)
        now = self._clock()
        deadline = now + self.timeout_seconds
        attempt = self._attempts
        triggered, pending, by_deadline = self._triggered, self._pending, self._by_deadline
        observers = self._observers
        made: list[Transfer] = []
        for request_id, seq_len, block_ids, trace_headers in marks:
            attempt += 1
            # Positional, in the fields' order (request_id, trigger, seq_len, block_ids,
            # marked_at, deadline, trace_headers, attempt): one per transfer, on the step.
            transfer = Transfer(request_id, trigger, seq_len, block_ids, now, deadline,
                                trace_headers, attempt)
            triggered.add(request_id)
            pending[request_id] = transfer
            by_deadline[request_id] = transfer
            made.append(transfer)
            if observers:  # right after each change, as the others see the ledger then
                self._attempts = attempt
                for observer in observers:
                    observer.on_marked(self, transfer)
        self._attempts = attempt
        if self._batch is not None:
            self._batch.marked.extend(made)
            if not self._batch_depth:
                self._flush()
        return made

    def hand_off_pending(self) -> list[Transfer]:
        """Move every pending transfer to ACTIVE and return them, oldest first."""
        if not self._pending:
            return []
        now = self._clock()
        handed = list(self._pending.values())
        self._pending.clear()
        active = self._active
        for transfer in handed:
            transfer.phase = Phase.ACTIVE
            transfer.handed_off_at = now
            active[transfer.request_id] = transfer
            for observer in self._observers:
                observer.on_handed_off(self, transfer)
        if self._batch is not None:
            self._batch.handed_off.extend(handed)
            if not self._batch_depth:
                self._flush()
        return handed

    def resolve(
        self,
        request_id: str,
        outcome: Outcome,
        reason: str | None = None,
        *,
        only_active: bool = False,
        attempt: int | None = None,
    ) -> Transfer | None:
        """Resolve the request's unresolved transfer. Returns it, or None when there is none
        (an ack for a transfer that already expired, say). If the returned transfer is
        ``held``, the caller must now free the request's blocks.

        ``only_active``: resolve only a transfer that was handed off. An answer from the
        runner can only be about a transfer it was given; one for a pending transfer is a
        late answer about an earlier attempt and must not resolve the new one.
        ``attempt``: resolve only that attempt (the one the answer names); None: any."""
        transfer = self._by_deadline.get(request_id)
        if transfer is None or (only_active and transfer.phase is not Phase.ACTIVE):
            return None
        if attempt is not None and transfer.attempt != attempt:
            return None
        self._resolve(transfer, outcome, reason, self._clock())
        return transfer

    def _resolve(self, transfer: Transfer, outcome: Outcome, reason: str | None,
                 now: float) -> None:
        """Resolve an unresolved transfer at ledger time ``now`` (the checks are the
        caller's)."""
        request_id = transfer.request_id
        del self._by_deadline[request_id]
        if transfer.phase is Phase.PENDING:
            del self._pending[request_id]
        else:
            del self._active[request_id]
        if transfer.held_since is not None:
            del self._held[request_id]
            self._held_block_count -= transfer.held_blocks
        transfer.phase = Phase.RESOLVED
        transfer.outcome = outcome
        transfer.reason = reason
        transfer.resolved_at = now
        for observer in self._observers:
            observer.on_resolved(self, transfer)
        if self._batch is not None:
            self._batch.resolved.append(transfer)
            if not self._batch_depth:
                self._flush()

    def resolve_answers(self, answers: Mapping[str, Any],
                        ignored: list[str] | None = None) -> Iterator[Transfer]:
        """The runner's answers of a step, by request id, each naming the attempt it answers
        (``attempt``) and why it failed (``reason``, None: delivered; ``expired``: no answer
        came before the deadline): for each, ``resolve(request_id, ACKED, EXPIRED or FAILED,
        reason, only_active=True, attempt=...)``, in
        one loop, yielding each transfer resolved. Lazily: an answer is taken when the
        iteration reaches it, so the caller gives back one transfer's blocks before the next
        resolves (a failure in between strands no other transfer's blocks); iterate to the
        end. An answer about another attempt, or about a transfer not handed off or already
        resolved, resolves nothing (logged at debug level; its request id appended to
        ``ignored``, if given)."""
        by_deadline, active = self._by_deadline, Phase.ACTIVE
        now = self._clock()  # one read for the step's answers: they arrived together
        for request_id, answer in answers.items():
            transfer = by_deadline.get(request_id)
            if (transfer is None or transfer.phase is not active
                    or transfer.attempt != answer.attempt):
                logger.debug("ignoring an answer for request %s (attempt %s): not its active "
                             "transfer", request_id, answer.attempt)
                if ignored is not None:
                    ignored.append(request_id)
                continue
            reason = answer.reason
            outcome = Outcome.ACKED if reason is None else \
                Outcome.EXPIRED if getattr(answer, "expired", False) else Outcome.FAILED
            self._resolve(transfer, outcome, reason, now)
            yield transfer

    def expire_due(self) -> list[Transfer]:
        """Resolve as EXPIRED every transfer whose deadline has passed. O(expired)."""
        if not self._by_deadline:
            return []
        now = self._clock()
        expired: list[Transfer] = []
        first = next(iter(self._by_deadline.values()))
        if first.deadline > now:
            return expired
        self.begin_batch()  # one batch for the burst, even outside the scheduler's
        try:
            self._expire(now, expired)
        finally:
            self.end_batch()
        return expired

    def _expire(self, now: float, expired: list[Transfer]) -> None:
        while self._by_deadline:
            transfer = next(iter(self._by_deadline.values()))
            if transfer.deadline > now:
                break
            waited = now - transfer.marked_at
            self.resolve(
                transfer.request_id,
                Outcome.EXPIRED,
                f"no answer within {self.timeout_seconds:g}s (waited {waited:.1f}s, "
                f"{transfer.phase.value})",
            )
            expired.append(transfer)

    def request_finished(self, request_id: str, num_blocks: int, *, aborted: bool) -> bool:
        """The request has finished (stopped, length-capped, aborted or errored).

        Returns True when the caller must keep the request's ``num_blocks`` KV blocks
        allocated (HELD) until its transfer resolves; False when it may free them now. A
        pending transfer of an aborted request is cancelled: its blocks are about to be freed
        and must never reach the runner. An active transfer is held even on abort: the runner
        may be reading the blocks. The request's trigger state is dropped either way.
        """
        self._triggered.discard(request_id)
        transfer = self._by_deadline.get(request_id)
        if transfer is None:
            return False
        if transfer.held_since is not None:
            return True  # finished twice: held once, from the first finish, with its blocks
        if aborted and transfer.phase is Phase.PENDING:
            self.resolve(request_id, Outcome.CANCELLED, "request aborted before hand-off")
            return False
        transfer.held_since = self._clock()
        transfer.held_blocks = num_blocks
        self._held[request_id] = transfer
        self._held_block_count += num_blocks
        for observer in self._observers:
            observer.on_held(self, transfer)
        if self._batch is not None:
            self._batch.held.append(transfer)
            if not self._batch_depth:
                self._flush()
        return True

    # ------------------------------------------------------------------ introspection
    def check_invariants(self) -> None:
        """Assert the documented invariants. O(n): for tests and debugging only."""
        unresolved = set(self._by_deadline)
        pending, active, held = set(self._pending), set(self._active), set(self._held)
        assert not pending & active, f"in two states: {pending & active}"
        assert pending | active == unresolved, "unresolved != pending | active"
        assert held <= unresolved, f"held but resolved: {held - unresolved}"
        assert self._held_block_count == sum(t.held_blocks for t in self._held.values())
        deadlines = [t.deadline for t in self._by_deadline.values()]
        assert deadlines == sorted(deadlines), "deadlines out of marking order"
        for rid, t in self._pending.items():
            assert t.phase is Phase.PENDING and t.request_id == rid
        for rid, t in self._active.items():
            assert t.phase is Phase.ACTIVE and t.request_id == rid
        for t in self._held.values():
            assert t.held_since is not None

    def __repr__(self) -> str:
        return (
            f"TransferLedger(pending={self.num_pending}, active={self.num_active}, "
            f"held={self.num_held}, held_blocks={self.num_held_blocks}, "
            f"triggered={len(self._triggered)})"
        )
