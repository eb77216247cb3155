"""A pipeline past its first hop, as real processes: thinker (a vLLM stage) -> talker (a vLLM
stage whose requests are made from the thinker's hand-offs) -> receiver (a receiving stage),
the pipeline's endpoint in front; the client is the ``openai`` package.

Oracles that owe nothing to our code: the thinker's own answer to the same prompt (greedy,
asked of it directly), and Hugging Face transformers' greedy continuation and
``past_key_values`` for the talker's whole sequence with the same model: the KV the talker
loaded as its prefix instead of computing it is checked through everything the talker
computed on top of it, and what it shipped on.
"""

from __future__ import annotations

import io
import os
import threading
import time
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from chain import MODEL, chain_configs, running
from input_hooks import RAISE, TALK_LONG, TALK_LONGEST
from otlp_receiver import OtlpReceiver
from procs import http_get, metric_value, wait_until

from omni_runtime.devtools.tiny_model import ensure_tiny_model

pytestmark = pytest.mark.engine

HERE = Path(__file__).resolve().parent
TALKER_TOKENS = 16
TALKER_INPUT = {"samplingParams": {"max_tokens": TALKER_TOKENS, "temperature": 0,
                                   "ignore_eos": True},
                "hook": "input_hooks:by_first_tokens"}
#: The talker's own limit, below the thinker's: a long thinker answer is over it.
TALKER_MAX_MODEL_LEN = 700
ENV = {"PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH"))
                                     if p)}


@pytest.fixture(scope="module")
def otlp():
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def chain(tmp_path_factory, otlp):
    configs = chain_configs([
        {"name": "thinker", "role": "ar", "engineArgs": {"max-model-len": 1024}},
        {"name": "talker", "role": "ar", "input": TALKER_INPUT,
         "engineArgs": {"max-model-len": TALKER_MAX_MODEL_LEN}},
        {"name": "receiver", "role": "generation"},
    ], otlp_endpoint=otlp.endpoint)
    tracing = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": otlp.endpoint,
               "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
               "OTEL_BSP_SCHEDULE_DELAY": "200"}  # ms: spans exported promptly
    with running(configs, tmp_path_factory.mktemp("chain"), env={**ENV, **tracing}) as stages:
        yield stages


def client(stage) -> openai.OpenAI:
    return openai.OpenAI(base_url=stage.url + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def hf_model():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ensure_tiny_model()), dtype=torch.float32)
    return model.eval()


