"""A stage whose KV transport thread died says so: the receiving stage's /health fails with
the reason and its gauge shows 0; the AR stage's supervisor reads the sender's gauge from
its own /metrics and stops the stage (so Kubernetes restarts it)."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request

import pytest
from procs import free_port, http_get, metric_value, wait_until

from omni_runtime.stages.ar import transport_threads_down
from omni_runtime.stages.config import StageConfig


pytestmark = pytest.mark.engine

class BrokenInbox:
    """Raised from the receiver loop's own timer step, outside any message: a stand-in for a
    bug that ends the receiver thread (the only way it can end now that every message's
    errors are answered)."""

    def __init__(self, inbox):
        self._inbox = inbox
        self.broken = threading.Event()

    def __getattr__(self, name):
        return getattr(self._inbox, name)

    def expire(self):
        if self.broken.is_set():
            raise RuntimeError("inbox corrupted")
        return self._inbox.expire()


@pytest.fixture
def receiving_stage():
    from omni_runtime.stages.receiver import ReceiverStage

    config = StageConfig(pipeline="p", stage="health-probe", role="generation", model="m",
                         model_name="m", http_port=free_port(), kv_port=free_port())
    stage = ReceiverStage(config, host="127.0.0.1")
    stage.inbox = BrokenInbox(stage.inbox)
    stage.receiver.inbox = stage.inbox
    stage.receiver.start()
    server = threading.Thread(target=stage._http.serve_forever, kwargs={"poll_interval": 0.1},
                              daemon=True)
    server.start()
    yield stage
    stage._http.shutdown()
    stage._http.server_close()
    stage.receiver.close()


def test_a_dead_receiver_thread_fails_health_and_shows_on_metrics(receiving_stage):
    url = f"http://127.0.0.1:{receiving_stage.config.http_port}"
    assert http_get(url + "/health")[0] == 200
    text = http_get(url + "/metrics")[1].decode()
    assert metric_value(text, "omni_kv_transport_thread_up", stage="health-probe",
                        thread="receiver") == 1
    receiving_stage.inbox.broken.set()
    receiving_stage.receiver._thread.join(5)  # the loop's timer runs at least every second
    status, body, _ = http_get(url + "/health")
    assert status == 503 and b"KV receiver thread died: RuntimeError: inbox corrupted" in body
    text = http_get(url + "/metrics")[1].decode()
    assert metric_value(text, "omni_kv_transport_thread_up", stage="health-probe",
                        thread="receiver") == 0
    # Only this stage's series: senders that earlier tests in this process closed report 0
    # in the same global registry.
    mine = "\n".join(line for line in text.splitlines() if 'stage="health-probe"' in line)
    assert transport_threads_down(mine) == ["receiver"]


def test_the_supervisor_reads_which_transport_thread_is_down():
    page = (
        '# TYPE omni_kv_transport_thread_up gauge\n'
        'omni_kv_transport_thread_up{model_name="m",stage="ar",thread="sender"} 0.0\n'
        'omni_kv_transport_thread_up{model_name="m",stage="x",thread="receiver"} 1.0\n'
    )
    assert transport_threads_down(page) == ["sender"]
    assert transport_threads_down(page.replace("} 0.0", "} 1.0")) == []
    assert transport_threads_down("") == []


def test_an_ar_stage_whose_sender_thread_died_stops_with_exit_3(tmp_path):
    """The whole path, in a running AR stage (omni-stage, vLLM, the connector): the sender's
    I/O thread dies at its first send (tests/faults/sitecustomize.py injects that fault; see
    there why it is injected), its gauge drops to 0 on the stage's /metrics, and the
    supervisor's next health check reads it, stops vLLM and exits EXIT_TRANSPORT_DEAD, so that
    Kubernetes restarts the pod, with the reason in its log."""
    import json
    import os
    import urllib.request
    from pathlib import Path

    from procs import StageProcess

    from omni_runtime.stages.ar import EXIT_TRANSPORT_DEAD, HEALTH_CHECK_PERIOD_S
    from test_pipeline_e2e import stage_configs

    faults = str(Path(__file__).resolve().parents[1] / "faults")
    env = {"OMNI_TEST_SENDER_DIES": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (faults, os.environ.get("PYTHONPATH")) if p)}
    ar = StageProcess(stage_configs(tmp_path)["ar"], tmp_path, env=env)
    ar.start()
    try:
        body = json.dumps({"model": ar.config["model"]["name"], "prompt": "Hello world",
                           "max_tokens": 2, "temperature": 0}).encode()
        req = urllib.request.Request(ar.url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 200  # serving goes on; only the KV cannot leave
        # The supervisor exits this way only when its health check read the sender's gauge
        # at 0 on the stage's /metrics (transport_threads_down).
        code = ar.proc.wait(timeout=HEALTH_CHECK_PERIOD_S + 30)
        assert code == EXIT_TRANSPORT_DEAD, ar.log_tail()
        log = ar.log_tail(20000)
        assert "injected fault: the KV sender's I/O thread dies" in log
        assert "KV sender thread of the engine died" in log
    finally:
        ar.stop()


def test_a_wait_that_is_not_a_number_of_seconds_is_refused_not_waited_on():
    """``GET /v1/streams/<id>?wait=nan`` held a handler thread for good (the inbox waited on a
    nan deadline); every path with a ``wait`` answers 400 naming it for nan or a negative
    wait, and takes a larger one as its cap."""
    from omni_runtime.stages.config import parse_stage_config
    from omni_runtime.stages.receiver import MAX_WAIT_S, ReceiverStage, wait_seconds

    assert wait_seconds({}) == 0 and wait_seconds({"wait": ["0.5"]}) == 0.5
    assert wait_seconds({"wait": ["inf"]}) == wait_seconds({"wait": ["1e400"]}) == MAX_WAIT_S
    assert [wait_seconds({"wait": [w]}) for w in ("nan", "-1", "abc", "")] == [None] * 4

    raw = {"pipeline": "p", "stage": "vocoder", "role": "generation",
           "model": {"name": "m"}, "kvTransfer": {"send": False},
           "inputs": [{"stage": "talker", "mode": "stream", "stream": {"firstChunkTokens": 4}}],
           "ports": {"http": free_port(), "kv": free_port()}}
    stage = ReceiverStage(parse_stage_config(raw), host="127.0.0.1")
    server = threading.Thread(target=stage._http.serve_forever, kwargs={"poll_interval": 0.1},
                              daemon=True)
    server.start()
    try:
        assert stage.streams is not None
        url = f"http://127.0.0.1:{raw['ports']['http']}"
        for path in ("/v1/streams/nope", "/v1/kv/nope"):
            for wait in ("nan", "NaN", "-1"):
                status, body, _ = http_get(f"{url}{path}?wait={wait}", timeout=10)
                assert status == 400 and b"wait must be a number of seconds" in body, (path, wait)
            assert http_get(f"{url}{path}?wait=0.1", timeout=10)[0] == 404
        # Another method: 405 naming GET (it was the standard library's HTML 501).
        for method in ("POST", "PUT", "DELETE", "HEAD"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(urllib.request.Request(url + "/omni/drain", method=method,
                                                              data=b"" if method != "HEAD" else None), timeout=10)
            assert refused.value.code == 405 and refused.value.headers["Allow"] == "GET", method
    finally:
        stage._http.shutdown()
        stage._http.server_close()
        stage.receiver.close()
