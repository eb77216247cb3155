"""The observers' writer threads (observability/writer_thread.py): jobs run when kicked (or
after their delay), in order, bounded, isolated from each other, flushed on demand, at exit
and after a fork; and the scheduler kicks them once per step, after handing the step to the
runner."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from omni_runtime.devtools.sched_harness import make_scheduler, make_vllm_config, step
from omni_runtime.observability.writer_thread import WriterThread, metrics_thread, span_thread
from omni_runtime.sched.scheduler import OmniARScheduler
from omni_runtime.transfers.ledger import Batch, Outcome, TransferLedger, TransferObserver, Trigger

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: Long enough that no job of these tests runs by its delay unless the test waits for it.
NEVER = 3600.0


def test_a_job_waits_for_the_kick_and_jobs_run_in_order():
    worker = WriterThread(max_delay=NEVER)
    ran: list[int] = []
    done = threading.Event()
    for i in range(3):
        assert worker.submit(1, ran.append, i)
    assert worker.submit(1, done.set)
    # Not woken by a submission (the step it came from is still running): a fifth of a
    # second is ample for a woken thread to run four list appends.
    assert not done.wait(timeout=0.2) and ran == []
    worker.kick()  # not flush(): the kick alone runs them
    assert done.wait(timeout=10)
    assert ran == [0, 1, 2]
    assert worker.flush(timeout=10) and worker.written == 4 and worker.cpu_ns >= 0


def test_kicks_before_the_thread_takes_the_queue_wake_it_once():
    """The observers sharing a thread each kick it once per step: a kick while an earlier one
    has not been answered (the thread busy with the jobs before) wakes it no more; one after
    it took the queue does."""
    worker = WriterThread(max_delay=NEVER)
    busy, release = threading.Event(), threading.Event()
    worker.submit(1, lambda: (busy.set(), release.wait()))
    worker.kick()
    assert busy.wait(timeout=10)  # the thread is inside the first job, the queue empty
    notified = []
    notify = worker._work.notify
    worker._work.notify = lambda *args: (notified.append(1), notify(*args))
    ran = threading.Event()
    assert worker.submit(1, ran.set)
    worker.kick()
    worker.kick()
    assert notified == [1], "one wake-up for the queue"
    release.set()
    assert ran.wait(timeout=10) and worker.flush(timeout=10)
    assert worker.submit(1, lambda: None)
    worker.kick()
    assert notified == [1, 1] and worker.flush(timeout=10)


def test_a_job_nobody_kicks_runs_after_its_delay():
    worker = WriterThread(max_delay=0.05)
    done = threading.Event()
    worker.submit(1, done.set)
    assert done.wait(timeout=10)


def test_flush_runs_the_queue_and_times_out_on_a_stuck_job():
    worker = WriterThread(max_delay=NEVER)
    release = threading.Event()
    worker.submit(1, release.wait)
    assert not worker.flush(timeout=0.05)  # the job is stuck (an exporter that hangs, say)
    release.set()
    assert worker.flush(timeout=10)


def test_past_the_bound_a_report_is_dropped_counted_and_logged(caplog):
    worker = WriterThread(max_queued=3, max_delay=NEVER)
    release = threading.Event()
    ran: list[str] = []
    assert worker.submit(2, lambda: (release.wait(), ran.append("a")))
    with caplog.at_level(logging.WARNING, logger="omni_runtime.observability.writer_thread"):
        assert not worker.submit(2, ran.append, "b")  # 2 + 2 > 3: dropped whole
    assert worker.dropped == 2
    assert "KV transfer spans not written off the step" in caplog.text
    assert "at most 3" in caplog.text
    assert worker.submit(1, ran.append, "c")  # within the bound
    release.set()
    assert worker.flush(timeout=10)
    assert ran == ["a", "c"]
    assert worker.submit(3, ran.append, "d") and worker.flush(timeout=10)  # room again


def test_a_job_raising_systemexit_loses_its_spans_not_the_thread(caplog):
    worker = WriterThread(max_delay=NEVER)
    ran: list[str] = []

    def exits() -> None:
        raise SystemExit(3)  # an exporter that calls sys.exit

    with caplog.at_level(logging.ERROR, logger="omni_runtime.observability.writer_thread"):
        worker.submit(1, exits)
        worker.submit(1, ran.append, "after")
        assert worker.flush(timeout=10)
    assert ran == ["after"] and worker._thread.is_alive()
    assert worker.submit(1, ran.append, "again") and worker.flush(timeout=10)
    assert ran == ["after", "again"]


def test_without_a_thread_the_spans_are_dropped_and_counted(monkeypatch, caplog):
    worker = WriterThread(max_delay=NEVER)

    def refuse(self):
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    with caplog.at_level(logging.WARNING, logger="omni_runtime.observability.writer_thread"):
        assert not worker.submit(4, lambda: None)
        assert not worker.submit(2, lambda: None)  # (a shutdown refuses every report)
    assert worker.dropped == 6 and "no thread to write them" in caplog.text
    assert caplog.text.count("interpreter shutdown") == 1  # the cause, once
    assert caplog.text.count("not written off the step") == 1  # the first (then every 1000th)
    assert worker.flush(timeout=1)  # nothing waits for a job that was never queued
    monkeypatch.undo()
    ran: list[str] = []
    assert worker.submit(1, ran.append, "later") and worker.flush(timeout=10)
    assert ran == ["later"]


def test_a_failing_job_loses_its_spans_only(caplog):
    worker = WriterThread(max_delay=NEVER)
    ran: list[str] = []

    def fails() -> None:
        raise RuntimeError("exporter exploded")

    with caplog.at_level(logging.ERROR, logger="omni_runtime.observability.writer_thread"):
        worker.submit(5, fails)
        worker.submit(2, ran.append, "after")
        assert worker.flush(timeout=10)
    assert ran == ["after"] and worker.written == 2
    assert "writing KV transfer spans failed (1 times so far)" in caplog.text
    assert "exporter exploded" in caplog.text
    assert worker.submit(1, ran.append, "again") and worker.flush(timeout=10)


def test_flush_from_a_job_does_not_wait_for_itself():
    worker = WriterThread(max_delay=NEVER)
    answers: list[bool] = []
    worker.submit(1, lambda: answers.append(worker.flush(timeout=10)))
    assert worker.flush(timeout=10)
    assert answers == [False]  # itself unfinished, and no deadlock


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_queued"):
        WriterThread(max_queued=0)
    with pytest.raises(ValueError, match="max_delay"):
        WriterThread(max_delay=0)


@pytest.mark.parametrize("thread", [span_thread, metrics_thread])
def test_a_forked_child_runs_its_own_thread(thread):
    worker = thread()  # the process's, which the module resets in a forked child
    assert worker.submit(1, lambda: None) and worker.flush(timeout=10)  # the parent's runs
    pid = os.fork()
    if pid == 0:  # child: the parent's thread does not exist here; a new one on first use
        code = 1
        try:
            done = threading.Event()
            if worker.submit(1, done.set) and worker.flush(timeout=10) and done.is_set():
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert worker.submit(1, lambda: None) and worker.flush(timeout=10)  # the parent's still runs


#: For the subprocesses below: a span exporter printing each span's name (or the label it
#: was given) and request id, as it exports them.
_PRINTING = textwrap.dedent("""
    from opentelemetry.sdk.trace.export import SpanExportResult

    class Printing:
        def __init__(self, label=None):
            self.label = label
        def export(self, spans):
            for span in spans:
                print(self.label or span.name, span.attributes["gen_ai.request.id"], flush=True)
            return SpanExportResult.SUCCESS
        def shutdown(self):
            pass
        def force_flush(self, timeout_millis=0):
            return True
