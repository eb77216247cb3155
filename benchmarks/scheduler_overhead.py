"""One scheduler step (schedule + update_from_output) of OmniARScheduler against vLLM's stock
Scheduler, on the same synthetic decode workload, side by side in one run.

Workload: N running requests decoding (no model: hand-made runner outputs, as vLLM's own
scheduler tests do). Ours runs with the special_token criteria, the costlier trigger (it
looks at every request's new tokens each step); 10% of the requests sample the sentinel
during the measured window, so their transfers are marked, handed off and acked while the
others are scanned. Observers (metrics, tracing) are detached here: their cost is measured
by benchmarks/instrumentation_overhead.py.

The two schedulers step in lock step (stock, then ours), so that machine noise hits both
alike; the reported ratio per size is the median of the per-step ratios (robust to bursts of
load from elsewhere on a shared 2-core machine), next to the ratio of the best total times.

Churn workload (``churn_ratio_N``): what a serving engine's steady state looks like. N requests
run; each lives ``CHURN_LIFE`` output tokens (their ends staggered), so about N/50 finish per
step (5 at 256, 20 at 1024) and as many arrive, prefill in one step, start a
``prefill_finished`` transfer, hand it off in the next step's ``schedule()`` and have it acked in
the output of the step after (one step later), then decode and finish. Ours runs with the
observers a stage runs (metrics in prometheus_client's multiprocess mode, as in the
engine-core process; tracing on a global SDK tracer provider with a batch span processor, as
vLLM installs it; the per-edge families of its one downstream stage), told of the changes
at the stage's default telemetry interval (``--telemetry-interval 0``: every step). The
median of the per-step ratios leaves out the steps that write the interval's figures and
spans; ``churn_ratio_best_totals_N`` (total time over total time) counts them. The two
schedulers step in lock step as in the steady workload (S O S O: stock, then ours, each pair
at the same point of the workload), so that each scheduler's step always follows the other's:
both find the caches as the other left them (the writer threads run in ours' gaps only, see
``forward_pass``). ``churn_ratio_balanced_N`` is the median over each two
consecutive pairs of ours' time over stock's. ``--churn-order alternate`` swaps which steps
first in every other pair instead (S O | O S | S O): each then follows itself in half of its
steps, finding its own data still in the caches, and the other in the rest, which splits the
per-step ratios in two clusters (measured: ours first about 0.99, stock first about 1.07 at
256) whose median, between them, moves by several per cent from run to run; the balanced
median (one pair of each order) cancels that. Arrivals
(``add_request``), ``schedule()`` and ``update_from_output()`` are timed; the runner's outputs
are built outside the timed span, the same for both schedulers (plus the acks for ours), and
there, where a GPU stage waits for the forward pass, the observers' writer threads finish
what the reports handed them (their CPU per transfer is printed apart,
``churn_writer_threads_us_per_transfer_N``).
By default both schedulers run without vLLM's stats
(``log_stats`` off, as with ``--disable-log-stats``; the omni connector then records none
either); ``--log-stats`` turns them on in both schedulers of both workloads, as a served
engine (``vllm serve``, ``omni-stage``) makes them. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SENTINEL = 9
TRANSFER_FRACTION = 0.10
#: Churn: prompt tokens of each arrival, and its output tokens (its life in steps).
CHURN_PROMPT = 32
CHURN_LIFE = 50
#: Steps before the measured window: the first cohort prefills at once, and its burst of
#: transfers is marked, handed off and acked within three steps; its staggered ends already
#: run at the steady rate (N/50 per step) from the first step on.
CHURN_WARMUP = 10
CHURN_TARGET = 1.03
STEADY_TARGET = 1.02


class DroppingExporter:
    """A span exporter to nowhere: what is measured is our cost and the SDK's, not a network's."""

    def export(self, spans):  # noqa: ANN001
        from opentelemetry.sdk.trace.export import SpanExportResult

        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 0) -> bool:
        return True


_provider = None


def production_observability():
    """The observers' setting of a stage's engine-core process: prometheus_client in
    multiprocess mode (chosen before anything imports it) and a global SDK tracer provider
    with a batch span processor (what vLLM installs with ``--otlp-traces-endpoint``),
    exporting to nowhere. Idempotent; returns the provider."""
    global _provider
    if _provider is not None:
        return _provider
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        assert "prometheus_client" not in sys.modules, "multiprocess mode must come first"
        directory = tempfile.TemporaryDirectory(prefix="omni-bench-prom-")
        production_observability.directory = directory  # kept alive with the process
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory.name
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        del os.environ[name]
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from prometheus_client import values

    assert values.ValueClass.__name__ == "MmapedValue", "not in multiprocess mode"
    _provider = TracerProvider()
    _provider.add_span_processor(BatchSpanProcessor(DroppingExporter()))
    trace.set_tracer_provider(_provider)
    return _provider


def build(cls, n: int, kv_config, *, keep_observers: bool = False, log_stats: bool = False):
    from omni_runtime.devtools.sched_harness import make_request, make_scheduler, make_vllm_config, step

    sched = make_scheduler(
        cls,
        make_vllm_config(
            kv_config, max_num_seqs=n, max_num_batched_tokens=max(8192, 40 * n), num_blocks=n * 8 + 16
        ),
        log_stats=log_stats,
    )
    if not keep_observers and hasattr(sched, "transfer_ledger"):
        sched.transfer_ledger.remove_observers()
    for i in range(n):
        sched.add_request(make_request(32, max_tokens=100_000, request_id=f"r{i}"))
    step(sched)  # prefill everything (not measured)
    return sched


def decode_plan(n: int, steps: int):
    """Per step, the requests that sample the sentinel: every 10th request, spread over the
    window."""
    carriers = [f"r{i}" for i in range(0, n, int(1 / TRANSFER_FRACTION))]
    plan: list[list[str]] = [[] for _ in range(steps)]
    for k, rid in enumerate(carriers):
        plan[k % steps].append(rid)
    return plan


def forward_pass(runner_output, writes: bool = True):
    """What a GPU stage's engine core does between ``schedule()`` and
    ``update_from_output()``: waits for the forward pass, the GIL free, and the observers'
    writer threads write what the reports handed them meanwhile
    (observability/writer_thread.py). Here there is no forward pass: the runner's outputs are
    built, and the threads are let finish, outside the timed span. Their CPU is counted apart
    (``churn_writer_threads_us_per_transfer_N``). ``writes``: whether the stepping scheduler
    has observers; the threads are the process's, so a scheduler without (stock) leaves ours'
    writes to ours' own gap instead of running them between its two timed halves."""
    from omni_runtime.observability.writer_thread import metrics_thread, span_thread

    outputs = runner_output()
    if writes:
        metrics_thread().flush()
        span_thread().flush()
    return outputs


