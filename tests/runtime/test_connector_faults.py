"""The KV data plane under faults: a receiver killed mid-read and restarted, an AR killed
mid-read, a network partition (the AR's process stopped, its memory unreachable over UCX's
TCP), restarts of either side (re-handshake; a restarted AR is a new agent and the idle one is
forgotten), registration failures, transport threads that die, bugs on the receiver's answer
path, and payloads found by the client's own request id.

Real processes (transport_fixtures.processes: a receiver, or a synthetic AR rank with its
NIXL agent and sender, in a child process), real NIXL, real sockets on 127.0.0.1. What is
mocked is the fault itself, and each test says so: a Hold (the receiver thread made slow at
one step, so that the kill lands mid-read), SIGKILL and SIGSTOP of a child, an I/O thread
made to raise."""

from __future__ import annotations

import os
import runpy
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from omni_runtime.kv.transport import KVSender
from omni_runtime.kv.transport.nixl_agent import KVAgent, NixlUnavailable
from omni_runtime.kv.transport.observer import NullReceiverObserver
from omni_runtime.observability.transport_metrics import thread_up_setter

from transport_fixtures import (  # noqa: F401 (fixtures)
    STAGE,
    WAIT,
    RawDealer,
    SyntheticAR,
    ar,
    collect,
    hold,
    kv_digest,
    make_ar,
    make_receiver,
    make_sender,
    processes,
    receiver,
    registry,
    rejected_counts,
    sample,
    wait_for,
    zctx,
)
from procs import free_port

FAULTS = Path(__file__).resolve().parents[1] / "faults"


def known_agents(receiver) -> list[str]:
    """The receiver's peers, read from the test's thread (the receiver's may be changing
    them: a read that raced a change is read again)."""
    while True:
        try:
            return receiver.known_agents
        except RuntimeError:  # OrderedDict mutated during iteration
            continue