def hf_kv(model, token_ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        pkv = model(torch.tensor([token_ids]), use_cache=True).past_key_values
    return np.stack([np.stack([layer.keys[0].numpy(), layer.values[0].numpy()])
                     for layer in pkv.layers])


def hf_greedy(model, token_ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens, the end-of-text token as any other (the stages ignore_eos)."""
    out, past, step = [], None, torch.tensor([token_ids])
    with torch.no_grad():
        for _ in range(n):
            result = model(step, past_key_values=past, use_cache=True)
            past = result.past_key_values
            out.append(int(result.logits[0, -1].argmax()))
            step = torch.tensor([[out[-1]]])
    return out


def fetch_kv(receiver, request_id: str) -> np.ndarray:
    status, body, _ = http_get(f"{receiver.url}/v1/kv/{request_id}?wait=5")
    assert status == 200, body
    return np.load(io.BytesIO(body), allow_pickle=False)


def transfers_settled(stage) -> bool:
    """No transfer of the stage pending, active or held."""
    page = stage.metrics()
    return all(metric_value(page, "omni_kv_transfers", state=s) == 0
               for s in ("pending", "active", "held"))


def test_the_talkers_input_is_the_thinkers_output_and_its_loaded_prefix_is_exact(chain):
    """Through the one endpoint, with the client's X-Request-Id: the talker's request is the
    thinker's whole sequence (its prompt and every token it generated, token for token as
    the thinker answers the same prompt alone), the talker computed only its last prompt
    token (the rest was the thinker's KV, loaded), and what the talker generated and shipped
    on is exactly what the same model computes from scratch."""
    prompt = [40, 41, 42, 43, 44]
    answer = client(chain["endpoint"]).completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
        extra_headers={"X-Request-Id": "chain-exact"})
    assert answer.id == "cmpl-chain-exact"
    payload = answer.choices[0].model_extra["omni_payload"]
    assert payload["stage"] == "receiver" and payload["from_stage"] == "talker"
    assert payload["external_request_id"] == "chain-exact"
    alone = client(chain["thinker"]).completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
        extra_body={"return_token_ids": True})
    thinker_sequence = prompt + list(alone.choices[0].model_extra["token_ids"])
    talker_input = payload["token_ids"][:payload["prompt_len"]]
    assert talker_input == thinker_sequence
    model = hf_model()
    talker_output = payload["token_ids"][payload["prompt_len"]:]
    assert talker_output == hf_greedy(model, talker_input, TALKER_TOKENS)
    kv = fetch_kv(chain["receiver"], payload["request_id"])
    reference = hf_kv(model, payload["token_ids"][:payload["seq_len"]])
    np.testing.assert_allclose(kv, reference, rtol=1e-3, atol=1e-4)
    page = chain["talker"].metrics()
    assert metric_value(page, "vllm:external_prefix_cache_hits_total") >= len(thinker_sequence) - 1


def test_one_trace_follows_the_request_through_every_stage(chain, otlp):
    """The client's W3C trace context: the endpoint's span, each vLLM stage's request, each
    stage's KV transfer and the last stage's receive are spans of one trace."""
    trace_id, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    client(chain["endpoint"]).completions.create(
        model=MODEL, prompt=[21, 22, 23], max_tokens=4, temperature=0,
        extra_headers={"traceparent": f"00-{trace_id}-{client_span}-01"})

    wanted = {("omni.pipeline_request", None), ("omni.kv_transfer", "thinker"),
              ("omni.kv_transfer", "talker"), ("omni.kv_receive", "receiver")}
    seen: set = set()

    def whole(spans):
        mine = [s for s in spans if s.trace_id == trace_id]
        seen.update((s.name, s.attributes.get("omni.stage")) for s in mine)
        requests = [s for s in mine if s.name == "llm_request"]
        return mine if wanted <= seen and len(requests) >= 2 else None

    try:
        mine = otlp.wait_for(whole, 30)
    except AssertionError:
        raise AssertionError(f"the trace's spans: {sorted(seen, key=str)}; missing "
                             f"{sorted(wanted - seen, key=str)}") from None
    (root,) = [s for s in mine if s.name == "omni.pipeline_request"]
    assert root.parent_span_id == client_span
    # vLLM's own request spans, the thinker's and the talker's, in the same trace
    assert len({s.span_id for s in mine if s.name == "llm_request"}) >= 2


def test_concurrent_requests_each_get_their_own_answer_and_every_transfer_resolves(chain):
    prompts = [[50 + i, 60 + i, 70 + i] for i in range(8)]
    answers: dict[int, object] = {}

    def ask(i: int) -> None:
        answers[i] = client(chain["endpoint"]).completions.create(
            model=MODEL, prompt=prompts[i], max_tokens=6, temperature=0)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(answers) == list(range(len(prompts)))
    for i, answer in answers.items():
        payload = answer.choices[0].model_extra["omni_payload"]
        assert payload["token_ids"][:3] == prompts[i], "each answer is its own request's"
    for stage in ("thinker", "talker"):
        wait_until(lambda: transfers_settled(chain[stage]), 20, f"{stage}'s transfers to settle")


def test_a_thinker_answer_over_the_talkers_limit_comes_back_as_the_talkers_error(chain):
    """The talker refuses an input over its max-model-len (vLLM's own validation): the
    client's error, a 400 as vLLM's server answers it (what the client asked for is more than
    the talker can take), names the talker and why; the thinker's transfer fails with the
    reason (input_refused) and gives its blocks back."""
    before = metric_value(chain["thinker"].metrics(), "omni_kv_transfers_resolved_total",
                          outcome="failed") or 0
    with pytest.raises(openai.APIStatusError) as err:
        client(chain["endpoint"]).completions.create(
            model=MODEL, prompt=[45, 46], max_tokens=TALKER_MAX_MODEL_LEN + 10, temperature=0,
            extra_body={"ignore_eos": True})
    body = err.value.body
    assert err.value.status_code == 400 and body["stage"] == "talker"
    assert "refused its input" in body["message"] and "maximum context length" in body["message"]
    wait_until(lambda: transfers_settled(chain["thinker"]), 20, "the thinker's transfers")
    after = metric_value(chain["thinker"].metrics(), "omni_kv_transfers_resolved_total",
                         outcome="failed")
    assert after == before + 1
    assert metric_value(chain["talker"].metrics(), "omni_kv_receiver_rejected_total",
                        reason="input_refused") >= 1


def test_an_input_hook_that_raises_fails_that_request_alone(chain):
    with pytest.raises(openai.APIStatusError) as err:
        client(chain["endpoint"]).completions.create(model=MODEL, prompt=[*RAISE, 9, 9],
                                                     max_tokens=4, temperature=0)
    assert err.value.body["stage"] == "talker"
    assert ("the input hook raised RuntimeError: this hook refuses prompts"
            in err.value.body["message"])
    fine = client(chain["endpoint"]).completions.create(model=MODEL, prompt=[7, 9, 9],
                                                        max_tokens=4, temperature=0)
    assert fine.choices[0].model_extra["omni_payload"]["token_ids"][:3] == [7, 9, 9]


def test_an_abort_at_the_endpoint_reaches_the_stage_holding_the_request(chain):
    """The client goes away while the talker generates (a long answer): the endpoint aborts
    the talker's request: it stops without finishing, hands nothing on, holds nothing."""
    talker, receiver = chain["talker"], chain["receiver"]

    def counts():
        page = talker.metrics()
        return (metric_value(page, "omni_kv_transfers_started_total"),
                metric_value(page, "vllm:request_success_total"),
                metric_value(receiver.metrics(), "omni_kv_received_total"))

    before = counts()
    stream = client(chain["endpoint"]).completions.create(
        model=MODEL, prompt=[*TALK_LONGEST, 3, 4], max_tokens=4, temperature=0, stream=True)
    wait_until(lambda: metric_value(talker.metrics(), "vllm:num_requests_running") == 1, 30,
               "the talker to run the request", interval=0.02)
    stream.close()  # the client goes away
    wait_until(lambda: metric_value(talker.metrics(), "vllm:num_requests_running") == 0, 30,
               "the talker's request to end")
    assert counts() == before, "aborted: not finished, no transfer, nothing received"
    for stage in ("thinker", "talker"):
        wait_until(lambda: transfers_settled(chain[stage]), 20, f"{stage}'s transfers")


# ---------------------------------------------------------------------------- a vLLM last stage


@pytest.fixture(scope="module")
def duet(tmp_path_factory):
    """thinker -> talker, the talker the last stage: its tokens are the answer. The tests of
    stages that die use it last (this file's order): the talker's comes back, the thinker's
    does not."""
    configs = chain_configs([
        {"name": "thinker", "role": "ar"},
        {"name": "talker", "role": "ar", "input": TALKER_INPUT},
    ], pipeline="duet", timeout_seconds=5)
    with running(configs, tmp_path_factory.mktemp("duet"), env=ENV) as stages:
        yield stages


def thinker_sequence(stages, prompt: list[int], max_tokens: int) -> list[int]:
    alone = client(stages["thinker"]).completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
        extra_body={"return_token_ids": True})
    return prompt + list(alone.choices[0].model_extra["token_ids"])


def test_the_last_vllm_stages_tokens_stream_back_as_openai_chunks(duet):
    prompt = [80, 81, 82]
    chunks = list(client(duet["endpoint"]).completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True,
        extra_headers={"X-Request-Id": "duet-stream"}))
    assert {c.id for c in chunks} == {"cmpl-duet-stream"}
    assert chunks[-1].choices[0].finish_reason == "length"
    tokens = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
    expected = hf_greedy(hf_model(), thinker_sequence(duet, prompt, 8), TALKER_TOKENS)
    assert tokens == expected, "the talker's own greedy answer to the thinker's sequence"
    whole = client(duet["endpoint"]).completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert whole.choices[0].text == "".join(c.choices[0].text for c in chunks)
    assert whole.choices[0].model_extra["token_ids"] == tokens
    assert whole.usage.completion_tokens == TALKER_TOKENS


def test_a_chat_completion_comes_back_as_the_last_stages_message(duet):
    answer = client(duet["endpoint"]).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=6,
        temperature=0, extra_headers={"X-Request-Id": "duet-chat"})
    assert answer.id == "chatcmpl-duet-chat" and answer.object == "chat.completion"
    message = answer.choices[0].message
    assert message.role == "assistant" and message.content
    assert len(answer.choices[0].model_extra["token_ids"]) == TALKER_TOKENS