""")

_EXIT = _PRINTING + textwrap.dedent("""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from omni_runtime.observability.observers import build_observers
    from omni_runtime.transfers.ledger import Outcome, TransferLedger, Trigger

    # As vLLM's init_tracer in the engine core: a global provider, a batch processor.
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Printing()))
    trace.set_tracer_provider(provider)
    ledger = TransferLedger(5, observers=build_observers(
        stage="ar", model_name="tiny", timeout_seconds=5))
    for i in range(50):
        ledger.mark(f"r{i}", Trigger.PREFILL_FINISHED, 8, [0])
        ledger.resolve(f"r{i}", Outcome.ACKED)
    # No flush, no kick: the interpreter's exit writes them before the provider shuts down.
""")


def test_spans_handed_over_are_written_at_exit_before_the_provider_shuts_down():
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", _EXIT], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.split()) == sorted(
        w for i in range(50) for w in ("omni.kv_transfer", f"r{i}"))


_METRICS_AT_EXIT = textwrap.dedent("""
    import sys
    from omni_runtime.observability.writer_thread import metrics_thread, span_thread

    def write(what, i):
        print(what, i)
        sys.stdout.flush()

    for thread, what in ((metrics_thread(), "metrics"), (span_thread(), "spans")):
        for i in range(3):
            thread.submit(1, write, what, i)  # never kicked, nor flushed
""")


def test_both_threads_write_what_they_hold_at_exit():
    out = subprocess.run([sys.executable, "-c", _METRICS_AT_EXIT], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == sorted(
        f"{what} {i}" for what in ("metrics", "spans") for i in range(3))


_TWO_PROVIDERS = _PRINTING + textwrap.dedent("""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from omni_runtime.observability.tracing import TransferTracing
    from omni_runtime.transfers.ledger import Outcome, TransferLedger, Trigger

    def stage(name):  # as a private provider per stage: made when its scheduler starts
        provider = TracerProvider()  # registers its own shutdown at exit
        provider.add_span_processor(BatchSpanProcessor(Printing(name)))
        tracing = TransferTracing(provider.get_tracer("t"), stage=name, model_name="m")
        return TransferLedger(5, observers=[tracing])

    a = stage("A")
    a.mark("a1", Trigger.PREFILL_FINISHED, 8, [0])
    a.resolve("a1", Outcome.ACKED)
    assert a.flush(timeout=10)  # the span thread has started
    b = stage("B")  # its provider made after the thread started
    b.mark("b1", Trigger.PREFILL_FINISHED, 8, [0])
    b.resolve("b1", Outcome.ACKED)  # no flush: written at exit, before B's provider shuts down
