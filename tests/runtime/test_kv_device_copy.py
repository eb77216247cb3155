"""The side-stream copier's orchestration (omni_runtime/kv/device_copy.py).

No GPU runs in this project's CI, so the CUDA API is a stand-in (``FakeCuda`` below: a
mock, because no real CUDA runtime can run here) that records the order of stream
operations and runs each enqueued copy at once on CPU tensors. What is checked is what the
connector relies on: the side stream starts behind the engine's stream, all reads of the
cache are enqueued before ``read_done``, the engine's stream waits for ``read_done`` (and
only it) at the end of the step, nothing on the engine's thread waits for the host copy,
and each transfer is shipped from the copier's own thread once its host copy is done (or
with the reason it failed). ``benchmarks/gpu_kv_copy.py`` runs the same class on a device.
"""

from __future__ import annotations

import threading

import pytest
import torch

from omni_runtime.kv.device_copy import SideStreamCopier


class FakeCuda:
    """Records stream operations as ("stream name", op, event id) in ``log``."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, int | None]] = []
        self.engine = self.Stream(name="engine", log=self.log)
        self.current = self.engine
        self.synchronized = threading.Event()
        self.release = threading.Event()  # lets host_done.synchronize() return
        self.release.set()
        fake = self

        class Event:
            count = 0

            def __init__(self) -> None:
                Event.count += 1
                self.id = Event.count

            def record(self, stream) -> None:
                fake.log.append((stream.name, "record", self.id))

            def synchronize(self) -> None:
                fake.log.append(("host", "synchronize", self.id))
                fake.release.wait(10)

        self.Event = Event

    class Stream:
        def __init__(self, device=None, name="side", log=None) -> None:
            self.name = name
            self.log = log

        def wait_event(self, event) -> None:
            self.log.append((self.name, "wait", event.id))

    def stream(self, stream):
        fake = self

        class Context:
            def __enter__(self):
                fake.previous, fake.current = fake.current, stream
                if stream.log is None:
                    stream.log = fake.log

            def __exit__(self, *exc):
                fake.current = fake.previous

        return Context()

    def current_stream(self, device=None):
        return self.current


class Job:
    def __init__(self, layers: int, fail_layer: int | None = None) -> None:
        self.cache = [torch.randn(2, 3, 4) for _ in range(layers)]
        self.staging = torch.empty(layers, 2, 3, 4)
        self.host = torch.zeros(layers, 2, 3, 4)
        self.fail_layer = fail_layer


@pytest.fixture
def copier_and_shipped():
    cuda = FakeCuda()
    shipped: list[tuple[Job, str | None, str]] = []
    done = threading.Semaphore(0)

    def ship(job, error):
        shipped.append((job, error, threading.current_thread().name))
        done.release()

    copier = SideStreamCopier("cuda:0", ship, cuda=cuda)
    yield copier, cuda, shipped, done
    copier.close()


def _gather_with(cuda):
    def gather(job, layer):
        assert cuda.current.name == "side", "reads of the cache run on the side stream"
        if layer == job.fail_layer:
            raise RuntimeError("index out of range")
        cuda.log.append(("side", f"gather {layer}", None))
        job.staging[layer].copy_(job.cache[layer])
    return gather


def test_the_step_enqueues_reads_behind_the_engine_and_the_engine_waits_only_for_them(
        copier_and_shipped):
    copier, cuda, shipped, done = copier_and_shipped
    cuda.release.clear()  # the host copies are "still running" until released
    jobs = [Job(2), Job(2)]
    copier.start(jobs, _gather_with(cuda), 2, staging=lambda j: j.staging, host=lambda j: j.host)
    copier.end_step()  # returns although no host copy has completed
    log = list(cuda.log)
    ready = log[0]
    assert ready[:2] == ("engine", "record")
    assert log[1] == ("side", "wait", ready[2])  # the side stream starts behind the engine
    read_done = next(e for e in log if e[1] == "record" and e[0] == "side")[2]
    i_read_done = log.index(("side", "record", read_done))
    assert [e[1] for e in log[2:i_read_done]] == ["gather 0", "gather 1"] * 2
    # The end of the step: the engine's stream waits (on the device) for the reads only.
    engine_waits = [e for e in log if e[:2] == ("engine", "wait")]
    assert engine_waits == [("engine", "wait", read_done)]
    assert shipped == []  # nothing ships before its host copy is done
    cuda.release.set()
    for _ in jobs:
        assert done.acquire(timeout=10)
    assert [(job, error) for job, error, _ in shipped] == [(jobs[0], None), (jobs[1], None)]
    assert {thread for _, _, thread in shipped} == {"omni-kv-d2h"}
    for job in jobs:
        torch.testing.assert_close(job.host, torch.stack(job.cache))


def test_a_transfer_whose_gather_fails_ships_with_the_reason_and_the_others_still_copy(
        copier_and_shipped):
    copier, cuda, shipped, done = copier_and_shipped
    bad, good = Job(3, fail_layer=1), Job(3)
    copier.start([bad, good], _gather_with(cuda), 3, staging=lambda j: j.staging,
                 host=lambda j: j.host)
    copier.end_step()
    for _ in range(2):
        assert done.acquire(timeout=10)
    errors = {id(job): error for job, error, _ in shipped}
    assert errors[id(bad)] == "extraction failed: RuntimeError: index out of range"
    assert errors[id(good)] is None
    torch.testing.assert_close(good.host, torch.stack(good.cache))
    # The failed transfer's (partial) staging buffer is never copied to host.
    assert torch.count_nonzero(bad.host) == 0


def test_a_device_fault_on_the_host_copy_fails_that_transfer_with_the_reason(copier_and_shipped):
    copier, cuda, shipped, done = copier_and_shipped

    def failing_synchronize(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    cuda.Event.synchronize = failing_synchronize
    job = Job(1)
    copier.start([job], _gather_with(cuda), 1, staging=lambda j: j.staging, host=lambda j: j.host)
    copier.end_step()
    assert done.acquire(timeout=10)
    ((_, error, _),) = shipped
    assert error == ("device copy failed: RuntimeError: CUDA error: an illegal memory access "
                     "was encountered")


def test_end_step_without_a_started_step_enqueues_nothing(copier_and_shipped):
    copier, cuda, shipped, _ = copier_and_shipped
    copier.end_step()
    assert cuda.log == [] and shipped == []
