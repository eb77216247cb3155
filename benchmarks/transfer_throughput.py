"""KV transfer throughput over loopback: the connector (KVSender -> KVReceiver, header,
checksum, store in the inbox, ack) against raw ZeroMQ sending the same bytes (DEALER ->
ROUTER, no header, no checksum, no per-message ack) in the same run.

Each receiver runs in its own process (as a receiving stage does), started and connected
before timing. Connector time: first submit() to the last ack seen by poll(); a consumer
thread in the receiving process takes every payload out of the inbox (as the next stage
would). Raw time: first send to the receiver's one reply after the last message.

    python benchmarks/transfer_throughput.py [--payload-mib 16] [--count 40] [--rounds 3]

The last line of output is one JSON object; ``throughput_ratio`` = connector bytes/s over
raw bytes/s (target >= 0.5). Measurements are functions in MEASUREMENTS: each returns a dict
that is merged into that line. The AR engine's step time with transfers on against off is
``benchmarks/kv_data_path.py``'s, at the tiny and the 7B KV shape, in one engine whose
transfers are switched per round (two in-process engines cannot be compared here: vLLM's KV
connector is one per process, so an engine without transfers would run the other's).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omni_runtime.kv.transport import KVInbox, KVPayload, KVReceiver, KVSender  # noqa: E402
from omni_runtime.kv.transport.wire import CHECKSUMS, DEFAULT_CHECKSUM  # noqa: E402
from omni_runtime.observability.receiver_metrics import ReceiverMetrics  # noqa: E402

# A 7B-class KV slice: 16 layers, 8 KV heads, head_dim 128, float16; seq_len sets the size.
LAYERS, HEADS, HEAD_DIM = 16, 8, 128
BYTES_PER_TOKEN = LAYERS * 2 * HEADS * HEAD_DIM * 2


# ---------------------------------------------------------------------- receiving processes
def _serve_connector(conn, count: int, payload_bytes: int) -> None:
    from prometheus_client import CollectorRegistry

    inbox = KVInbox(max_bytes=max(8 * payload_bytes, 1 << 20), ttl_s=600)
    receiver = KVReceiver("tcp://127.0.0.1:0", inbox, stage="next",
                          max_payload_bytes=payload_bytes * 2,
                          metrics=ReceiverMetrics(stage="next", registry=CollectorRegistry()))
    receiver.start()
    stop = threading.Event()

    def consume() -> None:  # the next stage reading what arrives, in order
        while not stop.is_set():
            for round_ in range(1_000_000):
                for i in range(count):
                    while inbox.get(f"r{round_}-{i}", timeout_s=0.5) is None:
                        if stop.is_set():
                            return

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    conn.send(receiver.endpoint)
    conn.recv()  # "stop"
    stop.set()
    consumer.join(5)
    receiver.close()
    conn.send("stopped")


def _serve_raw(conn, count: int) -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    conn.send(f"tcp://127.0.0.1:{port}")
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    while True:
        if conn.poll(0) and conn.recv() == "stop":
            break
        if not poller.poll(100):
            continue
        frames = router.recv_multipart(copy=False)
        if frames[1].bytes == b"warmup":
            router.send_multipart([frames[0], b"ok"])
            continue
        got = 1
        while got < count:  # one round: count data messages, then one reply
            router.recv_multipart(copy=False)
            got += 1
        router.send_multipart([frames[0], b"done"])
    router.close(linger=0)
    ctx.term()
    conn.send("stopped")


def _start(target, *args):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    endpoint = parent.recv()
    return proc, parent, endpoint


def _stop(proc, conn) -> None:
    conn.send("stop")
    if conn.poll(10):
        conn.recv()
    proc.join(10)
    if proc.is_alive():
        proc.kill()


# ---------------------------------------------------------------------- one timed round each
def _connector_round(sender: KVSender, arrays: list[np.ndarray], seq_len: int,
                     round_: int) -> float:
    start = time.perf_counter()
    for i, kv in enumerate(arrays):
        sender.submit(KVPayload(f"r{round_}-{i}", seq_len, kv, from_stage="ar"))
    done = 0
    while done < len(arrays):
        if not sender.wait(30):
            raise RuntimeError("connector round stalled")
        acked, failed = sender.poll()
        if failed:
            raise RuntimeError(f"transfers failed: {failed}")
        done += len(acked)
    return time.perf_counter() - start


def _raw_round(dealer: zmq.Socket, arrays: list[np.ndarray]) -> float:
    start = time.perf_counter()
    for kv in arrays:
        dealer.send(memoryview(kv.reshape(-1).view(np.uint8)), copy=False)
    if not dealer.poll(30_000):
        raise RuntimeError("raw round stalled")
    dealer.recv()
    return time.perf_counter() - start


def measure_throughput(args: argparse.Namespace) -> dict:
    seq_len = max(1, int(args.payload_mib * (1 << 20)) // BYTES_PER_TOKEN)
    rng = np.random.default_rng(0)
    # Distinct arrays (as the worker's copies would be), allocated and touched before timing.
    arrays = [rng.standard_normal((LAYERS, 2, HEADS, seq_len, HEAD_DIM), np.float32)
              .astype(np.float16) for _ in range(args.count)]
    payload_bytes = arrays[0].nbytes
    total = payload_bytes * len(arrays)

    raw_proc, raw_conn, raw_ep = _start(_serve_raw, args.count)
    kv_proc, kv_conn, kv_ep = _start(_serve_connector, args.count, payload_bytes)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(raw_ep)
    sender = KVSender({"next": kv_ep}, stage="ar", max_in_flight=args.max_in_flight,
                      send_timeout_s=60, checksum_algo=args.checksum)
    try:
        dealer.send(b"warmup")  # connect and handshake before timing
        dealer.poll(30_000)
        dealer.recv()
        # One untimed round each first: the receivers' first allocations and TCP windows.
        _raw_round(dealer, arrays)
        _connector_round(sender, arrays, seq_len, 0)
        raw_s, conn_s = [], []
        for round_ in range(1, args.rounds + 1):  # interleaved, so drift hits both alike
            raw_s.append(_raw_round(dealer, arrays))
            conn_s.append(_connector_round(sender, arrays, seq_len, round_))
            print(f"round {round_}: raw {total / raw_s[-1] / 1e9:.2f} GB/s, connector "
                  f"{total / conn_s[-1] / 1e9:.2f} GB/s", file=sys.stderr)
    finally:
        sender.close()
        dealer.close(linger=0)
        ctx.term()
        _stop(raw_proc, raw_conn)
        _stop(kv_proc, kv_conn)
    raw_bps = total / statistics.median(raw_s)
    conn_bps = total / statistics.median(conn_s)
    return {
        "throughput_ratio": round(conn_bps / raw_bps, 3),
        "connector_bytes_per_s": round(conn_bps),
        "raw_zmq_bytes_per_s": round(raw_bps),
        "payload_bytes": payload_bytes,
        "payloads_per_round": len(arrays),
        "rounds": args.rounds,
        "checksum": args.checksum,
    }


#: name -> measurement; each returns keys merged into the final JSON line.
MEASUREMENTS: dict[str, Callable[[argparse.Namespace], dict]] = {
    "throughput": measure_throughput,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--payload-mib", type=float, default=16.0, help="size of one KV payload")
    p.add_argument("--count", type=int, default=32, help="payloads per round")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per method (median)")
    p.add_argument("--max-in-flight", type=int, default=8, help="the sender's in-flight cap")
    p.add_argument("--checksum", default=DEFAULT_CHECKSUM, choices=sorted(CHECKSUMS),
                   help="the sender's checksum algorithm")
    p.add_argument("--only", action="append", choices=sorted(MEASUREMENTS),
                   help="run only these measurements (repeatable)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result: dict = {}
    for name, fn in MEASUREMENTS.items():
        if args.only and name not in args.only:
            continue
        start = time.perf_counter()
        part = fn(args)
        print(f"{name}: {part} ({time.perf_counter() - start:.1f}s)", file=sys.stderr)
        result.update(part)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