# ---------------------------------------------------------------------- killed, stopped
def test_a_receiver_killed_mid_read_fails_by_the_deadline_or_is_re_offered_on_restart(
        processes, ar, make_sender):
    """Two transfers in flight to a receiver process killed while it reads (held before its
    read_done, so the kill lands mid-read): the one with a short deadline fails once, at its
    deadline; the other goes to the receiver restarted on the same port (a new NIXL agent:
    the AR says hello again) and is stored there with the exact bytes, answered once."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    first = processes.receiver(endpoint, hold=True)
    sender = make_sender(ar, {STAGE: endpoint})
    sender.submit(ar.offer("short", [1, 2], 7), timeout_s=1.5)
    sender.submit(ar.offer("long", [3, 4, 5], 10), timeout_s=60)
    first.expect("held")
    first.kill()
    acked, failed = collect(sender, 1)
    assert not acked and "no ack from stage talker" in failed["short"]
    assert sender.pending() == 1
    second = processes.receiver(endpoint)
    assert collect(sender, 1) == (["long"], {})
    second.say("get long")
    assert second.expect("long").split()[1] == kv_digest(ar.expected([3, 4, 5], 10))
    second.say("get short")
    assert second.expect("short").split()[1] == "none"
    assert sender.pending() == 0 and sender.wait(0.3) is False  # nothing answered twice
    # The first receiver's agent is unloaded from the AR's: a restart leaves one peer.
    assert len(ar.agent.remotes) == 1
    sender.close()
    assert ar.agent.remotes == set()  # a closed sender leaves the agent as it found it


def test_an_ar_killed_mid_read_fails_the_read_and_the_receiver_serves_on(
        make_receiver, processes, make_ar, make_sender, hold, registry):
    """The AR process dies between two chunks of a read (the receiver held after its first
    chunk, so the kill lands mid-read): the read fails (``read_failed``, or ``deadline`` if
    NIXL never says), nothing is stored, the slot comes back, and what the receiver holds
    from others (a payload, another AR's agent) stays and serves."""
    receiver = make_receiver(slot_bytes=4096, slots=1)  # 8 blocks of 512 B a chunk
    shape = dict(layers=4, blocks=32, seed=7)
    proc = processes.ar({STAGE: receiver.endpoint}, **shape)
    local = SyntheticAR(agent=False, **shape)  # the same tensors, to compute the payloads
    proc.say("offer before 0 7 1,2 30")
    assert proc.expect("answer before") == "answer before 0 ok"
    assert np.array_equal(receiver.inbox.get("before", remove=False).kv,
                          local.expected([1, 2], 7))
    other = make_ar(seed=8)
    other_sender = make_sender(other, {STAGE: receiver.endpoint})
    other_sender.submit(other.offer("kept", [3], 4))
    assert collect(other_sender, 1) == (["kept"], {})

    held = hold(receiver, "_chunk_read")
    blocks = list(range(10, 20))
    proc.say(f"offer cut 0 40 {','.join(map(str, blocks))} 5")
    held.wait_entered()  # the first chunk is read; 7 more to go
    proc.kill()
    started = time.monotonic()
    held.release()
    wait_for(lambda: not receiver._reads, timeout=5 + WAIT, what="the read to end")
    codes = rejected_counts(registry)
    assert codes in ({"read_failed": 1}, {"deadline": 1}), codes
    assert time.monotonic() - started < 5 + 1  # by the transfer's deadline at the latest
    assert "cut" not in receiver.inbox
    staging = receiver._staging
    assert staging.available + staging.retired == 1 and staging.available == 1
    # Nothing it should keep is gone: the stored payload, the other AR and its reads.
    assert "before" in receiver.inbox and "kept" in receiver.inbox
    assert other.name in known_agents(receiver)
    other_sender.submit(other.offer("after", [4, 5], 6))
    assert collect(other_sender, 1) == (["after"], {})
    assert np.array_equal(receiver.inbox.get("after").kv, other.expected([4, 5], 6))


def test_a_partition_during_a_read_ends_it_at_the_deadline_and_later_reads_work(
        make_receiver, processes, make_ar, make_sender, hold, registry, monkeypatch):
    """A network partition's stand-in: over UCX's TCP transport the AR's process must
    progress for its memory to be read, and it is stopped (SIGSTOP) just before the READ is
    posted (the receiver held there): the READ never completes. The receiver gives up at the
    transfer's deadline (``deadline``), releases its staging slot, and reads on: another
    AR's at once, the stopped AR's own once it runs again."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # this process's agents (the receiver's) too
    receiver = make_receiver(slots=1)
    proc = processes.ar({STAGE: receiver.endpoint}, env={"UCX_TLS": "tcp"}, seed=3)
    local = SyntheticAR(agent=False, seed=3)
    proc.say("offer before 0 6 1,2 30")
    assert proc.expect("answer before") == "answer before 0 ok"
    held = hold(receiver, "_post")
    proc.say("offer cut 0 6 3,4 2")
    held.wait_entered()
    os.kill(proc.proc.pid, signal.SIGSTOP)
    try:
        held.release()
        wait_for(lambda: rejected_counts(registry) == {"deadline": 1}, timeout=2 + WAIT,
                 what="the receiver to give up")
        assert "cut" not in receiver.inbox and not receiver._reads
        assert receiver._staging.available == 1 and receiver._staging.retired == 0
        other = make_ar(seed=4)
        sender = make_sender(other, {STAGE: receiver.endpoint})
        sender.submit(other.offer("meanwhile", [1, 2], 6))
        assert collect(sender, 1) == (["meanwhile"], {})
    finally:
        os.kill(proc.proc.pid, signal.SIGCONT)
    assert proc.expect("answer cut").startswith("answer cut 0 ")  # failed, once
    proc.say("offer again 0 6 5,6 30")
    assert proc.expect("answer again") == "answer again 0 ok"
    assert np.array_equal(receiver.inbox.get("again").kv, local.expected([5, 6], 6))
    assert np.array_equal(receiver.inbox.get("before").kv, local.expected([1, 2], 6))


# ---------------------------------------------------------------------- restarts
def test_a_restarted_ar_is_a_new_agent_and_an_idle_agent_is_forgotten(make_receiver, make_ar,
                                                                      make_sender, registry):
    """A restarted AR is a new NIXL agent; the old one, idle, is forgotten after
    agent_idle_ttl_s. An AR idle that long is forgotten too: its next read is answered
    ``unknown_agent``, its sender says hello again and the transfer is delivered."""
    receiver = make_receiver(agent_idle_ttl_s=0.5)
    old = make_ar(seed=1)
    old_sender = make_sender(old, {STAGE: receiver.endpoint})
    old_sender.submit(old.offer("one", [1], 3))
    assert collect(old_sender, 1) == (["one"], {})
    old_sender.close()
    old.close()
    new = make_ar(seed=2)  # the restarted process
    sender = make_sender(new, {STAGE: receiver.endpoint})
    sender.submit(new.offer("two", [1], 3))
    assert collect(sender, 1) == (["two"], {})
    assert new.name != old.name and new.name in known_agents(receiver)
    wait_for(lambda: known_agents(receiver) == [], timeout=0.5 + WAIT,
             what="both agents forgotten")
    sender.submit(new.offer("three", [2, 3], 7))
    assert collect(sender, 1) == (["three"], {})
    assert rejected_counts(registry) == {"unknown_agent": 1}
    assert known_agents(receiver) == [new.name]
    assert np.array_equal(receiver.inbox.get("three").kv, new.expected([2, 3], 7))


def test_an_agent_with_a_read_in_flight_is_not_forgotten(make_receiver, ar, make_sender,
                                                         hold):
    """A read that outlasts the agent idle TTL (the receiver thread stalled between two
    chunks longer than the TTL): the agent stays while its read is in flight, and the rest
    of the read from it succeeds."""
    receiver = make_receiver(agent_idle_ttl_s=0.2, slot_bytes=4096, slots=1)
    held = hold(receiver, "_chunk_read")
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    blocks = list(range(10))  # 8 blocks a chunk: two chunks per layer
    sender.submit(ar.offer("r", blocks, 40))
    held.wait_entered()
    time.sleep(0.3)  # the fault: the receiver thread stalls past the idle TTL
    held.release()
    assert collect(sender, 1) == (["r"], {})
    assert np.array_equal(receiver.inbox.get("r").kv, ar.expected(blocks, 40))


# ---------------------------------------------------------------------- start-up
def test_registration_failures_name_their_cause():
    with pytest.raises(NixlUnavailable, match="none of the backends \\['NOPE'\\]"):
        KVAgent("omni-test-no-backend", backends=("NOPE",))
    agent = KVAgent("omni-test-vram")
    try:
        host = np.zeros(4096, np.uint8)
        with pytest.raises(NixlUnavailable, match="registering 1 VRAM regions \\(4096 bytes\\)"):
            agent.register([(host.ctypes.data, 4096, 0)], "VRAM")  # host memory as VRAM
    finally:
        agent.close()


# ---------------------------------------------------------------------- NIXL's progress thread
def _thread_cpu_s(tids: set[str]) -> float:
    total = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / os.sysconf("SC_CLK_TCK")


def test_an_agent_with_its_progress_thread_sleeps_while_idle():
    """NIXL's Python wrapper gives its progress thread a poll timeout of 0 (a thread that
    spins on a CPU); the AR's agent is made with a real timeout: idle, its threads take
    next to no CPU. The window is a measurement, not a wait for anything."""
    before = set(os.listdir("/proc/self/task"))
    agent = KVAgent("omni-test-progress-idle", progress_thread=True)
    try:
        started = set(os.listdir("/proc/self/task")) - before
        assert started and agent.progresses_itself  # NIXL's progress thread (and UCX's)
        cpu0, wall0 = _thread_cpu_s(started), time.monotonic()
        time.sleep(1.0)
        cpu, wall = _thread_cpu_s(started) - cpu0, time.monotonic() - wall0
        assert cpu < 0.2 * wall, f"the agent's threads took {cpu:.2f} s of CPU in {wall:.2f} s"
    finally:
        agent.close()


def test_closing_an_agent_destroys_it_and_its_progress_thread_at_once():
    """close() destroys the agent then and there (its progress thread joined), not whenever
    the garbage collector gets to it; the agent refuses to be used after."""
    before = set(os.listdir("/proc/self/task"))
    agent = KVAgent("omni-test-closed", progress_thread=True)
    assert set(os.listdir("/proc/self/task")) - before, "NIXL's progress thread"
    agent.close()
    assert set(os.listdir("/proc/self/task")) - before == set()
    with pytest.raises(NixlUnavailable, match="is closed"):
        agent.metadata()
    agent.close()  # once


_CLOBBERED = """
import os, sys
sys.path.insert(0, os.getcwd())
from omni_runtime.kv.transport.nixl_agent import KVAgent
agent = KVAgent("omni-test-clobbered", progress_thread=True)
eventfds = [fd for fd, what in agent._event_fds.items() if what.startswith("anon_inode:[eventfd]")]
assert eventfds, agent._event_fds
for fd in eventfds:
    os.close(fd)  # a stray close elsewhere in the process
    r, w = os.pipe()  # its number reused, by a descriptor with something to read
    assert fd in (r, w), (fd, r, w)
    os.write(w, b"x")
