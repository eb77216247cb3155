"""The KV data plane at real sizes: the real vLLM engine with the omni KV connector, a
receiving process reading the engine's KV cache over NIXL, against a bare NIXL READ and a bare
ZeroMQ socket moving the same bytes between the same two processes, in one run.

At the 7B KV shape (the ``kv7b`` recipe: 28 layers, 4 KV heads, head size 128, float32) the
same concurrent prompts run in rounds interleaved with transfers on and off
(``prefill_finished``), in one engine (in-process engine core, so its steps can be timed).
Transfers are switched off for a round by turning the scheduler's ``need_send_cache`` off.
Prefix caching is off (the second run of a pair would skip its prefill).

CPUs are split as vLLM's CPU binding does on a real host: the engine's OpenMP threads on
``--engine-cpus``; the connector's threads (``io_cpus``), the receiving process and every
reference on ``--io-cpus``. Default: the last CPU for I/O, the others for the engine.

    python benchmarks/kv_data_path.py [--requests 4] [--prompt-tokens 1024] [--rounds 1]

Last line, one JSON object:
  * ``step_ratio_7b``: mean engine step time, on over off (target <= 1.03);
  * ``handoff_step_ratio_7b``: slowest step on over slowest step off (target <= 1.10);
  * ``zmq_ratio_7b``: KV bytes/s from hand-off to the AR's ack (the receiver read the blocks,
    was told commit and stored each payload), over a bare ZeroMQ socket sending the same
    bytes between the same two processes, each message answered (target >= 2.0);
  * ``nixl_ratio_7b``: the same over bare NIXL READs of the same bytes between the same two
    processes under the same load, paired with them in the same round: once the round's
    transfers are acked, while the engine still decodes the same batch, the receiving process
    reads the very cache blocks those transfers read (the same addresses, runs and
    descriptors), one READ per transfer, its connection wired up beforehand (target >= 0.8).
    ``nixl_idle_ratio_7b``: against the best of 3 READs of as many bytes from a buffer of
    their own, the engine stopped;
  * ``mean_handoff_to_ack_s_7b``: a transfer's own hand-off to ack, the mean over the
    round's transfers (``handoff_to_ack_s_7b`` is the round's, first hand-off to last ack);
  * ``ar_cpu_ms_per_transfer_7b``: the AR process's CPU time per transfer outside the engine's
    threads (the connector's sender thread, ZeroMQ's, UCX's and NIXL's progress thread; not the engine's main
    thread nor its idle gloo threads), on rounds minus off rounds; ``copy_send_cpu_ms_per_transfer_7b``: what the AR did per transfer before NIXL,
    measured here on the same cache: copying the transfer's blocks out to a host buffer plus
    a bare ZeroMQ send of it; their ratio ``ar_cpu_ratio_7b`` (target <= 0.10);
  * ``synthetic_nixl_ratio_7b``: the data plane alone against the bare READs with the engine
    stopped: offer to ack from a synthetic 7B-shaped AR rank
    (omni_runtime/devtools/synthetic_ar.py) in the AR's process once the engine has stopped;
  * ``tcp_zmq_ratio_7b``: the data plane over UCX's TCP transport (the synthetic rank's agent
    on ``UCX_TLS=tcp``, the stand-in for two hosts without RDMA), offer to ack, against bare
    ZeroMQ;
  * ``consumer_get_ms_per_transfer_7b``: what the next stage pays to take a payload (the
    inbox's ``get``: the layout conversion from the AR's blocks to ``[layers, 2, H, T, D]``,
    which a host receiver leaves off the ack's path). The next stage takes each round's
    payloads after the round's acks: the receiving process is pinned to the one I/O CPU
    here, where a real next stage consumes on CPUs (or a GPU) of its own;
  * ``receiver_rss_peak_mb``, ``ar_rss_growth_mb``.
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
           "zmq_ratio_7b": (">=", 2.0), "nixl_ratio_7b": (">=", 0.8),
           "ar_cpu_ratio_7b": ("<=", 0.10)}
#: The 7B shape: 28 layers, 4 KV heads, head size 128, float32.
SHAPE_7B = dict(layers=28, heads=4, head_size=128)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _engine_side_threads() -> set[int]:
    """The engine's torch.distributed (gloo) loop threads: idle, no part of a transfer, and
    a dozen of them: their few milliseconds of jitter per round would swamp the connector's
    own CPU time."""
    out = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith("gloo"):
                    out.add(int(tid))
        except OSError:
            pass
    return out


def thread_cpu_s() -> dict[int, float]:
    """CPU seconds of each of this process's threads, by thread id (the scheduler's run time,
    in nanoseconds: /proc's tick-based counters are too coarse for a few ms)."""
    out: dict[int, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0]) / 1e9
        except OSError:  # the thread ended meanwhile
            continue
    return out


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
    """The receiving stage (a KVReceiver into an inbox the next stage empties on command),
    a bare ZeroMQ ROUTER answering each message, and a bare NIXL reader, in one process on
    ``io_cpus``."""
    os.sched_setaffinity(0, io_cpus)  # before any thread starts: all of them inherit it
    import torch

    from omni_runtime.kv.transport import KVInbox, KVReceiver
    from omni_runtime.kv.transport.nixl_agent import DONE, KVAgent
    from omni_runtime.stages.heap import freeze_startup_heap

    inbox = KVInbox(max_bytes=4 << 30)
    receiver = KVReceiver("tcp://127.0.0.1:0", inbox, pipeline="bench", stage="next",
                          max_payload_bytes=2 << 30).start()
    ctx = zmq.Context()
    raw = ctx.socket(zmq.ROUTER)
    raw_port = raw.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def consume() -> tuple[int, float]:  # the next stage taking what arrived
        t0, taken = time.perf_counter(), 0
        for entry in inbox.list():
            taken += inbox.get(entry["request_id"]) is not None
        return taken, time.perf_counter() - t0

    def raw_acks() -> None:  # bare ZeroMQ: one reply per message received
        poller = zmq.Poller()
        poller.register(raw, zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(50):
                ident, _ = raw.recv_multipart(copy=False)
                raw.send_multipart([ident, b"ok"])

    threads = [threading.Thread(target=raw_acks, name="raw-acks", daemon=True)]
    for t in threads:
        t.start()
    bare = KVAgent(f"bare-reader-{os.getpid()}")
    remotes: dict[bytes, str] = {}
    landing = None
    freeze_startup_heap()  # as the receiving stage does once started (stages/heap.py)
    conn.send((receiver.endpoint, f"tcp://127.0.0.1:{raw_port}"))
    while True:
        cmd = conn.recv()
        if cmd[0] == "bare":  # one READ per transfer: each a list of (addr, length, device)
            _, metadata, transfers, repeats = cmd
            size = max(sum(length for _, length, _ in t) for t in transfers)
            if landing is None or landing.numel() < size:
                landing = torch.empty(size, dtype=torch.uint8).zero_()
                bare.register([(landing.data_ptr(), size, 0)], "DRAM")
            if metadata not in remotes:  # kept: each agent is wired up once
                remotes[metadata] = bare.add_remote(metadata)
            name = remotes[metadata]
            reads = []
            for t in transfers:  # into the landing buffer, back to back
                local, offset = [], landing.data_ptr()
                for _, length, _ in t:
                    local.append((offset, length, 0))
                    offset += length
                reads.append((np.array(local, dtype=np.uint64), np.array(t, dtype=np.uint64)))

            def read(local, remote) -> None:
                handle = bare.read(local, "DRAM", remote, "DRAM", name)
                while (state := bare.state(handle)) != DONE:
                    assert state != "ERR", "bare NIXL READ failed"
                bare.release(handle)

            # The connection's wire-up (UCX endpoint, the remote keys) before the clock starts,
            # as the data plane's is done by the warm-up round.
            read(reads[0][0][:1], reads[0][1][:1])
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                for local, remote in reads:
                    read(local, remote)
                best = min(best, time.perf_counter() - t0)
            conn.send(best)
        elif cmd[0] == "consume":
            conn.send(consume())
        elif cmd[0] == "split":  # the receiver's time reading and assembling, so far
            conn.send((receiver.read_seconds, receiver.assemble_seconds, receiver.num_delivered))
        elif cmd[0] == "stop":
            break
    stop.set()
    for t in threads:
        t.join(5)
    receiver.close()
    raw.close(linger=0)
    ctx.term()
    conn.send(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def _start_receiver(ctx, io_cpus: list[int]):
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child, io_cpus), daemon=True)
    proc.start()
    endpoint, raw_endpoint = parent.recv()
    return proc, parent, endpoint, raw_endpoint


