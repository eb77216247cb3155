"""The KV control plane's messages on NIXL notifications against ZeroMQ, between two processes.

What the move of the KV control onto NIXL (the seed's ZeroMQ DEALER/ROUTER today) would
trade, measured before it is made, in one run:

  * a control message and its answer (200 bytes each way, as a read descriptor and its
    reply): over ZeroMQ as the control plane runs now (a DEALER and a ROUTER, each side
    blocked in ``recv`` until the message comes), and as NIXL notifications
    (``send_notif`` / ``get_new_notifs``) with each side polling for them, back to back
    (``busy``) or sleeping ``--poll-ms`` between polls that found nothing (``polled``: what
    an idle stage can afford), over UCX's shared memory and over its TCP transport;
  * a read's completion, as the side whose memory was read learns it: the READ carrying a
    notification that NIXL delivers once the bytes are read, against the reader polling the
    READ to its end and then sending a ZeroMQ message (what the ``read_done`` message does now);
  * what polling costs while nothing comes: the CPU of a thread polling every ``--poll-ms``.

The AR-like side's agent has NIXL's progress thread (as the AR's sender has); the
receiver-like side progresses its own (as the receiver does). Last line, one JSON object:
``*_p50_us``/``*_p99_us`` per way, ``notif_rtt_ratio`` (busy notifications over ZeroMQ),
``notif_polled_rtt_ratio``, ``read_done_ratio`` (the notification over polling plus a
ZeroMQ message) and ``idle_poll_cpu_pct``.

    python benchmarks/kv_control_rtt.py [--messages 1000] [--poll-ms 1]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

MESSAGE = b"m" * 200
READ_BYTES = 1 << 20
WARMUP = 50


def _wait_notification(agent, poll_s: float) -> list:
    while True:
        got = agent.notifications()
        if got:
            return got
        if poll_s:
            time.sleep(poll_s)


def _ar_side(pipe, tls: str | None, messages: int, poll_s: float) -> None:
    """The side whose memory is read; answers every message it gets."""
    if tls:
        os.environ["UCX_TLS"] = tls
    import zmq

    from omni_runtime.kv.transport.nixl_agent import KVAgent

    agent = KVAgent(f"ar-{tls}-{os.getpid()}", progress_thread=True)
    src = np.ones(READ_BYTES, dtype=np.uint8)
    agent.register([(src.ctypes.data, src.nbytes, 0)], "DRAM")
    pipe.send((agent.metadata(), src.ctypes.data))
    peer = agent.add_remote(pipe.recv())
    router = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    pipe.send(port)
    for mode in pipe.recv():
        if mode == "zmq":
            for _ in range(messages):
                router.send_multipart(router.recv_multipart())
        elif mode in ("busy", "polled"):
            answered = 0
            while answered < messages:
                for _, message in _wait_notification(agent, poll_s if mode == "polled" else 0.0):
                    agent.notify(peer, message)
                    answered += 1
        elif mode == "read_notif":
            seen = []
            while len(seen) < messages:
                seen += [time.perf_counter() for _ in _wait_notification(agent, 0.0)]
            pipe.send(seen)
        elif mode == "read_zmq":
            pipe.send([(router.recv_multipart(), time.perf_counter())[1] for _ in range(messages)])
        pipe.recv()  # the other side is done with this mode
    router.close(0)
    agent.close()


def _receiver_side(pipe, results_queue, tls: str | None, messages: int, poll_s: float, modes: list[str]) -> None:
    """The reading side: sends each message and times its answer; posts the reads."""
    if tls:
        os.environ["UCX_TLS"] = tls
    import zmq

    from omni_runtime.kv.transport.nixl_agent import DONE, KVAgent

    agent = KVAgent(f"rx-{tls}-{os.getpid()}")
    dst = np.zeros(READ_BYTES, dtype=np.uint8)
    agent.register([(dst.ctypes.data, dst.nbytes, 0)], "DRAM")
    metadata, src_addr = pipe.recv()
    peer = agent.add_remote(metadata)
    pipe.send(agent.metadata())
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{pipe.recv()}")
    local = np.array([[dst.ctypes.data, dst.nbytes, 0]], dtype=np.uint64)
    remote = np.array([[src_addr, READ_BYTES, 0]], dtype=np.uint64)
    results = {}
    pipe.send(modes)
    for mode in modes:
        times = []
        for i in range(messages):
            started = time.perf_counter()
            if mode == "zmq":
                dealer.send(MESSAGE)
                dealer.recv()
            elif mode in ("busy", "polled"):
                agent.notify(peer, MESSAGE)
                _wait_notification(agent, poll_s if mode == "polled" else 0.0)
            else:
                handle = agent.read(local, "DRAM", remote, "DRAM", peer,
                                    notify=b"read_done %d" % i if mode == "read_notif" else b"")
                if mode == "read_zmq":
                    while agent.state(handle) != DONE:
                        pass
                    dealer.send(b"read_done %d" % i)
                else:
                    while agent.state(handle) != DONE:  # released once done, as the receiver does
                        pass
                agent.release(handle)
                times.append(started)
                continue
            times.append(time.perf_counter() - started)
        if mode.startswith("read_"):
            seen = pipe.recv()
            times = [end - start for start, end in zip(times, seen)]
        results[mode] = times[WARMUP:]
        pipe.send("next")
    dealer.close(0)
    agent.close()
    results_queue.put(results)


def _pair(tls: str | None, messages: int, poll_s: float, modes: list[str]) -> dict[str, list[float]]:
    context = mp.get_context("spawn")
    ar_end, receiver_end = context.Pipe()
    ar = context.Process(target=_ar_side, args=(ar_end, tls, messages, poll_s))
    results = context.Queue()
    receiver = context.Process(target=_receiver_side, args=(receiver_end, results, tls, messages, poll_s, modes))
    ar.start()
    receiver.start()
    try:
        return results.get(timeout=120)
    finally:
        for process in (ar, receiver):
            process.join(10)
            if process.is_alive():
                process.kill()


def _idle_poll_cpu_pct(poll_s: float, seconds: float = 2.0) -> float:
    from omni_runtime.kv.transport.nixl_agent import KVAgent

    agent = KVAgent(f"idle-{os.getpid()}")
    started, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() - started < seconds:
        agent.notifications()
        time.sleep(poll_s)
    used = (time.process_time() - cpu) / (time.perf_counter() - started)
    agent.close()
    return round(100 * used, 2)


def _us(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(1e6 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--poll-ms", type=float, default=1.0)
    args = parser.parse_args()
    poll_s = args.poll_ms / 1000
    out: dict[str, float] = {}
    shm = _pair(None, args.messages, poll_s, ["zmq", "busy", "polled", "read_notif", "read_zmq"])
    tcp = _pair("tcp", args.messages, poll_s, ["zmq", "busy", "read_notif", "read_zmq"])
    for prefix, results in (("", shm), ("tcp_", tcp)):
        for mode, name in (("zmq", "zmq_rtt"), ("busy", "notif_rtt"), ("polled", "notif_polled_rtt"),
                           ("read_notif", "read_done_notif"), ("read_zmq", "read_done_zmq")):
            if mode in results:
                out[f"{prefix}{name}_p50_us"] = _us(results[mode], 0.5)
                out[f"{prefix}{name}_p99_us"] = _us(results[mode], 0.99)
    out["notif_rtt_ratio"] = round(out["notif_rtt_p50_us"] / out["zmq_rtt_p50_us"], 3)
    out["notif_polled_rtt_ratio"] = round(out["notif_polled_rtt_p50_us"] / out["zmq_rtt_p50_us"], 3)
    out["tcp_notif_rtt_ratio"] = round(out["tcp_notif_rtt_p50_us"] / out["tcp_zmq_rtt_p50_us"], 3)
    out["read_done_ratio"] = round(statistics.median(shm["read_notif"]) / statistics.median(shm["read_zmq"]), 3)
    out["tcp_read_done_ratio"] = round(statistics.median(tcp["read_notif"]) / statistics.median(tcp["read_zmq"]), 3)
    out["poll_ms"] = args.poll_ms
    out["idle_poll_cpu_pct"] = _idle_poll_cpu_pct(poll_s)
    out["messages"] = args.messages
    out["load_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
