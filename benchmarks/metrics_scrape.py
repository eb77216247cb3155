"""/metrics scrape time of an AR stage under full load next to idle, and where it goes.

Starts a receiving stage and an AR stage (``omni-stage``: vLLM's OpenAI server, the omni
scheduler, the omni KV connector, the tiny CPU model, multiprocess metrics) on 127.0.0.1,
then, idle and under full load (CLIENTS streaming completions back to back), measures:

* ``scrape``: GET /metrics, wall time (what Prometheus waits for; its default timeout 10 s);
* ``health``: GET /health on the same server: the API server's event loop and CPU share,
  without the metrics work;
* ``collect``: prometheus_client's MultiProcessCollector + text exposition over the stage's
  PROMETHEUS_MULTIPROC_DIR, in this process: the metrics work itself, without the server.

So ``scrape ~ health`` means the time is spent waiting for the server (event loop, CPU),
``scrape ~ collect`` means it is the collection. ``run_queue_wait_fraction``: how much of the
window the API server's threads were runnable but waiting for a CPU (/proc schedstat).

Two loaded legs on the same server, side by side: ``load_engine_nice0`` with vLLM's
engine-core processes at the API server's priority (vLLM's default), and ``load`` with them
reniced to ENGINE_NICE as the stage's supervisor does (the stage is started with
OMNI_ENGINE_NICE=0 and this benchmark applies the supervisor's own renice between the legs).
``tokens_per_s`` (streamed) per leg shows what the renice costs the engine.

    python benchmarks/metrics_scrape.py [--clients 16] [--samples 12] [--prompt-words 100]

The last line is one JSON object: medians and maxima in seconds per leg, ``load_over_idle``
(median scrape ratio, reniced leg) and ``target_met`` (max scrape under load < 1 s, reniced
leg). Takes about 55 s here with the defaults (20 samples a leg: the 16 clients' requests come in waves, so a short leg can fall between two), a third of it vLLM's start-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "operator"))

from omni_runtime.stages.ar import ENGINE_NICE, ENGINE_NICE_ENV, _descendants, _tasks  # noqa: E402


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 30.0) -> tuple[int, bytes, float]:
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = resp.read()
            status = resp.status
    except urllib.error.HTTPError as err:
        body, status = err.read(), err.code
    return status, body, time.perf_counter() - start


def stage_configs(workdir: Path) -> dict[str, dict]:
    from omni_operator.local.run import local_stage_configs
    from omni_operator.pipeline.model import parse_pipeline

    from omni_runtime.devtools.tiny_model import ensure_tiny_model

    ports = {n: {"http": free_port(), "kv": free_port()} for n in ("ar", "receiver")}
    body = {
        "apiVersion": "omnipipeline.dev/v1alpha1", "kind": "OmniPipeline",
        "metadata": {"name": "bench", "namespace": "bench"},
        "spec": {
            "image": "omni-stage:bench",
            "model": {"name": "tiny-qwen2", "path": str(ensure_tiny_model())},
            "stages": [
                {"name": "ar", "role": "ar", "gpus": 0,
                 "engineArgs": {"dtype": "float32", "max-model-len": 1024,
                                "kv-cache-memory-bytes": 64 << 20, "enforce-eager": True},
                 "kvTransfer": {"send": True, "criteria": {"type": "prefill_finished"},
                                "timeoutSeconds": 10}},
                {"name": "receiver", "role": "generation", "gpus": 0, "inputs": ["ar"]},
            ],
        },
    }
    return local_stage_configs(parse_pipeline(body), ports)


class Stage:
    def __init__(self, config: dict, workdir: Path, env: dict[str, str]) -> None:
        import yaml

        self.http = config["ports"]["http"]
        path = workdir / f"{config['stage']}.yaml"
        path.write_text(yaml.safe_dump(config))
        self.log = workdir / f"{config['stage']}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "omni_runtime.stages.main", "--config", str(path),
                 "--host", "127.0.0.1", "--grace-seconds", "2"],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http}"

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"stage exited: {self.log.read_text()[-3000:]}")
            try:
                if get(self.url + "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)  # start-up poll interval
        raise TimeoutError(f"stage not healthy within {timeout}s")

    def stop(self) -> None:
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def load(url: str, stop: threading.Event, done: list[int], prompt_words: int,
         tokens: list[int]) -> None:
    import http.client

    port = int(url.rsplit(":", 1)[1])
    while not stop.is_set():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        body = json.dumps({"model": "tiny-qwen2", "prompt": "full load " * prompt_words,
                           "max_tokens": 64, "ignore_eos": True, "stream": True})
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                raise RuntimeError(f"load request answered {resp.status}: {resp.read()[:300]!r}")
            while line := resp.fp.readline():
                if line.startswith(b"data: {"):
                    tokens.append(1)  # one streamed chunk per generated token
                if stop.is_set():
                    break
            done.append(1)
        finally:
            conn.close()


def renice_engine(api_server: int, nice: int) -> None:
    """The supervisor's renice (omni_runtime.stages.ar), applied once to every thread."""
    for pid in _descendants(api_server):
        for tid in _tasks(pid):
            try:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            except OSError:
                pass


