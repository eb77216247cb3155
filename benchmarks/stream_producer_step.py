"""The producer's step with streaming on and off, at 256 running requests, side by side in
one run (issue target ``producer_step_ratio_256`` <= 1.05).

Two OmniARSchedulers on vLLM's real scheduler, no model (hand-made runner outputs, as vLLM's
own scheduler tests and ``benchmarks/scheduler_overhead.py`` do): both hand their requests
to a ``talker``; ``on`` streams them (a first chunk of 4 tokens, then 16 each, 4 chunks in
flight, each chunk acked in the next step's output, as a consumer one step away answers),
``off`` hands each off whole when it finishes (none finishes in the window: the step pays
only the trigger's bookkeeping). ``--requests`` (256) decode one token a step; after the
warm-up, ``--steps`` (300) steps of each are timed in lock step (on, then off, at the same
point of the workload), ``schedule()`` and ``update_from_output()`` only: the runner's
outputs and the acks are built outside the timed span, the same for both.

What is measured is the scheduler's share of an AR step. The model's forward pass, the same
with streaming on or off, is left out, so the ratio here bounds the AR step's ratio from
above (adding the same forward time to both sides moves a ratio toward 1); the worker's
sending of the step's chunks (rank 0, in the forward pass's shadow on a GPU) is not in it.

Last line: one JSON object: ``producer_sched_step_ratio_256`` (median of the per-step
ratios), ``..._best_totals`` (total over total), the microseconds per step of each, and the
chunks cut per step.

    python benchmarks/stream_producer_step.py [--requests 256] [--steps 300]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from vllm.v1.outputs import KVConnectorOutput  # noqa: E402

from omni_contract.edges import StreamSettings, stream_config  # noqa: E402
from omni_runtime.devtools.sched_harness import (make_request, make_scheduler,  # noqa: E402
                                                 make_vllm_config, runner_output)
from omni_runtime.kv.metadata import OmniKVWorkerMetadata  # noqa: E402
from omni_runtime.sched import OmniARScheduler  # noqa: E402
from omni_runtime.sched.handoff import ChunkAnswer  # noqa: E402

SETTINGS = StreamSettings(first_chunk_tokens=4, chunk_tokens=16, chunks_in_flight=4,
                          max_open_streams=4096)


class Producer:
    """One scheduler and what its next step's output answers."""

    def __init__(self, streamed: bool, requests: int) -> None:
        omni = {"need_send_cache": True, "stage_name": "thinker"}
        if streamed:
            omni["streams"] = {"talker": stream_config(SETTINGS)}
        config = make_vllm_config(omni, endpoints={"talker": "tcp://127.0.0.1:9"},
                                  max_num_seqs=requests, max_num_batched_tokens=32 * requests,
                                  max_model_len=2048, num_blocks=requests * 64)
        self.s = make_scheduler(OmniARScheduler, config)
        for i in range(requests):
            self.s.add_request(make_request(32, max_tokens=100_000, request_id=f"r{i}"))
        self.to_answer: list = []
        self.chunks = 0

    def step(self) -> float:
        """One step; returns the seconds spent in the scheduler."""
        s = self.s
        began = time.perf_counter()
        so = s.schedule()
        spent = time.perf_counter() - began
        out = runner_output(so, scheduler=s)
        if self.to_answer:
            out.kv_connector_output = KVConnectorOutput(
                kv_connector_worker_meta=OmniKVWorkerMetadata(chunk_answers=[
                    ChunkAnswer(c.request_id, c.to_stage, c.seq, None)
                    for c in self.to_answer if c.end is None]))
        chunks = list(getattr(so.kv_connector_metadata, "chunks", ()) or ())
        self.chunks += len(chunks)
        began = time.perf_counter()
        s.update_from_output(so, out)
        spent += time.perf_counter() - began
        self.to_answer = chunks
        return spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=40)
    args = parser.parse_args()
    on, off = Producer(True, args.requests), Producer(False, args.requests)
    for _ in range(args.warmup):
        on.step()
        off.step()
    on.chunks = 0
    gc.collect()
    gc.disable()  # a collection lands in one scheduler's step, not the other's
    try:
        times_on, times_off = [], []
        for _ in range(args.steps):
            times_on.append(on.step())
            times_off.append(off.step())
    finally:
        gc.enable()
    assert on.s._streams is not None and len(on.s._streams) == args.requests, \
        "every request streams through the window"
    ratios = [a / b for a, b in zip(times_on, times_off)]
    n = args.requests
    print(json.dumps({
        "requests": n, "steps": args.steps,
        f"producer_sched_step_ratio_{n}": round(statistics.median(ratios), 4),
        f"producer_sched_step_ratio_{n}_best_totals": round(sum(times_on) / sum(times_off), 4),
        "step_us_on": round(statistics.median(times_on) * 1e6, 1),
        "step_us_off": round(statistics.median(times_off) * 1e6, 1),
        "chunks_per_step": round(on.chunks / args.steps, 2),
        "target": {f"producer_step_ratio_{n}": "<= 1.05 (the AR step; this ratio bounds it)"},
    }))


if __name__ == "__main__":
    main()
