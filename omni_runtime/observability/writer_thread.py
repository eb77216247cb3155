"""The observers' writes off the scheduler's step: daemon threads that write what a report
handed over, while the engine core waits for the forward pass.

The scheduler's step is on every request's critical path (the next forward pass waits for
it), and an observer's report is most of what the observers cost there: a transfer's span
(its ids, sampling, the SDK's span object, the span processors' ``on_end``), the metric
families' multiprocess writes (a locked mmap write per counter, bucket and gauge). None of
it needs the step. What a report reads is either final (a resolved transfer: the ledger
never changes it again; a hand-off's attempt and time) or copied on the step (the gauges'
values, a snapshot of a few counts), so the same writes done later, on another thread, give
the same spans and samples. The step hands them over (a lock, a list append); a thread writes
them while the engine waits for the forward pass, the GIL free then. The CPU is spent either
way: this moves it off the step's latency, as the SDK's batch span processor moves the export.

When the thread runs matters under the GIL: a thread woken while the step runs would get
the GIL within the interpreter's switch interval (5 ms) and run its jobs inside the step. So
a submission does not wake it; :meth:`WriterThread.kick` does, which the scheduler calls
once it has handed its step to the model runner (``TransferLedger.engine_waits``: the engine
waits for the forward pass next). Jobs nobody kicks (a ledger driven outside a scheduler)
are written once the oldest has waited ``max_delay`` seconds for a kick.

Two threads per process, started on first use: the spans' (:func:`span_thread`) and the
metric families' (:func:`metrics_thread`), so that a span exporter that blocks (behind a
synchronous processor) never holds the metrics back.

Guarantees:
  * **Bounded**: at most ``max_queued`` items wait; past that :meth:`WriterThread.submit`
    refuses, counted (logged on the first refusal and every 1000th), and the caller decides:
    spans are dropped, as the SDK's batch processor drops spans past its queue; the metric
    families wait for the thread to write the earlier reports and then write on the step
    (:meth:`WritesOffStep._write_in_order`), so no count is lost and no gauge left behind.
  * **In order**: jobs run in submission order, one at a time.
  * **Flushed**: :meth:`WriterThread.flush` waits until everything submitted so far is
    written; the scheduler's shutdown calls it (through ``TransferLedger.flush``), and so does
    the interpreter's exit, before the SDK's tracer providers shut down (see
    :func:`register_exit_flush`).
  * **Isolated**: a job that raises (anything, ``SystemExit`` included) loses its writes
    (logged on the first failure and every 1000th), never the thread nor the other jobs.
    A thread that cannot be started (at interpreter shutdown) refuses, counted.
  * **Fork-safe**: a fork waits (briefly) for the threads to finish what they hold, so no
    lock is held across it; a forked child starts with empty queues and starts its own
    threads on first use (the parent's queued writes are the parent's).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

#: Spans that may wait at most (a transfer's span holds its Transfer until written: well
#: under a kilobyte). A report of a busy stage is a few hundred; the SDK's batch processor
#: queues 2048 spans by default.
MAX_QUEUED_SPANS = 16384

#: Transfers whose metric writes may wait at most (the thread never blocks on them: only a
#: thread that cannot be started or is starved leaves them waiting).
MAX_QUEUED_METRICS = 65536

#: Seconds a job waits for a kick before the thread writes it all the same.
MAX_DELAY_SECONDS = 0.5

#: Seconds a report the thread refused waits for the earlier ones before it is written on
#: the step (the thread never blocks on metric writes: only starved, it falls behind).
REFUSED_FLUSH_SECONDS = 5.0

#: Seconds the interpreter's exit waits for the queue to be written.
EXIT_FLUSH_SECONDS = 5.0

#: Seconds a fork waits for the threads to finish what they were handed (see
#: :func:`_quiet_before_fork`).
FORK_FLUSH_SECONDS = 1.0


class WriterThread:
    """Runs writing jobs in submission order on one daemon thread, started on first use.

    A job is ``fn(*args)`` writing ``count`` items (spans, or transfers' figures); ``count``
    is what the bound counts. ``what`` names them in the log.
    """

    def __init__(self, *, what: str = "KV transfer spans", max_queued: int = MAX_QUEUED_SPANS,
                 max_delay: float = MAX_DELAY_SECONDS, name: str = "omni-kv-spans") -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued!r}")
        if not max_delay > 0:
            raise ValueError(f"max_delay must be > 0, got {max_delay!r}")
        self.what = what
        self.max_queued = max_queued
        self.max_delay = max_delay
        self.name = name
        self._reset()

    def _reset(self) -> None:
        """Fresh state (at construction, and in a forked child, whose copy of the lock may be
        held by a thread that does not exist there)."""
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the thread waits here for jobs
        self._done = threading.Condition(self._lock)  # flush() waits here for the thread
        self._jobs: list[tuple[Callable[..., Any], tuple[Any, ...], int]] = []
        #: Whether the thread was kicked since it last took the queue.
        self._kicked = False
        #: time.monotonic() of the oldest job's submission (while there is one).
        self._oldest = 0.0
        #: Items submitted and not yet written (nor lost by a failing job).
        self._queued = 0
        #: Jobs submitted and not finished (those waiting, and those being run).
        self._unfinished = 0
        self._thread: threading.Thread | None = None
        #: Items refused at submission (the queue was full, or no thread), since start.
        self.dropped = 0
        self._drops = 0
        self._failures = 0
        #: Items written, and the thread's CPU time writing them (ns), since start.
        self.written = 0
        self.cpu_ns = 0

    # ------------------------------------------------------------------ the caller's side
    def submit(self, count: int, fn: Callable[..., Any], *args: Any) -> bool:
        """Queue a job writing ``count`` items, run at the next :meth:`kick` (or after
        ``max_delay``); False (and nothing queued) when the queue is full or no thread can
        be started (at interpreter shutdown, say). Cheap: the caller is the scheduler's
        step."""
        with self._lock:
            if self._thread is None and not self._start():
                why = "no thread to write them could be started"
            elif self._queued + count > self.max_queued:
                why = f"{self._queued} waiting to be written, at most {self.max_queued}"
            else:
                if not self._jobs:
                    self._oldest = time.monotonic()
                self._jobs.append((fn, args, count))
                self._queued += count
                self._unfinished += 1
                return True
            self.dropped += count
            self._drops += 1
            drops, dropped = self._drops, self.dropped
        if drops == 1 or drops % 1000 == 0:
            logger.warning("%s not written off the step: %s (%d refused so far)", self.what,
                           why, dropped)
        return False

    def kick(self) -> None:
        """Run what is queued now (the caller is about to wait, the GIL free). Nothing
        queued, or kicked already since the thread last took the queue (the observers
        sharing a thread each kick it): two attribute reads. (Read without the lock: while
        ``_kicked`` is set, the thread has yet to take the queue, and takes whatever is in
        it then, with the flag's reset, under the lock.)"""
        if self._jobs and not self._kicked:
            with self._lock:
                if self._jobs:  # (the delay's look may have taken them meanwhile)
                    self._kicked = True
                    self._work.notify()

    def flush(self, timeout: float | None = None) -> bool:
        """Run every job submitted so far and wait until they have run; False if
        ``timeout`` (seconds) passed first. From a job (on the thread itself) it returns at
        once."""
        if threading.current_thread() is self._thread:
            return not self._unfinished
        self.kick()
        with self._lock:
            return self._done.wait_for(lambda: not self._unfinished, timeout)

    # ------------------------------------------------------------------ the thread
    def _start(self) -> bool:
        """Under the lock (so the thread takes no job before ``_thread`` is set). False when
        no thread can be started (interpreter shutdown, the process's thread limit)."""
        thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        try:
            thread.start()
        except RuntimeError as exc:
            # Each refusal is counted and logged (rate-limited) by submit(); the cause once.
            if not self.dropped:
                logger.warning("cannot start the thread writing %s: %s", self.what, exc)
            return False
        self._thread = thread
        register_exit_flush()
        return True

    def _run(self) -> None:
        lock, work, done, max_delay = self._lock, self._work, self._done, self.max_delay
        while True:
            with lock:
                # Until kicked, or the oldest job has waited max_delay for a kick (with none
                # queued, a look every max_delay: a submission does not wake the thread).
                while not (self._kicked and self._jobs):
                    if not self._jobs:
                        work.wait(max_delay)
                        continue
                    left = self._oldest + max_delay - time.monotonic()
                    if left <= 0.0:
                        break
                    work.wait(left)
                jobs, self._jobs, self._kicked = self._jobs, [], False
            started = time.thread_time_ns()
            written = 0
            try:
                for fn, args, count in jobs:
                    try:
                        fn(*args)
                        written += count
                    except BaseException:  # those writes are lost, never the thread
                        self._failed()
            finally:  # whatever happens, flush() must not wait for these jobs forever
                cpu = time.thread_time_ns() - started
                with lock:
                    self._queued -= sum(count for _, _, count in jobs)
                    self._unfinished -= len(jobs)
                    self.written += written
                    self.cpu_ns += cpu
                    done.notify_all()

    def _failed(self) -> None:
        """A job raised (anything: an exporter's SystemExit too): its writes are lost."""
        self._failures += 1
        if self._failures == 1 or self._failures % 1000 == 0:
            try:
                logger.exception("writing %s failed (%d times so far); those writes are lost",
                                 self.what, self._failures)
            except BaseException:  # a failing log handler must not stop the thread either
                pass


class WritesOffStep:
    """For a ledger observer whose reports are written by a :class:`WriterThread` (mixed in
    before :class:`~omni_runtime.transfers.ledger.TransferObserver`): the thread is kicked
    when the engine waits for the forward pass, and the ledger's flush waits for it. With no
    thread (``_writer_thread`` None: an observer made by hand, in tests, say) the reports are
    written on the step, as they come."""

    _writer_thread: WriterThread | None = None

    def on_engine_wait(self, ledger: Any) -> None:
        if self._writer_thread is not None:
            self._writer_thread.kick()

    def flush(self, timeout: float | None = None) -> bool:
        return self._writer_thread is None or self._writer_thread.flush(timeout)

    def _write_in_order(self, ledger: Any, count: int, fn: Callable[..., Any],
                        *args: Any) -> None:
        """``fn(*args)``, a report's writes that must all land, in report order: on the
        thread while transfers are in flight; on the step, after the thread has written every
        earlier report (a later report written before an earlier one would leave its gauges
        and per-edge state behind), when none is (the ledger then reports at once, and an
        idle stage's figures must be exact by the time its last response is out: the engine
        steps no more, so no kick would come) or when the thread refuses (its queue full: it
        fell behind; or no thread)."""
        thread = self._writer_thread
        if thread is not None:
            if ledger.has_unresolved() and thread.submit(count, fn, *args):
                return
            if not thread.flush(REFUSED_FLUSH_SECONDS):
                logger.warning("%s: the writer thread is stuck; a report is written on the "
                               "step out of order", thread.what)
        fn(*args)


_spans = WriterThread(what="KV transfer spans", name="omni-kv-spans")
_metrics = WriterThread(what="KV transfer metrics", max_queued=MAX_QUEUED_METRICS,
                        name="omni-kv-metrics")


def span_thread() -> WriterThread:
    """The process's thread writing the transfer spans."""
    return _spans


def metrics_thread() -> WriterThread:
    """The process's thread writing the ledger-fed metric families."""
    return _metrics


def register_exit_flush() -> None:
    """(Re-)register the exit hook that writes the queues: as the last one so far, so that it
    runs before the exit hooks registered until now (they run last-registered first), those
    of the tracer providers the spans go to among them. Called when a thread starts and by
    each tracing observer once its provider exists (a second stage's private provider, made
    later, registers its own exit hook later). A forked child inherits the hook."""
    atexit.unregister(_flush_at_exit)
    atexit.register(_flush_at_exit)


def _flush_at_exit() -> None:
    for thread in (_metrics, _spans):
        if not thread.flush(EXIT_FLUSH_SECONDS):
            logger.warning("%s still unwritten after %.0f s at exit: left out", thread.what,
                           EXIT_FLUSH_SECONDS)


def _quiet_before_fork() -> None:
    """Let the threads finish what they hold before a fork (briefly): a thread forked in the
    middle of a write holds locks (prometheus_client's multiprocess lock, a family's) that
    the child, which has no such thread, would wait for for ever. (vLLM forks its workers
    before the scheduler exists; this covers a later fork.)"""
    for thread in (_metrics, _spans):
        thread.flush(FORK_FLUSH_SECONDS)


def _reset_in_child() -> None:
    _spans._reset()
    _metrics._reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_quiet_before_fork, after_in_child=_reset_in_child)