def collect_time(multiproc_dir: str) -> float:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    start = time.perf_counter()
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=multiproc_dir)
    generate_latest(registry)
    return time.perf_counter() - start


def children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


def run_delay_s(pid: int) -> float:
    """Seconds the process's threads have waited on a CPU run queue (runnable, not running)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            total += int((task / "schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return total / 1e9


def sample(ar: Stage, multiproc_dir: str, n: int) -> dict[str, list[float]]:
    """``scrape``; ``health``: the slowest /health answer polled every 20 ms by another
    client while that scrape ran (the API server's event loop at that moment); ``collect``."""
    out: dict[str, list[float]] = {"scrape": [], "health": [], "collect": []}
    for _ in range(n):
        during: list[float] = []
        scraping = threading.Event()
        scraping.set()

        def poll_health() -> None:
            while scraping.is_set():
                during.append(get(ar.url + "/health")[2])
                time.sleep(0.02)  # probe interval

        prober = threading.Thread(target=poll_health)
        prober.start()
        status, body, seconds = get(ar.url + "/metrics")
        scraping.clear()
        prober.join()
        assert status == 200 and b"omni_kv_transfers" in body
        out["scrape"].append(seconds)
        out["health"].append(max(during))
        out["collect"].append(collect_time(multiproc_dir))
        time.sleep(0.25)  # spacing between samples, as a scraper's interval would
    return out


def summary(samples: dict[str, list[float]]) -> dict[str, float]:
    res = {}
    for key, values in samples.items():
        res[f"{key}_median_s"] = round(statistics.median(values), 4)
        res[f"{key}_max_s"] = round(max(values), 4)
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--prompt-words", type=int, default=100,
                        help="words per prompt (long prompts: prefill-heavy steps)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="omni-scrape-bench-"))
    multiproc = workdir / "prometheus-multiproc"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PROMETHEUS_"))}
    env.update(VLLM_TARGET_DEVICE="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "operator")]))
    configs = stage_configs(workdir)
    receiver = Stage(configs["receiver"], workdir, env)
    ar = Stage(configs["ar"], workdir, {**env, "PROMETHEUS_MULTIPROC_DIR": str(multiproc),
                                        ENGINE_NICE_ENV: "0"})
    try:
        receiver.wait_healthy(60)
        t0 = time.monotonic()
        ar.wait_healthy(300)
        startup_s = time.monotonic() - t0
        get(ar.url + "/metrics")  # warm-up
        idle = sample(ar, str(multiproc), args.samples)
        stop, done, tokens = threading.Event(), [], []
        threads = [threading.Thread(target=load, args=(ar.url, stop, done, args.prompt_words, tokens), daemon=True)
                   for _ in range(args.clients)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while len(done) < args.clients:  # every client has finished one request: full load
            if time.monotonic() > deadline or not all(t.is_alive() for t in threads):
                raise RuntimeError(f"the load did not run (see {workdir}/ar.log)")
            time.sleep(0.1)  # poll interval
        api = children(ar.proc.pid)[0]
        legs: dict[str, dict] = {}
        for leg in ("load_engine_nice0", "load"):
            if leg == "load":
                renice_engine(api, ENGINE_NICE)
            engines = _descendants(api)
            delay0 = {p: run_delay_s(p) for p in [api, *engines]}
            tokens0, t_leg = len(tokens), time.monotonic()
            samples = sample(ar, str(multiproc), args.samples)
            window = time.monotonic() - t_leg
            legs[leg] = {
                **summary(samples),
                "tokens_per_s": round((len(tokens) - tokens0) / window, 1),
                "api_server_run_queue_wait_fraction": round((run_delay_s(api) - delay0[api]) / window, 3),
                "engine_nice": os.getpriority(os.PRIO_PROCESS, engines[0]) if engines else None,
            }
        stop.set()
        for t in threads:
            t.join(120)
    finally:
        ar.stop()
        receiver.stop()
    idle_s, load_s = summary(idle), legs["load"]
    result = {
        "benchmark": "metrics_scrape",
        "clients": args.clients,
        "samples": args.samples,
        "startup_s": round(startup_s, 1),
        "requests_done_under_load": len(done),
        "idle": idle_s,
        **legs,
        "load_over_idle": round(load_s["scrape_median_s"] / idle_s["scrape_median_s"], 2),
        "target_met": load_s["scrape_max_s"] < 1.0,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