def _stop_receiver(proc, pipe) -> float:
    pipe.send(("stop",))
    peak = pipe.recv() if pipe.poll(15) else float("nan")
    proc.join(10)
    if proc.is_alive():
        proc.kill()
    return peak


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


class _AckTimes:
    """When the connector's sender reported each transfer acked (the AR knows it there; the
    scheduler sees it at the end of the step that is running then)."""

    def __init__(self) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        sender = get_kv_transfer_group().worker_half._sender
        self.times: dict[str, float] = {}
        report = sender._report_locked

        def stamped(t, failure):
            reported = report(t, failure)
            if reported and failure is None:
                self.times[t.offer.request_id] = time.monotonic()
            return reported

        sender._report_locked = stamped


def _round(llm, core, prompts, transfers_on: bool, cpu: list | None,
           before_step=None) -> list[float]:
    """One round of the prompts; the engine step times. ``before_step(k)`` is called as step
    ``k`` starts (step 0 prefills every prompt; a round with transfers on hands them off in
    step 1)."""
    from vllm import SamplingParams

    from omni_runtime.devtools.offline import drain_transfers

    scheduler = core.scheduler
    scheduler._send = transfers_on
    scheduler._criteria = scheduler.omni_kv_config.criteria if transfers_on else None
    inner, times = core.step_fn, []

    def step():
        if before_step is not None:
            before_step(len(times))
        t0 = time.perf_counter()
        out = inner()
        times.append(time.perf_counter() - t0)
        return out

    core.step_fn = step
    main_tid = threading.get_native_id()
    before = thread_cpu_s()
    try:
        llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                     use_tqdm=False)
    finally:
        core.step_fn = inner
    drain_transfers(llm, timeout_s=60)
    if cpu is not None:  # every thread but the engine's (OMP_NUM_THREADS=1: the main thread)
        after = thread_cpu_s()
        engine = _engine_side_threads() | {main_tid}
        cpu.append(sum(v - before.get(k, 0.0) for k, v in after.items() if k not in engine))
        if os.environ.get("KVDP_THREADS"):
            names = {}
            for k in after:
                try:
                    names[k] = open(f"/proc/self/task/{k}/comm").read().strip()
                except OSError:
                    names[k] = "?"
            print("# threads", transfers_on, {f"{names[k]}:{k}": round(v - before.get(k, 0.0), 4)
                  for k, v in after.items() if v - before.get(k, 0.0) > 0.001}, file=sys.stderr)
    return times


