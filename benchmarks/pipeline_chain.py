"""A pipeline past its first hop: thinker -> talker through the pipeline's endpoint, against
each stage run alone on the same requests, side by side in one run.

Starts a thinker and a talker (``omni-stage``, the tiny CPU model, the stage configs the
operator renders, as ``omni-pipeline up`` runs them) and the pipeline's endpoint on
127.0.0.1. The thinker says ``--thinker-tokens`` (64) to each prompt and hands its whole
sequence to the talker when it finishes; the talker says ``--talker-tokens`` (16), its prompt
that sequence, whose KV it loads (the same model) instead of computing it. Then, for
``--requests`` (50) prompts of ``--prompt-tokens`` (1024) tokens, one at a time, side by
side prompt by prompt (so that the machine's state is the same for each way):

* the chain: each prompt through the endpoint (the talker's tokens are the answer);
* alone, every ``--alone-every`` (3) prompts: the prompt at the thinker's own API (its hand-off names no pipeline endpoint: the
  talker refuses it before making a request of it), then the thinker's sequence at the
  talker's own API (it computes its whole prompt).

Figures (the last line, one JSON object):

* ``hop_p50_ms``: the thinker's hand-off offered to the talker's request taken, i.e. added to
  its engine, whose next step schedules it (both unix clocks of this host; the endpoint's
  answer carries them per stage); target <= 10;
* ``chain_overhead_ratio``: p50 end to end through the endpoint over (the thinker's p50 alone
  + the talker's p50 alone), for the same requests (the prompts run alone too); target
  <= 1.10;
* ``prefix_reuse_prefill_ratio``: the talker's prefill time (vLLM's own
  ``vllm:request_prefill_time_seconds``, scheduled to first token, per request from its
  histogram's sum) with the KV loaded over recomputed, p50 of each; target <= 0.5.

    python benchmarks/pipeline_chain.py [--requests 50] [--prompt-tokens 1024]

Takes about 60 s here with the defaults, 25 s of it the two engines' start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "operator"))

import yaml  # noqa: E402
from omni_operator.local.run import ENDPOINT, free_port, local_stage_configs  # noqa: E402
from omni_operator.pipeline.model import parse_pipeline  # noqa: E402

from omni_runtime.devtools.tiny_model import ensure_tiny_model  # noqa: E402

TARGETS = {"hop_p50_ms": "<= 10", "chain_overhead_ratio": "<= 1.10",
           "prefix_reuse_prefill_ratio": "<= 0.5"}


def pipeline_body(model: str, talker_tokens: int) -> dict:
    # No prefix cache: the same prompts go through the chain and then alone.
    engine = {"dtype": "float32", "max-model-len": 2048, "max-num-seqs": 4,
              "enforce-eager": True, "kv-cache-memory-bytes": 64 << 20,
              "no-enable-prefix-caching": True}
    return {
        "apiVersion": "omnipipeline.dev/v1alpha1", "kind": "OmniPipeline",
        "metadata": {"name": "bench", "namespace": "default"},
        "spec": {"image": "omni-stage:bench", "model": {"name": "tiny-qwen2", "path": model},
                 "stages": [
                     {"name": "thinker", "role": "ar", "gpus": 0, "engineArgs": engine,
                      "kvTransfer": {"send": True, "criteria": {"type": "request_finished"},
                                     "timeoutSeconds": 30}},
                     {"name": "talker", "role": "ar", "gpus": 0, "inputs": ["thinker"],
                      "engineArgs": engine,
                      "input": {"samplingParams": {"max_tokens": talker_tokens,
                                                   "temperature": 0, "ignore_eos": True}}},
                 ]},
    }


def post(url: str, body: dict, timeout: float = 120.0) -> tuple[dict, float]:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=timeout) as resp:
        answer = json.loads(resp.read())
    return answer, time.perf_counter() - start


def get(url: str, timeout: float = 5.0) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read().decode()
    except OSError:
        return None


def prefill(url: str) -> tuple[float, float]:
    """(sum, count) of the stage's vllm:request_prefill_time_seconds so far (the two lines
    read straight off the page: parsing all of it took longer than the requests)."""
    totals = {"sum": 0.0, "count": 0.0}
    for line in (get(url + "/metrics") or "").splitlines():
        if line.startswith("vllm:request_prefill_time_seconds_"):
            name, _, value = line.rpartition(" ")
            kind = name.removeprefix("vllm:request_prefill_time_seconds_").split("{")[0]
            if kind in totals:
                totals[kind] += float(value)
    return totals["sum"], totals["count"]


def prefill_after(url: str, before: tuple[float, float]) -> tuple[float, tuple[float, float]]:
    """The prefill time of the one request the stage finished since ``before`` (its
    histogram's sum grows with it when vLLM's output handler records it; bounded wait), and
    the histogram's (sum, count) now."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = prefill(url)
        if now[1] > before[1]:
            assert now[1] == before[1] + 1, "one request at a time"
            return now[0] - before[0], now
        time.sleep(0.01)
    raise SystemExit(f"{url}: no request's prefill time recorded in 30 s")


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (vLLM runs in a process group of its own, under
    the stage's supervisor: a signal to the supervisor's group would not reach it)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += children.get(current, [])
    return found


