"""A thread that copies a step's transfers out of the KV cache on the transport's CPUs, while
the engine's forward runs on its own.

Why this is exact: a transfer handed off in step N covers tokens ``[0, seq_len)``, whose KV
was written in earlier steps (every trigger fires in ``update_from_output``, after the step
that computed the KV; the hand-off goes out in the next step's metadata), and step N's
forward writes only later positions of the running request (its blocks are the request's
own; a held or pinned transfer's blocks are not written at all). So the copy may read
during the whole of step N, concurrently with the forward; the connector waits for it in
``wait_for_save``, so the worker still reads a transfer's blocks only during the step that
hands it off (the block guarantee's worker half).

Used only when the transport's CPUs are disjoint from the engine's OpenMP CPUs: on a shared
core the copy is cheaper inline (``save_kv_layer``) than as a thread the OpenMP barriers
would wait for.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import threading
from collections.abc import Callable, Collection

logger = logging.getLogger(__name__)


class BlockCopier:
    """Runs one batch of copies at a time: :meth:`start` then :meth:`wait`."""

    def __init__(self, cpus: Collection[int], name: str = "omni-kv-copy") -> None:
        self.cpus = sorted(cpus)
        self._work: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._done = threading.Event()
        self._done.set()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def start(self, batch: Callable[[], None]) -> None:
        if not self._done.is_set():
            raise RuntimeError("BlockCopier.start: the previous batch was not waited for")
        self._error = None
        self._done.clear()
        self._work.put(batch)

    def wait(self) -> BaseException | None:
        """Blocks until the batch has run; the exception it raised, if any."""
        self._done.wait()
        return self._error

    def close(self) -> None:
        self._work.put(None)
        self._thread.join(5)

    def _run(self) -> None:
        try:
            os.sched_setaffinity(0, self.cpus)  # this thread only (Linux)
        except (OSError, AttributeError) as exc:
            logger.warning("KV copier: cannot bind to CPUs %s: %s", self.cpus, exc)
        _one_openmp_thread()
        while True:
            batch = self._work.get()
            if batch is None:
                return
            try:
                batch()
            except BaseException as exc:  # reported to the waiting step, per transfer
                self._error = exc
            finally:
                self._done.set()


def _one_openmp_thread() -> None:
    """This thread's torch ops run on this thread only: an OpenMP team started from here would
    be bound to the engine's places (OMP_PROC_BIND). ``omp_set_num_threads`` sets the calling
    thread's ICV only; torch.set_num_threads would change the engine's too."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libgomp" in line or "libiomp" in line}
        for path in paths:
            ctypes.CDLL(path).omp_set_num_threads(1)
    except (OSError, AttributeError) as exc:
        logger.debug("KV copier: cannot limit its OpenMP threads: %s", exc)