agent.close()
print("closed", flush=True)
"""


def test_an_agent_whose_event_descriptor_was_closed_behind_its_back_is_left_not_hung(tmp_path):
    """A stray close of the UCX worker's event descriptor, its number reused: NIXL's progress
    thread then blocks in UCX's read of it, and destroying the agent (which joins the thread,
    holding the interpreter's lock) hung the process for ever (seen once in make test). close()
    sees the descriptor is not the agent's any more, leaves the agent undestroyed and says so.
    (In a process of its own: the test must not hang its runner if this fails.)"""
    import subprocess
    import sys

    script = tmp_path / "clobbered.py"
    script.write_text(_CLOBBERED)
    try:
        done = subprocess.run([sys.executable, str(script)], cwd=Path(__file__).parents[2],
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"closing the agent hung: {exc.stderr}")
    assert done.returncode == 0 and "closed" in done.stdout, done.stderr[-3000:]
    assert "were closed by something else in this process" in done.stderr


@pytest.mark.parametrize("release", ["no bindings", "bindings it does not call"])
def test_a_nixl_whose_progress_thread_cannot_be_tamed_gets_none(monkeypatch, caplog, release):
    """A NIXL wrapper without the native constructor this module wraps, or one that makes
    its agent without calling it (other releases): the agent gets no progress thread (it
    would spin a core; one made spinning is dropped) and says so; its owner progresses it,
    as the sender does for such an agent."""
    import types

    from omni_runtime.kv.transport import nixl_agent

    real = nixl_agent._nixl_api()
    other = types.SimpleNamespace(nixl_agent=real.nixl_agent, nixl_agent_config=real.nixl_agent_config,
                                  __name__=f"nixl-with-{release}")
    if release == "bindings it does not call":  # the real wrapper calls the real module's
        other.nixlBind = types.SimpleNamespace(nixlAgent=real.nixlBind.nixlAgent,
                                               nixlAgentConfig=real.nixlBind.nixlAgentConfig)
    monkeypatch.setattr(nixl_agent, "_nixl_api", lambda: other)
    before = set(os.listdir("/proc/self/task"))
    agent = KVAgent("omni-test-untamed", progress_thread=True)
    try:
        assert not agent.progresses_itself
        assert "progressed by its owner" in caplog.text
        started = set(os.listdir("/proc/self/task")) - before
        cpu0 = _thread_cpu_s(started)
        time.sleep(0.5)  # a measurement window: no thread of the agent's spins
        assert _thread_cpu_s(started) - cpu0 < 0.1
    finally:
        agent.close()


def test_an_agent_with_its_progress_thread_is_read_over_tcp_without_being_polled(monkeypatch):
    """Over UCX's TCP transport a remote read is served by the owner's progress: the AR's
    agent makes it on its own thread, nobody calls its progress() (without that thread the
    READ would never complete)."""
    from omni_runtime.kv.transport.nixl_agent import DONE, ERROR

    monkeypatch.setenv("UCX_TLS", "tcp")  # read by UCX as each agent is made
    source, reader = KVAgent("omni-test-tcp-owner", progress_thread=True), KVAgent("omni-test-tcp-reader")
    try:
        data = np.arange(1 << 20, dtype=np.uint8) * 7
        landing = np.zeros_like(data)
        source.register([(data.ctypes.data, data.nbytes, 0)], "DRAM")
        reader.register([(landing.ctypes.data, landing.nbytes, 0)], "DRAM")
        name = reader.add_remote(source.metadata())
        handle = reader.read(np.array([[landing.ctypes.data, data.nbytes, 0]], np.uint64), "DRAM",
                             np.array([[data.ctypes.data, data.nbytes, 0]], np.uint64), "DRAM", name)
        deadline = time.monotonic() + 20
        while (state := reader.state(handle)) != DONE:
            assert state != ERROR and time.monotonic() < deadline, f"the READ is {state}"
        reader.release(handle)
        assert np.array_equal(landing, data)
    finally:
        reader.close()
        source.close()


# ---------------------------------------------------------------------- the receiver's thread
class ExplodingObserver(NullReceiverObserver):
    """An observer whose rejection counter raises (a bug on the rejection path itself)."""

    def __init__(self) -> None:
        self.calls = 0

    def rejected(self, code: str) -> None:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("counter broke")


def test_an_exception_on_the_rejection_path_is_answered_and_serving_goes_on(
        make_receiver, ar, make_sender, zctx):
    receiver = make_receiver(metrics=ExplodingObserver())
    dealer = RawDealer(zctx, receiver.endpoint)
    dealer.send([b"not json"])
    answer = dealer.reply()
    assert (answer["type"], answer["code"]) == ("rejected", "malformed")
    assert receiver.running and receiver.num_rejected == 1
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    sender.submit(ar.offer("after", [1], 2))
    assert collect(sender, 1) == (["after"], {})


def test_the_receiver_thread_reports_itself_up_then_down(make_receiver, registry):
    receiver = make_receiver()
    assert sample(registry, "omni_kv_transport_thread_up", thread="receiver") == 1
    receiver.close()
    assert sample(registry, "omni_kv_transport_thread_up", thread="receiver") == 0


# ---------------------------------------------------------------------- the sender's thread
def break_the_io_thread(sender: KVSender) -> None:
    """Make the next loop iteration raise on the I/O thread (a stand-in for a bug there)."""
    def boom(*_a, **_k):
        raise RuntimeError("bug in the I/O thread")

    sender._next_timeout_ms = boom  # called once per idle loop iteration, on the I/O thread
    sender._kick()


def test_close_returns_normally_after_the_io_thread_died(ar, make_sender):
    states: list[bool] = []
    sender = make_sender(ar, {STAGE: "tcp://127.0.0.1:1"}, on_thread_state=states.append)
    sender.submit(ar.offer("queued", [1], 2))  # nothing listens: it stays queued
    break_the_io_thread(sender)
    sender._thread.join(WAIT)
    assert not sender.alive and "bug in the I/O thread" in sender.died
    acked, failed = collect(sender, 1)
    assert "bug in the I/O thread" in failed["queued"]
    sender.close()
    sender.close()
    sender.submit(ar.offer("later", [1], 2))
    assert "bug in the I/O thread" in sender.poll()["later"][1]
    assert states == [True, False]


def test_the_sender_thread_state_feeds_the_thread_up_gauge(ar, make_sender, registry):
    set_up = thread_up_setter(stage=STAGE, model_name="", thread="sender", registry=registry)
    sender = make_sender(ar, {STAGE: "tcp://127.0.0.1:1"}, on_thread_state=set_up)
    wait_for(lambda: sample(registry, "omni_kv_transport_thread_up", thread="sender") == 1,
             what="the gauge the I/O thread sets as it starts")
    break_the_io_thread(sender)
    sender._thread.join(WAIT)
    assert sample(registry, "omni_kv_transport_thread_up", thread="sender") == 0


def test_close_returns_when_the_io_thread_died_while_cleaning_up(ar, make_sender):
    sender = make_sender(ar, {STAGE: "tcp://127.0.0.1:1"})
    sender.submit(ar.offer("queued", [1], 2))

    def broken_report(*_a, **_k):
        raise RuntimeError("bug while resolving")

    sender._report = broken_report  # the thread's exit path breaks too
    break_the_io_thread(sender)
    sender._thread.join(WAIT)
    closer = threading.Thread(target=sender.close)
    closer.start()
    closer.join(WAIT)
    assert not closer.is_alive(), "close() hung after the I/O thread died"


def test_the_injected_fault_of_the_stage_health_test_kills_the_sender_at_its_first_offer(
        receiver, ar, make_sender, monkeypatch):
    """tests/faults/sitecustomize.py, which test_stage_health.py loads into a running AR
    stage, does to the real sender what it says: its I/O thread dies at the first offer,
    the transfer fails with the fault's message, and the thread says it is down."""
    monkeypatch.setenv("OMNI_TEST_SENDER_DIES", "1")
    monkeypatch.setattr(KVSender, "_pump", KVSender._pump)  # restored after the test
    runpy.run_path(str(FAULTS / "sitecustomize.py"))
    states: list[bool] = []
    sender = make_sender(ar, {STAGE: receiver.endpoint}, on_thread_state=states.append)
    sender.submit(ar.offer("r", [1], 2))
    failed = collect(sender, 1)[1]
    assert "injected fault: the KV sender's I/O thread dies" in failed["r"]
    sender._thread.join(WAIT)
    assert states == [True, False] and "injected fault" in sender.died


