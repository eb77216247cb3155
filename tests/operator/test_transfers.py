"""Transfer health as a pure function of metric text (omni_operator/health/transfers.py) and how it
lands in the status (status.py): stuck, failing, unknown, recovery, counter resets, fan-out."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from metrics_pages import ar_page
from omni_operator.pipeline.model import parse_pipeline
from omni_operator.controller.status import compute_status, status_patch
from omni_operator.health.transfers import (
    NOT_READ,
    PipelineReading,
    StageReading,
    parse_metrics,
    pod_reading,
    round_age,
    transfers_verdict,
)
from omnip_support import pipeline_body

NOW = 1_800_000_000.0
T0 = "2026-01-01T00:00:00Z"


def pipeline(stuck_seconds: int = 120, stages=None):
    body = pipeline_body(stages=stages, observability={"alerts": {"stuckTransferSeconds": stuck_seconds}})
    body["metadata"].update(uid="u-1", generation=1)
    return parse_pipeline(body)


FAN_OUT = [
    {"name": "thinker", "role": "ar", "replicas": 2, "kvTransfer": {"send": True}},
    {"name": "talker", "role": "generation", "inputs": ["thinker"]},
    {"name": "vocoder", "role": "generation", "inputs": ["thinker"]},
]


def reading(stage_pages: dict[str, dict[str, str]], previous: dict[str, dict[str, str]] | None = None,
            read_at: float = NOW, interval: float = 60.0, unreadable: dict[str, list] | None = None):
    """A PipelineReading from /metrics pages: {stage: {pod: page}} now and an interval before."""
    stages = {}
    for stage, pods in stage_pages.items():
        before = (previous or {}).get(stage, {})
        stages[stage] = StageReading(
            tuple(pod_reading(pod, parse_metrics(before[pod]) if pod in before else None, parse_metrics(page))
                  for pod, page in pods.items()),
            tuple((unreadable or {}).get(stage, ())))
    for stage, bad in (unreadable or {}).items():
        stages.setdefault(stage, StageReading((), tuple(bad)))
    return PipelineReading(read_at=read_at, interval=interval, stages=stages)


def healthy_pages(p=None, **kw):
    p = p or pipeline()
    return {s.name: {f"{s.name}-0": ar_page(s.name, **kw)} for s in p.stages if s.kv.send}


# ------------------------------------------------------------------------------- parsing
def test_parse_reads_the_real_exposition_of_the_runtime_families():
    """What prometheus_client prints for the runtime's own registries parses to their values."""
    from omni_runtime.observability.edge_metrics import EdgeMetrics
    from omni_runtime.observability.metrics import TransferMetrics
    from omni_runtime.observability.receiver_metrics import ReceiverMetrics

    registry = CollectorRegistry()
    TransferMetrics(stage="thinker", model_name="m", registry=registry)
    edges = EdgeMetrics(stage="thinker", model_name="m", to_stages=["talker", "vocoder"], registry=registry,
                        clock=lambda: NOW - 30)
    edges.started("r1")
    edges.resolved("r1", "talker", "acked", nbytes=10)
    ReceiverMetrics(stage="thinker", model_name="m", from_stages=["x"], registry=registry).delivered(5, "x")
    sample = parse_metrics(generate_latest(registry).decode())
    assert sample.sends and sample.receives
    assert sample.states == {"pending": 0, "active": 0, "held": 0}
    assert sample.edges["vocoder"].active == 1 and sample.edges["vocoder"].oldest_active == NOW - 30
    assert sample.edges["talker"].resolved["acked"] == 1 and sample.edges["talker"].active == 0
    assert sample.received == {"delivered": 1.0, "rejected": 0.0}


def test_parse_skips_other_families_and_odd_lines():
    page = ("# HELP vllm:x y\nvllm:num_requests_running{model_name=\"m\"} 3.0\n"
            + ar_page(active=2, oldest_active=NOW - 5, vllm_lines=50)
            + 'omni_kv_transfers{stage="t",state="active"} not-a-number\nomni_kv_transfers{broken 1\n')
    sample = parse_metrics(page)
    assert sample.states["active"] == 2 and sample.oldest == {"active": NOW - 5}


