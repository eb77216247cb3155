"""The KV data path at real sizes: the AR engine's step time with KV transfers on against off,
on the real vLLM engine with the omni KV connector and a receiving process.

For each model (the 7B-KV-shaped ``kv7b``: 28 layers, 4 KV heads, head size 128, and the tiny
one) the same concurrent prompts run in rounds interleaved with transfers on and off
(``prefill_finished``), in one engine (in-process engine core, so its steps can be timed; the
receiver is a separate process, as a receiving stage is). Transfers are switched off for a
round by turning the scheduler's ``need_send_cache`` off, so both sides share one engine.
Prefix caching is off: the same prompts run twice per pair, and the second run of a pair
would otherwise skip its prefill.

CPUs are split the same way for both sides, as vLLM's CPU binding does on a real host: the
engine's OpenMP threads on ``--engine-cpus`` (``OMP_PLACES``/``OMP_PROC_BIND``, set before
torch loads, one OpenMP thread per CPU), the transport's threads (the connector's
``io_cpus``), the receiving process and the raw-ZeroMQ reference on ``--io-cpus``. Default:
the last CPU for I/O, the others for the engine (on one CPU both share it).

    python benchmarks/kv_data_path.py [--requests 4] [--prompt-tokens 1024] [--rounds 2]

Last line, one JSON object:
  * ``step_ratio_7b``: mean engine step time, on over off (target <= 1.03);
  * ``handoff_step_ratio_7b``: slowest step on over slowest step off (target <= 1.10);
  * ``throughput_ratio_7b``: KV bytes/s from hand-off to the receiver's ack, over raw ZeroMQ
    sending the same bytes between the same two processes in the same run (target >= 0.9);
  * ``ar_rss_growth_mb`` (this process, from after the warm-up to the end) and
    ``receiver_rss_peak_mb``;
  * the same step figures for the tiny model (``*_tiny``);
  * diagnostics: ``transport_ratio_7b`` (the transport alone, submit() to ack, against raw
    ZeroMQ), ``decode_step_ratio_7b`` (steps after the prefill, on over off) and
    ``handoff_step_extra_ms_7b`` (the hand-off step over the median decode step off): the
    prefill step dominates both step ratios above;
  * the I/O CPUs' work per round: ``io_cpu_s_7b`` (CPU seconds of every thread on the I/O
    CPUs for one round of transfers: the copier, the sender, both ZeroMQ I/O threads and the
    receiving stage's receiver thread, split in ``io_cpu_split_7b``) against
    ``raw_io_cpu_s_7b`` (raw ZeroMQ's threads, both ends, sending the same bytes), and their
    ratio ``io_cpu_ratio_7b``: with one I/O CPU both paths keep it busy from the first byte
    to the last ack, so this is the best ``throughput_ratio_7b`` that split allows.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import zmq  # noqa: E402

TARGETS = {"step_ratio_7b": ("<=", 1.03), "handoff_step_ratio_7b": ("<=", 1.10),
           "throughput_ratio_7b": (">=", 0.9)}


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def thread_cpu_s(names_of: dict[int, str] | None = None) -> dict[str, float]:
    """CPU seconds (user + system) of each of this process's threads, by name: Python's
    thread name where it knows the thread (``names_of`` {native id: name} or
    threading.enumerate()), else the kernel's (ZeroMQ names its I/O threads ``ZMQbg/...``).
    Threads of one name are summed."""
    names = names_of if names_of is not None else {
        t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = names.get(int(tid)) or f.read().strip()
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}


def _io_threads(cpu: dict[str, float], *prefixes: str) -> float:
    return sum(v for k, v in cpu.items() if k.startswith(prefixes))


def _cpu_split(engine: str | None, io: str | None) -> tuple[list[int], list[int]]:
    from omni_runtime.kv.cpu_affinity import available_cpus, parse_cpu_list

    cpus = sorted(os.sched_getaffinity(0) & available_cpus())
    io_cpus = sorted(parse_cpu_list(io)) if io else cpus[-1:]
    engine_cpus = (sorted(parse_cpu_list(engine)) if engine
                   else [c for c in cpus if c not in io_cpus] or cpus)
    return engine_cpus, io_cpus


def _bind_engine_openmp(engine_cpus: list[int]) -> None:
    """What vLLM's CPU executor sets for a worker it binds: one OpenMP thread per CPU, bound.
    Must run before torch (libgomp) loads."""
    if "torch" in sys.modules:
        raise RuntimeError("bind the engine's OpenMP threads before importing torch")
    os.environ["OMP_NUM_THREADS"] = str(len(engine_cpus))
    os.environ["OMP_PLACES"] = "{" + ",".join(map(str, engine_cpus)) + "}"
    os.environ["OMP_PROC_BIND"] = "true"
    os.sched_setaffinity(0, engine_cpus)  # the main thread is OpenMP's master


# ---------------------------------------------------------------------- the receiving process
def _serve(conn, io_cpus: list[int]) -> None:
    os.sched_setaffinity(0, io_cpus)  # before any thread starts: all of them inherit it
    from omni_runtime.kv.transport import KVInbox, KVReceiver

    inbox = KVInbox(max_bytes=4 << 30)
    receiver = KVReceiver("tcp://127.0.0.1:0", inbox, pipeline="bench", stage="next",
                          max_payload_bytes=2 << 30).start()
    ctx = zmq.Context()
    raw = ctx.socket(zmq.ROUTER)
    raw_port = raw.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def consume() -> None:  # the next stage taking what arrives
        while not stop.is_set():
            for entry in inbox.list():
                inbox.get(entry["request_id"])
            time.sleep(0.005)

    def raw_acks() -> None:  # raw ZeroMQ: one reply per message received
        poller = zmq.Poller()
        poller.register(raw, zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(50):
                ident, _ = raw.recv_multipart(copy=False)
                raw.send_multipart([ident, b"ok"])

    threads = [threading.Thread(target=consume, name="consume", daemon=True),
               threading.Thread(target=raw_acks, name="raw-acks", daemon=True)]
    for t in threads:
        t.start()
    conn.send((receiver.endpoint, f"tcp://127.0.0.1:{raw_port}"))
    while conn.recv() == "cpu":  # per-thread CPU seconds so far, until "stop"
        conn.send(thread_cpu_s())
    stop.set()
    for t in threads:
        t.join(5)
    receiver.close()
    raw.close(linger=0)
    ctx.term()
    conn.send(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


# ---------------------------------------------------------------------- the AR side
def _engine(model: str, endpoint: str, prompt_tokens: int, requests: int, kv_bytes: int,
            io_cpus: list[int]):
    from omni_runtime.devtools.offline import engine_core_of, omni_llm

    llm = omni_llm(model, {"need_send_cache": True, "timeout_seconds": 60,
                           "kv_transfer_criteria": {"type": "prefill_finished"}},
                   endpoints={"next": endpoint}, io_cpus=io_cpus, kv_cache_memory_bytes=kv_bytes,
                   max_model_len=prompt_tokens + 64, dtype="float32", enforce_eager=True,
                   enable_prefix_caching=False,
                   max_num_batched_tokens=prompt_tokens * requests, max_num_seqs=requests)
    return llm, engine_core_of(llm)


def _round(llm, core, prompts, transfers_on: bool, resolved: list,
           io_cpu: list | None = None, receiver=None) -> list[float]:
    from vllm import SamplingParams

    from omni_runtime.devtools.offline import drain_transfers

    scheduler = core.scheduler
    scheduler._send = transfers_on
    scheduler._criteria = scheduler.omni_kv_config.criteria if transfers_on else None
    inner, times = core.step_fn, []

    def step():
        t0 = time.perf_counter()
        out = inner()
        times.append(time.perf_counter() - t0)
        return out

    core.step_fn = step
    if io_cpu is not None:
        ar0, rx0 = thread_cpu_s(), _receiver_cpu(receiver)
    try:
        llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)
    finally:
        core.step_fn = inner
    drain_transfers(llm, timeout_s=60)
    if io_cpu is not None:
        ar, rx = _cpu_delta(ar0, thread_cpu_s()), _cpu_delta(rx0, _receiver_cpu(receiver))
        io_cpu.append({"copy": _io_threads(ar, "omni-kv-copy"),
                       "sender": _io_threads(ar, "omni-kv-sender"),
                       "zmq_send": _io_threads(ar, "ZMQbg"),
                       "receiver": _io_threads(rx, "omni-kv-receiver", "ZMQbg")})
    return times


def _receiver_cpu(receiver) -> dict[str, float]:
    receiver.send("cpu")
    return receiver.recv()


def measure(model: str, endpoint: str, args, *, prompt_tokens: int, rounds: int,
            kv_bytes: int, receiver) -> dict:
    from omni_runtime.transfers.ledger import TransferObserver

    llm, core = _engine(model, endpoint, prompt_tokens, args.requests, kv_bytes, args.io_cpus)
    resolved: list = []

    class Keep(TransferObserver):
        def on_resolved(self, ledger, transfer):
            resolved.append(transfer)

    core.scheduler.transfer_ledger.add_observer(Keep())
    vocab = 400
    make = lambda r: [{"prompt_token_ids": [int(x) for x in  # noqa: E731
                       np.random.default_rng(r * 100 + i).integers(3, vocab, prompt_tokens)]}
                      for i in range(args.requests)]
    # Warm-up, both ways (layout probe, buffers; the first round after start-up is the
    # slowest whichever way it runs, measured: up to 8% on its prefill).
    _round(llm, core, make(99), True, resolved)
    _round(llm, core, make(98), False, resolved)
    resolved.clear()
    rss0 = _rss_mb()
    on, off, io_cpu = [], [], []
    for r in range(rounds):
        prompts = make(r)
        for transfers_on in ((True, False) if r % 2 == 0 else (False, True)):
            times = _round(llm, core, prompts, transfers_on, resolved,
                           io_cpu if transfers_on else None, receiver)
            (on if transfers_on else off).append(times)
            print(f"# {Path(model).name} transfers {'on ' if transfers_on else 'off'}: steps "
                  f"{[round(t, 3) for t in times]}", file=sys.stderr)
    rss1 = _rss_mb()
    bad = [t for t in resolved if t.outcome.value != "acked"]
    if bad:
        raise RuntimeError(f"transfers not acked: {[(t.request_id, t.reason) for t in bad]}")
    mean_on = statistics.fmean(t for ts in on for t in ts)
    mean_off = statistics.fmean(t for ts in off for t in ts)
    # The first step of a round prefills every prompt; the hand-off goes out in the second
    # (prefill_finished fires after the step that computed the KV).
    decode_on = statistics.fmean(t for ts in on for t in ts[1:])
    decode_off = statistics.fmean(t for ts in off for t in ts[1:])
    handoff_extra = statistics.fmean(ts[1] for ts in on) - statistics.median(
        t for ts in off for t in ts[1:])
    # Hand-off to ack, per round: bytes over the span from the first hand-off to the last ack.
    kv_per_token = None
    spans, nbytes = [], 0
    spec = core.scheduler.kv_cache_config.kv_cache_groups[0].kv_cache_spec
    layers = len(core.scheduler.kv_cache_config.kv_cache_groups[0].layer_names)
    kv_per_token = layers * 2 * spec.num_kv_heads * spec.head_size * 4
    for i in range(0, len(resolved), args.requests):
        batch = resolved[i:i + args.requests]
        spans.append(max(t.resolved_at for t in batch) - min(t.handed_off_at for t in batch))
        nbytes = sum(t.seq_len for t in batch) * kv_per_token
    llm.llm_engine.engine_core.shutdown()
    return {"step_ratio": mean_on / mean_off, "decode_step_ratio": decode_on / decode_off,
            "handoff_step_extra_s": handoff_extra,
            "handoff_step_ratio": max(max(ts) for ts in on) / max(max(ts) for ts in off),
            "mean_step_on_s": mean_on, "mean_step_off_s": mean_off,
            "steps_on": sum(map(len, on)), "steps_off": sum(map(len, off)),
            "bytes_per_round": nbytes, "handoff_to_ack_s": statistics.median(spans),
            "rss_growth_mb": rss1 - rss0,
            "io_cpu": {k: statistics.median(c[k] for c in io_cpu) for k in io_cpu[0]}}


def raw_zmq_seconds(raw_endpoint: str, nbytes: int, count: int, io_cpus: list[int],
                    receiver) -> tuple[float, float]:
    """Raw ZeroMQ: ``count`` messages of ``nbytes / count`` bytes, each answered, as the
    connector's transfers are; from a thread on the transport's CPUs, as the sender's is.
    (best seconds of 3, CPU seconds of the I/O threads of both ends per repetition)."""
    result: list[tuple[float, float]] = []
    rx0 = _receiver_cpu(receiver)
    thread = threading.Thread(target=lambda: result.append(
        _raw_zmq(raw_endpoint, nbytes, count, io_cpus)))
    thread.start()
    thread.join()
    rx = _cpu_delta(rx0, _receiver_cpu(receiver))
    best, sender_cpu = result[0]
    return best, sender_cpu + _io_threads(rx, "raw-acks", "ZMQbg") / RAW_REPEATS


RAW_REPEATS = 3


def _raw_zmq(raw_endpoint: str, nbytes: int, count: int, io_cpus: list[int]
             ) -> tuple[float, float]:
    os.sched_setaffinity(0, io_cpus)
    ctx = zmq.Context()
    for cpu in io_cpus:
        ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(raw_endpoint)
    data = np.random.default_rng(0).standard_normal(nbytes // count // 4, np.float32)
    dealer.send(b"warm")
    dealer.recv()
    best = float("inf")
    cpu0, zmq0 = time.thread_time(), _io_threads(thread_cpu_s(), "ZMQbg")
    for _ in range(RAW_REPEATS):
        t0 = time.perf_counter()
        for _ in range(count):
            dealer.send(memoryview(data.view(np.uint8)), copy=False)
        for _ in range(count):
            dealer.recv()
        best = min(best, time.perf_counter() - t0)
    # Before term(): the context's I/O thread ends with it.
    cpu = time.thread_time() - cpu0 + _io_threads(thread_cpu_s(), "ZMQbg") - zmq0
    dealer.close(linger=0)
    ctx.term()
    return best, cpu / RAW_REPEATS


def transport_seconds(endpoint: str, shape: tuple[int, ...], count: int,
                      io_cpus: list[int]) -> float:
    """The transport alone: ``count`` payloads of ``shape`` from submit() to the last ack,
    from a KVSender on the transport's CPUs to the same receiving process (best of 3)."""
    from omni_runtime.kv.transport import KVPayload, KVSender

    arrays = [np.full(shape, i + 1.0, np.float32) for i in range(count)]
    sender = KVSender({"next": endpoint}, pipeline="bench", stage="ar", io_cpus=io_cpus)
    best = float("inf")
    try:
        for rep in range(3):
            t0 = time.perf_counter()
            for i, kv in enumerate(arrays):
                sender.submit(KVPayload(f"transport-{rep}-{i}", shape[3], kv, pipeline="bench",
                                        from_stage="ar"))
            done = 0
            while done < count:
                if not sender.wait(30.0):
                    raise RuntimeError("transport-only transfers not answered within 30 s")
                acked, failed = sender.poll()
                if failed:
                    raise RuntimeError(f"transport-only transfers failed: {failed}")
                done += len(acked)
            best = min(best, time.perf_counter() - t0)
    finally:
        sender.close()
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=2, help="on/off pairs at the 7B shape (the second pair runs off first)")
    parser.add_argument("--tiny-rounds", type=int, default=2)
    parser.add_argument("--engine-cpus", help="the engine's OpenMP CPUs, e.g. 0 or 0-2")
    parser.add_argument("--io-cpus", help="the transport's and the receiver's CPUs, e.g. 3")
    args = parser.parse_args(argv)
    engine_cpus, args.io_cpus = _cpu_split(args.engine_cpus, args.io_cpus)
    _bind_engine_openmp(engine_cpus)

    from omni_runtime.devtools.tiny_model import ensure_kv7b_model, ensure_tiny_model

    kv7b, tiny = str(ensure_kv7b_model()), str(ensure_tiny_model())
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child, args.io_cpus), daemon=True)
    proc.start()
    endpoint, raw_endpoint = parent.recv()
    try:
        big = measure(kv7b, endpoint, args, prompt_tokens=args.prompt_tokens, rounds=args.rounds,
                      kv_bytes=int(args.requests * (args.prompt_tokens + 64) * 28 * 4096 * 1.5),
                      receiver=parent)
        small = measure(tiny, endpoint, args, prompt_tokens=256, rounds=args.tiny_rounds,
                        kv_bytes=64 << 20, receiver=parent)
        raw_s, raw_cpu_s = raw_zmq_seconds(raw_endpoint, big["bytes_per_round"], args.requests,
                                           args.io_cpus, parent)
        transport_s = transport_seconds(endpoint, (28, 2, 4, args.prompt_tokens, 128),
                                        args.requests, args.io_cpus)
    finally:
        parent.send("stop")
        receiver_peak = parent.recv() if parent.poll(15) else float("nan")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    result = {
        "step_ratio_7b": round(big["step_ratio"], 4),
        "handoff_step_ratio_7b": round(big["handoff_step_ratio"], 4),
        "throughput_ratio_7b": round(raw_s / big["handoff_to_ack_s"], 4),
        "kv_bytes_per_round_7b": big["bytes_per_round"],
        "handoff_to_ack_s_7b": round(big["handoff_to_ack_s"], 4),
        "raw_zmq_s_7b": round(raw_s, 4),
        "transport_ratio_7b": round(raw_s / transport_s, 4),
        "io_cpu_ratio_7b": round(raw_cpu_s / sum(big["io_cpu"].values()), 4),
        "io_cpu_s_7b": round(sum(big["io_cpu"].values()), 4),
        "raw_io_cpu_s_7b": round(raw_cpu_s, 4),
        "io_cpu_split_7b": {k: round(v, 3) for k, v in big["io_cpu"].items()},
        "decode_step_ratio_7b": round(big["decode_step_ratio"], 4),
        "handoff_step_extra_ms_7b": round(big["handoff_step_extra_s"] * 1e3, 1),
        "mean_step_on_s_7b": round(big["mean_step_on_s"], 4),
        "mean_step_off_s_7b": round(big["mean_step_off_s"], 4),
        "steps_on_off_7b": [big["steps_on"], big["steps_off"]],
        "step_ratio_tiny": round(small["step_ratio"], 4),
        "handoff_step_ratio_tiny": round(small["handoff_step_ratio"], 4),
        "ar_rss_growth_mb": round(big["rss_growth_mb"] + small["rss_growth_mb"], 1),
        "receiver_rss_peak_mb": round(receiver_peak, 1),
        "engine_cpus": engine_cpus,
        "io_cpus": args.io_cpus,
        "targets": {k: f"{op} {v}" for k, (op, v) in TARGETS.items()},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