def timed_step(sched, sentinel_for, acked):
    """One step; returns (nanoseconds in the scheduler, (id, attempt) of each hand-off)."""
    from omni_runtime.devtools.sched_harness import handed_off, runner_output

    t0 = time.perf_counter_ns()
    so = sched.schedule()
    t1 = time.perf_counter_ns()
    mro = forward_pass(lambda: runner_output(so, {rid: [SENTINEL] for rid in sentinel_for},
                                             acked=acked))
    t2 = time.perf_counter_ns()
    sched.update_from_output(so, mro)
    t3 = time.perf_counter_ns()
    # The hand-offs in the step's connector metadata, as the (request id, attempt) the
    # workers answer.
    handed = [(rid, info.attempt) for rid, info in handed_off(so).items()]
    return (t1 - t0) + (t3 - t2), handed


def measure(n: int, steps: int, repeats: int, log_stats: bool = False) -> dict:
    from vllm.v1.core.sched.scheduler import Scheduler

    from omni_runtime.sched.scheduler import OmniARScheduler

    kv = {
        "need_send_cache": True,
        "kv_transfer_criteria": {"type": "special_token", "token_id": SENTINEL},
        "timeout_seconds": 300,
    }
    totals = {"stock": [], "omni": []}
    pair_ratios: list[float] = []
    transfers = 0
    for _ in range(repeats):
        stock = build(Scheduler, n, None, log_stats=log_stats)
        ours = build(OmniARScheduler, n, kv, log_stats=log_stats)
        plan = decode_plan(n, steps)
        acks: list[str] = []
        t_stock = t_ours = 0
        gc.collect()
        gc.disable()
        try:
            for k in range(steps):
                ns_stock, _ = timed_step(stock, plan[k], ())
                t_stock += ns_stock
                ns_ours, handed = timed_step(ours, plan[k], acks)
                t_ours += ns_ours
                pair_ratios.append(ns_ours / ns_stock)
                acks = handed  # the runner acks in the next step's output
                transfers += len(handed)
        finally:
            gc.enable()
        totals["stock"].append(t_stock)
        totals["omni"].append(t_ours)
    # The median of the paired step ratios: a burst of load from elsewhere hits one pair
    # (both steps run back to back), not the statistic.
    best_stock, best_ours = min(totals["stock"]), min(totals["omni"])
    return {
        "ratio": statistics.median(pair_ratios),
        "ratio_best_totals": best_ours / best_stock,
        "stock_step_us": best_stock / steps / 1e3,
        "omni_step_us": best_ours / steps / 1e3,
        "transfers": transfers // repeats,
    }