# ------------------------------------------------------------------------------- verdicts
def test_an_active_transfer_older_than_the_threshold_is_stuck():
    p = pipeline(stuck_seconds=120)
    pages = healthy_pages(p)
    pages["thinker"] = {"thinker-0": ar_page(active=1, oldest_active=NOW - 121),
                        "thinker-1": ar_page(active=3, oldest_active=NOW - 119)}
    verdict = transfers_verdict(p, reading(pages))
    assert (verdict.status, verdict.reason, verdict.summary) == ("False", "TransferStuck", "stuck 1")
    assert "stage thinker: 1 of 2 pods" in verdict.message and "threshold 120s" in verdict.message
    assert verdict.stages["thinker"]["active"] == 4 and verdict.stages["thinker"]["oldestActiveSeconds"] == 120
    # Just below the threshold it is not.
    pages["thinker"]["thinker-0"] = ar_page(active=1, oldest_active=NOW - 119)
    assert transfers_verdict(p, reading(pages)).summary == "ok"


def test_failed_and_expired_share_over_the_interval_above_the_ratio_is_failing():
    p = pipeline()
    before = healthy_pages(p, resolved={"acked": 1000, "failed": 10})
    now = healthy_pages(p, resolved={"acked": 1017, "failed": 12, "expired": 1})
    verdict = transfers_verdict(p, reading(now, before), failing_ratio=0.05)
    assert (verdict.status, verdict.reason, verdict.summary) == ("False", "TransfersFailing", "failing 15%")
    assert "3 of 20 transfers" in verdict.message and "(2 failed, 1 expired)" in verdict.message
    assert verdict.stages["thinker"]["failed"] == 2 and verdict.stages["thinker"]["expired"] == 1
    # The same counts under a looser ratio are healthy; the figures stay in the status.
    looser = transfers_verdict(p, reading(now, before), failing_ratio=0.2)
    assert looser.summary == "ok" and looser.stages["thinker"]["failed"] == 2


def test_stuck_wins_over_failing_and_failing_over_unknown():
    p = pipeline()
    before = healthy_pages(p, resolved={"failed": 0})
    now = {"thinker": {"thinker-0": ar_page(active=1, oldest_active=NOW - 500, resolved={"failed": 5})},
           "talker": {"talker-0": ar_page("talker", resolved={"failed": 5})}}
    assert transfers_verdict(p, reading(now, before)).reason == "TransferStuck"
    now["thinker"]["thinker-0"] = ar_page(resolved={"failed": 5})
    unreadable = {"talker": [("talker-1", "GET /metrics failed: timed out")]}
    assert transfers_verdict(p, reading(now, before, unreadable=unreadable)).reason == "TransfersFailing"


@pytest.mark.parametrize("case", ["unreadable pod", "no pod", "not the omni scheduler", "reading error"])
def test_metrics_that_cannot_be_read_make_it_unknown(case):
    p = pipeline()
    pages = healthy_pages(p)
    unreadable = None
    error = ""
    if case == "unreadable pod":
        unreadable = {"talker": [("talker-1", "GET /metrics failed: connection refused")]}
        expected = "pod talker-1: GET /metrics failed: connection refused"
    elif case == "no pod":
        del pages["talker"]
        expected = "stage talker: no running pod to read"
    elif case == "not the omni scheduler":
        pages["talker"] = {"talker-0": 'vllm:num_requests_running{model_name="m"} 0.0\n'}
        expected = "stage talker: its pods export no omni_kv_transfers"
    else:
        pages, error = {}, "querying Prometheus at http://p:9090 failed: timed out"
        expected = error
    r = reading(pages, unreadable=unreadable)
    if error:
        r = PipelineReading(read_at=NOW, stages={}, error=error)
    verdict = transfers_verdict(p, r)
    assert (verdict.status, verdict.reason, verdict.summary) == ("Unknown", "MetricsUnavailable", "unknown")
    assert expected in verdict.message