def test_a_bad_request_is_the_first_stages_error_with_its_status(duet):
    with pytest.raises(openai.NotFoundError) as err:
        client(duet["endpoint"]).completions.create(model="no-such-model", prompt=[1, 2],
                                                    max_tokens=4)
    assert err.value.body["stage"] == "thinker" and "no-such-model" in err.value.body["message"]


# ---------------------------------------------------------------------------- stages that die


def ask_all(stage, prompts: list[list[int]]) -> dict[int, object]:
    """Each prompt through the endpoint on a thread of its own: its answer or its error."""
    got: dict[int, object] = {}

    def ask(i: int) -> None:
        try:
            got[i] = client(stage).completions.create(model=MODEL, prompt=prompts[i],
                                                      max_tokens=4, temperature=0)
        except openai.APIError as exc:
            got[i] = exc

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    return got, threads


def test_the_talker_killed_mid_request_fails_its_clients_naming_it_and_comes_back(duet):
    """The talker dies (SIGKILL) while it holds requests: each of their clients gets an error
    naming the talker, at once (their links drop), none waits for a deadline; the thinker's
    transfers all resolve, nothing held; the talker restarted on its ports takes requests
    again."""
    talker = duet["talker"]
    got, threads = ask_all(duet["endpoint"], [[*TALK_LONG, i, 5] for i in range(4)])
    wait_until(lambda: metric_value(talker.metrics(), "vllm:num_requests_running") >= 1, 60,
               "the talker to run a request", interval=0.02)
    killed = time.monotonic()
    talker.kill()
    for t in threads:
        t.join(60)
    assert len(got) == 4 and time.monotonic() - killed < 20, "every client answered, soon"
    errors = [a for a in got.values() if isinstance(a, openai.APIError)]
    assert errors and all(e.body["stage"] == "talker" for e in errors), got
    wait_until(lambda: transfers_settled(duet["thinker"]), 30, "the thinker's transfers")
    talker.start(timeout=240)
    answer = client(duet["endpoint"]).completions.create(model=MODEL, prompt=[9, 8, 7],
                                                            max_tokens=4, temperature=0)
    assert answer.choices[0].model_extra["token_ids"]


