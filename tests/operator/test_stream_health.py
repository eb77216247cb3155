"""Streams in the transfer health (issue 49): the stream families read from a stage's page
(either end of a streamed edge), ``status.stages[].transfers.streams``, ``TransfersHealthy``
with reason ``StreamStalled`` naming the edge, and its events at the start and the end of a
stall, against the API emulator with pods whose /metrics are PageServers."""
from __future__ import annotations

import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from metrics_pages import PageServer, ar_page, create_pod, stream_lines
from omni_contract import metrics as contract
from omni_operator.health.reader import PodMetricsSource, PrometheusSource, TransferHealth
from omni_operator.pipeline.model import parse_pipeline
from omni_operator.controller.reconcile import Reconciler
from omni_operator.controller.resync import Resync
from omni_operator.controller.status import compute_status
from omni_operator.health.transfers import parse_metrics, transfers_verdict
from omnip_support import NAMESPACE, complete_rollout, create_pipeline, make_kube, pipeline_body, status
from test_transfer_health import condition, events
from test_transfers import NOW, T0, reading

EDGE = ("thinker", "talker")


def streamed_body(stalled_seconds: int | None = 60) -> dict:
    body = pipeline_body(observability={"alerts": {} if stalled_seconds is None
                                        else {"stalledStreamSeconds": stalled_seconds}})
    body["spec"]["stages"][1]["streams"] = [{"stage": "thinker"}]
    return body


def streamed_pipeline(stalled_seconds: int | None = 60):
    body = streamed_body(stalled_seconds)
    body["metadata"].update(uid="u-1", generation=1)
    return parse_pipeline(body)


def pages(thinker: dict | None = None, talker: dict | None = None, **thinker_kw) -> dict[str, dict[str, str]]:
    """Both ends' pages: the thinker's (the producer) and the talker's (the consumer: it
    sends on to code2wav whole)."""
    return {"thinker": {"thinker-0": ar_page("thinker", streams={EDGE: thinker or {}}, **thinker_kw)},
            "talker": {"talker-0": ar_page("talker", streams={EDGE: talker or {}})}}


def test_parse_reads_the_stream_families_as_the_runtime_registers_them():
    """The page as prometheus_client exposes the contract's stream families (the runtime's
    own register(), omni_runtime/observability/metrics.py), both ends of two edges."""
    from omni_runtime.observability.metrics import register

    registry = CollectorRegistry()
    streams = register(contract.STREAMS, registry)
    oldest = register(contract.STREAM_OLDEST_WAIT, registry)
    # talker consumes thinker's stream and produces one for code2wav
    streams.labels("talker", "m", "thinker", "talker", "waiting").set(2)
    streams.labels("talker", "m", "talker", "code2wav", "open").set(3)
    streams.labels("talker", "m", "talker", "code2wav", "held").set(1)
    oldest.labels("talker", "m", "thinker", "talker").set(NOW - 40)
    oldest.labels("talker", "m", "talker", "code2wav").set(0)
    sample = parse_metrics(generate_latest(registry).decode())
    assert sample.streams[("thinker", "talker")].waiting == 2
    assert sample.streams[("thinker", "talker")].oldest_wait == NOW - 40
    assert (sample.streams[("talker", "code2wav")].open, sample.streams[("talker", "code2wav")].held) == (3, 1)
    assert sample.streams[("talker", "code2wav")].oldest_wait == 0.0
    assert not sample.sends  # stream series alone do not make a ledger page


def test_status_counts_each_ends_streams_per_edge():
    p = streamed_pipeline()
    verdict = transfers_verdict(p, reading(pages({"open": 5, "held": 1, "oldest_wait": NOW - 3},
                                                 {"waiting": 2, "oldest_wait": NOW - 12})))
    assert (verdict.reason, verdict.summary) == ("TransfersFlowing", "ok")
    assert verdict.stages["thinker"]["streams"] == [
        {"fromStage": "thinker", "toStage": "talker", "open": 5, "held": 1, "waiting": 0, "oldestWaitSeconds": 2}]
    assert verdict.stages["talker"]["streams"] == [
        {"fromStage": "thinker", "toStage": "talker", "open": 0, "held": 0, "waiting": 2, "oldestWaitSeconds": 10}]


