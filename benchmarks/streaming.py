"""Streamed against whole hand-offs: thinker -> talker through the pipeline's endpoint, both
ways side by side in one run.

Starts two pipelines of the tiny CPU model at once (``omni-stage`` processes and their
endpoints on 127.0.0.1, the stage configs the operator renders, as ``omni-pipeline up``
runs them): ``whole`` (the thinker hands its whole sequence to the talker when it finishes)
and ``streamed`` (the thinker streams it, a first chunk of ``--first-chunk`` (4) tokens, then
``--chunk`` (16) each; the talker's request grows chunk by chunk). The thinker says
``--thinker-tokens`` (64) to each prompt of ``--prompt-tokens`` (64); the whole talker says
``--talker-tokens`` (16), the streamed one ``--talker-tokens-per-chunk`` (4) after each chunk.
``--requests`` (50) requests, one at a time, half of them each way on the same prompts, one
way after the other (vLLM's engine busy-waits a second after each step: the idle pipeline's
engines would spin through the other's requests on two cores), each asked with
``"stream": true`` so that the talker's first output is seen when it comes. Each engine's
stage (its server, engine core and worker) computes on a core of its own once all are up,
as each stage has its own accelerator in a deployment: unpinned, the whole pipeline's
thinker borrows the idle talker's core, which no deployment lends it, and the streamed
pipeline's stages, busy at once, take each other's (a first output then waits, now and
then, for the other stage's whole run). At the end the streamed thinker is stopped
(SIGSTOP) in the middle of a stream; the edge's gap deadline is ``--stall-gap`` (3) s for
every request (on this 2-core machine four engines share the cores, and a chunk has come
more than a second late).

Figures (the last line, one JSON object; a figure the run could not measure is listed in
``not_measured`` and the exit status is 1):

* ``first_output_ratio``: p50 time to the talker's first output, streamed / whole; target
  <= 0.25; beside it ``first_output_bound_s``, the streamed thinker's time to its first chunk
  (its TTFT + 4 TPOT, from the whole pipeline's own thinker timings) + the chunk's hop + one
  talker step, what streaming can at best give;
* ``e2e_ratio``: p50 end to end, streamed / whole; target <= 1.05;
* ``chunk_hop_p50_ms`` / ``chunk_hop_p99_ms``: a chunk cut to consumable at the talker, from
  the talker's ``omni_kv_stream_chunk_hop_seconds`` histogram (interpolated in its buckets);
  targets <= 5 and <= 25;
* ``stall_error_over_deadline_s``: the stopped thinker's stream reaching the client as an
  error, less the edge's gap deadline; target <= 1.0.

``producer_step_ratio_256`` (the AR step at 256 running requests, 16-token chunks on and
off) is ``benchmarks/stream_producer_step.py``'s: the scheduler's share of it, a bound.

Runs about 90 s here, over the benchmarks' 60 s rule: the four engines (three processes each
importing vLLM) take 50-65 s to start on two cores, before the first request.

    python benchmarks/streaming.py [--requests 50]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "operator"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from omni_operator.local.run import ENDPOINT, free_port, local_stage_configs  # noqa: E402
from omni_operator.pipeline.model import parse_pipeline  # noqa: E402
from pipeline_chain import descendants, get, start, stop  # noqa: E402

from omni_runtime.devtools.tiny_model import ensure_tiny_model  # noqa: E402

TARGETS = {"first_output_ratio": "<= 0.25", "e2e_ratio": "<= 1.05", "chunk_hop_p50_ms": "<= 5",
           "chunk_hop_p99_ms": "<= 25", "stall_error_over_deadline_s": "<= 1.0"}


def pipeline_body(name: str, model: str, args: argparse.Namespace, streamed: bool) -> dict:
    engine = {"dtype": "float32", "max-model-len": 2048, "max-num-seqs": 4,
              "enforce-eager": True, "kv-cache-memory-bytes": 32 << 20}
    talker = {"name": "talker", "role": "ar", "gpus": 0, "inputs": ["thinker"],
              "engineArgs": engine,
              "input": {"samplingParams": {
                  "max_tokens": args.talker_tokens_per_chunk if streamed else args.talker_tokens,
                  "temperature": 0, "ignore_eos": True}}}
    if streamed:
        talker["streams"] = [{"stage": "thinker", "firstChunkTokens": args.first_chunk,
                              "chunkTokens": args.chunk, "gapSeconds": args.stall_gap,
                              "firstChunkSeconds": 30, "streamSeconds": 120}]
    return {
        "apiVersion": "omnipipeline.dev/v1alpha1", "kind": "OmniPipeline",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"image": "omni-stage:bench", "model": {"name": "tiny-qwen2", "path": model},
                 "stages": [
                     {"name": "thinker", "role": "ar", "gpus": 0, "engineArgs": engine,
                      "kvTransfer": {"send": True, "criteria": {"type": "request_finished"},
                                     "timeoutSeconds": 30}},
                     talker]},
    }


def ask(url: str, prompt: list[int], tokens: int) -> tuple[float | None, float, dict]:
    """(seconds to the first event with tokens, seconds to the end, the last event with
    choices, its ``usage`` the stream's last chunk's) of one streamed completion at a
    pipeline's endpoint."""
    body = {"model": "tiny-qwen2", "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    began = time.perf_counter()
    first, last, usage = None, {}, None
    with urllib.request.urlopen(request, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(event["error"])
            if first is None and any(c.get("token_ids") for c in event.get("choices", ())):
                first = time.perf_counter() - began
            if event.get("usage"):  # include_usage: a last chunk of no choices
                usage = event["usage"]
            if event.get("choices"):
                last = event
    return first, time.perf_counter() - began, {**last, "usage": usage}


def histogram(page: str, name: str, labels: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of a histogram's buckets on a metrics page."""
    buckets = []
    for line in page.splitlines():
        if line.startswith(name + "_bucket{") and labels in line:
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le),
                            float(line.rpartition(" ")[2])))
    return sorted(buckets)


def quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """Prometheus' histogram_quantile: linear within the bucket the rank falls in."""
    total = buckets[-1][1] if buckets else 0
    if not total:
        return float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = upper, count
    return lower


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--thinker-tokens", type=int, default=64)
    parser.add_argument("--talker-tokens", type=int, default=16)
    parser.add_argument("--talker-tokens-per-chunk", type=int, default=4)
    parser.add_argument("--first-chunk", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=16)
    parser.add_argument("--stall-gap", type=float, default=3.0)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    began = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="omni-bench-stream-"))
    model = str(ensure_tiny_model())
    configs = {}
    for mode in ("whole", "streamed"):
        pipeline = parse_pipeline(pipeline_body(mode, model, args, mode == "streamed"))
        ports = {s.name: {"http": free_port("127.0.0.1"), "kv": free_port("127.0.0.1")}
                 for s in pipeline.stages}
        ports[ENDPOINT] = {"http": free_port("127.0.0.1")}
        for name, config in local_stage_configs(pipeline, ports).items():
            configs[f"{mode}-{name}"] = config
    procs = start(configs, workdir, pin_stages=True)
    started = time.monotonic() - began
    urls = {name: url for name, (_, url) in procs.items()}
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 500) for _ in range(args.prompt_tokens)]
               for _ in range(args.warmup + args.requests)]
    first = {"whole": [], "streamed": []}
    end = {"whole": [], "streamed": []}
    said = {"whole": [], "streamed": []}
    thinker_tpot = []
    split: dict[str, list[tuple[float, float, float]]] = {"whole": [], "streamed": []}
    try:
        hop_before: list[tuple[float, float]] = []
        half = len(prompts) // 2
        # One way after the other, not interleaved: vLLM's engine busy-waits for a second
        # after each step, so the idle pipeline's two engines would spin through the other's
        # requests on this machine's two cores. The same prompts both ways.
        plan = [("whole", p) for p in prompts[:half + args.warmup]] + \
            [("streamed", p) for p in prompts[:half + args.warmup]]
        for i, (mode, prompt) in enumerate(plan):
            warm = i % (half + args.warmup) < args.warmup
            if mode == "streamed" and i == half + args.warmup + args.warmup:
                # the warm-up's chunks are not the figures'
                hop_before = histogram(get(urls["streamed-talker"] + "/metrics") or "",
                                       "omni_kv_stream_chunk_hop_seconds", 'from_stage="thinker"')
            if i == half + args.warmup:
                time.sleep(1.5)  # the whole pipeline's engines stop spinning
            seconds_first, seconds, last = ask(urls[f"{mode}-{ENDPOINT}"], prompt,
                                               args.thinker_tokens)
            if warm:
                continue
            first[mode].append(seconds_first)
            end[mode].append(seconds)
            stages = last.get("omni", {}).get("stages", {})
            thinker_t, talker_t = stages.get("thinker", {}), stages.get("talker", {})
            if {"sent_at"} <= set(thinker_t) and \
                    {"offered_at", "taken_at", "first_output_at"} <= set(talker_t):
                # Where the talker's first output's time goes: the thinker to its hand-off
                # (whole: its finish; streamed: its first chunk sent), the hop to the talker's
                # taking it, the talker's taking it to its first output at the endpoint.
                split[mode].append((talker_t["offered_at"] - thinker_t["sent_at"],
                                    talker_t["taken_at"] - talker_t["offered_at"],
                                    talker_t["first_output_at"] - talker_t["taken_at"]))
            said[mode].append((last.get("usage") or {}).get("completion_tokens"))
            if mode == "whole":
                thinker = last["omni"]["stages"].get("thinker", {})
                if "finished_at" in thinker and "sent_at" in thinker:
                    # The whole thinker's own time per token, over its tokens.
                    thinker_tpot.append((thinker["finished_at"] - thinker["sent_at"])
                                        / args.thinker_tokens)
        page = get(urls["streamed-talker"] + "/metrics") or ""
        hop = histogram(page, "omni_kv_stream_chunk_hop_seconds", 'from_stage="thinker"')
        before = dict(hop_before)
        hop = [(le, count - before.get(le, 0.0)) for le, count in hop]
        # A stall: the streamed thinker stopped while its stream is open.
        stall_prompt = prompts[0]
        stalled = None
        thinker_proc = procs["streamed-thinker"][0]
        import threading

        def first_chunks() -> float:
            """Streams whose first chunk the talker acked (the thinker's time-to-first-chunk
            histogram's count, observed at the producer): one more than before is this
            request's (the open-streams gauge, refreshed on a timer, can still show the
            previous request's)."""
            page = get(urls["streamed-thinker"] + "/metrics") or ""
            return sum(float(line.rpartition(" ")[2]) for line in page.splitlines()
                       if line.startswith("omni_kv_stream_first_chunk_seconds_count{")
                       and 'to_stage="talker"' in line)

        taken_before = first_chunks()

        def stop_thinker() -> None:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if first_chunks() > taken_before:
                    stop_thinker.pids = descendants(thinker_proc.pid)
                    signal_all(stop_thinker.pids, signal.SIGSTOP)
                    stop_thinker.at = time.perf_counter()
                    return
                time.sleep(0.005)

        stop_thinker.at, stop_thinker.pids = None, []
        watcher = threading.Thread(target=stop_thinker, daemon=True)
        watcher.start()
        try:
            ask(urls[f"streamed-{ENDPOINT}"], stall_prompt, 900)
        except (RuntimeError, urllib.error.HTTPError):
            if stop_thinker.at is not None:
                stalled = time.perf_counter() - stop_thinker.at
        finally:
            watcher.join(5)
            signal_all(stop_thinker.pids, signal.SIGCONT)
    finally:
        stop(procs)
        shutil.rmtree(workdir, ignore_errors=True)
    p50 = statistics.median
    ttft_whole = p50(first["whole"])
    hop_p50 = quantile(hop, 0.5)
    tpot = p50(thinker_tpot)
    bound = tpot * args.first_chunk + hop_p50 + tpot  # the thinker's 4 tokens, the hop, a step
    result = {
        "requests": args.requests, "prompt_tokens": args.prompt_tokens,
        "thinker_tokens": args.thinker_tokens,
        "talker_said_p50": {m: p50([s for s in said[m] if s is not None] or [0]) for m in said},
        "first_output_whole_p50_s": round(ttft_whole, 4),
        "first_output_streamed_p50_s": round(p50(first["streamed"]), 4),
        "first_output_ratio": round(p50(first["streamed"]) / ttft_whole, 4),
        "first_output_bound_s": round(bound, 4),
        "to_hand_off_p50_s": {m: round(p50([a for a, _, _ in v]), 4)
                              for m, v in split.items() if v},
        "hand_off_to_taken_p50_s": {m: round(p50([b for _, b, _ in v]), 4)
                                    for m, v in split.items() if v},
        "taken_to_first_output_p50_s": {m: round(p50([c for _, _, c in v]), 4)
                                        for m, v in split.items() if v},
        "e2e_whole_p50_s": round(p50(end["whole"]), 4),
        "e2e_streamed_p50_s": round(p50(end["streamed"]), 4),
        "e2e_ratio": round(p50(end["streamed"]) / p50(end["whole"]), 4),
        "chunk_hop_p50_ms": round(hop_p50 * 1e3, 3),
        "chunk_hop_p99_ms": round(quantile(hop, 0.99) * 1e3, 3),
        "stall_error_over_deadline_s": (round(stalled - args.stall_gap, 3)
                                        if stalled is not None else None),
        "producer_step_ratio_256": "benchmarks/stream_producer_step.py",
        "seconds": round(time.monotonic() - began, 1), "start_up_seconds": round(started, 1),
        "targets": TARGETS,
    }
    # A figure the run could not measure is a broken benchmark, not a result: said, and the
    # exit status fails (the JSON stays the last line).
    missing = [key for key in TARGETS if result[key] is None or result[key] != result[key]]
    missing += [f"talker_said_p50.{m}" for m, n in result["talker_said_p50"].items() if not n]
    if missing:
        result["not_measured"] = missing
    print(json.dumps(result))
    if missing:
        sys.exit(1)


if __name__ == "__main__":
    main()
