"""Span writing off the scheduler's step: one daemon thread per process writes the spans.

The scheduler's step is on every request's critical path (the next forward pass waits for
it), and writing a transfer's span (its ids, sampling, the SDK's span object, the span
processors' ``on_end``) is most of what tracing costs there. Nothing about a span needs the
step: a resolved transfer is final (the ledger never changes it again), so its span built
later, on another thread, is the same span. The step only hands the report's resolved
transfers over (a list append); this thread builds and writes them while the engine core
waits for the forward pass, the GIL free then. The CPU is spent either way: this moves it
off the step's latency, as the SDK's batch span processor moves the export.

When the thread runs matters under the GIL: a thread woken while the step runs would get
the GIL within the interpreter's switch interval (5 ms) and run its jobs inside the step. So
a submission does not wake it; :meth:`SpanWorker.kick` does, which the scheduler calls once
it has handed its step to the model runner (``TransferLedger.engine_waits``: the engine
waits for the forward pass next). Jobs nobody kicks (a ledger driven outside a scheduler)
are written once the oldest has waited ``max_delay`` seconds for a kick.

Guarantees:
  * **Bounded**: at most ``max_queued`` spans wait (a thread stalled behind a synchronous
    exporter, say); past that, a report's spans are dropped and counted, as the SDK's batch
    processor drops spans past its queue (logged on the first drop and every 1000th).
  * **Flushed**: :meth:`SpanWorker.flush` waits until everything submitted so far is written;
    the scheduler's shutdown calls it (through ``TransferLedger.flush``), and so does the
    interpreter's exit, before the SDK's tracer providers shut down (see
    :func:`register_exit_flush`).
  * **Isolated**: a job that raises (anything, ``SystemExit`` included) loses its spans
    (logged on the first failure and every 1000th), never the thread nor the other jobs.
    A thread that cannot be started (at interpreter shutdown) drops the spans, counted.
  * **Fork-safe**: a forked child starts with an empty queue and starts its own thread on
    first use (the parent's queued spans are the parent's to write).
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

#: Seconds a job may wait for a kick: the thread looks at its queue this often.
MAX_DELAY_SECONDS = 0.5

#: Seconds the interpreter's exit waits for the queue to be written.
EXIT_FLUSH_SECONDS = 5.0


class SpanWorker:
    """Runs span-writing jobs in submission order on one daemon thread, started on first use.

    A job is ``fn(*args)`` writing ``count`` spans; ``count`` is what the bound counts.
    """

    def __init__(self, *, max_queued: int = MAX_QUEUED_SPANS,
                 max_delay: float = MAX_DELAY_SECONDS, name: str = "omni-kv-spans") -> None:
        if max_queued < 1:
            raise ValueError(f"max_queued must be >= 1, got {max_queued!r}")
        if not max_delay > 0:
            raise ValueError(f"max_delay must be > 0, got {max_delay!r}")
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
        #: Spans submitted and not yet written (nor dropped by a failing job).
        self._queued = 0
        #: Jobs submitted and not finished (those waiting, and those being run).
        self._unfinished = 0
        self._thread: threading.Thread | None = None
        #: Spans dropped at submission (the queue was full), since start.
        self.dropped = 0
        self._drops = 0
        self._failures = 0
        #: Spans written, and the thread's CPU time writing them (ns), since start.
        self.written = 0
        self.cpu_ns = 0

    # ------------------------------------------------------------------ the caller's side
    def submit(self, count: int, fn: Callable[..., Any], *args: Any) -> bool:
        """Queue a job writing ``count`` spans, run at the next :meth:`kick` (or within
        ``max_delay``); False (and nothing queued) when the queue is full or no thread can
        be started (at interpreter shutdown, say). Cheap: the caller is the scheduler's
        step."""
        with self._lock:
            if self._thread is None and not self._start():
                why = "no thread to write them could be started"
            elif self._queued + count > self.max_queued:
                why = f"{self._queued} spans waiting to be written, at most {self.max_queued}"
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
            logger.warning("KV transfer spans dropped: %s (%d spans dropped so far)", why,
                           dropped)
        return False

    def kick(self) -> None:
        """Run what is queued now (the caller is about to wait, the GIL free). Nothing
        queued: one attribute read."""
        if self._jobs:
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
        except RuntimeError:
            logger.exception("cannot start the KV transfer span thread")
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
                    except BaseException:  # those spans are lost, never the thread
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
        """A job raised (anything: an exporter's SystemExit too): its spans are lost."""
        self._failures += 1
        if self._failures == 1 or self._failures % 1000 == 0:
            try:
                logger.exception("writing KV transfer spans failed (%d times so far); those "
                                 "spans are lost", self._failures)
            except BaseException:  # a failing log handler must not stop the thread either
                pass


_worker = SpanWorker()


def span_worker() -> SpanWorker:
    """The process's span worker."""
    return _worker


def register_exit_flush() -> None:
    """(Re-)register the exit hook that writes the queue: as the last one so far, so that it
    runs before the exit hooks registered until now (they run last-registered first), those
    of the tracer providers the spans go to among them. Called when the thread starts and by
    each tracing observer once its provider exists (a second stage's private provider, made
    later, registers its own exit hook later). A forked child inherits the hook."""
    atexit.unregister(_flush_at_exit)
    atexit.register(_flush_at_exit)


def _flush_at_exit() -> None:
    if not _worker.flush(EXIT_FLUSH_SECONDS):
        logger.warning("KV transfer spans still unwritten after %.0f s at exit: left out",
                       EXIT_FLUSH_SECONDS)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _worker._reset())