def _split(pipe) -> tuple[float, float, int]:
    pipe.send(("split",))
    return pipe.recv()


def _consume(pipe) -> tuple[int, float]:
    """The next stage takes every stored payload: (how many, seconds)."""
    pipe.send(("consume",))
    return pipe.recv()


def measure(model: str, endpoint: str, args, *, prompt_tokens: int, rounds: int,
            kv_bytes: int, pipe) -> dict:
    from omni_runtime.transfers.ledger import TransferObserver

    llm, core = _engine(model, endpoint, prompt_tokens, args.requests, kv_bytes, args.io_cpus)
    acks = _AckTimes()
    resolved: list = []

    class Keep(TransferObserver):
        def on_resolved(self, ledger, transfer):
            resolved.append(transfer)

    core.scheduler.transfer_ledger.add_observer(Keep())
    vocab = 400
    make = lambda r: [{"prompt_token_ids": [int(x) for x in  # noqa: E731
                       np.random.default_rng(r * 100 + i).integers(3, vocab, prompt_tokens)]}
                      for i in range(args.requests)]
    # Warm-up, transfers on: the receiver's hello, NIXL's wire-up, the payload pool's slabs,
    # and the first round after start-up, the slowest whichever way it runs.
    print("# engine up", file=sys.stderr, flush=True)
    _round(llm, core, make(99), True, None)
    _consume(pipe)
    resolved.clear()
    # The reference for hand-off to ack under the same load, paired with it in the same round:
    # once every transfer of a round with transfers on has been acked, while the engine still
    # decodes the same batch on its CPUs (the copies' speed varies from round to round on this
    # shared memory bus), bare READs of the very cache blocks those transfers read.
    reference = SameBlocksReference(prompt_tokens, pipe)
    rss0 = _rss_mb()
    split0 = _split(pipe)
    on, off, cpu_on, cpu_off, gets, bare_loaded = [], [], [], [], [], []
    for r in range(rounds):
        prompts = make(r)
        for transfers_on in ((True, False) if r % 2 == 0 else (False, True)):
            base, asked = len(resolved), []

            def after_the_acks(k: int) -> None:
                if not asked and len(resolved) - base >= args.requests:
                    reference.ask(pipe, [list(t.block_ids)
                                         for t in resolved[base:base + args.requests]])
                    asked.append(k)

            times = _round(llm, core, prompts, transfers_on,
                           cpu_on if transfers_on else cpu_off,
                           after_the_acks if transfers_on else None)
            (on if transfers_on else off).append(times)
            if transfers_on:
                if not asked:
                    raise RuntimeError("the round ended before its transfers were acked: no "
                                       "decode steps left to time the reference under")
                if not pipe.poll(30):
                    raise RuntimeError("the reference READs did not finish")
                bare_loaded.append(pipe.recv())
                print(f"# reference READs from step {asked[0]} of {len(times)}",
                      file=sys.stderr)
                taken, seconds = _consume(pipe)
                gets.append(seconds / max(1, taken))
            print(f"# {Path(model).name} transfers {'on ' if transfers_on else 'off'}: "
                  f"steps {[round(t, 3) for t in times]}", file=sys.stderr)
    rss1 = _rss_mb()
    split1 = _split(pipe)
    bad = [t for t in resolved if t.outcome.value != "acked"]
    if bad:
        raise RuntimeError(f"transfers not acked: {[(t.request_id, t.reason) for t in bad]}")
    mean_on = statistics.fmean(t for ts in on for t in ts)
    mean_off = statistics.fmean(t for ts in off for t in ts)
    decode_on = statistics.fmean(t for ts in on for t in ts[1:])
    decode_off = statistics.fmean(t for ts in off for t in ts[1:])
    handoff_extra = statistics.fmean(ts[1] for ts in on) - statistics.median(
        t for ts in off for t in ts[1:])
    # Hand-off to ack, per round: from the first hand-off to the last ack the AR got.
    spec = core.scheduler.kv_cache_config.kv_cache_groups[0].kv_cache_spec
    layers = len(core.scheduler.kv_cache_config.kv_cache_groups[0].layer_names)
    kv_per_token = layers * 2 * spec.num_kv_heads * spec.head_size * 4
    spans, nbytes = [], 0
    for i in range(0, len(resolved), args.requests):
        batch = resolved[i:i + args.requests]
        spans.append(max(acks.times[t.request_id] for t in batch)
                     - min(t.handed_off_at for t in batch))
        nbytes = sum(t.seq_len for t in batch) * kv_per_token
    each = [acks.times[t.request_id] - t.handed_off_at for t in resolved]
    if nbytes != reference.nbytes:
        raise RuntimeError(f"the rounds moved {nbytes} bytes, the loaded reference read "
                           f"{reference.nbytes}")
    copy_s = _copy_out_seconds(core, args.requests, prompt_tokens)
    llm.llm_engine.engine_core.shutdown()
    return {"step_ratio": mean_on / mean_off, "decode_step_ratio": decode_on / decode_off,
            "handoff_step_extra_s": handoff_extra,
            "handoff_step_ratio": max(max(ts) for ts in on) / max(max(ts) for ts in off),
            "mean_step_on_s": mean_on, "mean_step_off_s": mean_off,
            "bytes_per_round": nbytes, "handoff_to_ack_s": statistics.median(spans),
            "mean_handoff_to_ack_s": statistics.fmean(each),
            "bare_loaded_s": statistics.median(bare_loaded),
            "ar_cpu_s_per_transfer": max(0.0, statistics.fmean(cpu_on) - statistics.fmean(cpu_off))
            / args.requests,
            "copy_out_s_per_transfer": copy_s,
            "consumer_get_s": statistics.fmean(gets),
            # The receiver's time per round reading (posted to done, summed over the reads
            # in flight) and assembling.
            "rx_read_s": (split1[0] - split0[0]) / rounds,
            "rx_assemble_s": (split1[1] - split0[1]) / rounds,
            "rss_growth_mb": rss1 - rss0}


