"""End to end: a real vLLM OpenAI server (multi-process engine core, as in production) with
OmniARScheduler on the tiny model, whose transfers nobody acks. Its one /metrics page shows
vLLM's and our families with the ledger's values, a real Prometheus scrapes it and answers the
stuck query of docs/metrics.md, and an OTLP receiver gets the transfer spans, in the trace of a
request that came with a W3C traceparent.

One server start per module (each costs about a minute on a small CPU machine)."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families


sys.path.insert(0, str(Path(__file__).resolve().parent))
from otlp_receiver import OtlpReceiver  # noqa: E402
from procs import PrometheusServer, VllmServer, wait_until  # noqa: E402

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
STAGE, MODEL = "ar", "tiny"
TIMEOUT_S = 15.0  # the transfer deadline: long enough to observe active/held, short to wait
STUCK_THRESHOLD_S = 1
BLOCK_SIZE = 32  # the CPU attention backend needs a multiple of 32
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN_ID = "b7ad6b7169203331"
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4  # about 40 tokens: 2 KV blocks
SECRET = "zebra-prompt-marker-9431"  # must never appear in a span
N_PLAIN = 3
START_TIMEOUT_S = 300.0


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def sample(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset({"stage": STAGE, "model_name": MODEL, **labels}.items())))


def stuck_query(threshold: float) -> str:
    """The stuck query exactly as docs/metrics.md gives it, with the test's threshold."""
    doc = (REPO / "docs" / "metrics.md").read_text()
    match = re.search(r"^(time\(\) - \(omni_kv_transfer_oldest_start_timestamp_seconds"
                      r"\{state=\"active\"\} > 0\) > )(\d+)$", doc, re.M)
    assert match, "docs/metrics.md lost the stuck query"
    return f"{match.group(1)}{threshold:g}"


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def otlp():
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def stage(tmp_path_factory, otlp):
    server = VllmServer(
        tmp_path_factory.mktemp("stage"),
        omni_kv_config={
            "need_send_cache": True,
            "kv_transfer_criteria": {"type": "prefill_finished"},
            "timeout_seconds": TIMEOUT_S,
            "stage_name": STAGE,
        },
        served_model_name=MODEL,
        block_size=BLOCK_SIZE,
        extra_args=("--otlp-traces-endpoint", otlp.endpoint),
        env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
             "OTEL_BSP_SCHEDULE_DELAY": "200"},  # ms; export spans promptly
    ).start(START_TIMEOUT_S)
    try:
        yield {"url": server.url, "port": server.port, "proc": server.proc, "log": server.log_path}
    finally:
        server.stop()


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory, stage):
    server = PrometheusServer(tmp_path_factory.mktemp("prometheus"), json.dumps({  # JSON is YAML
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "omni-stage",
                            "static_configs": [{"targets": [f"127.0.0.1:{stage['port']}"]}]}],
    }))
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="module")
def traffic(stage, prometheus):
    """Requests whose transfers nobody acks: each ends with its transfer active and held.
    Each decodes its four tokens (``ignore_eos``): a request that ends at its first token ends
    in its prefill's step, and its transfer starts on ``request_finished`` instead (a random
    model may end at once; which token wins a near tie can differ between CPUs)."""
    started = time.time()
    responses = []
    for i in range(N_PLAIN + 1):
        headers = {}
        if i == N_PLAIN:  # the last one comes with a W3C trace context
            headers["traceparent"] = f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"
        r = requests.post(f"{stage['url']}/v1/completions", headers=headers, timeout=60, json={
            "model": MODEL, "prompt": f"{SECRET} {PROMPT}", "max_tokens": 4, "temperature": 0,
            "ignore_eos": True,
        })
        r.raise_for_status()
        responses.append(r.json())
    return {"started": started, "finished": time.time(), "responses": responses}


def scrape(stage) -> str:
    r = requests.get(f"{stage['url']}/metrics", timeout=5)
    r.raise_for_status()
    return r.text


