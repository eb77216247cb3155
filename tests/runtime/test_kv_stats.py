"""The omni KV connector's figures on vLLM's own connector-stats path (omni_runtime/kv/stats.py):
the stats object's semantics and both of vLLM's serializations, the Prometheus families in
each registry situation, and real ``vllm serve`` processes with the omni scheduler (plain,
under MultiConnector, and with the multiprocess metrics directory omni-stage sets) and a test
connector that records through the same API (tests/stats_kv_connector.py)."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import prometheus_client
import pytest
from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

from omni_runtime.kv import stats as kv_stats
from omni_runtime.kv.stats import (
    BYTES_FAMILY,
    HANDOFF_FAMILY,
    RESOLVED_FAMILY,
    KVStatsRecorder,
    OmniKVConnectorStats,
    build_kv_connector_stats,
    build_prom_metrics,
)

pytestmark = pytest.mark.engine

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
METRIC_TYPES = {Gauge: Gauge, Counter: Counter, Histogram: Histogram}
LABELNAMES = ["model_name", "engine"]
ENGINES = {0: ["m", "0"]}


#: The stream records' lists of a stats object that has none.
NO_STREAMS = {f: [] for f in kv_stats.STREAM_FIELDS}


def _stats(*records) -> OmniKVConnectorStats:
    s = OmniKVConnectorStats()
    for r in records:
        s.record(*r)
    return s


# ============================================================================ the stats object
def test_aggregate_concatenates_and_reduce_summarizes_acked_transfers():
    a = _stats(("acked", 1 << 20, 0.1, "talker"), ("failed", 0, 2.0, "talker"))
    b = _stats(("acked", 3 << 20, 0.3, "talker"), ("expired", 0, 30.0, "code2wav"))
    assert a.aggregate(b) is a and len(a) == 4
    assert a.data["to_stage"] == ["talker", "talker", "talker", "code2wav"]
    r = a.reduce()
    assert (r["Acked"], r["Failed"], r["Expired"], r["Cancelled"]) == (2, 1, 1, 0)
    # Times and sizes over the two acked ones only (the failure's 2 s and expiry's 30 s are not
    # delivery times): 0.1 and 0.3 s, 1 and 3 MiB.
    assert r["Avg xfer time (ms)"] == 200.0
    assert r["P90 xfer time (ms)"] == pytest.approx(280.0)
    assert r["Avg MB per transfer"] == 2.0 and r["MB acked"] == 4.0
    assert r["Throughput (MB/s)"] == 10.0


def test_an_interval_of_failures_only_still_reports_them():
    r = _stats(("failed", 0, 1.0, "t"), ("failed", 0, 1.0, "t")).reduce()
    assert r["Failed"] == 2 and r["Acked"] == 0 and r["Throughput (MB/s)"] == 0


def test_empty_stats_are_empty_yet_truthy_and_aggregating_empty_changes_nothing():
    empty = OmniKVConnectorStats()
    assert empty.is_empty() and bool(empty)  # vLLM tests `stats or None` for presence
    s = _stats(("acked", 1, 0.1, "t"))
    s.aggregate(OmniKVConnectorStats())
    assert len(s) == 1 and not s.is_empty()
    with pytest.raises(TypeError):
        s.aggregate(OmniKVConnectorStats.__mro__[1]())  # another connector's stats


def test_an_outcome_outside_the_contract_is_refused():
    with pytest.raises(ValueError, match="outcome must be one of"):
        OmniKVConnectorStats().record("ok", 1, 0.1, "t")


def test_records_are_plain_builtins_clamped_at_zero_and_a_bad_column_records_nothing():
    import numpy as np

    stats = OmniKVConnectorStats()
    stats.record_columns(["acked", "failed", "expired"], [np.int64(7), -3, 0],
                         [np.float32(0.5), -1.0, float("nan")], "t")
    stats.record("cancelled", 2, -0.0, "u")
    assert stats.data == {"outcome": ["acked", "failed", "expired", "cancelled"],
                          "bytes": [7, 0, 0, 2], "duration_s": [0.5, 0.0, 0.0, 0.0],
                          "to_stage": ["t", "t", "t", "u"], **NO_STREAMS}
    assert [type(v) for v in stats.data["bytes"] + stats.data["duration_s"]] == [int] * 4 + [float] * 4
    assert str(stats.data["duration_s"][3]) == "0.0", "-0.0 is clamped as max(0.0, -0.0) was"
    before = {f: list(v) for f, v in stats.data.items()}
    with pytest.raises(ValueError, match="outcome must be one of .* not 'ok'"):
        stats.record_columns(["acked", "ok", "acked"], [1, 1, 2], [0.1, 0.1, 0.1], "t")
    with pytest.raises(ValueError, match="invalid literal"):
        stats.record_columns(["acked", "acked"], [1, "many"], [0.1, 0.1], "t")
    with pytest.raises(ValueError, match="2 outcomes, 1 sizes, 2 durations"):
        stats.record_columns(["acked", "acked"], [1], [0.1, 0.1], "t")
    assert stats.data == before, "all or nothing: no column grew"


def test_the_recorder_hands_out_each_record_once_and_none_when_nothing_happened():
    rec = KVStatsRecorder()
    assert kv_stats.get_kv_connector_stats(rec) is None
    rec.record("acked", 10, 0.01, "t")
    rec.record("failed", 0, 0.02, "t")
    first = kv_stats.get_kv_connector_stats(rec)
    assert first.data["outcome"] == ["acked", "failed"]
    assert kv_stats.get_kv_connector_stats(rec) is None
    rec.record("acked", 5, 0.01, "t")
    assert kv_stats.get_kv_connector_stats(rec).data["bytes"] == [5]
    assert first.data["bytes"] == [10, 0], "a handed-out object is not reused"
    rec.record_columns(["acked", "expired"], [7, 0], [0.5, 3.0], "u")
    many = kv_stats.get_kv_connector_stats(rec)
    assert many.data == {"outcome": ["acked", "expired"], "bytes": [7, 0],
                         "duration_s": [0.5, 3.0], "to_stage": ["u", "u"], **NO_STREAMS}
    with pytest.raises(ValueError, match="outcome"):
        rec.record_columns(["lost"], [0], [0.0], "t")
    assert kv_stats.get_kv_connector_stats(rec) is None


def test_a_producers_chunks_and_streams_are_recorded_beside_the_transfers():
    """A streamed edge's producer (the scheduler's stream ledger, observed by StreamStats)
    records each chunk and stream it resolves: they survive aggregation, and the log line
    counts them only where there are any."""
    from omni_contract.edges import StreamSettings
    from omni_runtime.transfers.streams import ConsumerStreams, ProducerStreams, StreamOutcome

    rec = KVStatsRecorder()
    p = ProducerStreams()
    p.add_observer(kv_stats.StreamStats(lambda: rec))
    settings = StreamSettings(first_chunk_tokens=2, chunk_tokens=2, chunks_in_flight=4)
    s = p.open("r", "talker", settings, 10.0)
    p.cut(s, 4, False, 10.0, 0.0)
    p.ack(s, 0, 10.25)
    p.fail(s, 1, "refused", 10.5)
    gone = p.open("r2", "talker", settings, 11.0)
    p.resolve(gone.request_id, StreamOutcome.ABORTED, "abort", 12.0)
    c = ConsumerStreams()  # a consumer's records are not the producer's figures
    c.add_observer(kv_stats.StreamStats(lambda: rec))
    c.arrive("x", "thinker", 0, True, 0.0, settings, 0.0)
    stats = rec.take()
    assert stats.data["stream_record"] == ["chunk", "chunk", "stream", "stream"]
    assert stats.data["stream_outcome"] == ["acked", "failed", "consumer_error", "aborted"]
    assert stats.data["stream_seconds"] == [0.25, 0.5, 0.5, 1.0]
    assert stats.data["stream_to_stage"] == ["talker"] * 4
    assert stats.data["outcome"] == [] and len(stats) == 4 and not stats.is_empty()
    r = stats.aggregate(_stats(("acked", 1, 0.1, "talker"))).reduce()
    assert (r["Chunks acked"], r["Chunks failed"], r["Chunks expired"]) == (1, 1, 0)
    assert r["Avg chunk ack time (ms)"] == 250.0
    assert (r["Streams finished"], r["Streams not finished"], r["Acked"]) == (0, 2, 1)
    assert "Chunks acked" not in _stats(("acked", 1, 0.1, "t")).reduce()
    with pytest.raises(ValueError, match="a chunk's outcome must be one of"):
        OmniKVConnectorStats().record_stream("chunk", "finished", 0.1, "t")
    with pytest.raises(ValueError, match="stream record must be chunk or stream"):
        OmniKVConnectorStats().record_stream("turn", "acked", 0.1, "t")
    # Once the engine collects no stats (the connector's stop_stats), nothing is recorded.
    off = ProducerStreams()
    off.add_observer(kv_stats.StreamStats(lambda: None))
    off.resolve(off.open("r", "talker", settings, 0.0).request_id, StreamOutcome.ABORTED, "",
                1.0)


def test_the_worker_to_engine_core_pickle_and_the_api_server_msgpack_round_trips():
    """Worker processes pickle the stats object; the engine core sends ``to_dict()`` inside
    SchedulerStats with vLLM's msgpack encoder; the API server rebuilds it with
    build_kv_connector_stats. The summary survives both unchanged."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    s = _stats(("acked", 4096, 0.25, "talker"), ("failed", 0, 0.5, "talker"))
    s.record_stream("chunk", "acked", 0.002, "talker")
    s.record_stream("stream", "finished", 0.5, "talker")
    from_worker = pickle.loads(pickle.dumps(s))
    assert isinstance(from_worker, OmniKVConnectorStats) and from_worker.data == s.data

    out = EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=s.to_dict()))
    frames = MsgpackEncoder().encode(out)
    got = MsgpackDecoder(EngineCoreOutputs).decode(frames).scheduler_stats.kv_connector_stats
    assert got == s.data
    rebuilt = build_kv_connector_stats(got)
    assert rebuilt.reduce() == s.reduce()
    rebuilt.aggregate(_stats(("acked", 1, 0.1, "talker")))
    assert got == s.data, "the payload (also handed to Prometheus) is not aggregated into"
    assert build_kv_connector_stats(None).is_empty()