def pin(pid: int, core: int) -> None:
    """Every thread of ``pid``'s process tree onto ``core`` (an affinity is per thread)."""
    for process in descendants(pid):
        for task in Path(f"/proc/{process}/task").glob("*"):
            try:
                os.sched_setaffinity(int(task.name), {core})
            except OSError:  # gone since
                pass


def start(configs: dict, workdir: Path,
          pin_stages: bool = False) -> dict[str, tuple[subprocess.Popen, str]]:
    """Every stage started at once (the engines load side by side), each engine's OpenMP
    threads on a core of its own where there are two (the thinker's busy cores would
    otherwise slow the talker's steps, and the reverse). With ``pin_stages``, once all are
    up, every process of each engine's stage (its server, engine core and worker) on that
    core too: each stage computes on a core of its own, as each has its own accelerator
    in a deployment, and no stage borrows another's while that one idles."""
    procs = {}
    bound: dict[str, int] = {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "operator")])}
    cores = sorted(os.sched_getaffinity(0))
    for index, (name, config) in enumerate(configs.items()):
        if config.get("role") == "ar" and len(cores) >= 2:
            bound[name] = cores[index % len(cores)]
            env = {**env, "VLLM_CPU_OMP_THREADS_BIND": str(bound[name])}
        path = workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        log = open(workdir / f"{name}.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "omni_runtime.stages.main", "--config",
                                 str(path), "--host", "127.0.0.1"], stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        procs[name] = (proc, f"http://127.0.0.1:{config['ports']['http']}")
    deadline = time.monotonic() + 300
    for name, (proc, url) in procs.items():
        while get(url + "/health", timeout=2) is None:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (workdir / f"{name}.log").read_text(errors="replace")[-3000:]
                raise SystemExit(f"stage {name} did not start:\n{tail}")
            time.sleep(0.2)
    if pin_stages:
        for name, core in bound.items():
            pin(procs[name][0].pid, core)
    return procs


