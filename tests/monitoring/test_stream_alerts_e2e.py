"""End to end: OmniStreamStalled fired through a real Prometheus and a real Alertmanager by a
stage whose producer was stopped mid-stream.

The lightest pipeline that shows it: one vLLM stage (the thinker, an ``omni-stage`` AR
process on the tiny model) streaming what it decodes to a receiving stage (the vocoder, an
``omni-stage`` generation process: no engine) over a streamed edge; both scraped by a real
Prometheus loaded with the generated rules (the stall threshold a few seconds), alerting a
real Alertmanager that posts to a webhook receiver. Once the vocoder holds the stream's
first chunk, the thinker and everything under it get SIGSTOP (a hung producer: no chunk, no
end, no goodbye); the vocoder's stream then waits for its next chunk, and the alert names
the edge and the end that waits. The edge's gap deadline is well above the threshold, so the
stream is still waiting when the alert fires; the thinker is continued before it is stopped.
"""
from __future__ import annotations

import signal
import socket
import threading

import pytest
import requests

from omni_mixin.config import Config

from chain import CHAIN_ENV, MODEL, chain_configs
from procs import StageProcess, metric_value, wait_until

from .alert_sinks import alerting_prometheus

pytestmark = pytest.mark.engine

PIPELINE, NAMESPACE = "streaming", "e2e"
#: The pipeline's stall threshold (the alert's T) and its hold (``for``): short, so the test
#: waits seconds; the edge's gap deadline far above both and the alert's delivery (a 1 s
#: scrape, a 1 s evaluation, Alertmanager's 1 s group wait), so the stream still waits when
#: the alert fires rather than expiring first.
STALLED_SECONDS = 3
STREAM = {"firstChunkTokens": 4, "chunkTokens": 8, "firstChunkSeconds": 60, "gapSeconds": 60,
          "streamSeconds": 300}
#: Far more tokens than the thinker can say before the test stops it (its max-model-len
#: leaves room for them): the stream is mid-way when it is stopped.
THINKER_TOKENS = 900


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    configs = chain_configs([
        {"name": "thinker", "role": "ar", "engineArgs": {"max-model-len": 1024}},
        {"name": "vocoder", "role": "generation", "stream": STREAM},
    ], pipeline=PIPELINE, timeout_seconds=10)
    workdir = tmp_path_factory.mktemp("stages")
    # No endpoint: the request goes to the thinker itself, the stream is the thinker's.
    procs = {name: StageProcess(configs[name], workdir, env=CHAIN_ENV)
             for name in ("vocoder", "thinker")}
    try:
        for name in ("vocoder", "thinker"):  # the receiver first, as a rollout starts them
            procs[name].launch()
        for proc in procs.values():
            proc.wait_healthy(timeout=240)
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()  # resumes a stage still paused first


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory, stages, alertmanager):
    server = alerting_prometheus(
        tmp_path_factory.mktemp("prometheus"),
        Config(stalled_stream_seconds=STALLED_SECONDS, stalled_stream_for="0s"), alertmanager,
        [(stage.http_port, {"namespace": NAMESPACE, "pipeline": PIPELINE, "stage": name,
                            "pod": f"{PIPELINE}-{name}-0"})
         for name, stage in stages.items()])
    yield server
    server.stop()


def _open_streams(vocoder: StageProcess) -> list[dict]:
    answer = requests.get(f"{vocoder.url}/v1/streams", timeout=5).json()
    return [s for s in answer["streams"] if s["outcome"] is None and s["chunks"] >= 1]


@pytest.fixture(scope="module")
def stopped_mid_stream(stages, prometheus):
    """A long completion at the thinker, streamed to the vocoder; the thinker stopped
    (SIGSTOP, the whole process tree) as soon as the vocoder holds the stream's first chunk.
    Yields the stream as the vocoder listed it then."""
    thinker, vocoder = stages["thinker"], stages["vocoder"]
    # Both stages scraped before anything stops, so the edge's series exist in Prometheus.
    wait_until(lambda: len(prometheus.query('up{job="omni-stages"} == 1')["data"]["result"]) == 2,
               60, "Prometheus to scrape both stages")
    session = requests.Session()
    answered: dict = {}

    def ask() -> None:
        try:
            with session.post(f"{thinker.url}/v1/completions", stream=True, timeout=600, json={
                    "model": MODEL, "prompt": [11, 12, 13, 14, 15],
                    "max_tokens": THINKER_TOKENS, "temperature": 0, "ignore_eos": True,
                    "stream": True}) as response:
                answered["response"] = response
                for _ in response.iter_lines():
                    pass
                answered["status"] = response.status_code
        except requests.RequestException as exc:  # its connection shut at teardown
            answered["error"] = exc

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    try:
        [stream] = wait_until(lambda: _open_streams(vocoder), 120,
                              "the vocoder to hold the stream's first chunk", interval=0.01)
        thinker.signal_tree(signal.SIGSTOP)
        yield stream
    finally:
        if thinker.proc.poll() is None:
            thinker.signal_tree(signal.SIGCONT)
        # The client goes away (the thinker aborts the request) rather than reading the
        # rest of its long answer: its connection is shut under the reading thread, which
        # then sees the answer end early.
        sock = getattr(getattr(answered.get("response") and answered["response"].raw, "connection", None),
                       "sock", None)
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
        session.close()
        asker.join(timeout=60)
        assert not asker.is_alive(), "the asking thread did not end"


