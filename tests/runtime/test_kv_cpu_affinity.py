"""Where the KV transport's threads run: the io_cpus setting and its "auto" default."""

from __future__ import annotations

import os
import threading

import pytest

from omni_runtime.kv.cpu_affinity import (
    CPUListError,
    disjoint_from_engine,
    omp_bound_cpus,
    parse_cpu_list,
    transport_cpus,
)

ALL = {0, 1, 2, 3}


def test_cpu_lists_parse_like_linux_writes_them():
    assert parse_cpu_list("0,2-3, 6") == {0, 2, 3, 6}
    for bad in ("a", "3-1", "1-", "-1"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


@pytest.mark.parametrize("environ, expected", [
    ({"OMP_PLACES": "{0,1,2}", "OMP_PROC_BIND": "true"}, {0, 1, 2}),  # what vLLM writes
    ({"OMP_PLACES": "{0},{1}", "OMP_PROC_BIND": "close"}, {0, 1}),
    ({"OMP_PLACES": "{2:2}", "OMP_PROC_BIND": "true"}, {2, 3}),
    ({"OMP_PLACES": "{0,1}"}, None),  # places without binding bind nothing
    ({"GOMP_CPU_AFFINITY": "0 1"}, {0, 1}),
    ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[0,1,2]"}, {0, 1, 2}),
    ({}, None),
    # Tensor parallel: every rank's CPUs, not only this worker's.
    ({"OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "true", "VLLM_CPU_OMP_THREADS_BIND": "0-1|2"},
     {0, 1, 2}),
    ({"VLLM_CPU_OMP_THREADS_BIND": "auto"}, None),
])
def test_the_engines_openmp_binding_is_read_from_the_variables_vllm_sets(environ, expected):
    assert omp_bound_cpus(environ) == expected


def test_auto_takes_the_cpus_the_engine_is_not_bound_to():
    bound = {"OMP_PLACES": "{0,1,2}", "OMP_PROC_BIND": "true"}
    assert transport_cpus(None, bound, ALL) == {3}
    assert transport_cpus("auto", bound, ALL) == {3}
    assert disjoint_from_engine({3}, bound) and not disjoint_from_engine({2, 3}, bound)


def test_auto_never_narrows_to_the_masters_core_when_nothing_is_left_or_known():
    # OpenMP on every CPU, or no binding known: all of the process's CPUs, not the inherited
    # binding of the thread that starts the sender (the OpenMP master's core).
    assert transport_cpus(None, {"OMP_PLACES": "{0-3}", "OMP_PROC_BIND": "true"}, ALL) == ALL
    assert transport_cpus(None, {}, ALL) == ALL
    assert not disjoint_from_engine(ALL, {})


@pytest.mark.parametrize("setting, expected", [("3", {3}), ("2-3", {2, 3}), ([1, 3], {1, 3})])
def test_an_explicit_setting_is_honoured(setting, expected):
    assert transport_cpus(setting, {}, ALL) == expected


@pytest.mark.parametrize("setting, words", [
    ("7", "names CPUs [7] this process cannot use"),
    ("", "is empty"),
    ("x", "not a CPU list item"),
    ([1, "2"], "a string like"),
    (3, "a string like"),
    # A typo'd range is refused before a set of billions of ids is built.
    ("0-99999999999", "CPU id above 65535"),
    ([70000], "a string like"),
])
def test_a_bad_setting_is_refused_naming_the_field_and_the_fix(setting, words):
    with pytest.raises(CPUListError) as err:
        transport_cpus(setting, {}, ALL)
    assert "kv_connector_extra_config.io_cpus" in str(err.value) and words in str(err.value)


def test_the_senders_threads_run_on_its_io_cpus():
    """The sender's I/O thread and ZeroMQ's are bound to io_cpus, whatever the binding of the
    thread that created the sender (the engine's OpenMP master, in a vLLM worker)."""
    from omni_runtime.kv.transport import KVInbox, KVReceiver, KVSender

    from transport_fixtures import SLOT_BYTES, SyntheticAR

    cpus = sorted(os.sched_getaffinity(0))
    io = cpus[-1:]
    ar = SyntheticAR()
    rx = KVReceiver("tcp://127.0.0.1:0", KVInbox(), pipeline="p", stage="next",
                    slot_bytes=SLOT_BYTES, slots=1).start()
    sender = KVSender({"next": rx.endpoint}, hello=ar.hello, agent=ar.agent, io_cpus=io)
    try:
        sender.submit(ar.offer("r1", [1], 2))
        assert sender.wait(10.0) and sender.poll() == {"r1": (0, None)}
        names = {}
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                names[int(tid)] = f.read().strip()
        sender_io = next(t.native_id for t in threading.enumerate()
                         if t.name == "omni-kv-sender-ar")
        assert os.sched_getaffinity(sender_io) == set(io)
        zmq_io = [tid for tid, name in names.items() if name.startswith("ZMQbg/IO")]
        assert any(os.sched_getaffinity(tid) == set(io) for tid in zmq_io)
    finally:
        sender.close()
        rx.close()
        ar.close()