# ---------------------------------------------------------------------- churn
class Churn:
    """One scheduler under the churn workload: its requests, arrivals and acks."""

    def __init__(self, cls, n: int, kv_config, *, keep_observers: bool,
                 log_stats: bool = False) -> None:
        from omni_runtime.devtools.sched_harness import make_request, make_scheduler, make_vllm_config

        self._make_request = make_request
        self.sched = make_scheduler(
            cls,
            make_vllm_config(kv_config, max_num_seqs=n, max_num_batched_tokens=max(8192, 40 * n),
                             num_blocks=n * 8 + 16),
            log_stats=log_stats,
        )
        if not keep_observers and hasattr(self.sched, "transfer_ledger"):
            self.sched.transfer_ledger.remove_observers()
        # Whether its gap lets the observers' writer threads run (see forward_pass).
        self.observed = keep_observers and hasattr(self.sched, "transfer_ledger")
        self.next_id = 0
        self.arrivals: list = []
        self.acks: list = []
        self.finished = 0
        self.transfers = 0
        # The first cohort's ends are staggered over a life, so that as many finish (and
        # arrive) in every step.
        for i in range(n):
            self.sched.add_request(self._new(1 + i % CHURN_LIFE))

    def _new(self, max_tokens: int):
        self.next_id += 1
        return self._make_request(CHURN_PROMPT, max_tokens=max_tokens,
                                  request_id=f"c{self.next_id}")

    def step(self) -> int:
        """One engine step; returns the nanoseconds spent in the scheduler."""
        from omni_runtime.devtools.sched_harness import hand_off_attempts, runner_output

        sched, arrivals = self.sched, self.arrivals
        t0 = time.perf_counter_ns()
        for request in arrivals:
            sched.add_request(request)
        so = sched.schedule()
        t1 = time.perf_counter_ns()
        mro = forward_pass(lambda: runner_output(so, acked=self.acks), self.observed)
        t2 = time.perf_counter_ns()
        outputs = sched.update_from_output(so, mro)
        t3 = time.perf_counter_ns()
        self.acks = hand_off_attempts(so)  # acked in the next step's output
        self.transfers += len(self.acks)
        done = sum(o.finish_reason is not None for eco in outputs.values() for o in eco.outputs)
        self.finished += done
        self.arrivals = [self._new(CHURN_LIFE) for _ in range(done)]
        return (t1 - t0) + (t3 - t2)