def test_no_sending_stage_has_nothing_to_watch():
    p = pipeline(stages=[{"name": "gen", "role": "generation"}])
    verdict = transfers_verdict(p, reading({}))
    assert (verdict.status, verdict.reason, verdict.summary) == ("True", "NoSendingStage", "none")


def test_recovery_after_stuck():
    p = pipeline()
    stuck = healthy_pages(p)
    stuck["talker"] = {"talker-0": ar_page("talker", active=1, oldest_active=NOW - 3600)}
    assert transfers_verdict(p, reading(stuck)).unhealthy
    later = healthy_pages(p, resolved={"acked": 1})
    verdict = transfers_verdict(p, reading(later, stuck, read_at=NOW + 60))
    assert (verdict.status, verdict.reason, verdict.summary) == ("True", "TransfersFlowing", "ok")


def test_a_counter_reset_after_a_pod_restart_is_not_a_burst_of_failures():
    p = pipeline()
    # Days of history: 500 failures among a million transfers.
    before = healthy_pages(p, resolved={"acked": 1_000_000, "failed": 500})
    # The pod restarted (same pod, its process anew): counters start again from zero.
    after = healthy_pages(p, resolved={"acked": 40, "failed": 0})
    verdict = transfers_verdict(p, reading(after, before))
    assert verdict.summary == "ok" and verdict.stages["thinker"]["failed"] == 0
    # A restarted pod under a new name (a new uid) is first seen now: nothing counted yet,
    # whatever its counters say; the next interval counts from there.
    new_pod = {s: {f"{s}-new": page for page in pods.values()} for s, pods in before.items()}
    assert transfers_verdict(p, reading(new_pod, before)).stages["thinker"]["failed"] == 0
    # After a reset, failures since the restart do count (as Prometheus' increase() does).
    after_bad = healthy_pages(p, resolved={"acked": 10, "failed": 5})
    assert transfers_verdict(p, reading(after_bad, before)).reason == "TransfersFailing"


def test_a_fan_out_pipeline_with_one_bad_edge_names_that_edge():
    p = pipeline(stages=FAN_OUT)
    before = {"thinker": {"thinker-0": ar_page(resolved={"acked": 100}, edges={
        "talker": {"acked": 100}, "vocoder": {"acked": 100}})}}
    # The vocoder stopped answering: its transfers fail, and one is still active toward it,
    # its request finished: its 9 blocks are held for the vocoder alone.
    now = {"thinker": {"thinker-0": ar_page(active=1, oldest_active=NOW - 20, resolved={"acked": 110, "failed": 10},
                                            held=1, held_blocks=9, oldest_held=NOW - 5,
                                            edges={"talker": {"acked": 120},
                                                   "vocoder": {"acked": 100, "failed": 10, "active": 1,
                                                               "oldest": NOW - 20, "held": 1, "held_blocks": 9,
                                                               "oldest_held": NOW - 5}})}}
    verdict = transfers_verdict(p, reading(now, before))
    assert verdict.reason == "TransfersFailing" and "by edge: vocoder (10 failed, 0 expired)" in verdict.message
    assert "talker" not in verdict.message
    assert verdict.stages["thinker"]["edges"] == [
        {"toStage": "talker", "active": 0, "held": 0, "heldBlocks": 0, "oldestActiveSeconds": 0,
         "oldestHeldSeconds": 0, "failed": 0, "expired": 0},
        {"toStage": "vocoder", "active": 1, "held": 1, "heldBlocks": 9, "oldestActiveSeconds": 20,
         "oldestHeldSeconds": 5, "failed": 10, "expired": 0},
    ]
    # Later the vocoder's edge is stuck: the message says toward which stage.
    stuck = {"thinker": {"thinker-0": ar_page(active=1, oldest_active=NOW - 300, resolved={"acked": 110, "failed": 10},
                                              edges={"talker": {"acked": 130},
                                                     "vocoder": {"acked": 100, "failed": 10, "active": 1,
                                                                 "oldest": NOW - 300}})}}
    verdict = transfers_verdict(p, reading(stuck, now))
    assert verdict.reason == "TransferStuck" and "toward vocoder" in verdict.message and "talker" not in verdict.message