def test_a_pipeline_without_streams_has_no_streams_in_its_status():
    p = parse_pipeline(pipeline_body())
    verdict = transfers_verdict(p, reading({"thinker": {"thinker-0": ar_page("thinker")},
                                            "talker": {"talker-0": ar_page("talker")}}))
    assert all("streams" not in t for t in verdict.stages.values())


def test_a_wait_over_the_threshold_is_a_stall_naming_the_edge():
    p = streamed_pipeline(stalled_seconds=60)
    stalled = transfers_verdict(p, reading(pages(talker={"waiting": 1, "oldest_wait": NOW - 61})))
    assert (stalled.status, stalled.reason, stalled.summary) == ("False", "StreamStalled", "stalled 1")
    assert stalled.message == ("edge thinker -> talker: a stream has waited for over 1m00s for a chunk, an ack or "
                               "a credit (threshold 60s; at talker: 1 of 1 pods)")
    # At the producer (out of credit, waiting for an ack) it is the same edge's stall.
    producer = transfers_verdict(p, reading(pages({"held": 1, "oldest_wait": NOW - 200})))
    assert producer.reason == "StreamStalled" and "at thinker: 1 of 1 pods" in producer.message
    # Just below the threshold it is not.
    assert transfers_verdict(p, reading(pages(talker={"waiting": 1, "oldest_wait": NOW - 59}))).summary == "ok"


def test_the_threshold_defaults_from_the_crd_and_rolls_no_pod():
    from omni_operator.pipeline import crd

    default = (crd.openapi_schema()["properties"]["spec"]["properties"]["observability"]["properties"]["alerts"]
               ["properties"]["stalledStreamSeconds"]["default"])
    assert streamed_pipeline(stalled_seconds=None).observability.stalled_stream_seconds == default == 60
    assert streamed_pipeline(5).revision == streamed_pipeline(500).revision


def test_a_stuck_transfer_wins_over_a_stall():
    p = streamed_pipeline()
    both = pages({"oldest_wait": NOW - 500}, active=1, oldest_active=NOW - 500)
    assert transfers_verdict(p, reading(both)).reason == "TransferStuck"


def test_an_ageing_stall_is_not_rewritten_at_every_resync():
    p = streamed_pipeline()
    first = transfers_verdict(p, reading(pages(talker={"waiting": 1, "oldest_wait": NOW - 70}), read_at=NOW))
    later = transfers_verdict(p, reading(pages(talker={"waiting": 1, "oldest_wait": NOW - 70}), read_at=NOW + 40))
    assert (first.message, first.stages) == (later.message, later.stages)


def test_the_stream_fields_are_in_the_crds_status_schema():
    from omni_operator.pipeline import crd
    from omni_operator.check.validation import validate

    p = streamed_pipeline()
    verdict = transfers_verdict(p, reading(pages({"open": 1}, {"waiting": 1, "oldest_wait": NOW - 99})))
    body = streamed_body()
    body["status"] = compute_status(p, {}, None, T0, verdict)
    assert "streams" in body["status"]["stages"][1]["transfers"]
    assert validate(crd.openapi_schema(), body) == []
    body["status"]["stages"][1]["transfers"]["streams"][0]["bogus"] = 1
    assert any("bogus" in e for e in validate(crd.openapi_schema(), body))


def test_the_prometheus_reader_reads_the_same_stream_figures():
    class Canned(PrometheusSource):
        def query(self, expr, at):
            if not expr.startswith("{__name__"):
                return []
            assert contract.STREAMS.name in expr and contract.STREAM_OLDEST_WAIT.name in expr
            where = {"namespace": NAMESPACE, "pipeline": "tiny", "stage": "talker", "pod": "talker-0",
                     "from_stage": "thinker", "to_stage": "talker"}
            return [{"metric": {"__name__": contract.STREAMS.name, "state": "waiting", **where}, "value": [at, "2"]},
                    {"metric": {"__name__": contract.STREAM_OLDEST_WAIT.name, **where}, "value": [at, str(NOW - 90)]}]

    read = Canned("http://p:9090", window_seconds=60, clock=lambda: NOW).read([(NAMESPACE, "tiny")])
    verdict = transfers_verdict(streamed_pipeline(), read[(NAMESPACE, "tiny")])
    assert verdict.reason == "StreamStalled"
    assert verdict.stages["talker"]["streams"][0]["waiting"] == 2


