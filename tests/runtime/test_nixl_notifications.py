"""NIXL's notifications between two agents, as the KV control plane would carry its messages
on them (docs/connector.md, "The control plane and NIXL notifications"): a message to a peer,
and one that a READ delivers to the peer it read once the bytes are read. Real NIXL agents over
UCX, in this process (shared memory) and in a process of their own on UCX's TCP transport."""

from __future__ import annotations

import multiprocessing
import os
import time

import numpy as np

from omni_runtime.kv.transport.nixl_agent import DONE, KVAgent

WAIT_S = 10.0


def _until(agent: KVAgent, count: int, *others: KVAgent) -> list[tuple[str, bytes]]:
    """The notifications ``agent`` collects until it has ``count`` (``others`` progressed
    meanwhile: a message goes out as its sender's agent progresses)."""
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + WAIT_S
    while len(got) < count and time.monotonic() < deadline:
        for other in others:
            other.progress()
        got += agent.notifications()
    return got


def _pair(tag: str) -> tuple[KVAgent, KVAgent, np.ndarray, np.ndarray]:
    """An AR-like agent (NIXL's progress thread) holding ``src``, a receiver-like one (its
    owner progresses it) holding ``dst``, each with the other's metadata loaded (after their
    memory is registered: the metadata describes it)."""
    ar, receiver = KVAgent(f"ar-{tag}-{os.getpid()}", progress_thread=True), KVAgent(f"rx-{tag}-{os.getpid()}")
    src = np.arange(1 << 16, dtype=np.uint8)
    dst = np.zeros(1 << 16, dtype=np.uint8)
    ar.register([(src.ctypes.data, src.nbytes, 0)], "DRAM")
    receiver.register([(dst.ctypes.data, dst.nbytes, 0)], "DRAM")
    assert receiver.add_remote(ar.metadata()) == ar.name
    assert ar.add_remote(receiver.metadata()) == receiver.name
    return ar, receiver, src, dst


def _exchange(tag: str) -> dict:
    ar, receiver, src, dst = _pair(tag)
    try:
        ar.notify(receiver.name, b"offer 1")
        ar.notify(receiver.name, b"offer 2")
        offers = _until(receiver, 2)
        # The receiver's own message goes out as the receiver progresses (it has no thread).
        receiver.notify(ar.name, b"rejected 0")
        replies = _until(ar, 1, receiver)
        handle = receiver.read(np.array([[dst.ctypes.data, dst.nbytes, 0]], dtype=np.uint64), "DRAM",
                               np.array([[src.ctypes.data, src.nbytes, 0]], dtype=np.uint64), "DRAM",
                               ar.name, notify=b"read_done 1")
        deadline = time.monotonic() + WAIT_S
        while receiver.state(handle) != DONE and time.monotonic() < deadline:
            pass
        read_state = receiver.state(handle)
        receiver.release(handle)
        read_done = _until(ar, 1, receiver)
        # What progress() collects is kept for notifications(), not dropped.
        ar.notify(receiver.name, b"verdict 1 commit")
        deadline = time.monotonic() + WAIT_S
        while not receiver._pending and time.monotonic() < deadline:
            receiver.progress()
        kept = receiver.notifications()
        # The largest read descriptor the protocol allows is about 1 MB of JSON.
        large = bytes(range(256)) * (1 << 12)  # 1 MiB
        ar.notify(receiver.name, large)
        arrived = _until(receiver, 1)
        return {"large": arrived == [(ar.name, large)], "offers": offers, "replies": replies, "read_state": read_state,
                "read_equal": bool((src == dst).all()), "read_done": read_done, "kept": kept,
                "ar": ar.name, "receiver": receiver.name}
    finally:
        receiver.close()
        ar.close()


def _check(result: dict) -> None:
    ar, receiver = result["ar"], result["receiver"]
    assert result["offers"] == [(ar, b"offer 1"), (ar, b"offer 2")]
    assert result["replies"] == [(receiver, b"rejected 0")]
    assert result["read_state"] == DONE and result["read_equal"]
    assert result["read_done"] == [(receiver, b"read_done 1")]
    assert result["kept"] == [(ar, b"verdict 1 commit")]
    assert result["large"], "a 1 MiB notification did not arrive whole"


def test_messages_and_a_reads_completion_reach_the_peer_in_order():
    _check(_exchange("shm"))


def _over_tcp(queue) -> None:
    os.environ["UCX_TLS"] = "tcp"  # read by UCX when this process's first agent is made
    try:
        queue.put(_exchange("tcp"))
    except BaseException as exc:  # reported to the test
        queue.put(repr(exc))


def test_they_reach_it_over_ucxs_tcp_transport_too():
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_over_tcp, args=(queue,))
    process.start()
    try:
        result = queue.get(timeout=120)
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()
            process.join()
    assert isinstance(result, dict), result
    _check(result)
