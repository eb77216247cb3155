"""Fixtures and helpers of the KV transport tests (test_connector*.py): real NIXL agents, real
ZeroMQ sockets on 127.0.0.1, real processes; every receiver, sender, agent and process a test
starts is stopped by a fixture finalizer.

The AR side is a :class:`SyntheticAR`: a few layers of torch CPU tensors laid out as vLLM's
attention backends lay out their paged KV cache (the CPU backend's ``[num_blocks, kv_heads,
block_size, 2 * head_size]`` with K transposed per head, or FlashAttention's two planes
``[2, num_blocks, block_size, kv_heads, head_size]``), registered with a real
:class:`~omni_runtime.kv.transport.nixl_agent.KVAgent`, and the hello built from them as the
connector's worker half builds it (omni_runtime/kv/worker_side.py). :meth:`SyntheticAR.expected`
computes the payload a transfer must deliver from the tensors themselves, by indexing them,
independently of the block format the receiver assembles with.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
import zmq
from prometheus_client import CollectorRegistry

from omni_runtime.kv.transport import KVInbox, KVReceiver, KVSender, Offer
from omni_runtime.kv.transport.nixl_agent import KVAgent
from omni_runtime.kv.transport.protocol import (
    Affine,
    BlockFormat,
    Compat,
    Hello,
    ReadRequest,
    Region,
    Reply,
    WIRE_VERSION,
    Verdict,
    encode_hello,
    encode_read,
    encode_reply,
    encode_verdict,
)
from omni_runtime.observability.receiver_metrics import ReceiverMetrics

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
STAGE = "talker"
PIPELINE = "p"
MODEL = "m"
WAIT = 10.0  # upper bound of every wait; the events themselves come in milliseconds
#: Small staging by default: 2 slots of 256 KiB (the default 4 x 64 MiB is zeroed at start).
SLOT_BYTES = 256 << 10
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}




def wait_for(predicate: Callable[[], Any], timeout: float = WAIT, what: str = "a condition",
             interval: float = 0.005) -> Any:
    """Poll ``predicate`` (state another thread changes, with no event to wait on) until it
    is truthy; fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(interval)  # polling interval between checks, not a synchronisation