# -- at the emulator: the condition, the column and the events --------------------------------

@pytest.fixture
def servers():
    made: list[PageServer] = []
    yield made
    for server in made:
        server.stop()


def test_a_stall_begins_and_ends_one_event_each_and_no_write_while_it_lasts(kube, emulator, servers):
    create_pipeline(kube, streamed_body(stalled_seconds=30))
    by_stage = {}
    for stage in ("thinker", "talker", "code2wav"):
        page = (ar_page(stage, streams={EDGE: {}}) if stage != "code2wav"
                else 'omni_kv_received_total{stage="code2wav",outcome="delivered"} 0.0\n')
        by_stage[stage] = PageServer(page)
        servers.append(by_stage[stage])
        create_pod(kube, "tiny", stage, f"tiny-{stage}-0", by_stage[stage].port)
    client = make_kube(emulator.url)
    health = TransferHealth(PodMetricsSource(client, timeout=2.0))
    reconciler = Reconciler(client, health=health)
    resync = Resync(reconciler, [NAMESPACE], interval=3600)
    try:
        resync.run_once()
        for stage in ("thinker", "talker", "code2wav"):
            complete_rollout(kube, stage)
        resync.run_once()
        assert status(kube)["transfersHealth"] == "ok"

        # The talker has waited 90 s for the thinker's next chunk: past the 30 s threshold.
        by_stage["talker"].page = ar_page("talker", streams={EDGE: {"waiting": 1, "oldest_wait": time.time() - 90}})
        resync.run_once()
        assert status(kube)["transfersHealth"] == "stalled 1"
        cond = condition(kube)
        assert (cond["status"], cond["reason"]) == ("False", "StreamStalled")
        assert cond["message"].startswith("edge thinker -> talker: a stream has waited for over 1m00s")
        (warning,) = events(kube, "StreamStalled")
        assert warning["type"] == "Warning" and "edge thinker -> talker" in warning["message"]
        talker = next(s for s in status(kube)["stages"] if s["name"] == "talker")
        assert talker["transfers"]["streams"] == [{"fromStage": "thinker", "toStage": "talker", "open": 0,
                                                   "held": 0, "waiting": 1, "oldestWaitSeconds": 60}]

        # Still stalled a resync later: no event, nothing written.
        writes = client.writes
        resync.run_once()
        assert client.writes == writes and len(events(kube, "StreamStalled")) == 1

        # The chunk comes: the stall ends (one event), and the condition recovers (one event).
        by_stage["talker"].page = ar_page("talker", streams={EDGE: {"open": 0}})
        resync.run_once()
        assert status(kube)["transfersHealth"] == "ok"
        (ended,) = events(kube, "StreamStallEnded")
        assert ended["type"] == "Normal" and "edge thinker -> talker" in ended["message"]
        assert len(events(kube, "TransfersRecovered")) == 1
        assert len(events(kube, "StreamStalled")) == 1
    finally:
        health.close()
        client.close()


def test_omni_pipeline_status_prints_the_streams_per_edge_and_end():
    from omni_operator.health.transfers import render_table

    p = streamed_pipeline()
    table = render_table(p, transfers_verdict(p, reading(pages({"open": 5, "held": 1},
                                                               {"waiting": 2, "oldest_wait": NOW - 75}))))
    lines = table.splitlines()
    assert lines[0].startswith("pipeline tiny: transfers stalled 1 (StreamStalled: edge thinker -> talker")
    start = next(i for i, line in enumerate(lines) if line.startswith("STREAM"))
    assert lines[start].split() == ["STREAM", "AT", "OPEN", "HELD", "WAITING", "OLDEST", "WAIT"]
    assert lines[start + 1].split() == ["thinker", "->", "talker", "thinker", "5", "1", "0", "0s"]
    assert lines[start + 2].split() == ["thinker", "->", "talker", "talker", "0", "0", "2", "1m00s"]
    # Without streams the table is what it was.
    plain = parse_pipeline(pipeline_body())
    assert "STREAM" not in render_table(plain, transfers_verdict(plain, reading({})))
