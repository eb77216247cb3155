"""Fixtures and helpers of the KV transport tests (test_connector.py,
test_connector_faults.py): real receivers and senders on 127.0.0.1, each closed when its test
ends."""

from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry

from omni_runtime.kv.transport import KVInbox, KVReceiver, KVSender
from omni_runtime.observability.receiver_metrics import ReceiverMetrics

STAGE = "talker"
WAIT = 10.0  # upper bound of every wait; the events themselves come in milliseconds


@pytest.fixture
def registry():
    return CollectorRegistry()


@pytest.fixture
def make_receiver(registry):
    made: list[KVReceiver] = []

    def make(bind: str = "tcp://127.0.0.1:0", *, inbox: KVInbox | None = None,
             **kw) -> KVReceiver:
        stage = kw.pop("stage", STAGE)
        kw.setdefault("metrics", ReceiverMetrics(stage=stage, registry=registry))
        r = KVReceiver(bind, inbox if inbox is not None else KVInbox(max_bytes=64 << 20),
                       stage=stage, pipeline=kw.pop("pipeline", "p"), **kw)
        made.append(r)
        return r.start()

    yield make
    for r in made:
        r.close()


@pytest.fixture
def receiver(make_receiver):
    return make_receiver()


@pytest.fixture
def make_sender():
    made: list[KVSender] = []

    def make(endpoints, **kw) -> KVSender:
        kw.setdefault("send_timeout_s", WAIT)
        s = KVSender(endpoints, pipeline="p", stage="ar", **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def collect(sender: KVSender, n: int, timeout: float = WAIT):
    """Wait (on the sender's condition) until ``n`` results arrived; (acked, failed)."""
    acked: list[str] = []
    failed: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while len(acked) + len(failed) < n:
        left = deadline - time.monotonic()
        assert left > 0, f"only {acked} {failed} of {n} results within {timeout}s"
        sender.wait(left)
        a, f = sender.poll()
        acked += a
        failed.update(f)
    return acked, failed