# ---------------------------------------------------------------------- tests
def test_metrics_page_shows_vllm_and_omni_families_with_active_and_held_transfers(stage, traffic):
    n = N_PLAIN + 1
    usages = [r["usage"] for r in traffic["responses"]]
    low = sum(math.ceil((u["prompt_tokens"] + u["completion_tokens"] - 1) / BLOCK_SIZE) for u in usages)
    high = sum(math.ceil((u["prompt_tokens"] + u["completion_tokens"]) / BLOCK_SIZE) for u in usages)

    def ready():
        # A scrape is not one atomic read of every family (the engine core writes them one by
        # one as the page is read): wait for both the gauge and the counter to show all n.
        samples = parse(scrape(stage))
        started = sum(value for (name, _), value in samples.items()
                      if name == "omni_kv_transfers_started_total")
        if sample(samples, "omni_kv_transfers", state="held") == n and started >= n:
            return samples
        return None

    samples = wait_until(ready, TIMEOUT_S / 2, f"{n} held transfers on /metrics", proc=stage["proc"],
                         log=stage["log"])
    names = {name for name, _ in samples}
    assert "vllm:num_requests_running" in names and "vllm:request_success_total" in names
    assert sample(samples, "omni_kv_transfers", state="active") == n
    assert sample(samples, "omni_kv_transfers", state="pending") == 0
    assert low <= sample(samples, "omni_kv_held_blocks") <= high
    started = {dict(labels)["trigger"]: value for (name, labels), value in samples.items()
               if name == "omni_kv_transfers_started_total" and value}
    assert started == {"prefill_finished": n}, [r["choices"][0]["finish_reason"]
                                                for r in traffic["responses"]]
    assert sample(samples, "omni_kv_transfers_resolved_total", outcome="expired") == 0
    oldest = sample(samples, "omni_kv_transfer_oldest_start_timestamp_seconds", state="active")
    assert traffic["started"] - 1 <= oldest <= traffic["finished"] + 1
    # What the engine core's ledger reported for each request agrees with the page.
    for r, u in zip(traffic["responses"], usages):
        meta = r["kv_transfer_params"]["kv_metadata"]
        assert meta["state"] == "active" and meta["seq_len"] == u["prompt_tokens"]
    # Only the contract's labels: no request or block ids anywhere. (The connector's family
    # on vLLM's stats path carries vLLM's engine label and the bounded to_stage too; the
    # per-edge families carry to_stage, one series set per downstream stage.)
    for name, labels in samples:
        if name.startswith("omni_"):
            keys = {k for k, _ in labels} - {"le"}
            allowed = (({"stage", "model_name", "to_stage"},
                        {"stage", "model_name", "to_stage", "outcome"})
                       if name.startswith("omni_kv_edge_") else
                       ({"stage", "model_name"}, {"stage", "model_name", "state"},
                        {"stage", "model_name", "trigger"},
                        {"stage", "model_name", "outcome"},
                        {"stage", "model_name", "engine", "to_stage", "outcome"}))
            assert keys in allowed, (name, keys)
            assert dict(labels)["stage"] == STAGE and dict(labels)["model_name"] == MODEL


