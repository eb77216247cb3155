"""End to end: a real AR stage (vLLM OpenAI server, multi-process engine core, the omni
scheduler) whose transfers nobody acknowledges, scraped by a real Prometheus loaded with the
generated alert rules; OmniKVTransferStuck fires and reaches a webhook receiver through a
real Alertmanager. (Every dashboard query, against a live two-stage pipeline and the
operator: test_dashboards_e2e.py.)"""
from __future__ import annotations

import time

import pytest
import requests

from omni_mixin.config import Config

from procs import VllmServer, wait_until

from .alert_sinks import alerting_prometheus

pytestmark = pytest.mark.engine

STAGE, MODEL = "ar", "tiny"
SCRAPE_LABELS = {"namespace": "e2e", "pipeline": "tiny", "pod": "tiny-ar-0"}
STUCK_SECONDS = 3
# The transfer deadline, well above the alert threshold: the transfers stay active all test.
DEADLINE_SECONDS = 900
BLOCK_SIZE = 32  # the CPU attention backend needs a multiple of 32
START_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    server = VllmServer(
        tmp_path_factory.mktemp("stage"),
        omni_kv_config={
            "need_send_cache": True,
            "kv_transfer_criteria": {"type": "prefill_finished"},
            "timeout_seconds": DEADLINE_SECONDS,
            "stage_name": STAGE,
        },
        served_model_name=MODEL,
        block_size=BLOCK_SIZE,
    ).start(START_TIMEOUT_S)
    try:
        yield {"url": server.url, "port": server.port}
    finally:
        server.stop()


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory, stage, alertmanager):
    # The generated rules, with a threshold a test can wait for.
    server = alerting_prometheus(
        tmp_path_factory.mktemp("prometheus"),
        Config(stuck_transfer_seconds=STUCK_SECONDS, stuck_transfer_for="0s"), alertmanager,
        [(stage["port"], {**SCRAPE_LABELS, "stage": STAGE})])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def traffic(stage, prometheus):
    """Requests whose transfers are never acknowledged (there is no receiver)."""
    for _ in range(2):
        r = requests.post(f"{stage['url']}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "The quick brown fox jumps over the lazy dog. " * 4,
            "max_tokens": 4, "temperature": 0})
        r.raise_for_status()
    return time.time()


def test_stuck_transfer_alert_reaches_the_webhook(webhook, prometheus, traffic):
    alerts = wait_until(lambda: webhook.alerts("OmniKVTransferStuck"), 90,
                        "OmniKVTransferStuck at the webhook receiver", interval=0.5)
    alert = alerts[0]
    labels = alert["labels"]
    assert labels["severity"] == "critical" and labels["state"] == "active"
    assert labels["stage"] == STAGE and labels["model_name"] == MODEL
    assert {k: labels[k] for k in SCRAPE_LABELS} == SCRAPE_LABELS
    annotations = alert["annotations"]
    assert annotations["runbook_url"].endswith("/docs/runbooks.md#omnikvtransferstuck")
    assert annotations["description"].startswith(
        "The oldest KV transfer on e2e/tiny stage ar (pod tiny-ar-0) has been active for ")
    # The stage itself is fine: it is scraped and exports the omni families.
    assert not webhook.alerts("OmniStageDown") and not webhook.alerts("OmniKVMetricsAbsent")


def test_prometheus_shows_the_alert_firing_and_no_failure_alert(prometheus, traffic, webhook):
    wait_until(lambda: webhook.alerts("OmniKVTransferStuck"), 90, "the stuck alert")
    answer = requests.get(f"{prometheus.url}/api/v1/alerts", timeout=5).json()
    firing = {a["labels"]["alertname"] for a in answer["data"]["alerts"] if a["state"] == "firing"}
    assert "OmniKVTransferStuck" in firing
    # Nothing resolved yet (the deadline is far), so no failure-rate alert.
    assert "OmniKVTransferFailureRateHigh" not in firing
