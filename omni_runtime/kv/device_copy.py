"""Copying a step's transfers out of a GPU KV cache on a side CUDA stream, so that the engine's
stream never waits for a device-to-host copy.

Per step, for the transfers its connector metadata hands off:

1. :meth:`SideStreamCopier.start` (``bind_connector_metadata``, the start of step N, on the
   engine's thread): an event is recorded on the engine's stream behind all the work
   enqueued so far (with async scheduling, step N-1's forward may still be running on the
   device); the side stream waits for it, gathers each transfer's blocks, layer by layer,
   into the transfer's device staging buffer (device-to-device: one ``index_select`` per
   layer), records ``read_done``, then copies each staging buffer to the transfer's pinned
   host buffer (``non_blocking``) and records the transfer's ``host_done``. One event at the
   start of the step orders every read after every write it needs: a transfer handed off in
   step N covers tokens ``[0, seq_len)``, whose KV earlier steps wrote, and step N's forward
   writes only later positions (kv/copier.py states the same invariant for the CPU copier).
2. :meth:`SideStreamCopier.end_step` (``wait_for_save``): the engine's stream waits for
   ``read_done``, an event wait on the device (the host does not block). Once step N has
   run, the scheduler may give the blocks to another request, whose KV writes step N+1
   enqueues on the engine's stream, so after the reads: the block guarantee's worker half.
   The gathers are device-to-device (117 MB at HBM bandwidth: well under a millisecond,
   computed, not measured here), so done long before the forward ends; the device-to-host
   copies after them read only the staging buffers, which no step writes, so the engine's
   stream never waits for them.
3. A shipping thread waits for each transfer's ``host_done`` (``Event.synchronize``, off the
   engine's thread) and hands the transfer on (the connector ships its host buffer).

The CUDA API is a parameter (``cuda``, default ``torch.cuda``) only so that the orchestration
can be tested on a CPU-only machine with a stand-in; ``benchmarks/gpu_kv_copy.py`` runs this
class on a real device.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

logger = logging.getLogger(__name__)


class SideStreamCopier:
    """``start`` a step's copies, ``end_step`` at its end; ``ship(job, error)`` is called
    from the shipping thread once each job's host buffer holds its KV (or with the reason it
    does not)."""

    def __init__(self, device: Any, ship: Callable[[Any, str | None], None], *,
                 cuda: Any = None, name: str = "omni-kv-d2h") -> None:
        if cuda is None:
            import torch

            cuda = torch.cuda
        self._cuda = cuda
        self.device = device
        self.stream = cuda.Stream(device=device)
        self._ship = ship
        self._read_done: Any = None
        self._shipping: queue.SimpleQueue[tuple[Any, Any, str | None] | None] = (
            queue.SimpleQueue())
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def start(self, jobs: Sequence[Any], gather: Callable[[Any, int], None], layers: int,
              staging: Callable[[Any], Any], host: Callable[[Any], Any]) -> None:
        """Enqueue the step's copies on the side stream: ``gather(job, layer)`` fills
        ``staging(job)`` (a device tensor) with one layer; ``host(job)`` is the pinned host
        tensor it is copied to."""
        cuda = self._cuda
        ready = cuda.Event()
        ready.record(cuda.current_stream(self.device))  # behind everything enqueued so far
        errors: dict[int, str] = {}
        with cuda.stream(self.stream):
            self.stream.wait_event(ready)
            for job in jobs:
                try:
                    for layer in range(layers):
                        gather(job, layer)
                except Exception as exc:  # enqueue-time failure: that transfer fails
                    errors[id(job)] = f"extraction failed: {type(exc).__name__}: {exc}"
            read_done = cuda.Event()
            read_done.record(self.stream)
            for job in jobs:
                if id(job) not in errors:
                    try:
                        host(job).copy_(staging(job), non_blocking=True)
                    except Exception as exc:
                        errors[id(job)] = f"extraction failed: {type(exc).__name__}: {exc}"
                done = cuda.Event()
                done.record(self.stream)
                self._shipping.put((job, done, errors.get(id(job))))
        self._read_done = read_done

    def end_step(self) -> None:
        """The engine's stream waits (on the device) for this step's reads of the cache."""
        if self._read_done is not None:
            self._cuda.current_stream(self.device).wait_event(self._read_done)
            self._read_done = None

    def close(self) -> None:
        self._shipping.put(None)
        self._thread.join(5)

    def _run(self) -> None:
        while True:
            item = self._shipping.get()
            if item is None:
                return
            job, done, error = item
            if error is None:
                try:
                    done.synchronize()
                except Exception as exc:  # a device fault: that transfer fails, say why
                    error = f"device copy failed: {type(exc).__name__}: {exc}"
            try:
                self._ship(job, error)
            except Exception:  # pragma: no cover - keep shipping the others
                logger.exception("KV side-stream copier: shipping a transfer failed")