def _copy_out_seconds(core, requests: int, prompt_tokens: int) -> float:
    """What the AR's step did per transfer before NIXL: copy the transfer's blocks out of the
    engine's cache into a host buffer [layers, 2, H, seq_len, D] (the same strided copy, here
    the receiver's assembly code run on the engine's own cache, from a thread on the I/O
    CPUs as the old copier thread ran). CPU seconds per transfer, best of 3."""
    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from omni_runtime.kv.transport.assemble import assemble_chunk

    worker = get_kv_transfer_group().worker_half
    fmt = worker._sender.hello.block_format
    caches = worker.caches
    blocks = prompt_tokens // fmt.block_size
    out = torch.empty(len(caches), 2, fmt.num_kv_heads, blocks * fmt.block_size, fmt.head_size)
    best = float("inf")
    for _ in range(3):
        t0 = time.thread_time()
        for _ in range(requests):
            for layer, cache in enumerate(caches):
                staged = cache.view(-1).view(torch.uint8)[: blocks * fmt.block_bytes]
                assemble_chunk(staged, fmt, 1, blocks, blocks * fmt.block_size,
                               out[layer:layer + 1])
        best = min(best, (time.thread_time() - t0) / requests)
    return best


def raw_zmq(raw_endpoint: str, nbytes: int, count: int, io_cpus: list[int]
            ) -> tuple[float, float]:
    """Bare ZeroMQ: ``count`` messages of ``nbytes / count`` bytes, each answered, from a
    thread on the I/O CPUs. (best seconds of 3, the sending thread's CPU s per message)."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(
        _raw_zmq(raw_endpoint, nbytes, count, io_cpus)))
    thread.start()
    thread.join()
    return result[0]


def _raw_zmq(raw_endpoint: str, nbytes: int, count: int, io_cpus: list[int]):
    os.sched_setaffinity(0, io_cpus)
    ctx = zmq.Context()
    for cpu in io_cpus:
        ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(raw_endpoint)
    data = np.random.default_rng(0).standard_normal(nbytes // count // 4, np.float32)
    dealer.send(b"warm")
    dealer.recv()
    best, repeats = float("inf"), 3
    before = thread_cpu_s()
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(count):
            dealer.send(memoryview(data.view(np.uint8)), copy=False)
        for _ in range(count):
            dealer.recv()
        best = min(best, time.perf_counter() - t0)
    after = thread_cpu_s()
    dealer.close(linger=0)
    ctx.term()
    me = threading.get_native_id()
    # The sending side: this thread and ZeroMQ's I/O thread (the only other new thread).
    send_cpu = sum(v - before.get(k, 0.0) for k, v in after.items()
                   if k == me or k not in before)
    return best, send_cpu / (repeats * count)


class SameBlocksReference:
    """Bare NIXL READs of the very bytes a round's transfers read: their blocks in the engine's
    KV cache (the regions the connector's NIXL agent registered, as its hello describes them),
    one READ per transfer into the receiving process's buffer, none of the data plane's
    protocol. On UCX's ``cma`` transport the side whose memory is read
    needs no progress (omni_runtime/kv/transport/nixl_agent.py), so none is made here."""

    def __init__(self, prompt_tokens: int, pipe) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        from omni_runtime.kv.transport.protocol import blocks_needed

        sender = get_kv_transfer_group().worker_half._sender
        self._hello, self._metadata = sender.hello, sender.agent.metadata()
        self._blocks = blocks_needed(prompt_tokens, self._hello.block_format.block_size)
        self.nbytes = 0
        # Wire the reader up to the connector's agent now, between rounds: connecting takes
        # the agent's progress, which its sender makes only while its own reads are in flight
        # (none now, so this thread is the only one progressing it).
        first = self._hello.regions[0]
        pipe.send(("bare", self._metadata,
                   [[(first.addr, self._hello.block_format.block_bytes, first.device)]], 1))
        _progress_until_answered(pipe, sender.agent)

    def ask(self, pipe, blocks: list[list[int]]) -> None:
        """The receiving process reads ``blocks`` (per transfer, the cache blocks it read: the
        same addresses in the same runs, so the same descriptors); ``pipe.recv()`` gives its
        seconds."""
        from omni_runtime.kv.transport.protocol import block_runs

        block_bytes = self._hello.block_format.block_bytes
        transfers = []
        for ids in blocks:
            runs = block_runs(ids[:self._blocks])  # as a transfer's offer has them
            transfers.append([(r.addr + first * block_bytes, count * block_bytes, r.device)
                              for r in self._hello.regions for first, count in runs])
        self.nbytes = sum(length for t in transfers for _, length, _ in t)
        pipe.send(("bare", self._metadata, transfers, 1))


def _progress_until_answered(pipe, agent, timeout_s: float = 60.0):
    """The receiving process's answer to what was just sent it, ``agent`` (whose memory it
    reads) progressed every millisecond meanwhile, as the connector's sender progresses its own
    while reads of it are in flight (and a new connection to it needs)."""
    deadline = time.monotonic() + timeout_s
    while not pipe.poll(0.001):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no answer from the receiving process within {timeout_s} s")
        agent.progress()
    return pipe.recv()


def bare_nixl(pipe, nbytes: int, count: int, io_cpus: list[int]) -> float:
    """Bare NIXL READs by the receiving process of ``count`` regions of ``nbytes / count``
    bytes registered here, with an agent of their own progressed from a thread on the I/O
    CPUs, the engine stopped (best seconds of 3)."""
    import torch

    from omni_runtime.kv.transport.nixl_agent import KVAgent

    size = nbytes // count
    source = torch.randn(nbytes // 4)
    agent = KVAgent(f"bare-source-{os.getpid()}")
    agent.register([(source.data_ptr(), nbytes, 0)], "DRAM")
    result: list[float] = []

    def progress() -> None:
        os.sched_setaffinity(0, io_cpus)
        result.append(_progress_until_answered(pipe, agent))

    try:
        base = source.data_ptr()
        pipe.send(("bare", agent.metadata(), [[(base + i * size, size, 0)] for i in range(count)],
                   3))
        thread = threading.Thread(target=progress, name="bare-progress", daemon=True)
        thread.start()
        thread.join()
        return result[0]
    finally:
        agent.close()


# ---------------------------------------------------------------------- the data plane alone
def synthetic_offer_to_ack(endpoint: str, consume, io_cpus: list[int], prompt_tokens: int,
                           count: int, rounds: int = 3) -> float:
    """Offer to ack of ``count`` transfers from a synthetic 7B-shaped AR rank in this process
    (omni_runtime/devtools/synthetic_ar.py): the data plane alone. Best seconds of ``rounds``
    after a warm-up one (as the bare READ's); ``consume()`` (the next stage taking the
    payloads) after each round."""
    import torch

    from omni_runtime.devtools.synthetic_ar import SyntheticAR

    blocks = prompt_tokens // 16
    ar = SyntheticAR(**SHAPE_7B, block_size=16, num_blocks=blocks * count + 1,
                     dtype=torch.float32, stage="ar", pipeline="bench", seed=None)
    sender = ar.sender({"next": endpoint}, io_cpus=io_cpus)

    def one_round(tag: str) -> float:
        t0 = time.perf_counter()
        for i in range(count):
            sender.submit(ar.offer(f"{tag}-{i}", range(i * blocks, (i + 1) * blocks),
                                   prompt_tokens), timeout_s=60)
        done = {}
        while len(done) < count:
            if not sender.wait(60):
                raise RuntimeError(f"{tag} transfers not answered within 60 s")
            done.update(sender.poll())
        seconds = time.perf_counter() - t0
        failed = {k: v for k, v in done.items() if v[1] is not None}
        if failed:
            raise RuntimeError(f"{tag} transfers failed: {failed}")
        consume()
        return seconds

    try:
        one_round("warm")
        return min(one_round(f"measured-{i}") for i in range(rounds))
    finally:
        sender.close()
        ar.close()


def _tcp_ar(conn, endpoint: str, io_cpus: list[int], prompt_tokens: int, count: int) -> None:
    """A process whose synthetic rank has only UCX's TCP transport (set before NIXL loads):
    the receiver reads it over TCP, the one transport both sides have."""
    os.environ["UCX_TLS"] = "tcp"
    os.sched_setaffinity(0, io_cpus)

    def consume() -> None:  # by the parent, which holds the receiving process's pipe
        conn.send("consume")
        conn.recv()

    conn.send(synthetic_offer_to_ack(endpoint, consume, io_cpus, prompt_tokens, count,
                                     rounds=1))


def tcp_offer_to_ack(ctx, endpoint: str, pipe, io_cpus: list[int], prompt_tokens: int,
                     count: int) -> float:
    parent, child = ctx.Pipe()
    ar = ctx.Process(target=_tcp_ar, args=(child, endpoint, io_cpus, prompt_tokens, count),
                     daemon=True)
    ar.start()
    try:
        while True:
            if not parent.poll(60):
                raise RuntimeError("the UCX_TLS=tcp measurement did not finish within 60 s")
            message = parent.recv()
            if message != "consume":
                return message
            _consume(pipe)
            parent.send("ok")
    finally:
        ar.join(10)
        if ar.is_alive():
            ar.kill()


def _phase(name: str, started: float) -> None:
    print(f"# {name} done at {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=1, help="on/off pairs at the 7B shape (every second pair runs off first); one keeps the run under a minute")
    parser.add_argument("--engine-cpus", help="the engine's OpenMP CPUs, e.g. 0 or 0-2")
    parser.add_argument("--io-cpus", help="the transport's and the receiver's CPUs, e.g. 3")
    parser.add_argument("--skip-tcp", action="store_true", help="no UCX_TLS=tcp measurement")
    args = parser.parse_args(argv)
    engine_cpus, args.io_cpus = _cpu_split(args.engine_cpus, args.io_cpus)
    _bind_engine_openmp(engine_cpus)
    started = time.monotonic()

    from omni_runtime.devtools.tiny_model import ensure_kv7b_model

    kv7b = str(ensure_kv7b_model())
    ctx = mp.get_context("spawn")
    proc, pipe, endpoint, raw_endpoint = _start_receiver(ctx, args.io_cpus)
    try:
        big = measure(kv7b, endpoint, args, prompt_tokens=args.prompt_tokens, rounds=args.rounds,
                      kv_bytes=int(args.requests * (args.prompt_tokens + 64) * 28 * 4096 * 1.5),
                      pipe=pipe)
        _phase("engine rounds", started)
        raw_s, raw_send_cpu = raw_zmq(raw_endpoint, big["bytes_per_round"], args.requests,
                                      args.io_cpus)
        nixl_s = bare_nixl(pipe, big["bytes_per_round"], args.requests, args.io_cpus)
        _phase("bare ZeroMQ and NIXL", started)
        alone_s = synthetic_offer_to_ack(endpoint, lambda: _consume(pipe), args.io_cpus,
                                         args.prompt_tokens, args.requests)
        _phase("synthetic rank", started)
        tcp_s = None if args.skip_tcp else tcp_offer_to_ack(
            ctx, endpoint, pipe, args.io_cpus, args.prompt_tokens, args.requests)
        _phase("UCX over TCP", started)
    finally:
        receiver_peak = _stop_receiver(proc, pipe)
    ours = big["handoff_to_ack_s"]
    copy_send = big["copy_out_s_per_transfer"] + raw_send_cpu
    result = {
        "step_ratio_7b": round(big["step_ratio"], 4),
        "handoff_step_ratio_7b": round(big["handoff_step_ratio"], 4),
        "zmq_ratio_7b": round(raw_s / ours, 4),
        "nixl_ratio_7b": round(big["bare_loaded_s"] / ours, 4),
        "nixl_idle_ratio_7b": round(nixl_s / ours, 4),
        "ar_cpu_ratio_7b": round(big["ar_cpu_s_per_transfer"] / copy_send, 4),
        "ar_cpu_ms_per_transfer_7b": round(big["ar_cpu_s_per_transfer"] * 1e3, 2),
        "copy_send_cpu_ms_per_transfer_7b": round(copy_send * 1e3, 2),
        "synthetic_nixl_ratio_7b": round(nixl_s / alone_s, 4),
        "synthetic_offer_to_ack_s_7b": round(alone_s, 4),
        "tcp_zmq_ratio_7b": round(raw_s / tcp_s, 4) if tcp_s else None,
        "tcp_offer_to_ack_s_7b": round(tcp_s, 4) if tcp_s else None,
        "kv_bytes_per_round_7b": big["bytes_per_round"],
        "handoff_to_ack_s_7b": round(ours, 4),
        "mean_handoff_to_ack_s_7b": round(big["mean_handoff_to_ack_s"], 4),
        "raw_zmq_s_7b": round(raw_s, 4),
        "bare_nixl_s_7b": round(big["bare_loaded_s"], 4),
        "bare_nixl_idle_s_7b": round(nixl_s, 4),
        "receiver_read_s_7b": round(big["rx_read_s"], 4),
        "receiver_assemble_s_7b": round(big["rx_assemble_s"], 4),
        "consumer_get_ms_per_transfer_7b": round(big["consumer_get_s"] * 1e3, 1),
        "decode_step_ratio_7b": round(big["decode_step_ratio"], 4),
        "handoff_step_extra_ms_7b": round(big["handoff_step_extra_s"] * 1e3, 1),
        "mean_step_on_s_7b": round(big["mean_step_on_s"], 4),
        "mean_step_off_s_7b": round(big["mean_step_off_s"], 4),
        "ar_rss_growth_mb": round(big["rss_growth_mb"], 1),
        "receiver_rss_peak_mb": round(receiver_peak, 1),
        "engine_cpus": engine_cpus,
        "io_cpus": args.io_cpus,
        "seconds": round(time.monotonic() - started, 1),
        "targets": {k: f"{op} {v}" for k, (op, v) in TARGETS.items()},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