def measure_churn(n: int, steps: int, repeats: int, warmup: int = CHURN_WARMUP,
                  observers: str = "on", telemetry_interval: float | None = None,
                  log_stats: bool = False, order: str = "lock-step") -> dict:
    from vllm.v1.core.sched.scheduler import Scheduler

    from omni_runtime.observability.writer_thread import metrics_thread, span_thread
    from omni_runtime.sched.scheduler import OmniARScheduler

    production_observability()
    kv = {
        "need_send_cache": True,
        "kv_transfer_criteria": {"type": "prefill_finished"},
        "timeout_seconds": 300,
    }
    if telemetry_interval is not None:  # else the stage's default
        kv["telemetry_interval_seconds"] = telemetry_interval
    threads = (metrics_thread(), span_thread())
    threads_cpu_ns = sum(thread.cpu_ns for thread in threads)
    all_transfers = 0  # warm-up included, as in the threads' CPU
    totals: dict[str, list[int]] = {"stock": [], "omni": []}
    paired: list[float] = []
    # Each two consecutive pairs (with --churn-order alternate, one of each order): ours' time
    # over stock's (the module's docstring).
    balanced: list[float] = []
    transfers = finished = 0
    for r in range(repeats):
        stock = Churn(Scheduler, n, None, keep_observers=False, log_stats=log_stats)
        ours = Churn(OmniARScheduler, n, kv, keep_observers=observers != "off",
                     log_stats=log_stats)
        ledger = ours.sched.transfer_ledger
        if observers == "metrics":  # the metric families only: tracing's share is the rest
            kept = [o for o in ledger.observers if type(o).__name__ != "TransferTracing"]
            ledger.remove_observers()
            for observer in kept:
                ledger.add_observer(observer)
        kinds = sorted(type(o).__name__ for o in ledger.observers)
        assert kinds == {"on": ["LedgerEdgeObserver", "TransferMetrics", "TransferTracing"],
                         "metrics": ["LedgerEdgeObserver", "TransferMetrics"],
                         "off": []}[observers], kinds
        for _ in range(warmup):
            stock.step()
            ours.step()
        t = {"stock": 0, "omni": 0}
        base_transfers, base_finished = ours.transfers, ours.finished
        previous = (0, 0)  # the pair before (ours, stock): set at every k, read at the odd ones
        gc.collect()
        gc.disable()
        try:
            for k in range(steps):
                # Lock step: each scheduler's step follows the other's (see the docstring).
                swap = order == "alternate" and (k + r) % 2 == 1
                ns = {}
                for churn in ((ours, stock) if swap else (stock, ours)):
                    ns[churn] = churn.step()
                t["stock"] += ns[stock]
                t["omni"] += ns[ours]
                paired.append(ns[ours] / ns[stock])
                if k % 2:
                    balanced.append((ns[ours] + previous[0]) / (ns[stock] + previous[1]))
                previous = (ns[ours], ns[stock])
        finally:
            gc.enable()
        assert stock.finished == ours.finished, (stock.finished, ours.finished)
        for churn in (stock, ours):  # every slot busy: the finished were replaced
            assert len(churn.sched.running) + len(churn.arrivals) == n
        ledger = ours.sched.transfer_ledger
        assert not ledger.num_held and ledger.num_active <= len(ours.acks)
        transfers += ours.transfers - base_transfers
        all_transfers += ours.transfers
        finished += ours.finished - base_finished
        totals["stock"].append(t["stock"])
        totals["omni"].append(t["omni"])
    best_stock, best_ours = min(totals["stock"]), min(totals["omni"])
    for thread in threads:
        thread.flush()
    threads_cpu_ns = sum(thread.cpu_ns for thread in threads) - threads_cpu_ns
    return {
        "ratio": statistics.median(paired),
        "ratio_balanced": statistics.median(balanced),
        # The writer threads' CPU per transfer of ours (off the step; warm-up included).
        "writer_threads_us_per_transfer": threads_cpu_ns / all_transfers / 1e3,
        "ratio_best_totals": best_ours / best_stock,
        "stock_step_us": best_stock / steps / 1e3,
        "omni_step_us": best_ours / steps / 1e3,
        "transfers_per_step": transfers / repeats / steps,
        "finished_per_step": finished / repeats / steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256,1024")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--churn-steps", type=int, default=100)
    parser.add_argument("--workloads", default="steady,churn")
    parser.add_argument("--churn-observers", choices=("on", "metrics", "off"), default="on",
                        help="metrics: ours without tracing, off: without any observer (to "
                             "tell their shares)")
    parser.add_argument("--telemetry-interval", type=float, default=None,
                        help="omni_kv_config.telemetry_interval_seconds of ours under churn "
                             "(default: the stage's default; 0: the observers told every step)")
    parser.add_argument("--churn-order", choices=("lock-step", "alternate"), default="lock-step",
                        help="lock-step: stock, then ours, every pair (each step follows the "
                             "other scheduler's); alternate: which steps first swaps every "
                             "other pair (each follows itself half the time: two clusters)")
    parser.add_argument("--log-stats", action="store_true",
                        help="vLLM's stats on in both schedulers (both workloads), as a served "
                             "engine makes them (default off, as with --disable-log-stats; the "
                             "omni connector then records none either)")
    args = parser.parse_args()
    workloads = set(args.workloads.split(","))
    production_observability()  # before vLLM imports prometheus_client
    logging.disable(logging.WARNING)
    result = {}
    sizes = [int(x) for x in args.sizes.split(",")]
    if "steady" in workloads:
        for n in sizes:
            m = measure(n, args.steps, args.repeats, log_stats=args.log_stats)
            print(f"# steady, {n} running: stock {m['stock_step_us']:.0f} us/step, omni "
                  f"{m['omni_step_us']:.0f} us/step, {m['transfers']} transfers", file=sys.stderr)
            result[f"ratio_{n}"] = round(m["ratio"], 4)
            result[f"ratio_best_totals_{n}"] = round(m["ratio_best_totals"], 4)
            result[f"stock_step_us_{n}"] = round(m["stock_step_us"], 1)
        result["target"] = STEADY_TARGET
    if "churn" in workloads:
        for n in sizes:
            m = measure_churn(n, args.churn_steps, args.repeats, observers=args.churn_observers,
                              telemetry_interval=args.telemetry_interval,
                              log_stats=args.log_stats, order=args.churn_order)
            print(f"# churn, {n} running: stock {m['stock_step_us']:.0f} us/step, omni "
                  f"{m['omni_step_us']:.0f} us/step, {m['transfers_per_step']:.1f} transfers and "
                  f"{m['finished_per_step']:.1f} finishes per step", file=sys.stderr)
            if args.churn_observers != "on":
                result["churn_observers"] = args.churn_observers
            if args.churn_order != "lock-step":
                result["churn_order"] = args.churn_order
            if args.telemetry_interval is not None:
                result["telemetry_interval_seconds"] = args.telemetry_interval
            result[f"churn_ratio_{n}"] = round(m["ratio"], 4)
            result[f"churn_ratio_best_totals_{n}"] = round(m["ratio_best_totals"], 4)
            result[f"churn_ratio_balanced_{n}"] = round(m["ratio_balanced"], 4)
            result[f"churn_stock_step_us_{n}"] = round(m["stock_step_us"], 1)
            result[f"churn_omni_step_us_{n}"] = round(m["omni_step_us"], 1)
            result[f"churn_transfers_per_step_{n}"] = round(m["transfers_per_step"], 2)
            result[f"churn_writer_threads_us_per_transfer_{n}"] = round(
                m["writer_threads_us_per_transfer"], 2)
        result["churn_target"] = CHURN_TARGET
    if args.log_stats:
        result["log_stats"] = True
    print(json.dumps(result))


if __name__ == "__main__":
    main()