def test_under_multi_connector_the_stats_are_rebuilt_by_class_name():
    """vLLM's MultiConnector keys children's stats by class name and looks the class up in
    its factory's registry, which knows only registered connectors: the mixin registers the
    class when it is created (ours is loaded by module path)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiConnector,
        MultiKVConnectorStats,
    )

    import stats_kv_connector

    name = stats_kv_connector.StatsTestConnector.__name__
    assert KVConnectorFactory.get_connector_class_by_name(name) is \
        stats_kv_connector.StatsTestConnector
    s = _stats(("acked", 8, 0.5, "t"))
    payload = MultiKVConnectorStats(data={name: s}).to_dict()  # as the engine core sends it
    rebuilt = MultiConnector.build_kv_connector_stats(json.loads(json.dumps(payload)))
    assert rebuilt.reduce() == {name: s.reduce()}


# ============================================================================ Prometheus
@pytest.fixture
def clean_registry(monkeypatch):
    """Prometheus families in the global registry (where vLLM's metric types register),
    dropped again after the test; no multiprocess directory unless a test sets one. The
    observability layer's families an earlier test of this process registered there (an
    in-process scheduler's) are set aside meanwhile and put back after."""
    from omni_runtime.observability import metrics as obs

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    earlier = obs._families.pop(REGISTRY, None)
    if earlier is not None:
        earlier.unregister()
    yield
    kv_stats._unregister_ours()
    if earlier is not None:
        left = obs._families.pop(REGISTRY, None)  # a test's own, if it left one
        if left is not None:
            left.unregister()
        for collector in (earlier.transfers, earlier.held_blocks, earlier.oldest,
                          earlier.started, earlier.resolved, earlier.duration, earlier.hold,
                          earlier.bytes):
            REGISTRY.register(collector)
        obs._families[REGISTRY] = earlier


def _config(endpoints=("talker", "code2wav"), stage="thinker", timeout=30, connector=None):
    from types import SimpleNamespace

    extra = {"endpoints": {s: f"tcp://127.0.0.1:{9600 + i}" for i, s in enumerate(endpoints)}}
    ktc = SimpleNamespace(kv_connector_extra_config=extra, **(connector or {}))
    return SimpleNamespace(
        kv_transfer_config=ktc, model_config=None,
        additional_config={"omni_kv_config": {"stage_name": stage, "timeout_seconds": timeout}})


def _value(name, **labels):
    return REGISTRY.get_sample_value(name, {"model_name": "m", "engine": "0", "stage": "thinker",
                                            **labels})


def test_families_are_registered_with_vllms_labels_and_every_series_starts_at_zero(
        clean_registry):
    prom = build_prom_metrics(_config(), METRIC_TYPES, LABELNAMES, ENGINES)
    assert prom.contract_families
    for to_stage in ("talker", "code2wav"):
        for outcome in ("acked", "failed", "expired", "cancelled"):
            assert _value(RESOLVED_FAMILY, to_stage=to_stage, outcome=outcome) == 0
            assert _value(HANDOFF_FAMILY + "_count", to_stage=to_stage, outcome=outcome) == 0
        assert _value(BYTES_FAMILY + "_count", to_stage=to_stage) == 0
    # The configured deadline is a bucket of its own (as in the contract's duration families).
    assert _value(HANDOFF_FAMILY + "_bucket", to_stage="talker", outcome="acked", le="30.0") == 0


def test_observe_counts_outcomes_and_bytes_of_delivered_transfers_only(clean_registry):
    prom = build_prom_metrics(_config(), METRIC_TYPES, LABELNAMES, ENGINES)
    s = _stats(("acked", 1 << 20, 0.1, "talker"), ("acked", 4096, 0.3, "talker"),
               ("failed", 1 << 30, 2.0, "talker"), ("acked", 100, 0.2, "code2wav"),
               ("acked", 7, 0.05, "a-request-id-42"))
    prom.observe(s.to_dict(), engine_idx=0)
    assert _value(RESOLVED_FAMILY, to_stage="talker", outcome="acked") == 2
    assert _value(RESOLVED_FAMILY, to_stage="talker", outcome="failed") == 1
    assert _value(RESOLVED_FAMILY, to_stage="code2wav", outcome="acked") == 1
    assert _value(BYTES_FAMILY + "_sum", to_stage="talker") == (1 << 20) + 4096
    assert _value(BYTES_FAMILY + "_count", to_stage="talker") == 2
    assert _value(HANDOFF_FAMILY + "_sum", to_stage="talker", outcome="failed") == 2.0
    # A destination the configuration does not name is counted as "other", never as itself.
    assert _value(RESOLVED_FAMILY, to_stage="other", outcome="acked") == 1
    assert _value(RESOLVED_FAMILY, to_stage="a-request-id-42", outcome="acked") is None


def test_a_stage_with_streamed_edges_shows_its_producers_stream_counters(clean_registry):
    """The contract's stream counters, labelled as the contract's edge families (stage,
    from_stage, to_stage) beside vLLM's labels: every series of a streamed edge from
    start-up; a destination the configuration does not stream to counted as ``other``."""
    from omni_contract.edges import StreamSettings, stream_config
    from omni_contract.metrics import STREAM_CHUNKS, STREAMS_RESOLVED

    config = _config()
    config.additional_config["omni_kv_config"]["streams"] = {
        "talker": stream_config(StreamSettings())}
    prom = build_prom_metrics(config, METRIC_TYPES, LABELNAMES, ENGINES)
    assert prom.streamed == ("talker",)
    edge = {"from_stage": "thinker", "to_stage": "talker"}
    for outcome in ("acked", "failed", "expired"):
        assert _value(STREAM_CHUNKS.name, outcome=outcome, **edge) == 0
    for outcome in ("finished", "producer_error", "consumer_error", "expired", "aborted"):
        assert _value(STREAMS_RESOLVED.name, outcome=outcome, **edge) == 0
    assert _value(STREAM_CHUNKS.name, outcome="acked", from_stage="thinker",
                  to_stage="code2wav") is None, "a whole edge has no stream series"
    s = OmniKVConnectorStats()
    for record, outcome, to_stage in [("chunk", "acked", "talker"), ("chunk", "acked", "talker"),
                                      ("chunk", "expired", "talker"),
                                      ("stream", "finished", "talker"),
                                      ("stream", "expired", "elsewhere")]:
        s.record_stream(record, outcome, 0.1, to_stage)
    prom.observe(build_kv_connector_stats(s.to_dict()).to_dict(), engine_idx=0)
    assert _value(STREAM_CHUNKS.name, outcome="acked", **edge) == 2
    assert _value(STREAM_CHUNKS.name, outcome="expired", **edge) == 1
    assert _value(STREAMS_RESOLVED.name, outcome="finished", **edge) == 1
    assert _value(STREAMS_RESOLVED.name, outcome="expired", from_stage="thinker",
                  to_stage="other") == 1
    # Without streamed edges, none of it.
    clean = build_prom_metrics(_config(), METRIC_TYPES, LABELNAMES, ENGINES)
    assert clean.streamed == ()
    assert _value(STREAM_CHUNKS.name, outcome="acked", **edge) is None


def test_with_a_multiprocess_directory_the_contract_names_are_left_to_the_observability_layer(
        clean_registry, monkeypatch, tmp_path):
    """omni-stage: the engine core's families reach /metrics through the directory; ours from
    the API server would land in the same directory and merge into one family with a second
    label set."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    prom = build_prom_metrics(_config(), METRIC_TYPES, LABELNAMES, ENGINES)
    assert not prom.contract_families
    prom.observe(_stats(("acked", 10, 0.1, "talker")).to_dict())
    assert _value(RESOLVED_FAMILY, to_stage="talker", outcome="acked") is None
    assert _value(BYTES_FAMILY + "_count", to_stage="talker") is None
    assert _value(HANDOFF_FAMILY + "_count", to_stage="talker", outcome="acked") == 1


def test_next_to_an_in_process_omni_scheduler_the_contract_names_are_not_registered_twice(
        clean_registry):
    """VLLM_ENABLE_V1_MULTIPROCESSING=0: the scheduler's TransferMetrics registered the
    contract's families in this registry before vLLM builds its loggers; registering them
    again would raise 'Duplicated timeseries'."""
    from omni_runtime.observability import metrics as obs

    obs.TransferMetrics(stage="thinker", model_name="m", registry=REGISTRY)
    try:
        prom = build_prom_metrics(_config(), METRIC_TYPES, LABELNAMES, ENGINES)
        assert not prom.contract_families
        prom.observe(_stats(("acked", 10, 0.1, "talker")).to_dict())
        assert _value(HANDOFF_FAMILY + "_count", to_stage="talker", outcome="acked") == 1
        # The scheduler's own series, untouched by the connector's stats.
        assert REGISTRY.get_sample_value(
            RESOLVED_FAMILY, {"stage": "thinker", "model_name": "m", "outcome": "acked"}) == 0
    finally:
        obs._families.pop(REGISTRY).unregister()


def test_a_second_build_replaces_the_first_instead_of_raising(clean_registry):
    """vLLM re-creates its Prometheus logger (scaling data parallelism); its own cleanup
    drops only ``vllm:`` names."""
    first = build_prom_metrics(_config(), METRIC_TYPES, LABELNAMES, ENGINES)
    first.observe(_stats(("acked", 10, 0.1, "talker")).to_dict())
    second = build_prom_metrics(_config(), METRIC_TYPES, LABELNAMES, {0: ["m", "0"], 1: ["m", "1"]})
    assert second.contract_families
    second.observe(_stats(("acked", 10, 0.1, "talker")).to_dict(), engine_idx=1)
    assert _value(RESOLVED_FAMILY, engine="1", to_stage="talker", outcome="acked") == 1
    assert _value(RESOLVED_FAMILY, to_stage="talker", outcome="acked") == 0


# ============================================================================ real servers
TO_STAGE = "talker"
STAGE = "thinker"
MODEL = "tiny"


def _connector(fail_every: int, record_on: str = "worker") -> dict:
    return {"kv_connector": "StatsTestConnector", "kv_connector_module_path": "stats_kv_connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"endpoints": {TO_STAGE: "tcp://127.0.0.1:9"},
                                          "fail_every": fail_every, "record_on": record_on}}


def _multi(storage: Path, **ours) -> dict:
    example = {"kv_connector": "ExampleConnector", "kv_role": "kv_producer",
               "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    return {"kv_connector": "MultiConnector", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"connectors": [example, _connector(**ours)]}}


class Server:
    """``python -m vllm.entrypoints.openai.api_server`` on the tiny model, on a free port,
    with this worktree's code and tests/ on PYTHONPATH and a 1 s stats log interval."""

    def __init__(self, workdir: Path, kv_transfer_config: dict, *, multiproc: bool):
        from omni_runtime.devtools.tiny_model import ensure_tiny_model
        from procs import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "server.log"
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("OTEL_", "PROMETHEUS_", "OMNI_"))
               and k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        env.update(VLLM_TARGET_DEVICE="cpu", VLLM_LOG_STATS_INTERVAL="1",
                   PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT), str(ROOT / "operator")]))
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(ensure_tiny_model()), "--served-model-name", MODEL,
               "--host", "127.0.0.1", "--port", str(self.port),
               "--additional-config", json.dumps({"omni_kv_config": {"stage_name": STAGE}}),
               "--kv-transfer-config", json.dumps(kv_transfer_config),
               "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "512",
               "--enforce-eager",
               # As every run of the real connector (only the omni scheduler hands transfers
               # off): its ledger's TransferMetrics register the contract's families in the
               # engine-core process, which a plain vllm serve never shows on /metrics.
               "--scheduler-cls", "omni_runtime.sched.OmniARScheduler"]
        if multiproc:
            # What omni-stage adds: a fresh multiprocess directory, which brings the engine
            # core's families to the API server's /metrics.
            directory = workdir / "prometheus-multiproc"
            directory.mkdir()
            env["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
        self.cmd, self.env = cmd, env
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        from procs import http_get, wait_until

        with self.log_path.open("wb") as out:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(lambda: http_get(self.url + "/health", timeout=5)[0] == 200, 300,
                   "the vLLM server to be healthy", interval=0.5, proc=self.proc,
                   log=self.log_path)
        return self

    def stop(self) -> None:
        from procs import stop_group

        if self.proc is not None:
            stop_group(self.proc)

    def complete(self, prompt: str) -> None:
        import requests

        r = requests.post(self.url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text

    def metrics(self) -> str:
        from procs import http_get

        status, body, _ = http_get(self.url + "/metrics")
        assert status == 200
        return body.decode()


@pytest.fixture
def serve(tmp_path):
    started: list[Server] = []

    def start(kv_transfer_config: dict, multiproc: bool = False) -> Server:
        server = Server(tmp_path, kv_transfer_config, multiproc=multiproc)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


def _samples(text: str, name: str) -> list:
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == name]


def _value_in(text: str, name: str, **labels: str) -> float | None:
    found = [s.value for s in _samples(text, name)
             if all(s.labels.get(k) == v for k, v in labels.items())]
    return sum(found) if found else None


_LOGGED = re.compile(r"KV Transfer metrics: (.*)")


def _logged_counts(log: str) -> dict[str, int]:
    """Acked and Failed summed over every 'KV Transfer metrics' line (the resolutions may fall
    into several log intervals); the plain form is 'Acked=2, ...', MultiConnector's
    'StatsTestConnector={'Acked': 2, ...}'."""
    totals = {"Acked": 0, "Failed": 0}
    for line in _LOGGED.findall(log):
        for key in totals:
            m = re.search(rf"'?{key}'?(?:=|: )(\d+)", line)
            if m:
                totals[key] += int(m.group(1))
    return totals


def _run_three_requests_and_wait_for_the_log(server: Server) -> dict[str, int]:
    from procs import wait_until

    for prompt in ("Hello world", "The quick brown fox", "An omni pipeline"):
        server.complete(prompt)
    def logged() -> dict[str, int] | None:
        counts = _logged_counts(server.log_path.read_text(errors="replace"))
        return counts if counts["Acked"] + counts["Failed"] >= 3 else None

    # The resolutions are in the log once vLLM's next interval (1 s here) has logged them.
    return wait_until(logged, 60, "vLLM's stats log line with the transfers", proc=server.proc,
                      log=server.log_path)


def _assert_transfer_families(text: str) -> None:
    """2 acked and 1 failed (fail_every=3), with vLLM's and our labels."""
    from stats_kv_connector import NBYTES, SECONDS

    labels = {"model_name": MODEL, "engine": "0", "stage": STAGE, "to_stage": TO_STAGE}
    assert _value_in(text, RESOLVED_FAMILY, **labels, outcome="acked") == 2
    assert _value_in(text, RESOLVED_FAMILY, **labels, outcome="failed") == 1
    assert _value_in(text, RESOLVED_FAMILY, **labels, outcome="expired") == 0
    assert _value_in(text, BYTES_FAMILY + "_count", **labels) == 2
    assert _value_in(text, BYTES_FAMILY + "_sum", **labels) == 2 * NBYTES
    assert _value_in(text, HANDOFF_FAMILY + "_count", **labels, outcome="acked") == 2
    assert _value_in(text, HANDOFF_FAMILY + "_sum", **labels, outcome="acked") == \
        pytest.approx(2 * SECONDS)


def _poll_metrics(server: Server, name: str, expected: float, **labels: str) -> str:
    """The /metrics page once ``name`` reached ``expected`` (stats reach Prometheus with the
    step's output, not at once with the HTTP answer)."""
    from procs import wait_until

    def reached() -> str | None:
        text = server.metrics()
        return text if _value_in(text, name, **labels) == expected else None

    return wait_until(reached, 30, f"{name} {labels} = {expected} on /metrics",
                      proc=server.proc, log=server.log_path)


def test_a_plain_vllm_serve_logs_the_transfer_stats_and_shows_the_families(serve):
    """No omni-stage, no multiprocess directory: vLLM's own stats path brings the figures
    to the API server, where the engine core's omni_ families never show."""
    server = serve(_connector(fail_every=3))
    assert _run_three_requests_and_wait_for_the_log(server) == {"Acked": 2, "Failed": 1}
    text = _poll_metrics(server, RESOLVED_FAMILY, 2, outcome="acked")
    _assert_transfer_families(text)


def test_composed_under_multi_connector_with_vllms_example_connector(serve, tmp_path):
    """Recorded by the scheduler-side connector this time: vLLM's scheduler collects those
    at the end of update_from_output and aggregates them with the workers'."""
    storage = tmp_path / "example-connector"
    storage.mkdir()
    server = serve(_multi(storage, fail_every=3, record_on="scheduler"))
    assert _run_three_requests_and_wait_for_the_log(server) == {"Acked": 2, "Failed": 1}
    text = _poll_metrics(server, RESOLVED_FAMILY, 2, outcome="acked")
    _assert_transfer_families(text)
    log = server.log_path.read_text(errors="replace")
    assert "StatsTestConnector={" in log, "MultiConnector logs each child's summary by name"
    assert list(storage.rglob("*.safetensors")), "the ExampleConnector ran too"


def test_as_omni_stage_runs_it_each_contract_family_is_exported_once(serve):
    """The omni scheduler's observability layer exports omni_kv_transfers_resolved_total and
    omni_kv_transfer_bytes through the multiprocess directory: the connector's stats do not
    add a second copy (nor fail to register); its hand-off family and the log line remain."""
    server = serve(_connector(fail_every=3), multiproc=True)
    assert _run_three_requests_and_wait_for_the_log(server) == {"Acked": 2, "Failed": 1}
    text = _poll_metrics(server, HANDOFF_FAMILY + "_count", 2, outcome="acked")
    for family, kind in (("omni_kv_transfers_resolved", "counter"),
                         ("omni_kv_transfer_bytes", "histogram")):
        # (the multiprocess collector names a counter family with its _total)
        types = re.findall(rf"^# TYPE {family}(?:_total)? (\w+)$", text, re.MULTILINE)
        assert types == [kind], (family, types)
    # Every series is the observability layer's (stage, model_name[, outcome]); none with
    # vLLM's engine label, and no transfer of the ledger's (there were none) counted.
    resolved = _samples(text, RESOLVED_FAMILY)
    assert resolved and all(set(s.labels) == {"stage", "model_name", "outcome"} for s in resolved)
    assert all(s.value == 0 for s in resolved)
    sizes = _samples(text, BYTES_FAMILY + "_count")
    assert sizes and all("engine" not in s.labels for s in sizes)
    assert _value_in(text, HANDOFF_FAMILY + "_count", engine="0", stage=STAGE,
                     to_stage=TO_STAGE, outcome="failed") == 1


@contextlib.contextmanager
def _receiver(stage: str):
    """A real KV receiver in this process (NIXL reads the server's KV cache into its inbox)."""
    from omni_runtime.kv.transport import KVInbox, KVReceiver

    inbox = KVInbox()
    receiver = KVReceiver("tcp://127.0.0.1:0", inbox, stage=stage).start()
    try:
        yield receiver
    finally:
        receiver.close()


def _three_delivered(server: Server, receiver) -> tuple[str, int]:
    """Three requests through the started ``server``, each transfer delivered to
    ``receiver`` and counted acked on vLLM's log line: the /metrics page once its resolved
    counter says so, and the bytes the receiver stored."""
    logged = _run_three_requests_and_wait_for_the_log(server)
    assert logged == {"Acked": 3, "Failed": 0}
    assert receiver.num_delivered == 3
    stored = sum(p["bytes"] for p in receiver.inbox.list())
    return _poll_metrics(server, RESOLVED_FAMILY, 3, outcome="acked"), stored


def test_the_readmes_plain_vllm_serve_shows_every_family_of_the_metric_contract(tmp_path):
    """The README's plain ``vllm serve`` command, run as written (the model, the next stage's
    address and vLLM's CPU settings put in; its fresh PROMETHEUS_MULTIPROC_DIR a directory of
    this test), with the real OmniKVConnector and a receiver in this process reading the
    server's KV cache: its /metrics shows every family of the metric contract that a sending
    stage exports (the ledger's, the per-edge ones, the transport thread's) and the
    connector-stats path's hand-off histogram, each transfer counted once; vLLM's log line
    counts them too."""
    from omni_contract.metrics import EDGE_FAMILIES, LEDGER_FAMILIES, STARTED, TRANSPORT_THREAD_UP
    from procs import readme_block, shell_commands

    with _receiver("next") as receiver:
        directory = tmp_path / "prometheus-multiproc"
        directory.mkdir()
        ((env, argv),) = shell_commands(readme_block("tcp://next-stage:9600"),
                                        {"$(mktemp -d)": str(directory)})
        assert argv[0] == "python" and set(env) == {"PROMETHEUS_MULTIPROC_DIR"}, (env, argv)
        server = Server(tmp_path, {}, multiproc=False)
        argv = [a.replace("tcp://next-stage:9600", receiver.endpoint) for a in argv]
        model = server.cmd[server.cmd.index("--model") + 1]
        server.cmd = [sys.executable, *[model if a == "MODEL" else a for a in argv[1:]],
                      "--served-model-name", MODEL, "--host", "127.0.0.1",
                      "--port", str(server.port), "--kv-cache-memory-bytes", str(64 << 20),
                      "--max-model-len", "512", "--enforce-eager"]
        server.env = {**server.env, **env}
        server.start()
        try:
            text, stored = _three_delivered(server, receiver)
            for family in (*LEDGER_FAMILIES, *EDGE_FAMILIES, TRANSPORT_THREAD_UP):
                sample = family.name + ("_count" if family.type == "histogram" else "")
                assert _samples(text, sample), f"{family.name} is not on /metrics"
            assert _value_in(text, STARTED.name) == 3
            assert _value_in(text, BYTES_FAMILY + "_count") == 3
            assert _value_in(text, BYTES_FAMILY + "_sum") == stored
            assert _value_in(text, HANDOFF_FAMILY + "_count", outcome="acked") == 3
            assert _value_in(text, TRANSPORT_THREAD_UP.name, thread="sender") == 1
            # Each once: the observability layer's series (no vLLM engine label), none from
            # the connector-stats path besides its own hand-off histogram.
            assert all("engine" not in s.labels for s in _samples(text, RESOLVED_FAMILY))
        finally:
            server.stop()


def test_a_plain_vllm_serve_with_the_real_connector_under_multi_connector_shows_its_transfers(
        tmp_path):
    """The real OmniKVConnector (NIXL: a receiver in this process reads the server's KV
    cache) as a MultiConnector's child beside vLLM's ExampleConnector, no omni-stage and no
    multiprocess directory: vLLM's periodic log line and /metrics (its connector-stats path)
    count every transfer the receiver stored, with its payload bytes."""
    from omni_runtime.kv.connector_config import kv_transfer_config

    with _receiver(TO_STAGE) as receiver:
        config = kv_transfer_config({TO_STAGE: receiver.endpoint})
        storage = tmp_path / "example-connector"
        storage.mkdir()
        example = {"kv_connector": "ExampleConnector", "kv_role": "kv_producer",
                   "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
        config = {"kv_connector": "MultiConnector", "kv_role": "kv_producer",
                  "kv_connector_extra_config": {"connectors": [example, config]}}
        server = Server(tmp_path, config, multiproc=False)
        server.cmd[server.cmd.index("--additional-config") + 1] = json.dumps(
            {"omni_kv_config": {"stage_name": STAGE, "need_send_cache": True,
                                "kv_transfer_criteria": {"type": "prefill_finished"}}})
        server.start()
        try:
            text, stored = _three_delivered(server, receiver)
            labels = {"model_name": MODEL, "engine": "0", "stage": STAGE, "to_stage": TO_STAGE}
            assert _value_in(text, BYTES_FAMILY + "_count", **labels) == 3
            assert _value_in(text, BYTES_FAMILY + "_sum", **labels) == stored
            assert _value_in(text, HANDOFF_FAMILY + "_count", **labels, outcome="acked") == 3
            log = server.log_path.read_text(errors="replace")
            assert "OmniKVConnector={" in log
        finally:
            server.stop()