def test_a_stopped_producer_fires_stream_stalled_at_its_consumer(
        stages, webhook, prometheus, stopped_mid_stream):
    vocoder = stages["vocoder"]
    edge = {"from_stage": "thinker", "to_stage": "vocoder"}
    # Stopped mid-stream: the vocoder has part of it and waits for the next chunk. Its
    # gauges, refreshed on the stage's deadline timer (every 0.5 s at most).
    wait_until(lambda: metric_value(vocoder.metrics(), "omni_kv_streams", state="waiting",
                                    **edge) == 1, 10, "the vocoder's stream to show as waiting")
    # Read once it waits: a chunk the thinker had sent as it stopped has arrived by then
    # (make test once saw one land between an earlier read and the alert).
    [now] = [s for s in requests.get(f"{vocoder.url}/v1/streams", timeout=5).json()["streams"]
             if s["request_id"] == stopped_mid_stream["request_id"]]
    assert now["outcome"] is None, f"the stream ended before the thinker stopped: {now}"
    assert metric_value(vocoder.metrics(), "omni_kv_stream_oldest_wait_start_timestamp_seconds",
                        **edge) > 0

    # Before the gap deadline expires the stream (and the wait with it).
    alerts = wait_until(lambda: webhook.alerts("OmniStreamStalled"), STREAM["gapSeconds"],
                        "OmniStreamStalled at the webhook receiver", interval=0.5)
    assert {a["labels"]["stage"] for a in alerts} == {"vocoder"}, "the waiting end alone"
    labels = alerts[0]["labels"]
    assert labels["severity"] == "critical"
    assert {k: labels[k] for k in ("namespace", "pipeline", "stage", "pod", *edge)} == {
        "namespace": NAMESPACE, "pipeline": PIPELINE, "stage": "vocoder",
        "pod": f"{PIPELINE}-vocoder-0", **edge}
    annotations = alerts[0]["annotations"]
    assert annotations["runbook_url"].endswith("/docs/runbooks.md#omnistreamstalled")
    assert annotations["description"].startswith(
        f"The oldest stream on {NAMESPACE}/{PIPELINE} edge thinker -> vocoder (at stage "
        f"vocoder) (pod {PIPELINE}-vocoder-0) has waited for a chunk, an ack or a credit for ")
    # The stream is still open: the alert came from the wait, not from its end.
    [still] = [s for s in requests.get(f"{vocoder.url}/v1/streams", timeout=5).json()["streams"]
               if s["request_id"] == stopped_mid_stream["request_id"]]
    assert still["outcome"] is None and still["chunks"] == now["chunks"]


def test_only_the_stall_fires_and_the_stopped_producer_is_unscrapable(
        prometheus, webhook, stopped_mid_stream):
    wait_until(lambda: webhook.alerts("OmniStreamStalled"), STREAM["gapSeconds"],
               "the stall alert")
    answer = requests.get(f"{prometheus.url}/api/v1/alerts", timeout=5).json()
    firing = {(a["labels"]["alertname"], a["labels"].get("stage"))
              for a in answer["data"]["alerts"] if a["state"] == "firing"}
    assert ("OmniStreamStalled", "vocoder") in firing
    # Nothing resolved on the edge yet: no deadline or send-failure alert.
    assert not {name for name, _ in firing} & {"OmniStreamDeadlineRate", "OmniStreamSendFailures"}
    # The thinker is stopped: its scrape fails (OmniStageDown's condition, not yet its 5m).
    down = prometheus.query('up{job="omni-stages", stage="thinker"} == 0')["data"]["result"]
    assert down, "the stopped thinker still answers its scrape"
