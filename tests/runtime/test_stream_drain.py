"""A stopping stage never cuts a stream it can let finish: a receiving stage (an ``omni-stage``
process) that gets SIGTERM with a stream open refuses new streams and new hand-offs, lets the
open stream run to its last chunk, then exits; one whose producer goes silent is cut at the
grace period, naming the stream; a vLLM consumer (a talker) stopped mid-stream takes the
stream to its last chunk before its engine's own drain. The grace period by default covers the stage's streamed
edges' longest ``streamSeconds``, the rule by which the operator sizes the pod's grace
period (omni_contract.edges.drain_seconds). The producer here is a real KV sender (NIXL
agent, ZeroMQ) of a synthetic AR rank."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
import yaml
from procs import StageProcess, free_port, http_get, wait_until

from omni_runtime.kv.transport.sender import ChunkOffer

from transport_fixtures import WAIT, make_ar, make_sender  # noqa: F401  (fixtures)

ROOT = Path(__file__).resolve().parents[2]
PIPELINE, MODEL, PRODUCER, CONSUMER = "drain", "tiny", "thinker", "vocoder"
OUTCOMES = ("finished", "consumer_error", "producer_error", "expired", "aborted")
STREAM = {"firstChunkTokens": 2, "chunkTokens": 2, "firstChunkSeconds": 30, "gapSeconds": 30,
          "streamSeconds": 60, "chunksInFlight": 4, "maxOpenStreams": 8}


def consumer_config() -> dict:
    return {"pipeline": PIPELINE, "stage": CONSUMER, "role": "generation",
            "model": {"name": MODEL},
            "ports": {"http": free_port(), "kv": free_port()},
            "inputs": [{"stage": PRODUCER, "mode": "stream", "stream": STREAM}]}


@pytest.fixture
def stage(tmp_path, request):
    proc = StageProcess(consumer_config(), tmp_path, grace_seconds=request.param)
    proc.start(timeout=60)
    yield proc
    proc.stop()


@pytest.fixture
def sender(stage, make_ar, make_sender):  # noqa: F811
    ar = make_ar(model=MODEL, pipeline=PIPELINE, stage=PRODUCER)
    return make_sender(ar, {CONSUMER: f"tcp://127.0.0.1:{stage.kv_port}"})


def answer(sender, offer: ChunkOffer) -> str | None:
    """Send one chunk and wait for its answer: None (acked) or the refusal."""
    sender.submit_chunk(offer, CONSUMER, timeout_s=WAIT)
    deadline = time.monotonic() + WAIT
    while True:
        got = sender.poll_chunks()
        if got:
            [(rid, _, seq, reason)] = got
            assert (rid, seq) == (offer.request_id, offer.seq)
            return reason
        assert time.monotonic() < deadline, f"no answer to chunk {offer.seq} of {offer.request_id}"
        sender.wait(deadline - time.monotonic())


def chunk(rid: str, seq: int, last: bool = False) -> ChunkOffer:
    return ChunkOffer(rid, seq, last=last, token_ids=(5, 6, 7, 8) if seq == 0 else (9, 10),
                      prompt_len=2 if seq == 0 else 0, produced_at=time.time())


def stopping(stage) -> bool:
    status, body, _ = http_get(stage.url + "/health", timeout=2)
    return status == 503 and b"stopping" in body


@pytest.mark.parametrize("stage", [60], indirect=True)
def test_sigterm_lets_the_open_stream_finish_and_refuses_new_work(stage, sender):
    assert answer(sender, chunk("open", 0)) is None
    stage.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: stopping(stage), 10, "/health to say the stage is stopping")
    # A new stream is refused at once, naming why; the open one goes on.
    refused = answer(sender, chunk("new", 0))
    assert refused is not None and "stopping: chunk 0" in refused
    assert "begins a new stream: stage vocoder is stopping" in refused
    assert stage.proc.poll() is None, "the stage exited with a stream open"
    assert answer(sender, chunk("open", 1)) is None
    assert answer(sender, chunk("open", 2, last=True)) is None
    assert stage.proc.wait(timeout=30) == 0
    log = stage.log_tail(20_000)
    assert "stopping: 1 open stream(s) may run on for up to 60s" in log
    assert "stopping: every open stream ended" in log and "are cut" not in log


@pytest.mark.parametrize("stage", [1.5], indirect=True)
def test_a_stream_whose_producer_goes_silent_is_cut_at_the_grace_period_naming_it(stage, sender):
    assert answer(sender, chunk("silent", 0)) is None
    began = time.monotonic()
    stage.proc.send_signal(signal.SIGTERM)
    assert stage.proc.wait(timeout=30) == 0
    # Not before the grace period, and not at the stream's own deadlines (30 s, 60 s).
    assert 1.5 <= time.monotonic() - began < STREAM["gapSeconds"]
    assert ("stopping: 1 stream(s) still open after the 2s grace period are cut: request "
            "silent from thinker") in stage.log_tail(20_000)


def test_the_default_grace_period_is_the_drain_the_operator_gives_the_pod():
    """Each stage of the streamed examples, from the stage config the operator renders: the
    grace period omni-stage takes by default is the operator's drain_seconds, which the pod's
    terminationGracePeriodSeconds covers."""
    from omni_operator.check.admission import admit
    from omni_operator.pipeline.render import (KILL_MARGIN_SECONDS, STOP_BEYOND_GRACE_SECONDS,
                                      drain_seconds)
    from omni_operator.pipeline.stage_config import dump_stage_config, render_stage_config

    from omni_runtime.stages.config import parse_stage_config
    from omni_runtime.stages.main import default_grace_seconds

    seen = set()
    for example in ("tiny-omni-streaming.yaml", "qwen-omni-thinker-talker.yaml",
                    "tiny-pipeline.yaml"):
        admitted = admit(yaml.safe_load((ROOT / "examples" / example).read_text()))
        pipeline = admitted.pipeline
        pods = {d["metadata"]["labels"]["omnipipeline.dev/stage"]: d["spec"]["template"]["spec"]
                for d in admitted.children if d["kind"] == "Deployment"}
        for s in pipeline.stages:
            config = parse_stage_config(yaml.safe_load(dump_stage_config(
                render_stage_config(pipeline, s.name, lambda stage: f"{stage}:9600"))))
            grace = default_grace_seconds(config)
            assert grace == drain_seconds(pipeline, s), (example, s.name)
            assert pods[s.name]["terminationGracePeriodSeconds"] == \
                grace + STOP_BEYOND_GRACE_SECONDS + KILL_MARGIN_SECONDS
            seen.add(grace)
    # Both rules are exercised: a stream's deadline above the transfers', and not.
    assert len(seen) > 1, seen


@pytest.mark.engine
def test_a_vllm_consumer_stopped_mid_stream_lets_it_finish(tmp_path):
    """The same for an ``ar`` consumer (a talker: vLLM fed by a stream through its
    streaming-input session): SIGTERM with a stream open (its producer held still meanwhile,
    SIGSTOP, so that the stream is mid-way whatever the machine's speed); its supervisor
    drains the streamed inputs before vLLM's own drain (which would end the session while it
    waits for its next chunk, as if finished: it did so under load, 15 of 76 chunks taken);
    the producer continued, the stream finishes, every chunk taken, and the talker exits
    cleanly."""
    from chain import CHAIN_ENV, chain_configs
    from procs import metric_value, stop_groups

    import requests

    configs = chain_configs([
        {"name": "thinker", "role": "ar", "engineArgs": {"max-model-len": 1024}},
        {"name": "talker", "role": "ar", "engineArgs": {"max-model-len": 1024},
         "stream": {**STREAM, "firstChunkTokens": 4, "chunkTokens": 8, "streamSeconds": 120},
         "input": {"samplingParams": {"max_tokens": 2, "temperature": 0, "ignore_eos": True}}},
    ], pipeline=PIPELINE, timeout_seconds=10)
    thinker = StageProcess(configs["thinker"], tmp_path, env=CHAIN_ENV)
    talker = StageProcess(configs["talker"], tmp_path, env=CHAIN_ENV, grace_seconds=120)
    edge = {"from_stage": "thinker", "to_stage": "talker"}

    try:
        talker.launch()
        thinker.launch()
        talker.wait_healthy(240)
        thinker.wait_healthy(240)
        with requests.post(f"{thinker.url}/v1/completions", stream=True, timeout=300, json={
                "model": "tiny-qwen2", "prompt": [11, 12, 13], "max_tokens": 600,
                "temperature": 0, "ignore_eos": True, "stream": True}) as response:
            lines = response.iter_lines()
            open_at_talker = lambda: metric_value(  # noqa: E731
                talker.metrics(), "omni_kv_streams", state="open", **edge) == 1
            wait_until(open_at_talker, 60, "the talker to hold the stream", interval=0.05)
            thinker.signal_tree(signal.SIGSTOP)
            try:
                # Still open (the gauge is set on a timer: a stream that had ended would show 0).
                wait_until(open_at_talker, 10, "the talker's stream, mid-way")
                talker.proc.send_signal(signal.SIGTERM)
                wait_until(lambda: stopping(talker), 30, "the talker's input to drain")
                assert talker.proc.poll() is None, "the talker stopped with its stream open"
            finally:
                thinker.signal_tree(signal.SIGCONT)
            for _ in lines:  # the thinker's answer runs to its end
                pass
        # The stream runs on after the thinker's answer (the talker takes a chunk a turn).
        ended = lambda: sum(metric_value(  # noqa: E731
            thinker.metrics(), "omni_kv_streams_resolved_total", outcome=o, **edge)
            for o in OUTCOMES)
        wait_until(ended, 120, "the thinker's stream to end")
        page = thinker.metrics()
        outcomes = {o: metric_value(page, "omni_kv_streams_resolved_total", outcome=o, **edge)
                    for o in OUTCOMES}
        acked = metric_value(page, "omni_kv_stream_chunks_total", outcome="acked", **edge)
        assert outcomes["finished"] == 1 and sum(outcomes.values()) == 1, (outcomes, acked)
        assert acked == 1 + -(-(600 - 4) // 8)  # every chunk (4, then 8s) taken
        assert talker.proc.wait(timeout=180) == 0
        log = talker.log_tail(400_000)
        assert "stopping: the streamed inputs drain first, for up to 120s" in log
        assert "stopping: every streamed input ended" in log
        assert "start mode=drain" in log  # then vLLM's own drain
    finally:
        if thinker.proc is not None and thinker.proc.poll() is None:
            thinker.signal_tree(signal.SIGCONT)
        stop_groups([p.proc for p in (thinker, talker) if p.proc is not None], 60)


@pytest.mark.parametrize("client, method, query, status", [
    ("10.0.0.5", "POST", b"wait=1", 403),      # another pod: the port is open to all
    ("127.0.0.1", "GET", b"wait=1", 405),
    ("127.0.0.1", "POST", b"wait=soon", 400),
    ("127.0.0.1", "POST", b"wait=1", 200),
    ("10.0.0.9", "POST", b"", 200),            # the pod's own address
])
def test_only_the_stage_itself_may_drain_it(client, method, query, status):
    import asyncio
    import json

    from omni_runtime.stages.stage_input import DRAIN_PATH, StageInputMiddleware

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": DRAIN_PATH, "method": method, "query_string": query,
             "client": (client, 40000), "server": ("10.0.0.9", 8000)}
    asyncio.run(StageInputMiddleware(app=None)(scope, None, send))
    assert sent[0]["status"] == status
    if status == 200:  # no stage input (not started): nothing open
        assert json.loads(sent[1]["body"]) == {"open": 0}