def test_the_thinker_killed_with_hand_offs_in_flight_leaves_no_client_waiting(duet):
    """The thinker (the first stage) dies while some requests are at the talker and others
    at the thinker: those the talker took are answered; the others fail naming the thinker;
    the talker holds nothing for the dead thinker."""
    talker = duet["talker"]
    got, threads = ask_all(duet["endpoint"], [[*TALK_LONG, i, 6] for i in range(6)])
    wait_until(lambda: metric_value(talker.metrics(), "vllm:num_requests_running") >= 1, 60,
               "the talker to take a request", interval=0.02)
    duet["thinker"].kill()
    for t in threads:
        t.join(90)
    assert len(got) == 6, "every client answered"
    answered = [a for a in got.values() if not isinstance(a, openai.APIError)]
    failed = [a for a in got.values() if isinstance(a, openai.APIError)]
    assert answered, "a request the talker had taken is answered"
    # Named as the stage lost, or, for a hand-off the thinker had offered before it died
    # (whose blocks no one can read now), as the hand-off from it that was never taken.
    assert all(e.body["stage"] == "thinker" or "hand-off of request" in e.body["message"]
               and "from stage thinker" in e.body["message"] for e in failed), \
        [e.body for e in failed]
    wait_until(lambda: metric_value(talker.metrics(), "vllm:num_requests_running") == 0, 60,
               "the talker to finish")
    assert metric_value(talker.metrics(), "omni_kv_receiver_buffered_payloads") == 0


# ---------------------------------------------------------------------------- plain vllm serve


def readme_pair_commands() -> list[tuple[dict[str, str], list[str]]]:
    """The README's plain ``vllm serve`` pair and endpoint: (environment, argv) each."""
    from procs import readme_block, shell_commands

    return shell_commands(readme_block("# the talker: requests made of"))