def test_promtool_finds_nothing_wrong_with_the_omni_families(stage, traffic):
    text = scrape(stage)
    lines = [line for line in text.splitlines()
             if re.match(r"(# (HELP|TYPE) )?omni_", line)]
    assert len(lines) > 50
    result = subprocess.run([shutil.which("promtool") or "/usr/bin/promtool", "check", "metrics"],
                            input="\n".join(lines) + "\n", capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0 and result.stdout == "" and result.stderr == "", result


def test_prometheus_answers_the_stuck_query(stage, prometheus, traffic):
    query = stuck_query(STUCK_THRESHOLD_S)

    def stuck():
        r = requests.get(f"{prometheus}/api/v1/query", params={"query": query}, timeout=5)
        body = r.json()
        assert body["status"] == "success", body
        return body["data"]["result"]

    result = wait_until(stuck, TIMEOUT_S / 2, "Prometheus to report the stuck transfers")
    (series,) = result
    assert series["metric"]["stage"] == STAGE and series["metric"]["model_name"] == MODEL
    assert series["metric"]["state"] == "active"
    assert float(series["value"][1]) > STUCK_THRESHOLD_S


def test_unacked_transfers_expire_after_the_deadline_and_free_their_blocks(stage, prometheus,
                                                                          traffic):
    n = N_PLAIN + 1

    def expired():
        samples = parse(scrape(stage))
        if sample(samples, "omni_kv_transfers_resolved_total", outcome="expired") == n:
            return samples
        return None

    samples = wait_until(expired, TIMEOUT_S * 3, "the transfers to expire", proc=stage["proc"],
                         log=stage["log"])
    assert time.time() - traffic["started"] >= TIMEOUT_S  # not before the deadline
    for state in ("pending", "active", "held"):
        assert sample(samples, "omni_kv_transfers", state=state) == 0
        assert sample(samples, "omni_kv_transfer_oldest_start_timestamp_seconds", state=state) == 0
    assert sample(samples, "omni_kv_held_blocks") == 0
    assert sample(samples, "omni_kv_transfer_duration_seconds_count", outcome="expired") == n
    assert sample(samples, "omni_kv_hold_duration_seconds_count") == n
    # The deadline is a bucket bound: expiries land just above it, answers in time below.
    assert sample(samples, "omni_kv_transfer_duration_seconds_bucket", outcome="expired",
                  le=f"{TIMEOUT_S}") == 0
    assert sample(samples, "omni_kv_transfer_duration_seconds_bucket", outcome="expired",
                  le="30.0") == n
    # ... and the stuck query goes quiet (the "> 0" guard: 0 means none, not 1970).
    query = stuck_query(STUCK_THRESHOLD_S)
    wait_until(lambda: requests.get(f"{prometheus}/api/v1/query", params={"query": query},
                                    timeout=5).json()["data"]["result"] == [],
               30, "the stuck query to clear")


def test_transfer_spans_reach_the_collector_in_the_requests_trace(otlp, traffic):
    n = N_PLAIN + 1

    def transfer_spans(spans):
        found = [s for s in spans if s.name == "omni.kv_transfer"]
        return found if len(found) >= n else None

    spans = otlp.wait_for(transfer_spans, TIMEOUT_S * 3)  # exported when they end (expiry)
    assert len(spans) == n
    traced = [s for s in spans if s.trace_id == TRACE_ID]
    assert len(traced) == 1
    (span,) = traced
    assert span.parent_span_id == CLIENT_SPAN_ID
    assert span.attributes["omni.stage"] == STAGE
    assert span.attributes["omni.kv_transfer.trigger"] == "prefill_finished"
    assert span.attributes["omni.kv_transfer.outcome"] == "expired"
    prompt_tokens = traffic["responses"][-1]["usage"]["prompt_tokens"]
    assert span.attributes["omni.kv_transfer.seq_len"] == prompt_tokens
    assert span.attributes["omni.kv_transfer.blocks"] == math.ceil(prompt_tokens / BLOCK_SIZE)
    assert span.attributes["gen_ai.request.id"]
    assert [e[0] for e in span.events] == ["handed_off", "held", "resolved"]
    assert (span.end_ns - span.start_ns) / 1e9 == pytest.approx(TIMEOUT_S, abs=1.0)
    assert span.status_code == 2  # STATUS_CODE_ERROR: expired
    # Made by vLLM's own tracer provider in the engine-core process: no second provider.
    assert span.resource.get("vllm.process_kind") == "engine_core"
    assert all(s.trace_id != TRACE_ID for s in spans if s is not span)
    # In the same trace as vLLM's own span of that request (made in the API server process).
    vllm_spans = otlp.wait_for(
        lambda all_spans: [s for s in all_spans
                           if s.trace_id == TRACE_ID and s.name != "omni.kv_transfer"], 30)
    assert {s.parent_span_id for s in vllm_spans} == {CLIENT_SPAN_ID}
    # Never prompt text, anywhere in what was exported.
    assert not any(SECRET.encode() in body for body in otlp.raw_bodies)