# ------------------------------------------------------------------------------- into the status
def test_ages_are_rounded_so_that_a_resync_writes_nothing_new():
    assert [round_age(s) for s in (0, 0.4, 1.5, 4.9, 59, 61, 119, 299, 301, 3599, 3601, 7300)] == \
        [0, 0, 1, 2, 30, 60, 60, 120, 300, 1800, 3600, 7200]
    p = pipeline(stuck_seconds=600)
    deployments = {}
    pages = healthy_pages(p)
    pages["thinker"] = {"thinker-0": ar_page(active=1, oldest_active=NOW - 130, held=1, held_blocks=7,
                                             oldest_held=NOW - 130)}
    first = compute_status(p, deployments, None, T0, transfers_verdict(p, reading(pages)))
    # One resync later: the transfer is 60 s older, still within the same step (120-300 s).
    later = compute_status(p, deployments, first, T0, transfers_verdict(p, reading(pages, pages, read_at=NOW + 60)))
    assert status_patch(first, later) == {}
    assert first["stages"][0]["transfers"] == {
        "pods": 1, "pending": 0, "active": 1, "held": 1, "heldBlocks": 7, "oldestActiveSeconds": 120,
        "oldestHeldSeconds": 120, "failed": 0, "expired": 0}


def test_a_stuck_or_failing_pipeline_is_not_rewritten_at_every_resync():
    """The condition's message carries ages too: rounded like the fields, a transfer stuck for
    6m40s and, one resync later, 7m40s says the same ("over 5m00s"); so does the interval of a
    failing pipeline whose resync timer jitters."""
    p = pipeline(stuck_seconds=300)
    pages = healthy_pages(p)
    pages["thinker"] = {"thinker-0": ar_page(active=1, oldest_active=NOW - 400)}
    first = compute_status(p, {}, None, T0, transfers_verdict(p, reading(pages)))
    cond = next(c for c in first["conditions"] if c["type"] == "TransfersHealthy")
    assert cond["reason"] == "TransferStuck" and "over 5m00s" in cond["message"], cond
    later = compute_status(p, {}, first, T0, transfers_verdict(p, reading(pages, pages, read_at=NOW + 60)))
    assert status_patch(first, later) == {}
    # Crossing a step (10 minutes) is news.
    much_later = compute_status(p, {}, later, T0,
                                transfers_verdict(p, reading(pages, pages, read_at=NOW + 240)))
    assert "over 10m00s" in next(c for c in status_patch(later, much_later)["conditions"]
                                 if c["type"] == "TransfersHealthy")["message"]

    before = {"thinker": {"thinker-0": ar_page(resolved={"acked": 100, "failed": 0})}}
    now = {"thinker": {"thinker-0": ar_page(resolved={"acked": 150, "failed": 50})}}
    messages = {transfers_verdict(p, reading(now, before, interval=i)).message for i in (59.6, 60.0, 61.8)}
    assert len(messages) == 1 and "in the last 1m00s" in messages.pop()


def test_status_carries_the_verdict_and_keeps_it_between_readings():
    p = pipeline()
    pages = healthy_pages(p)
    pages["thinker"] = {"thinker-0": ar_page(active=1, oldest_active=NOW - 999)}
    status = compute_status(p, {}, None, T0, transfers_verdict(p, reading(pages)))
    cond = next(c for c in status["conditions"] if c["type"] == "TransfersHealthy")
    assert (cond["status"], cond["reason"], status["transfersHealth"]) == ("False", "TransferStuck", "stuck 1")
    # A reconcile with no new reading (a Deployment event between resyncs) changes nothing.
    again = compute_status(p, {}, status, "2026-01-01T00:05:00Z", None)
    assert status_patch(status, again) == {}
    # Before the first reading the condition says so.
    fresh = compute_status(p, {}, None, T0, None)
    cond = next(c for c in fresh["conditions"] if c["type"] == "TransfersHealthy")
    assert (cond["status"], cond["reason"], fresh["transfersHealth"]) == ("Unknown", NOT_READ.reason, "unknown")
    assert all("transfers" not in st for st in fresh["stages"])
    # Without health reading there is no condition at all.
    off = compute_status(p, {}, None, T0, None, transfer_health=False)
    assert off["transfersHealth"] == "off" and all(c["type"] != "TransfersHealthy" for c in off["conditions"])


