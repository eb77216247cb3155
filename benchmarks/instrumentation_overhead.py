"""Scheduler step time with transfer metrics and tracing on, against off.

Same workload as benchmarks/scheduler_overhead.py (its builder and plan are imported from
there): a real vLLM 0.32 ``OmniARScheduler`` with 1024 running requests decoding, 10% of them
sampling the sentinel during the measured window, so their transfers are marked, handed off
and acked (one step later) while every step's callbacks run.

"on" is what production runs: prometheus_client in multiprocess mode (mmap-backed values, as
in the engine-core process) and an SDK tracer provider with a batch span processor, installed
globally the way vLLM installs it, found by ``build_observers``. "off" detaches the observers.
The two schedulers step alternately (which goes first alternates too), so machine noise hits
both alike; the ratio is the median over steps of on/off for the same step.

Last line: JSON ``{"ratio": on/off, ...}``. Target: ratio <= 1.02.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from scheduler_overhead import production_observability  # noqa: E402

# Multiprocess mode must be chosen before prometheus_client is first imported (vLLM imports
# it), as the stage launcher does for the engine-core process; with it the SDK tracer
# provider (a batch span processor exporting to nowhere), as vLLM installs it in the engine
# core when tracing is on.
production_observability()

N = 1024
TARGET = 1.02


def measure(steps: int, repeats: int) -> dict:
    from prometheus_client import values

    from omni_runtime.sched.scheduler import OmniARScheduler
    from scheduler_overhead import SENTINEL, build, decode_plan, timed_step

    assert values.ValueClass.__name__ == "MmapedValue", "not in multiprocess mode"
    provider = production_observability()

    kv = {
        "need_send_cache": True,
        "kv_transfer_criteria": {"type": "special_token", "token_id": SENTINEL},
        "timeout_seconds": 300,
    }
    totals: dict[str, list[int]] = {"off": [], "on": []}
    paired: list[float] = []  # on/off of the same step index, run back to back
    transfers = 0
    for r in range(repeats):
        off = build(OmniARScheduler, N, kv)
        on = build(OmniARScheduler, N, kv, keep_observers=True)
        kinds = sorted(type(o).__name__ for o in on.transfer_ledger.observers)
        assert kinds == ["LedgerEdgeObserver", "TransferMetrics", "TransferTracing"], kinds
        assert not off.transfer_ledger.observers
        plan = decode_plan(N, steps)
        acks = {"off": [], "on": []}
        t = {"off": 0, "on": 0}
        step_ns = {"off": 0, "on": 0}
        gc.collect()
        gc.disable()
        try:
            for k in range(steps):
                # Alternate which goes first, so neither always runs on a warmer cache.
                order = (("off", off), ("on", on)) if (k + r) % 2 == 0 else (("on", on), ("off", off))
                for name, sched in order:
                    ns, handed = timed_step(sched, plan[k], acks[name])
                    t[name] += ns
                    step_ns[name] = ns
                    acks[name] = handed  # the runner acks in the next step's output
                    if name == "on":
                        transfers += len(handed)
                paired.append(step_ns["on"] / step_ns["off"])
        finally:
            gc.enable()
        assert on.transfer_ledger.num_active <= len(acks["on"])  # all but the last acked
        totals["off"].append(t["off"])
        totals["on"].append(t["on"])
    us_per_transfer = per_transfer_cost()
    provider.shutdown()
    best_off, best_on = min(totals["off"]), min(totals["on"])
    return {
        # The median of paired steps: a burst of load from elsewhere on the machine hits
        # one pair, not the whole comparison.
        "ratio": statistics.median(paired),
        "ratio_best_totals": best_on / best_off,
        "off_step_us": best_off / steps / 1e3,
        "on_step_us": best_on / steps / 1e3,
        "transfers": transfers // repeats,
        "us_per_transfer": us_per_transfer,
    }


def per_transfer_cost(n: int = 3000) -> float:
    """Microseconds the observers add to one transfer's whole life (mark, hand-off, hold,
    ack), on a bare ledger with every operation a report of its own and another transfer in
    flight throughout (a loaded stage: its reports go to the writer threads): what a heavier
    transfer rate than the workload's would pay, the threads' writes included (the flush at
    the end waits for them)."""
    from opentelemetry import trace

    from omni_runtime.observability.observers import build_observers
    from omni_runtime.transfers.ledger import Outcome, TransferLedger, Trigger

    def run(ledger: TransferLedger) -> float:
        ledger.mark("busy", Trigger.PREFILL_FINISHED, 64, [1, 2])
        t0 = time.perf_counter_ns()
        for i in range(n):
            rid = f"t{i}"
            ledger.mark(rid, Trigger.PREFILL_FINISHED, 64, [1, 2])
            ledger.hand_off_pending()
            ledger.request_finished(rid, 3, aborted=False)
            ledger.resolve(rid, Outcome.ACKED)
        ledger.flush()  # the writes off the step count too: all of a transfer's cost
        elapsed = time.perf_counter_ns() - t0
        ledger.resolve("busy", Outcome.ACKED)
        return elapsed / n / 1e3

    observers = build_observers(stage="bench", model_name="m", timeout_seconds=300)
    assert len(observers) == 2 and trace.get_tracer_provider() is not None
    bare = min(run(TransferLedger(300)) for _ in range(3))
    observed = min(run(TransferLedger(300, observers=observers)) for _ in range(3))
    return observed - bare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    started = time.perf_counter()
    m = measure(args.steps, args.repeats)
    print(f"# {N} running: off {m['off_step_us']:.0f} us/step, on {m['on_step_us']:.0f} us/step, "
          f"{m['transfers']} transfers per run, observers add {m['us_per_transfer']:.1f} us per "
          f"transfer; {time.perf_counter() - started:.0f} s",
          file=sys.stderr)
    print(json.dumps({"ratio": round(m["ratio"], 4),
                      "ratio_best_totals": round(m["ratio_best_totals"], 4), "off_step_us": round(m["off_step_us"], 1),
                      "on_step_us": round(m["on_step_us"], 1), "transfers": m["transfers"],
                      "us_per_transfer": round(m["us_per_transfer"], 1), "target": TARGET}))


if __name__ == "__main__":
    main()