# ---------------------------------------------------------------------- the synthetic AR
def block_runs(block_ids) -> tuple[tuple[int, int], ...]:
    """Block ids as runs of consecutive ids (what the worker half offers)."""
    runs: list[list[int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1][1] += 1
        else:
            runs.append([int(b), 1])
    return tuple((first, count) for first, count in runs)


class SyntheticAR:
    """One AR rank's KV cache and NIXL agent (see the module docstring).

    ``layout``: ``"cpu"`` (vLLM's CPU backend), ``"flash"`` (FlashAttention's two planes) or
    ``"index"`` (the CPU layout described element by element, no affine map: the receiver's
    gather path). ``heads``: this rank's KV heads (shard ``shard`` of ``num_shards``).
    ``agent=False``: the tensors alone (to compute expected payloads of an AR that runs in
    another process from the same seed)."""

    def __init__(self, *, layers: int = 2, blocks: int = 16, heads: int = 2,
                 block_size: int = 4, head_size: int = 8, dtype: str = "float32",
                 layout: str = "cpu", shard: int = 0, num_shards: int = 1, model: str = MODEL,
                 pipeline: str = PIPELINE, stage: str = "ar", seed: int = 0,
                 agent: bool = True, name: str | None = None, revision: str = "") -> None:
        self.layers, self.blocks, self.heads = layers, blocks, heads
        self.block_size, self.head_size, self.dtype, self.layout = (block_size, head_size,
                                                                    dtype, layout)
        self.shard, self.num_shards = shard, num_shards
        L, N, H, B, D = layers, blocks, heads, block_size, head_size
        gen = torch.Generator().manual_seed(seed)
        shape = (N, H, B, 2 * D) if layout in ("cpu", "index") else (2, N, B, H, D)
        self.caches = [torch.randn(shape, generator=gen).to(TORCH_DTYPES[dtype])
                       for _ in range(L)]
        if layout == "flash":
            numel, planes = B * H * D, 2
            k = Affine(offset=0, head=D, token=H * D, dim=1, plane=0)
            v = Affine(offset=0, head=D, token=H * D, dim=1, plane=1)
        elif layout in ("cpu", "index"):
            # What layout.probe_block_format finds through vLLM's CPU kernel (checked against
            # the real kernel in test_connector.py).
            numel, planes = H * B * 2 * D, 1
            k = Affine(offset=0, head=2 * B * D, token=1, dim=B)
            v = Affine(offset=B * D, head=2 * B * D, token=D, dim=1)
        else:
            raise ValueError(layout)
        if layout == "index":
            k_index, v_index = (tuple(_affine_offsets(a, H, B, D)) for a in (k, v))
            k = v = None
        else:
            k_index = v_index = None
        self.fmt = BlockFormat(block_size=B, num_kv_heads=H, head_size=D, dtype=dtype,
                               block_numel=numel, planes=planes, k=k, v=v, k_index=k_index,
                               v_index=v_index)
        self.compat = Compat(model=model, dtype=dtype, num_layers=L,
                             num_kv_heads=H * num_shards, head_size=D, block_size=B,
                             layout=self.fmt.digest(), revision=revision)
        self.pipeline, self.stage = pipeline, stage
        self.name = name or f"{pipeline}.{stage}.tp{shard}.{uuid.uuid4().hex[:12]}"
        self.agent: KVAgent | None = None
        if agent:
            self.agent = KVAgent(self.name)
            self.agent.register([(c.data_ptr(), c.numel() * c.element_size(), 0)
                                 for c in self.caches], "DRAM")

    @property
    def regions(self) -> tuple[Region, ...]:
        out = []
        for c in self.caches:
            plane_bytes = c.numel() * c.element_size() // self.fmt.planes
            out.extend(Region(c.data_ptr() + p * plane_bytes, plane_bytes, 0)
                       for p in range(self.fmt.planes))
        return tuple(out)

    @property
    def hello(self) -> Hello:
        """This rank's hello, as worker_side.py builds it (to_stage and conn are the
        sender's to fill in)."""
        return Hello(agent=self.name, conn=0, pipeline=self.pipeline, from_stage=self.stage,
                     to_stage="", shard=self.shard, num_shards=self.num_shards,
                     mem_type="DRAM", compat=self.compat, compat_hash=self.compat.hash(),
                     block_format=self.fmt, regions=self.regions,
                     metadata=self.agent.metadata() if self.agent else b"")

    @property
    def token_bytes(self) -> int:
        return self.layers * 2 * self.heads * self.head_size * self.caches[0].element_size()

    def offer(self, rid: str, block_ids, seq_len: int, attempt: int = 0, **kw) -> Offer:
        needed = -(-seq_len // self.block_size)
        return Offer(request_id=rid, attempt=attempt, seq_len=seq_len,
                     runs=block_runs(list(block_ids)[:needed]),
                     nbytes=seq_len * self.token_bytes, **kw)

    def _tokens(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as [num_blocks, block_size, heads, head_size], by indexing
        the cache as the attention backend writes it."""
        N, H, B, D = self.blocks, self.heads, self.block_size, self.head_size
        if self.layout == "flash":
            return cache[0], cache[1]
        flat = cache.reshape(N, H, 2 * B * D)
        k = flat[:, :, : B * D].reshape(N, H, D, B).permute(0, 3, 1, 2)  # K^T per head
        v = flat[:, :, B * D:].reshape(N, H, B, D).permute(0, 2, 1, 3)
        return k, v

    def expected(self, block_ids, seq_len: int) -> np.ndarray:
        """The payload ``[layers, 2, heads, seq_len, head_size]`` of these blocks now."""
        idx = torch.tensor(list(block_ids)[: -(-seq_len // self.block_size)])
        per_layer = []
        for cache in self.caches:
            kv = []
            for part in self._tokens(cache):
                tokens = part[idx].reshape(-1, self.heads, self.head_size)[:seq_len]
                kv.append(tokens.permute(1, 0, 2))
            per_layer.append(torch.stack(kv))
        out = torch.stack(per_layer).contiguous()
        if self.dtype == "bfloat16":
            return out.view(torch.int16).numpy().view(np.uint16)
        return out.numpy()

    def overwrite(self, block_ids, value: float) -> None:
        """Re-use blocks: every layer's K and V of ``block_ids`` become ``value``."""
        for cache in self.caches:
            for b in block_ids:
                if self.layout == "flash":
                    cache[:, b] = value
                else:
                    cache[b] = value

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()


def _affine_offsets(a: Affine, H: int, B: int, D: int) -> list[int]:
    h, t, d = np.meshgrid(np.arange(H), np.arange(B), np.arange(D), indexing="ij")
    return (a.offset + h * a.head + t * a.token + d * a.dim).reshape(-1).tolist()


def kv_digest(kv: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(kv).tobytes()).hexdigest()


# ---------------------------------------------------------------------- fixtures
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
        kw.setdefault("slot_bytes", SLOT_BYTES)
        kw.setdefault("slots", 2)
        kw.setdefault("expect", {"model": MODEL})
        r = KVReceiver(bind, inbox if inbox is not None else KVInbox(max_bytes=64 << 20),
                       stage=stage, pipeline=kw.pop("pipeline", PIPELINE), **kw)
        made.append(r)
        return r.start()

    yield make
    for r in made:
        r.close()


@pytest.fixture
def receiver(make_receiver):
    return make_receiver()


@pytest.fixture
def make_ar():
    made: list[SyntheticAR] = []

    def make(**kw) -> SyntheticAR:
        ar = SyntheticAR(**kw)
        made.append(ar)
        return ar

    yield make
    for ar in made:
        ar.close()


@pytest.fixture
def ar(make_ar):
    return make_ar()


@pytest.fixture
def make_sender(make_ar):
    """``make(ar, endpoints, **kw)``: a KVSender for the synthetic AR rank (closed before
    its agent)."""
    made: list[KVSender] = []

    def make(ar: SyntheticAR, endpoints: dict[str, str], **kw) -> KVSender:
        kw.setdefault("send_timeout_s", WAIT)
        s = KVSender(endpoints, hello=kw.pop("hello", ar.hello), agent=ar.agent, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


class Hold:
    """Holds the receiver thread at one of its steps until the test says go: a mock of a
    delay only (a slow read, a slow assembly), what the receiver does is unchanged. The
    receiver thread blocks in the wrapped method at its first call for which ``when`` is
    true; ``entered`` is set when it got there."""

    def __init__(self, receiver: KVReceiver, method: str,
                 when: Callable[..., bool] = lambda *a, **k: True) -> None:
        self.entered = threading.Event()
        self._go = threading.Event()
        self.calls = 0
        original = getattr(receiver, method)

        def held(*args, **kw):
            if not self._go.is_set() and when(*args, **kw):
                self.calls += 1
                self.entered.set()
                self._go.wait(6 * WAIT)
            return original(*args, **kw)

        setattr(receiver, method, held)  # the instance's attribute shadows the method

    def wait_entered(self) -> None:
        assert self.entered.wait(WAIT), "the receiver never got to the held step"

    def release(self) -> None:
        self._go.set()


@pytest.fixture
def hold(make_receiver):
    """``hold(receiver, method, when)``: a :class:`Hold`, released at teardown (before the
    receiver closes)."""
    made: list[Hold] = []

    def make(receiver: KVReceiver, method: str, when=lambda *a, **k: True) -> Hold:
        h = Hold(receiver, method, when)
        made.append(h)
        return h

    yield make
    for h in made:
        h.release()


def at_read_done(*args, **kw) -> bool:
    """``when`` of a Hold on ``_reply``: the reply that says the blocks were read."""
    reply = args[2]
    return reply.kind == "read_done"


def collect(sender: KVSender, n: int, timeout: float = WAIT
            ) -> tuple[list[str], dict[str, str]]:
    """Wait (on the sender's condition) until ``n`` answers arrived: (acked request ids,
    {failed request id: reason})."""
    answers: dict[str, tuple[int, str | None]] = {}
    deadline = time.monotonic() + timeout
    count = 0
    while count < n:
        left = deadline - time.monotonic()
        assert left > 0, f"only {answers} of {n} answers within {timeout}s"
        sender.wait(left)
        got = sender.poll()
        count += len(got)
        answers.update(got)
    acked = sorted(rid for rid, (_, why) in answers.items() if why is None)
    failed = {rid: why for rid, (_, why) in answers.items() if why is not None}
    return acked, failed


def sample(registry, name, stage: str = STAGE, **labels):
    """Sum of the samples of ``name`` with these labels, over any others (the receiver's
    ``from_stage``), or None when there is none."""
    want = {"stage": stage, "model_name": "", **labels}
    found = [s.value for m in registry.collect() for s in m.samples
             if s.name == name and all(s.labels.get(k) == v for k, v in want.items())]
    return sum(found) if found else None


def rejected_counts(registry, stage: str = STAGE) -> dict[str, float]:
    from omni_runtime.kv.transport import REJECT_CODES

    return {c: sample(registry, "omni_kv_receiver_rejected_total", stage, reason=c)
            for c in REJECT_CODES
            if sample(registry, "omni_kv_receiver_rejected_total", stage, reason=c)}


# ---------------------------------------------------------------------- raw peers
class RawDealer:
    """A test peer that sends arbitrary control messages to a receiver and reads its
    replies (it may speak for a real agent: a hello with that agent's metadata). As the
    sender does: a hello (and any message of several frames) on the handshake connection,
    any other message, once a hello of ``ar`` was accepted, as a notification of ``ar``'s
    agent; replies come by either."""

    def __init__(self, ctx: zmq.Context, endpoint: str, ar: SyntheticAR | None = None) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        #: The AR whose agent this peer speaks for: its agent is progressed while waiting
        #: (UCX serves a remote read of its memory only then, as the sender's thread does).
        self.ar = ar
        self.peer: str | None = None  # the receiver's agent, once a hello was accepted
        self._notes: list[bytes] = []

    def channel(self, frames: list[bytes]) -> str:
        """``"notify"`` or ``"handshake"``: where the sender would send ``frames``."""
        if self.peer is None or len(frames) != 1:
            return "handshake"
        try:
            hello = json.loads(frames[0]).get("type") == "hello"
        except (ValueError, AttributeError):
            hello = False
        return "handshake" if hello else "notify"

    def send(self, frames: list[bytes], channel: str | None = None) -> None:
        if (channel or self.channel(frames)) == "notify":
            self.ar.agent.notify(self.peer, frames[0])
        else:
            self.sock.send_multipart(frames)

    def reply(self, timeout: float = WAIT) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            if self.sock.poll(0):
                frames = self.sock.recv_multipart()
                body = json.loads(frames[0])
                if body.get("type") == "hello_ok" and self.ar is not None and len(frames) == 2:
                    self.peer = self.ar.agent.add_remote(frames[1])
                return body
            if self.ar is not None:
                self._notes += [raw for source, raw in self.ar.agent.notifications()
                                if source == self.peer]
                if self._notes:
                    return json.loads(self._notes.pop(0))
            assert time.monotonic() < deadline, "no reply from the receiver"
            self.sock.poll(1)

    def hello(self, ar: SyntheticAR, to_stage: str = STAGE, **changes) -> dict:
        self.sock.send_multipart(encode_hello(dataclasses.replace(ar.hello, to_stage=to_stage,
                                                                  **changes)))
        return self.reply()

    def read(self, ar: SyntheticAR, tid: int, rid: str, block_ids, tokens: int,
             **changes) -> None:
        """A read of ``tokens`` tokens of ``block_ids``; ``changes``: fields replaced
        (``...`` removes one)."""
        body = read_body(ar, tid, rid, block_ids, tokens)
        for k, v in changes.items():
            if v is ...:
                body.pop(k, None)
            else:
                body[k] = v
        self.send([json.dumps(body).encode()])

    def verdict(self, ar: SyntheticAR, tid: int, commit: bool = True) -> None:
        self.send(encode_verdict(Verdict(ar.name, tid, commit)))


def read_body(ar: SyntheticAR, tid: int, rid: str, block_ids, seq_len: int) -> dict:
    offer = ar.offer(rid, block_ids, seq_len)
    req = ReadRequest(transfer_id=tid, agent=ar.name, compat_hash=ar.compat.hash(),
                      request_id=rid, external_request_id="", attempt=0, seq_len=seq_len,
                      runs=offer.runs, deadline_in_s=WAIT, trace_context=None,
                      pipeline=ar.pipeline, from_stage=ar.stage, to_stage=STAGE,
                      shard=ar.shard, num_shards=ar.num_shards, sent_at=time.time())
    return json.loads(encode_read(req)[0])


@pytest.fixture
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


class FakeReceiver:
    """A raw ROUTER and a NIXL agent that speak the receiver's side of the control protocol
    as the test says (accepts hellos, then reads are the test's to answer, or to leave
    unanswered): a stand-in for a receiver that misbehaves, for tests of the sender's own
    rules. A message's ``identity`` is the agent that sent it (answers go to it)."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.agent = KVAgent(f"fake-receiver.{uuid.uuid4().hex[:12]}")
        self._notes: list[tuple[str, bytes]] = []

    def recv(self, timeout: float = WAIT) -> tuple[str, dict]:
        """The next message other than a hello (hellos are accepted on the way)."""
        deadline = time.monotonic() + timeout
        while True:
            assert time.monotonic() < deadline, "nothing arrived"
            if self.sock.poll(0):
                identity, body, *rest = self.sock.recv_multipart()
                msg = json.loads(body)
                if msg["type"] == "hello":
                    self.agent.add_remote(rest[0])
                    self.sock.send_multipart([identity, encode_reply(Reply("hello_ok", conn=msg["conn"])),
                                              self.agent.metadata()])
                continue
            self._notes += self.agent.notifications()
            if self._notes:
                source, raw = self._notes.pop(0)
                return source, json.loads(raw)
            self.sock.poll(1)

    def nothing_within(self, seconds: float) -> bool:
        """No message but hellos within ``seconds`` (an assertion of absence)."""
        try:
            self.recv(seconds)
        except AssertionError:
            return True
        return False

    def send(self, identity: str, kind: str, msg: dict | None = None, **fields) -> None:
        body = {"v": WIRE_VERSION, "type": kind, "transfer_id": None, "request_id": None, "conn": None,
                "code": "", "reason": ""}
        if msg is not None:
            body["transfer_id"], body["request_id"] = msg["transfer_id"], msg["request_id"]
        body.update(fields)
        self.agent.notify(identity, json.dumps(body).encode())
        self.agent.progress()  # no thread of its own: the message leaves as it progresses

    def close(self) -> None:
        self.agent.close()


@pytest.fixture
def fake(zctx):
    f = FakeReceiver(zctx)
    yield f
    f.close()


# ---------------------------------------------------------------------- processes
def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH"))
                           if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


RECEIVER_PROCESS = textwrap.dedent("""
    # A receiving stage's receiver, alone in its process. Commands on stdin: "get RID" prints
    # "RID <sha256 of the stored payload, or none>"; end of stdin closes it. --hold: the
    # receiver thread stops (a mock of a slow read) before it says read_done, printing "held".
    import sys, threading
    from transport_fixtures import MODEL, SLOT_BYTES, kv_digest
    from omni_runtime.kv.transport import KVInbox, KVReceiver
    receiver = KVReceiver(sys.argv[1], KVInbox(), stage="talker", pipeline="p",
                          slot_bytes=SLOT_BYTES, slots=2, expect={"model": MODEL})
    if "--hold" in sys.argv:
        reply = receiver._reply
        def held(router, identity, r):
            if r.kind == "read_done":
                print("held", flush=True)
                threading.Event().wait()
            return reply(router, identity, r)
        receiver._reply = held
    receiver.start()
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, rid = line.split()
        p = receiver.inbox.get(rid, remove=False)
        print(rid, kv_digest(p.kv) if p is not None else "none", flush=True)
    receiver.close()
""")

AR_PROCESS = textwrap.dedent("""
    # A synthetic AR rank (its KV cache, NIXL agent and KVSender) alone in its process.
    # argv: endpoints as JSON, the SyntheticAR's keyword arguments as JSON. Commands on stdin:
    # "offer RID ATTEMPT SEQ_LEN BLOCK,IDS TIMEOUT_S"; it prints "ready AGENT" once up and
    # "answer RID ATTEMPT ok|REASON" for each answer.
    import json, sys, threading
    from transport_fixtures import SyntheticAR
    from omni_runtime.kv.transport import KVSender
    ar = SyntheticAR(**json.loads(sys.argv[2]))
    sender = KVSender(json.loads(sys.argv[1]), hello=ar.hello, agent=ar.agent,
                      send_timeout_s=30)
    def answers():
        while True:
            sender.wait(3600)
            for rid, (attempt, why) in sender.poll().items():
                print("answer", rid, attempt, why or "ok", flush=True)
    threading.Thread(target=answers, daemon=True).start()
    print("ready", ar.name, flush=True)
    for line in sys.stdin:
        _, rid, attempt, seq_len, blocks, timeout = line.split()
        sender.submit(ar.offer(rid, [int(b) for b in blocks.split(",")], int(seq_len),
                               int(attempt)), timeout_s=float(timeout))
    sender.close()
    ar.close()
""")


class Proc:
    """A child process speaking lines on stdin/stdout; its stdout is read by a thread, so
    waiting for a line has a deadline."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.strip())
                self._cond.notify_all()

    def expect(self, prefix: str, timeout: float = 4 * WAIT) -> str:
        """The first line starting with ``prefix`` (consumed)."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: any(l.startswith(prefix) for l in self.lines) or self.proc.poll()
                is not None, timeout)
            for i, line in enumerate(self.lines):
                if line.startswith(prefix):
                    return self.lines.pop(i)
        assert ok, f"no line {prefix!r} within {timeout}s: {self.lines}"
        raise AssertionError(f"process exited ({self.proc.returncode}) before {prefix!r}")

    def say(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(WAIT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)  # a stopped process reads no EOF
                self.proc.stdin.close()
                self.proc.wait(WAIT)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                self.proc.kill()
        self.proc.wait(WAIT)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except (OSError, ValueError):
                pass


@pytest.fixture
def processes():
    """``start_receiver(endpoint, hold=False)`` and ``start_ar(endpoints, env=..., **ar)``:
    child processes, stopped at teardown."""
    made: list[Proc] = []

    class Start:
        @staticmethod
        def receiver(endpoint: str, hold: bool = False, **env: str) -> Proc:
            p = Proc(["-c", RECEIVER_PROCESS, endpoint] + (["--hold"] if hold else []),
                     _env(**env))
            made.append(p)
            p.expect("ready")
            return p

        @staticmethod
        def ar(endpoints: dict[str, str], env: dict[str, str] | None = None, **kw) -> Proc:
            p = Proc(["-c", AR_PROCESS, json.dumps(endpoints), json.dumps(kw)],
                     _env(**(env or {})))
            made.append(p)
            p.agent = p.expect("ready").split()[1]
            return p

    yield Start
    for p in made:
        p.stop()
