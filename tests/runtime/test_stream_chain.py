"""A streamed edge end to end: thinker -> talker, both real vLLM stages (omni-stage
processes, the tiny model), the talker fed chunk by chunk while the thinker decodes, behind
the pipeline's one endpoint."""

from __future__ import annotations

import functools

import os
import signal
from pathlib import Path

import openai
import pytest
from chain import MODEL, chain_configs, running
from procs import metric_value, wait_until

pytestmark = pytest.mark.engine

HERE = Path(__file__).resolve().parent
ENV = {"PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH"))
                                     if p)}
#: Each chunk is a turn of the talker's streaming-input session: it says this much per chunk.
PER_CHUNK = 2
#: The talker's own limit: a long enough thinker answer overflows its streamed request.
TALKER_MAX_MODEL_LEN = 512
#: What the thinker says where a test needs it still decoding as the talker takes its first
#: chunk or answers it (the order, or something ended mid-stream), however loaded the
#: machine (with 20 and 90 tokens it once had said them all first under make test's load),
#: inside the talker's limit (5 + 300 + 2 per chunk of 38 < 512).
LONG_ANSWER = 300
STREAM = {"firstChunkTokens": 4, "chunkTokens": 8, "gapSeconds": 10, "firstChunkSeconds": 20,
          "streamSeconds": 60}


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    configs = chain_configs([
        {"name": "thinker", "role": "ar", "engineArgs": {"max-model-len": 1024}},
        {"name": "talker", "role": "ar", "stream": STREAM,
         "engineArgs": {"max-model-len": TALKER_MAX_MODEL_LEN},
         "input": {"samplingParams": {"max_tokens": PER_CHUNK, "temperature": 0,
                                      "ignore_eos": True}}},
    ], pipeline="streamed", timeout_seconds=10)
    with running(configs, tmp_path_factory.mktemp("streamed"), env=ENV) as stages:
        yield stages