def test_an_operator_restart_does_not_clear_a_failing_pipeline_for_one_round():
    """Its first reading has no interval (no previous sample): failures are not counted, so
    TransfersFailing stands (no recovery event, no relapse) until the next reading judges."""
    p = pipeline()
    before = healthy_pages(p, resolved={"acked": 100, "failed": 10})
    now = healthy_pages(p, resolved={"acked": 110, "failed": 20})
    failing = compute_status(p, {}, None, T0, transfers_verdict(p, reading(now, before)))
    assert failing["transfersHealth"] == "failing 50%"
    # The operator restarts: its first reading knows no previous sample.
    first = transfers_verdict(p, reading(now, None, interval=0.0))
    assert first.status == "True" and not first.judged_failing
    after_restart = compute_status(p, {}, failing, "2026-01-01T00:10:00Z", first)
    assert status_patch(failing, after_restart) == {}
    # The next reading judges: still failing, or recovered.
    later = healthy_pages(p, resolved={"acked": 200, "failed": 20})
    recovered = compute_status(p, {}, after_restart, "2026-01-01T00:11:00Z",
                               transfers_verdict(p, reading(later, now)))
    assert recovered["transfersHealth"] == "ok"
    # A first reading that finds a transfer stuck says so at once.
    stuck = healthy_pages(p)
    stuck["thinker"] = {"thinker-0": ar_page(active=1, oldest_active=NOW - 999)}
    assert compute_status(p, {}, failing, T0, transfers_verdict(p, reading(stuck, None, interval=0.0)))[
        "transfersHealth"] == "stuck 1"


def test_every_status_field_is_in_the_crds_status_schema():
    """The API server prunes what its structural schema does not name: a field missing there
    would be dropped from every write and differ again at the next reconcile (a write each time)."""
    from omni_operator.pipeline import crd
    from omni_operator.check.validation import validate

    p = pipeline(stages=FAN_OUT)
    before = {"thinker": {"thinker-0": ar_page(resolved={"acked": 1}, edges={"talker": {}, "vocoder": {}})},
              "talker": {"talker-0": 'omni_kv_received_total{from_stage="thinker",outcome="rejected"} 1.0\n'}}
    now = {"thinker": {"thinker-0": ar_page(active=1, held=1, held_blocks=3, oldest_active=NOW - 50, oldest_held=NOW - 9,
                                            resolved={"acked": 3, "failed": 1, "expired": 1},
                                            edges={"talker": {"acked": 2}, "vocoder": {"failed": 1, "active": 1,
                                                                                       "oldest": NOW - 50}})},
           "talker": {"talker-0": 'omni_kv_received_total{from_stage="thinker",outcome="rejected"} 3.0\n'}}
    verdict = transfers_verdict(p, reading(now, before, unreadable={"thinker": [("thinker-1", "timed out")]}))
    status = compute_status(p, {}, None, T0, verdict)
    transfers = status["stages"][0]["transfers"]
    assert {"unreadablePods", "edges", "heldBlocks", "oldestHeldSeconds"} <= set(transfers)
    assert status["stages"][1]["transfers"]["rejected"] == 2
    body = pipeline_body(stages=FAN_OUT)
    body["status"] = status
    assert validate(crd.openapi_schema(), body) == []
    body["status"]["stages"][0]["transfers"]["bogus"] = 1  # the check has teeth
    assert any("bogus" in e for e in validate(crd.openapi_schema(), body))