def test_a_plain_vllm_pair_behind_the_endpoint_runs_as_the_readme_shows(tmp_path):
    """The README's commands, run as written (the model, the ports and vLLM's CPU settings
    put in): the talker's tokens through the endpoint are its own greedy answer to the
    thinker's whole sequence."""
    import subprocess
    import sys

    from procs import free_port, stop_group

    model = str(ensure_tiny_model())
    ports = {p: str(free_port()) for p in ("8000", "8001", "9600", "8080")}
    cpu = ["--dtype", "float32", "--max-model-len", "256", "--enforce-eager",
           "--kv-cache-memory-bytes", str(32 << 20)]
    procs = []
    try:
        for n, (env, argv) in enumerate(readme_pair_commands()):
            argv = [model if a == "MODEL" else ports.get(a, a) for a in argv]
            argv = [a.replace("127.0.0.1:9600", f"127.0.0.1:{ports['9600']}")
                     .replace("0.0.0.0:9600", f"127.0.0.1:{ports['9600']}")
                     .replace("127.0.0.1:8000", f"127.0.0.1:{ports['8000']}") for a in argv]
            assert argv[0] == "python", argv
            argv = [sys.executable, *argv[1:], *(cpu if "vllm" in argv[2] else [])]
            log = open(tmp_path / f"{n}.log", "wb")
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True, env={**os.environ, **env}))
        for port, proc in zip(("8001", "8000", "8080"), procs):
            wait_until(lambda: http_get(f"http://127.0.0.1:{ports[port]}/health", timeout=2)[0]
                       == 200, 240, f"port {port} to serve", proc=proc,
                       log=tmp_path / f"{procs.index(proc)}.log")
        endpoint = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['8080']}/v1",
                                 api_key="unused", max_retries=0)
        prompt = [61, 62, 63]
        answer = endpoint.completions.create(model=model, prompt=prompt, max_tokens=6,
                                             temperature=0)
        alone = openai.OpenAI(base_url=f"http://127.0.0.1:{ports['8000']}/v1",
                              api_key="unused").completions.create(
            model=model, prompt=prompt, max_tokens=6, temperature=0,
            extra_body={"return_token_ids": True})
        sequence = prompt + list(alone.choices[0].model_extra["token_ids"])
        said = answer.choices[0].model_extra["token_ids"]
        assert said == hf_greedy(hf_model(), sequence, 16)[:len(said)]
        assert len(said) == 16 or said[-1] == 0, "its max_tokens, or its end-of-text token"
    finally:
        for proc in reversed(procs):
            stop_group(proc)


def test_a_hand_off_the_busy_talker_cannot_take_by_its_deadline_is_refused_naming_why(tmp_path):
    """input.maxInputs 1: while the talker runs one long request made of a hand-off, the next
    hand-off waits for room until its transfer's deadline (1 s), then is refused: the client
    gets the talker's error saying it is busy, the thinker's transfer resolves, and the first
    request is answered."""
    configs = chain_configs([
        {"name": "thinker", "role": "ar"},
        {"name": "talker", "role": "ar", "input": {**TALKER_INPUT, "maxInputs": 1},
         "engineArgs": {"max-model-len": 1600}},
    ], pipeline="busy", timeout_seconds=1)
    with running(configs, tmp_path, env=ENV) as stages:
        talker = stages["talker"]
        got, threads = ask_all(stages["endpoint"], [[*TALK_LONGEST, 1, 2]])
        wait_until(lambda: metric_value(talker.metrics(), "vllm:num_requests_running") == 1,
                   60, "the talker to run the long request", interval=0.02)
        with pytest.raises(openai.APIStatusError) as err:
            client(stages["endpoint"]).completions.create(model=MODEL, prompt=[5, 6, 7],
                                                          max_tokens=4, temperature=0)
        assert err.value.body["stage"] == "talker"
        assert "is busy: 1 requests from hand-offs are in flight" in err.value.body["message"]
        for t in threads:
            # The talker says 1,500 tokens: under make test's load that once took over 60 s.
            t.join(300)
        assert 0 in got, "the long request was not answered within 300 s"
        assert not isinstance(got[0], openai.APIError), got[0]
        wait_until(lambda: transfers_settled(stages["thinker"]), 20, "the thinker's transfers")