def client(stage) -> openai.OpenAI:
    return openai.OpenAI(base_url=stage.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def ask_in_background(endpoint, prompt, on_first=None):
    """A streamed request of LONG_ANSWER tokens asked on a thread, returned once its first
    output came:
    (the thread, what it saw: ``first``, and ``error`` if the stream failed). ``on_first`` is
    called on that thread as the first output comes, before anything else."""
    import threading
    import time

    outcome = {}

    def ask() -> None:
        stream = client(endpoint).completions.create(
            model=MODEL, prompt=prompt, max_tokens=LONG_ANSWER, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        try:
            for _ in stream:
                if "first" not in outcome and on_first is not None:
                    on_first()
                outcome.setdefault("first", time.monotonic())
        except openai.APIError as exc:
            outcome["error"] = exc

    asker = threading.Thread(target=ask)
    asker.start()
    wait_until(lambda: "first" in outcome, 60, "the talker's first output", interval=0.01)
    return asker, outcome


EDGE = {"from_stage": "thinker", "to_stage": "talker"}


def resolved(stage, outcomes) -> float:
    """The streams of the thinker -> talker edge that ``stage`` has resolved as one of
    ``outcomes``."""
    text = stage.metrics()
    return sum(metric_value(text, "omni_kv_streams_resolved_total", outcome=o, **EDGE)
               for o in outcomes)


def engine_cores(stage) -> list[int]:
    """The pids of the stage's vLLM engine-core processes (its API server serves on)."""
    from procs import descendants

    found = []
    for pid in descendants(stage.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"EngineCore" in f.read():
                    found.append(pid)
        except OSError:
            pass
    return found


def signal_pids(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def mid_stream(endpoint, prompt, pause, resume, midway, attempts=3):
    """A streamed request asked on a thread, and ``pause()`` called on that thread as its
    first output comes; then ``midway()`` says whether the thinker's stream is still
    mid-way. Under a heavy load the first output can reach the client only after the whole
    stream was taken (it happened in make test): then ``resume()``, that request runs to its
    end, and another is asked (at most ``attempts``). Returns (the thread, what it saw)."""
    for attempt in range(attempts):
        asker, outcome = ask_in_background(endpoint, [*prompt, attempt], on_first=pause)
        if midway():
            return asker, outcome
        resume()
        asker.join(120)
    raise AssertionError(f"the first output came only after the whole stream, {attempts} "
                         "times")


def chunk_count(n_output: int) -> int:
    """Chunks of a stream of ``n_output`` tokens: 4, then 8 each, the last the rest."""
    if n_output <= 4:
        return 1
    return 1 + -(-(n_output - 4) // 8)


def test_the_talker_takes_the_thinkers_output_chunk_by_chunk_and_answers_early(streamed):
    prompt = [11, 12, 13, 14, 15]
    # The thinker is still decoding well after its first chunk, even with the machine
    # loaded (with 20 tokens it once finished first under make test's load).
    thinker_tokens = LONG_ANSWER
    answer = client(streamed["endpoint"]).completions.create(
        model=MODEL, prompt=prompt, max_tokens=thinker_tokens, temperature=0,
        extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": "streamed-1"})
    chunks = chunk_count(thinker_tokens)
    # Its input is the thinker's whole sequence (the prompt, then every token it said, in
    # chunks), and it answered every chunk.
    assert answer.usage.prompt_tokens == len(prompt) + thinker_tokens
    assert answer.usage.completion_tokens == PER_CHUNK * chunks
    stages = answer.model_extra["omni"]["stages"]
    # Streamed: the talker took its input before the thinker had finished.
    assert stages["talker"]["taken_at"] < stages["thinker"]["finished_at"]
    thinker = streamed["thinker"].metrics()
    edge = EDGE
    assert metric_value(thinker, "omni_kv_streams_resolved_total", outcome="finished",
                        **edge) >= 1
    assert metric_value(thinker, "omni_kv_stream_chunks_total", outcome="acked",
                        **edge) >= chunks
    # No whole transfer on a streamed edge.
    assert metric_value(thinker, "omni_kv_transfers_started_total") == 0
    wait_until(lambda: metric_value(streamed["thinker"].metrics(), "omni_kv_streams",
                                    state="open", **edge) == 0, 10, "the thinker's streams")


def test_a_client_that_uses_its_x_request_id_again_gets_its_answer_again(streamed):
    """A retry with the same X-Request-Id once the first request has ended (an outside
    review: the talker remembered the first one's stream by that id for its streamSeconds,
    refused the new stream's first chunk, and the client waited until its own timeout)."""
    ask = functools.partial(client(streamed["endpoint"]).with_options(timeout=60).completions.create,
                            model=MODEL, prompt=[41, 42, 43], max_tokens=8, temperature=0,
                            extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": "again-1"})
    first, second = ask(), ask()
    assert second.choices[0].text == first.choices[0].text
    assert second.usage == first.usage


def test_a_chunk_over_the_talkers_limit_fails_that_request_naming_the_talker(streamed):
    with pytest.raises(openai.APIStatusError) as err:
        client(streamed["endpoint"]).completions.create(
            model=MODEL, prompt=[21, 22, 23], max_tokens=2 * LONG_ANSWER, temperature=0,
            extra_body={"ignore_eos": True})
    assert err.value.body["stage"] == "talker", err.value.body
    assert err.value.status_code == 400  # the client asked for more than the talker can hold
    assert err.value.body["param"] == "max_tokens", err.value.body
    assert "its streamed input failed" in err.value.body["message"]
    assert str(TALKER_MAX_MODEL_LEN) in err.value.body["message"]
    # The engine lives: the next request is answered.
    answer = client(streamed["endpoint"]).completions.create(
        model=MODEL, prompt=[24, 25], max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert answer.usage.prompt_tokens == 2 + 6
    # Counted where it was refused (the thinker's end resolves it as the refusal or the
    # endpoint's abort reaches it first).
    edge = EDGE
    assert metric_value(streamed["talker"].metrics(), "omni_kv_streams_resolved_total",
                        outcome="consumer_error", **edge) >= 1


def test_a_client_that_goes_away_ends_the_stream_at_both_ends(streamed):
    thinker, talker = streamed["thinker"], streamed["talker"]
    edge = EDGE
    every = ("aborted", "finished", "producer_error", "consumer_error", "expired")
    ended = lambda stage: resolved(stage, every)  # noqa: E731
    before = ended(talker), ended(thinker)
    stream = client(streamed["endpoint"]).completions.create(
        model=MODEL, prompt=[41, 42, 43], max_tokens=LONG_ANSWER, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    next(iter(stream))  # the talker's first output: the stream is open at both ends
    stream.close()  # the client goes away mid-stream
    # Ended at both ends (aborted, or, when the abort reached a stage after its stream's last
    # chunk, finished there).
    wait_until(lambda: ended(talker) > before[0] and ended(thinker) > before[1], 60,
               "the stream to end at both ends")
    wait_until(lambda: metric_value(talker.metrics(), "vllm:num_requests_running") == 0
               and metric_value(thinker.metrics(), "vllm:num_requests_running") == 0, 30,
               "both stages' requests to end")
    wait_until(lambda: metric_value(thinker.metrics(), "omni_kv_streams", state="open",
                                    **edge) == 0, 30, "the thinker's stream to end")


def test_the_thinker_killed_mid_stream_ends_the_talkers_request(streamed):
    """The producer dies with a stream open (its pod crashes: no goodbye, no stream_end):
    the client is told, naming the thinker; the talker's stream resolves within the edge's
    gap deadline (the endpoint's abort usually ends it at once; the talker's own deadline
    bounds it in any case), nothing stays open there and its engine is idle. Then the
    thinker comes back and the pipeline answers again (the talker takes the new thinker's
    stream)."""
    import time

    thinker, talker = streamed["thinker"], streamed["talker"]
    edge = EDGE
    failed = ("producer_error", "expired", "aborted")
    before = resolved(talker, failed)
    # The thinker's engine paused as the talker's first output comes (its API server serves
    # on), checked mid-answer, then the whole stage killed.
    engines = engine_cores(thinker)
    assert engines, "the thinker's engine core"
    asker, outcome = mid_stream(
        streamed["endpoint"], [61, 62, 63], lambda: signal_pids(engines, signal.SIGSTOP),
        lambda: signal_pids(engines, signal.SIGCONT),
        lambda: metric_value(thinker.metrics(), "vllm:num_requests_running") == 1)
    thinker.kill()
    killed = time.monotonic()
    asker.join(60)
    assert not asker.is_alive() and "error" in outcome, "the client was told"
    assert "thinker" in str(outcome["error"]), outcome["error"]
    bound = STREAM["gapSeconds"] + 10  # the deadline, and room for a loaded machine
    wait_until(lambda: resolved(talker, failed) > before, bound,
               "the talker's stream to resolve")
    assert time.monotonic() - killed < bound
    wait_until(lambda: metric_value(talker.metrics(), "omni_kv_streams", state="open",
                                    **edge) == 0, 10, "nothing open at the talker")
    wait_until(lambda: metric_value(talker.metrics(), "vllm:num_requests_running") == 0, 30,
               "the talker's request to end")
    thinker.launch().wait_healthy(timeout=240)
    answer = client(streamed["endpoint"]).completions.create(
        model=MODEL, prompt=[64, 65], max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True})
    assert answer.usage.prompt_tokens == 2 + 12


def test_the_talker_killed_mid_stream_frees_the_thinker(streamed):
    """The consumer dies with a stream open (last in this module: its talker stays dead): the
    client gets an error, and the thinker's stream resolves (its request aborted by the
    endpoint, the chunk it sent there failing, or the gap deadline) with nothing left open and
    its engine idle. (How soon after a deadline a stalled stream's error reaches the client is
    benchmarks/streaming.py's stall figure.)"""
    thinker, talker = streamed["thinker"], streamed["talker"]
    edge = EDGE
    failed = ("consumer_error", "expired", "aborted")
    before = resolved(thinker, failed)
    # Paused as its first output comes (its link and connections stay up; it takes no more
    # chunks), checked mid-stream (the thinker's stream open), then killed.

    def open_at_thinker() -> bool:
        try:
            wait_until(lambda: metric_value(thinker.metrics(), "omni_kv_streams",
                                            state="open", **edge) >= 1, 3, "open")
            return True
        except TimeoutError:
            return False

    asker, outcome = mid_stream(
        streamed["endpoint"], [51, 52, 53], lambda: talker.signal_tree(signal.SIGSTOP),
        lambda: talker.signal_tree(signal.SIGCONT), open_at_thinker)
    talker.kill()
    asker.join(60)
    assert not asker.is_alive() and "error" in outcome, "the client was told"
    assert "talker" in str(outcome["error"]), outcome["error"]
    wait_until(lambda: resolved(thinker, failed) > before, 60,
               "the thinker's stream to resolve")
    wait_until(lambda: metric_value(thinker.metrics(), "omni_kv_streams", state="open",
                                    **edge) == 0, 10, "nothing open at the thinker")
    wait_until(lambda: metric_value(thinker.metrics(), "vllm:num_requests_running") == 0, 30,
               "the thinker's request to end")


def test_ends_that_disagree_on_the_edge_fail_the_request_at_once_saying_so(tmp_path):
    """The thinker streams to a talker that reads the edge as whole (the class of vllm-omni's
    hangs, #4793 and #7544; the operator refuses such a pipeline, so here the stage configs
    are written by hand): the talker refuses the first chunk, and the client is told at once
    why, naming the talker, not that it did not take its input by the deadline."""
    configs = chain_configs([
        {"name": "thinker", "role": "ar"},
        {"name": "talker", "role": "ar", "stream": STREAM,
         "input": {"samplingParams": {"max_tokens": PER_CHUNK}}},
    ], pipeline="disagree", timeout_seconds=30)
    configs["talker"]["inputs"] = ["thinker"]  # whole, where the thinker streams
    with running(configs, tmp_path, env=ENV) as stages:
        with pytest.raises(openai.APIStatusError) as err:
            client(stages["endpoint"]).completions.create(
                model=MODEL, prompt=[7, 8, 9], max_tokens=8, temperature=0,
                extra_body={"ignore_eos": True})
        body = err.value.body
        assert body["stage"] == "talker", body
        assert "refused its streamed input from stage thinker" in body["message"], body
        assert "both ends must read the same edge" in body["message"], body