""")


def test_a_provider_made_after_the_thread_started_still_gets_its_spans_at_exit():
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", _TWO_PROVIDERS], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["A a1", "B b1"]


class Waits(TransferObserver):
    def __init__(self) -> None:
        self.waits = 0

    def on_engine_wait(self, ledger: TransferLedger) -> None:
        self.waits += 1


def test_the_scheduler_tells_the_observers_once_per_step_after_scheduling():
    sched = make_scheduler(OmniARScheduler, make_vllm_config(
        {"need_send_cache": True, "kv_transfer_criteria": {"type": "prefill_finished"}}))
    sched.transfer_ledger.add_observer(waits := Waits())
    seen = []
    schedule = sched.schedule

    def scheduled():  # the waits counted when schedule() returns
        output = schedule()
        seen.append(waits.waits)
        return output

    sched.schedule = scheduled
    for _ in range(3):
        step(sched)
    assert seen == [1, 2, 3]


def test_the_tracing_observer_kicks_its_span_thread_when_the_engine_waits():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult

    from omni_runtime.observability.tracing import TransferTracing

    exported = threading.Event()

    class Signalling:
        def export(self, spans):
            exported.set()
            return SpanExportResult.SUCCESS

        def shutdown(self):
            pass

    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(Signalling()))
    tracing = TransferTracing(provider.get_tracer("t"), stage="ar", model_name="m",
                              writer_thread=WriterThread(max_delay=NEVER))
    ledger = TransferLedger(5, observers=[tracing])
    ledger.mark("busy", Trigger.PREFILL_FINISHED, 8, [1])  # still in flight throughout
    ledger.mark("a", Trigger.PREFILL_FINISHED, 8, [0])
    ledger.resolve("a", Outcome.ACKED)  # reported: handed to the thread, not written yet
    assert not exported.wait(timeout=0.2)
    ledger.engine_waits()  # the scheduler's step went to the runner: no flush needed
    assert exported.wait(timeout=10)
    exported.clear()
    ledger.resolve("busy", Outcome.ACKED)  # the last in flight: the engine may step no more,
    assert exported.wait(timeout=10)  # so handed over and kicked at once
    provider.shutdown()


def test_only_observers_with_their_own_hook_are_asked():
    ledger = TransferLedger(5, observers=[TransferObserver(), waits := Waits()])
    assert ledger._waiting == [waits]
    ledger.engine_waits()
    assert waits.waits == 1
    ledger.remove_observers()
    ledger.engine_waits()
    assert waits.waits == 1


class BatchedWaits(Waits):
    batched = True

    def __init__(self) -> None:
        super().__init__()
        self.reports = 0

    def on_batch(self, ledger: TransferLedger, batch: Batch) -> None:
        self.reports += 1


def test_a_batched_observer_hears_the_engine_wait_only_after_a_report():
    """It is given work only in reports: at a wait with no report since the last, it has
    nothing to start, and is not called (most steps at a telemetry interval make none)."""
    clock = [0.0]
    batched, per_change = BatchedWaits(), Waits()
    ledger = TransferLedger(60, clock=lambda: clock[0], report_interval=1.0,
                            observers=[batched, per_change])
    ledger.engine_waits()  # nothing reported yet
    assert (batched.reports, batched.waits, per_change.waits) == (0, 0, 1)
    ledger.mark("busy", Trigger.PREFILL_FINISHED, 8, [1])  # reported (the first is due)
    ledger.engine_waits()
    ledger.engine_waits()  # no report since the last wait
    assert (batched.reports, batched.waits, per_change.waits) == (1, 1, 3)
    clock[0] = 0.5
    ledger.mark("a", Trigger.PREFILL_FINISHED, 8, [0])  # within the interval: not reported
    ledger.engine_waits()
    assert (batched.reports, batched.waits) == (1, 1)
    clock[0] = 1.5
    ledger.resolve("a", Outcome.ACKED)  # the interval passed: both changes reported
    assert batched.reports == 2
    ledger.engine_waits()
    assert (batched.waits, per_change.waits) == (2, 5)
    clock[0] = 1.6
    ledger.mark("b", Trigger.PREFILL_FINISHED, 8, [2])  # not due, but a report is asked for:
    ledger.report()  # one outside the step counts too
    assert batched.reports == 3
    ledger.engine_waits()
    assert (batched.waits, per_change.waits) == (3, 6)
    ledger.remove_observers()
    ledger.engine_waits()
    assert (batched.waits, per_change.waits) == (3, 6)