# ---------------------------------------------------------------------- request ids
def test_a_payload_is_found_by_the_internal_and_by_the_client_request_id(receiver, ar,
                                                                         make_sender):
    from omni_runtime.kv.transport.payload import vllm_external_request_id

    internal = "cmpl-my-client-id-0-1a2b3c4d"  # what vLLM's scheduler sees
    external = vllm_external_request_id(internal)
    assert external == "cmpl-my-client-id-0"
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    sender.submit(ar.offer(internal, [1], 2, external_request_id=external))
    assert collect(sender, 1) == ([internal], {})
    inbox = receiver.inbox
    assert internal in inbox and external in inbox
    assert inbox.list()[0]["external_request_id"] == external
    got = inbox.get(external, remove=False)
    assert got is not None and got.request_id == internal
    assert inbox.get(internal) is got  # consumed by either id: both are gone
    assert external not in inbox and internal not in inbox and inbox.bytes == 0


def test_a_newer_request_with_the_same_client_id_takes_the_alias(receiver, ar, make_sender):
    sender = make_sender(ar, {STAGE: receiver.endpoint})
    sender.submit(ar.offer("x-0-aaaaaaaa", [1], 2, external_request_id="x-0"))
    assert collect(sender, 1) == (["x-0-aaaaaaaa"], {})
    sender.submit(ar.offer("x-0-bbbbbbbb", [2], 2, external_request_id="x-0"))
    assert collect(sender, 1) == (["x-0-bbbbbbbb"], {})
    assert receiver.inbox.get("x-0", remove=False).request_id == "x-0-bbbbbbbb"
    receiver.inbox.get("x-0-aaaaaaaa")  # consuming the older one leaves the alias alone
    assert receiver.inbox.get("x-0").request_id == "x-0-bbbbbbbb"
    assert len(receiver.inbox) == 0


def test_a_receiver_paused_for_seconds_keeps_its_senders_connection(processes, ar, make_sender):
    """A receiving stage stopped (SIGSTOP: a long GC pause, a frozen cgroup) for 5 s keeps
    its sender's connection, so a stream mid-way goes on (a stream goes on only on the
    connection its first chunk took). ZeroMQ's heartbeat declared the peer dead after 3 s, and
    a 4.5 s pause ended every stream to it though each edge's deadlines were far longer (an
    outside review). What is mocked: the pause itself."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    stopped = processes.receiver(endpoint)
    sender = make_sender(ar, {STAGE: endpoint})
    sender.submit(ar.offer("before", [1, 2], 7))
    assert collect(sender, 1) == (["before"], {})
    os.kill(stopped.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(5.0)  # the fault itself: how long the receiver stays stopped
    finally:
        os.kill(stopped.proc.pid, signal.SIGCONT)
    sender.submit(ar.offer("after", [3, 4], 7), timeout_s=30)
    assert collect(sender, 1) == (["after"], {})
    (ep,) = sender._eps
    assert ep.connections == 1, "the connection was dropped and made again"