def stop(procs: dict) -> None:
    import signal

    for proc, _ in procs.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc, _ in procs.values():
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--thinker-tokens", type=int, default=64)
    parser.add_argument("--talker-tokens", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--alone-every", type=int, default=3,
                        help="run each stage alone on every N-th prompt")
    args = parser.parse_args()
    began = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="omni-bench-chain-"))
    pipeline = parse_pipeline(pipeline_body(str(ensure_tiny_model()), args.talker_tokens))
    ports = {s.name: {"http": free_port("127.0.0.1"), "kv": free_port("127.0.0.1")}
             for s in pipeline.stages}
    ports[ENDPOINT] = {"http": free_port("127.0.0.1")}
    configs = local_stage_configs(pipeline, ports)
    procs = start(configs, workdir)
    started = time.monotonic() - began
    urls = {name: url for name, (_, url) in procs.items()}
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 500) for _ in range(args.prompt_tokens)]
               for _ in range(args.warmup + args.requests)]
    thinker_params = {"model": "tiny-qwen2", "max_tokens": args.thinker_tokens,
                      "temperature": 0, "ignore_eos": True}
    # Its hand-offs still go to the talker, with a pipeline context that names no endpoint,
    # which the talker refuses before it makes a request of it (no work on the talker).
    gone = {"omni": {"request_id": "alone", "endpoint": "none"}}
    try:
        chain, hops, thinker_alone, talker_alone = [], [], [], []
        chain_of_alone = []  # the chain's times of the prompts that also ran alone
        loaded_prefills, computed_prefills = [], []
        talker_prefills = prefill(urls["talker"])  # (sum, count): only our requests move it
        for i, prompt in enumerate(prompts):
            # Side by side prompt by prompt, so that the machine's state (which engine's
            # worker still spins after its step, say) is the same for the three; alone on
            # every ``--alone-every``-th prompt (the run's time).
            answer, seconds = post(urls[ENDPOINT] + "/v1/completions",
                                   {**thinker_params, "prompt": prompt})
            assert len(answer["choices"][0]["token_ids"]) == args.talker_tokens, answer
            loaded, talker_prefills = prefill_after(urls["talker"], talker_prefills)
            if i >= args.warmup:
                talker = answer["omni"]["stages"]["talker"]
                chain.append(seconds)
                hops.append(talker["taken_at"] - talker["offered_at"])
                loaded_prefills.append(loaded)
            if i % args.alone_every:
                continue
            alone, thinker_s = post(urls["thinker"] + "/v1/completions",
                                    {**thinker_params, "prompt": prompt,
                                     "return_token_ids": True, "kv_transfer_params": gone})
            sequence = prompt + alone["choices"][0]["token_ids"]
            _, talker_s = post(urls["talker"] + "/v1/completions",
                               {"model": "tiny-qwen2", "prompt": sequence,
                                "max_tokens": args.talker_tokens, "temperature": 0,
                                "ignore_eos": True})
            computed, talker_prefills = prefill_after(urls["talker"], talker_prefills)
            if i >= args.warmup:
                chain_of_alone.append(seconds)
                thinker_alone.append(thinker_s)
                talker_alone.append(talker_s)
                computed_prefills.append(computed)
    finally:
        stop(procs)
        shutil.rmtree(workdir, ignore_errors=True)
    p50 = statistics.median
    loaded_prefill = p50(loaded_prefills)
    computed_prefill = p50(computed_prefills)
    result = {
        "requests": args.requests, "alone_requests": len(thinker_alone), "prompt_tokens": args.prompt_tokens,
        "thinker_tokens": args.thinker_tokens, "talker_tokens": args.talker_tokens,
        "hop_p50_ms": round(p50(hops) * 1e3, 2),
        "hop_p99_ms": round(sorted(hops)[int(0.99 * (len(hops) - 1))] * 1e3, 2),
        "chain_p50_s": round(p50(chain), 4),
        "thinker_alone_p50_s": round(p50(thinker_alone), 4),
        "talker_alone_p50_s": round(p50(talker_alone), 4),
        "chain_overhead_ratio": round(
            p50(chain_of_alone) / (p50(thinker_alone) + p50(talker_alone)), 4),
        "talker_prefill_loaded_ms": round(loaded_prefill * 1e3, 3),
        "talker_prefill_computed_ms": round(computed_prefill * 1e3, 3),
        "prefix_reuse_prefill_ratio": round(loaded_prefill / computed_prefill, 4),
        "seconds": round(time.monotonic() - began, 1), "start_up_seconds": round(started, 1),
        "targets": TARGETS,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
