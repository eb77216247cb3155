"""What a pipeline of several stages cannot carry is refused at its endpoint, before any stage
holds the request, naming the parameter; what the first stage would refuse only because the
endpoint asks it differently from the client is not sent to it.

A stand-in first stage (a small aiohttp app that records what reaches it: the endpoint is the
part under test) answers every request as a thinker that handed its request off would, and a
stand-in talker reports the pipeline's answer over its link. On real engines: a stop string
ended the thinker's request by an abort (vLLM's API server matches stop strings and aborts
the request in the engine), so no hand-off went and the client had a 504 after the edge's
10 s deadline (a run of examples/tiny-omni-streaming.yaml showed it); ``stream_options``
with ``"stream": true`` was refused by the thinker, which the endpoint asks without a stream.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from omni_runtime.pipeline.endpoint import EndpointConfigError, PipelineEndpoint, parse_endpoint_config
from omni_runtime.pipeline.protocol import CLOSE_WRONG_TOKEN, LINK_TOKEN_HEADER, encode_event, link_url

from stand_in_stage import endpoint_before, origin_of

DONE = {"finish_reason": "length", "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


async def _through(bodies: list[dict], chain: tuple[str, ...] = ("thinker", "talker"),
                   kind: str = "completions") -> list[tuple[int, dict | str]]:
    """Each body sent in turn to an endpoint in front of ``chain``, whose first stage is a
    stand-in recording what reaches it (``bodies`` is replaced by what reached it)."""
    session = aiohttp.ClientSession()
    received: list[dict] = []

    async def thinker(request: web.Request) -> web.Response:
        body = await request.json()
        received.append(body)
        if len(chain) == 1:  # the one stage: its answer is the client's
            return web.json_response({"choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]})
        request_id, endpoint, token = origin_of(body)
        async with session.ws_connect(link_url(endpoint, request_id, chain[-1]),
                                      headers={LINK_TOKEN_HEADER: token}) as link:
            await link.send_str(encode_event("taken"))
            await link.send_str(encode_event("output", token_ids=[7, 8], text="hi"))
            await link.send_str(encode_event("done", **DONE))
        return web.json_response({"choices": [{"finish_reason": "length"}]})

    answers = []
    try:
        async with endpoint_before(thinker, chain, kind) as front_url:
            path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
            for body in bodies:
                async with session.post(front_url + path, json=body) as resp:
                    text = await resp.text()
                    answers.append((resp.status, await resp.json() if "json" in resp.content_type else text))
    finally:
        await session.close()
    bodies[:] = received
    return answers


async def _one_request(first_stage) -> tuple[int, dict]:
    """One completion through an endpoint whose first stage is ``first_stage(session)`` (the
    client session its links use): (the status, the answer's JSON)."""
    session = aiohttp.ClientSession()
    try:
        async with endpoint_before(first_stage(session)) as front_url:
            async with session.post(front_url + "/v1/completions",
                                    json={"model": "m", "prompt": "hi", "max_tokens": 2}) as resp:
                return resp.status, await resp.json()
    finally:
        await session.close()


@pytest.mark.parametrize("body, param", [
    ({"stop": ["a", "e"]}, "stop"),
    ({"stop": "\n"}, "stop"),
    ({"n": 2}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"prompt": ["one", "two"]}, "prompt"),
    ({"prompt": [[1, 2], [3, 4]]}, "prompt"),
])
def test_what_cannot_go_past_the_first_stage_is_refused_at_the_door(body, param):
    sent = [{"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, **body}]
    [(status, answer)] = asyncio.run(_through(sent))
    assert status == 400, answer
    assert answer["error"]["param"] == param and param in answer["error"]["message"]
    assert sent == [], "nothing reached the first stage"


@pytest.mark.parametrize("stop", [5, {"a": 1}, ["a", 3]])
def test_a_stop_that_is_no_string_is_refused_as_such(stop):
    """``"stop": 5`` was refused with the stop-strings message (an outside review): it says
    what stop must be, as vLLM's validation does."""
    sent = [{"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, "stop": stop}]
    [(status, answer)] = asyncio.run(_through(sent))
    assert status == 400 and answer["error"]["param"] == "stop", answer
    assert answer["error"]["message"].startswith("stop must be a string or a list of strings"), answer


def test_what_can_go_past_it_goes_and_a_one_stage_pipeline_takes_anything():
    # One token-id prompt, one string in a list, n=1, an empty stop list, stop token ids.
    fine = [{"model": "m", "prompt": [1, 2, 3], "max_tokens": 2},
            {"model": "m", "prompt": ["one"], "max_tokens": 2, "n": 1, "stop": [],
             "stop_token_ids": [2]}]
    answers = asyncio.run(_through(fine))
    assert [status for status, _ in answers] == [200, 200], answers
    assert [a["choices"][0]["text"] for _, a in answers] == ["hi", "hi"]
    # A pipeline of one stage: the stage's own answer, whatever vLLM takes.
    alone = [{"model": "m", "prompt": ["one", "two"], "max_tokens": 2, "n": 2, "stop": ["a"]}]
    [(status, answer)] = asyncio.run(_through(alone, chain=("thinker",)))
    assert status == 200 and answer["choices"][0]["text"] == "ok", answer
    assert alone[0]["stop"] == ["a"] and alone[0]["n"] == 2


def test_stream_options_of_a_streamed_request_are_not_sent_to_a_first_stage_asked_without_a_stream():
    sent = [{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
             "stream": True, "stream_options": {"include_usage": True}}]
    [(status, answer)] = asyncio.run(_through(sent, kind="chat"))
    assert status == 200, answer
    assert "data: [DONE]" in answer and '"error"' not in answer
    [forwarded] = sent
    assert forwarded["stream"] is False and "stream_options" not in forwarded


def test_a_link_without_the_requests_token_is_refused_and_the_request_goes_on():
    """The links' path is on the clients' port and a request id can be a client's own
    X-Request-Id: a link that does not present the request's token (which only its origin
    carries, to the stages) is closed at once; it neither reports for the stage nor loses the
    request (one such link closing used to fail the request as lost; one could have put its
    own output in another client's answer)."""
    async def go():
        session = aiohttp.ClientSession()
        rogue_closes = []

        async def thinker(request: web.Request) -> web.Response:
            request_id, endpoint, token = origin_of(await request.json())
            assert token and len(token) >= 24
            url = link_url(endpoint, request_id, "talker")
            for headers in ({}, {LINK_TOKEN_HEADER: "guessed"}):
                async with session.ws_connect(url, headers=headers) as rogue:
                    await rogue.send_str(encode_event("output", token_ids=[666], text="injected"))
                    await rogue.receive(timeout=10)
                    rogue_closes.append(rogue.close_code)
            async with session.ws_connect(url, headers={LINK_TOKEN_HEADER: token}) as link:
                await link.send_str(encode_event("taken"))
                await link.send_str(encode_event("output", token_ids=[7, 8], text="hi"))
                await link.send_str(encode_event("done", **DONE))
            return web.json_response({"choices": [{"finish_reason": "length"}]})

        try:
            async with endpoint_before(thinker) as front_url:
                async with session.post(front_url + "/v1/completions", headers={"X-Request-Id": "known-id"},
                                        json={"model": "m", "prompt": [1], "max_tokens": 2}) as resp:
                    return resp.status, await resp.json(), rogue_closes
        finally:
            await session.close()

    status, answer, closes = asyncio.run(go())
    assert closes == [CLOSE_WRONG_TOKEN, CLOSE_WRONG_TOKEN]
    assert status == 200, answer
    assert answer["choices"][0]["text"] == "hi" and answer["choices"][0]["token_ids"] == [7, 8]


@pytest.mark.parametrize("chain", [("thinker", "talker"), ("thinker",)])
@pytest.mark.parametrize("body, param", [
    ({"kv_transfer_params": "abc"}, "kv_transfer_params"),
    ({"kv_transfer_params": [1, 2]}, "kv_transfer_params"),
    ({"kv_transfer_params": 5}, "kv_transfer_params"),
    ({"stream": "maybe"}, "stream"),
    ({"stream": 7}, "stream"),
    # vLLM refuses these too; the endpoint asks the first stage without them.
    ({"stream": True, "stream_options": "x"}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": 3}}, "stream_options.continuous_usage_stats"),
])
def test_what_the_endpoint_itself_cannot_read_is_refused_naming_it(chain, body, param):
    """A field the endpoint acts on must read as vLLM reads it, in a pipeline of any size: a
    ``kv_transfer_params`` that is not an object (the endpoint adds the request's origin to
    it) once left the request waiting, answered by nothing, until the request's timeout."""
    sent = [{"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, **body}]
    [(status, answer)] = asyncio.run(_through(sent, chain=chain))
    assert status == 400, answer
    assert answer["error"]["param"] == param and param in answer["error"]["message"]
    assert sent == [], "nothing reached the first stage"


def test_fields_read_as_vllm_reads_them():
    """vLLM's request model reads "false" as false and "2" as 2 (pydantic, lax): so does the
    endpoint, or it would answer a stream the first stage was not asked for, or send a
    request of two outputs past it."""
    sent = [{"model": "m", "prompt": [1], "max_tokens": 2, "stream": "false"},
            {"model": "m", "prompt": [1], "max_tokens": 2, "n": "2"},
            {"model": "m", "prompt": [1], "max_tokens": 2, "kv_transfer_params": None}]
    answers = asyncio.run(_through(sent))
    assert answers[0][0] == 200 and answers[0][1]["choices"][0]["text"] == "hi", answers[0]
    assert answers[1][0] == 400 and answers[1][1]["error"]["param"] == "n", answers[1]
    assert answers[2][0] == 200, answers[2]
    assert len(sent) == 2


def test_a_failure_of_the_endpoint_itself_fails_that_request_at_once(monkeypatch):
    """A bug in asking the first stage (here: the request's origin cannot be made) fails that
    request with a 500 naming it, instead of leaving it to wait for its timeout; the next
    request is served."""
    import omni_runtime.pipeline.endpoint as endpoint_module

    real = endpoint_module.origin
    calls = []

    def origin(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real(*args, **kw)

    monkeypatch.setattr(endpoint_module, "origin", origin)
    sent = [{"model": "m", "prompt": [1], "max_tokens": 2}] * 2
    answers = asyncio.run(asyncio.wait_for(_through(sent), 30))
    message = answers[0][1]["error"]["message"]
    assert answers[0][0] == 500 and "RuntimeError" in message and "injected" not in message  # the log has it
    assert answers[1][0] == 200 and answers[1][1]["choices"][0]["text"] == "hi", answers[1]


def test_connections_to_the_first_stage_are_not_kept_past_vllms_keep_alive():
    """A connection the first stage's server is closing must not be re-used: a request sent
    on it fails ("Server disconnected"; seen under load after an idle pause), and is not sent
    twice. The endpoint lets its connections go before vLLM's server does."""
    import vllm.envs

    from omni_runtime.pipeline.endpoint import ENTRY_KEEPALIVE_S

    async def session_keepalive():
        front = PipelineEndpoint(parse_endpoint_config("p", "m", {
            "entry": {"stage": "a", "url": "http://127.0.0.1:1"}, "sink": "a",
            "advertise": "http://127.0.0.1:2"}))
        await front._start(front.app)
        try:
            return front._session.connector._keepalive_timeout
        finally:
            await front._stop(front.app)

    assert asyncio.run(session_keepalive()) == ENTRY_KEEPALIVE_S
    assert ENTRY_KEEPALIVE_S < vllm.envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE


def test_the_endpoint_knows_which_edges_stream():
    """A missed take names what was not taken: a stream or a hand-off (a fault run saw a
    streamed edge's reported as a hand-off)."""
    config = parse_endpoint_config("p", "m", {
        "entry": {"stage": "a", "url": "http://127.0.0.1:1"}, "sink": "c", "advertise": "http://127.0.0.1:2",
        "edges": [{"from": "a", "to": "b", "timeoutSeconds": 10, "mode": "stream", "stream": {}},
                  {"from": "b", "to": "c", "timeoutSeconds": 10}]})
    assert [(e.target, e.streamed) for e in config.edges] == [("b", True), ("c", False)]


@pytest.mark.parametrize("kind, body, param", [
    ("completions", {"logprobs": 2}, "logprobs"),
    ("completions", {"logprobs": 0}, "logprobs"),  # the sampled token's
    ("completions", {"logprobs": False}, "logprobs"),  # vLLM reads it as 0
    ("completions", {"echo": True}, "echo"),
    ("completions", {"echo": "yes"}, "echo"),
    ("completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 2}, "logprobs"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_what_only_the_answers_own_stage_could_give_is_refused_naming_it(kind, body, param):
    """A pipeline's answer is its last stage's output, sampled with that stage's parameters:
    logprobs or an echo asked of it went to the first stage only and came back silently
    absent (an outside review with the openai client); stream_options without a stream is
    vLLM's own 400, which the first stage, asked without a stream, never saw."""
    request = {"model": "m", "max_tokens": 2, **body}
    request.update({"messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else {"prompt": [1]})
    sent = [request]
    [(status, answer)] = asyncio.run(_through(sent, kind="chat" if kind == "chat" else "completions"))
    assert status == 400 and answer["error"]["param"] == param, answer
    assert sent == []


@pytest.mark.parametrize("kind, body", [
    ("completions", {"echo": 0}), ("completions", {"echo": "false"}), ("completions", {"logprobs": None}),
    ("chat", {"logprobs": 0}), ("chat", {"top_logprobs": 0}), ("chat", {"echo": False}),
])
def test_what_asks_nothing_of_the_answer_goes_on(kind, body):
    """As vLLM's request model reads them, these ask nothing of the answer's tokens (``echo:
    0`` was refused)."""
    request = {"model": "m", "max_tokens": 2, **body}
    request.update({"messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else {"prompt": [1]})
    sent = [request]
    [(status, answer)] = asyncio.run(_through(sent, kind="chat" if kind == "chat" else "completions"))
    assert status == 200, answer
    assert len(sent) == 1  # it reached the first stage


def test_a_streamed_request_the_first_stage_refuses_is_its_plain_error():
    """The client's stream begins once a stage past the first holds the request: a refusal
    by the first stage is an HTTP error with its status (the openai client raises
    BadRequestError), not a 200 whose one event is the error."""
    async def refusing(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "max_tokens is too large", "type": "BadRequestError",
                                            "param": "max_tokens", "code": 400}}, status=400)

    async def go():
        async with endpoint_before(refusing) as front_url, aiohttp.ClientSession() as session:
            async with session.post(front_url + "/v1/completions", headers={"X-Request-Id": "r-1"}, json={
                    "model": "m", "prompt": [1], "max_tokens": 10 ** 6, "stream": True}) as resp:
                return resp.status, resp.content_type, await resp.json(), resp.headers.get("X-Request-Id")

    status, content_type, answer, request_id = asyncio.run(go())
    assert (status, content_type, request_id) == (400, "application/json", "r-1")
    assert "max_tokens is too large" in answer["error"]["message"]
    assert answer["error"]["param"] == "max_tokens"  # the stage's, kept


def test_a_stream_has_usage_only_when_asked_in_a_last_chunk_and_says_the_role_once():
    async def go(options):
        sent = [{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                 "stream": True, **options}]
        [(status, text)] = await _through(sent, kind="chat")
        assert status == 200, text
        return [json.loads(line[6:]) for line in text.splitlines()
                if line.startswith("data: {")], text

    plain, text = asyncio.run(go({}))
    assert text.rstrip().endswith("data: [DONE]")
    assert not any("usage" in c for c in plain)
    assert [c["choices"][0]["delta"].get("role") for c in plain] == ["assistant"] + [None] * (len(plain) - 1)
    asked, _ = asyncio.run(go({"stream_options": {"include_usage": True}}))
    assert asked[-1]["choices"] == [] and asked[-1]["usage"] == DONE["usage"]
    assert not any("usage" in c for c in asked[:-1])


def test_a_refusal_at_the_door_echoes_the_clients_request_id():
    async def never_asked(request: web.Request) -> web.Response:
        raise AssertionError("the first stage was asked")

    async def go():
        async with endpoint_before(never_asked) as front_url, aiohttp.ClientSession() as session:
            async with session.post(front_url + "/v1/completions", headers={"X-Request-Id": "mine-1"},
                                    json={"model": "m", "prompt": [1], "n": 2}) as resp:
                return resp.status, resp.headers.get("X-Request-Id")

    assert asyncio.run(go()) == (400, "mine-1")


@pytest.mark.parametrize("request_id, why", [
    ("x" * 1025, "1 to 1000 characters"),
    ("x" * 1001, "1 to 1000 characters"),  # vLLM's id of it would pass the wire's 1,024
    (".", "may not be '.'"),
    ("..", "may not be '..'"),
    ("caf\xe9", "ASCII"),  # not UTF-8
    # UTF-8, not ASCII (the header's bytes as sent): vLLM's server reads a header as Latin-1,
    # so the first stage knew it by another id, and past ~1,008 bytes the hand-off's id was
    # over the wire's bound: a 504 blaming the next stage, 12 s on (an outside review).
    ("caf\xc3\xa9", "ASCII"),
    ("\xc3\xa9" * 505, "ASCII"),
])
def test_an_x_request_id_no_stage_can_carry_is_refused_at_the_door(request_id, why):
    """An outside review: an id over the origin's bound, or ``.`` or ``..`` (a link path
    segment the link's URL loses), failed at the edge's deadline as a 504 naming no cause;
    one not UTF-8 failed as a 500. Each is now a 400 naming X-Request-Id, and no stage is asked."""
    async def never_asked(request: web.Request) -> web.Response:
        raise AssertionError("the first stage was asked")

    async def go():
        async with endpoint_before(never_asked) as front_url:
            host, port = front_url.split("//")[1].split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            body = b'{"model": "m", "prompt": [1], "max_tokens": 2}'
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + b"X-Request-Id: " + request_id.encode("latin-1") + b"\r\nConnection: close\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            await writer.drain()
            raw = await reader.read()
            writer.close()
            return raw

    raw = asyncio.run(go())
    head, _, answer = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), raw[:300]
    error = json.loads(answer)["error"]
    assert error["param"] == "X-Request-Id" and why in error["message"], error


def test_what_is_no_json_request_is_refused_as_vllm_refuses_it_in_json():
    """A body that is not JSON, a Content-Type other than JSON (vLLM's 400), a body over the
    endpoint's size limit, a path or method it does not serve: each an OpenAI-shaped JSON
    error carrying the client's X-Request-Id (aiohttp's own were plain text), no stage asked."""
    async def never_asked(request: web.Request) -> web.Response:
        raise AssertionError("the first stage was asked")

    async def go():
        answers = []
        headers = {"X-Request-Id": "door-1"}
        async with endpoint_before(never_asked) as front_url, aiohttp.ClientSession() as session:
            for method, path, kwargs in [
                    ("POST", "/v1/completions", {"data": b"{not json", "headers": {"Content-Type": "application/json"}}),
                    ("POST", "/v1/completions", {"data": b'{"model": "m", "prompt": [1]}',
                                                 "headers": {"Content-Type": "text/plain"}}),
                    ("POST", "/v1/completions", {"data": b"x" * ((16 << 20) + 1),
                                                 "headers": {"Content-Type": "application/json"}}),
                    ("GET", "/v1/completions", {}),
                    ("POST", "/v1/nothing", {"json": {}})]:
                kwargs["headers"] = {**headers, **kwargs.get("headers", {})}
                async with session.request(method, front_url + path, **kwargs) as resp:
                    answers.append((resp.status, resp.content_type, resp.headers.get("X-Request-Id"),
                                    (await resp.json())["error"]["message"]))
        return answers

    answers = asyncio.run(go())
    assert [a[0] for a in answers] == [400, 400, 413, 405, 404], answers
    assert all(kind == "application/json" and rid == "door-1" for _, kind, rid, _ in answers), answers
    assert "must be a JSON object" in answers[0][3]
    assert answers[1][3] == "Unsupported Media Type: Only 'application/json' is allowed"


def test_a_body_nested_too_deeply_or_not_in_its_content_encoding_is_a_400_and_a_bom_is_taken(caplog):
    """JSON nested 5,000 deep and a body that is not the gzip its Content-Encoding says were
    aiohttp's plain-text 500s with a traceback at ERROR (an outside review); a byte-order mark
    before the JSON was refused, which vLLM's server takes."""
    asked = []

    async def stage(request: web.Request) -> web.Response:
        asked.append(await request.json())
        return web.json_response({"error": {"message": "enough"}}, status=400)

    async def go():
        answers = []
        async with endpoint_before(stage) as front_url, aiohttp.ClientSession() as session:
            for data, headers in [
                    (b'{"model": "m", "prompt": [1], "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}", {}),
                    (b'{"model": "m", "prompt": [1]}', {"Content-Encoding": "gzip"}),
                    (b'\xef\xbb\xbf{"model": "m", "prompt": [1], "max_tokens": 2}', {})]:
                async with session.post(front_url + "/v1/completions", data=data, headers={
                        "Content-Type": "application/json", "X-Request-Id": "door-2", **headers}) as resp:
                    answers.append((resp.status, resp.content_type, (await resp.json())["error"]["message"]))
        return answers

    deep, gzip, bom = asyncio.run(go())
    assert deep[:2] == (400, "application/json") and "nested too deeply" in deep[2], deep
    assert gzip[:2] == (400, "application/json") and "Content-Encoding" in gzip[2], gzip
    assert bom[2] == "stage thinker: enough" and asked == [{"model": "m", "prompt": [1], "max_tokens": 2, **asked[0]}]
    assert "Traceback" not in caplog.text and "Error handling request" not in caplog.text


def test_a_stream_that_fails_after_it_began_ends_with_its_error_then_done():
    """A streamed answer whose pipeline fails once the events have begun: the error is an
    event, then ``data: [DONE]``, as vLLM's server ends it (clients reading to [DONE] saw a
    dropped connection: an outside review)."""
    session_box = {}

    async def thinker(request: web.Request) -> web.Response:
        request_id, endpoint, token = origin_of(await request.json())
        async with session_box["s"].ws_connect(link_url(endpoint, request_id, "talker"),
                                               headers={LINK_TOKEN_HEADER: token}) as link:
            await link.send_str(encode_event("taken"))
            await link.send_str(encode_event("error", message="over this stage's max-model-len"))
        return web.json_response({"choices": [{"finish_reason": "length"}]})

    async def go():
        async with aiohttp.ClientSession() as session:
            session_box["s"] = session
            async with endpoint_before(thinker) as front_url:
                async with session.post(front_url + "/v1/completions", json={
                        "model": "m", "prompt": [1], "max_tokens": 2, "stream": True}) as resp:
                    return resp.status, await resp.text()

    status, text = asyncio.run(go())
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]", text
    assert json.loads(events[-2])["error"]["stage"] == "talker", text


@pytest.mark.parametrize("bad", [
    {"event": "error", "status": "abc"}, {"event": "error", "status": 1000}, {"event": "error", "status": 200},
    {"event": "error", "status": True}, {"event": "payload", "payload": [1, 2]},
    {"event": "output", "text": 5}, {"event": "output", "token_ids": 5},
])
def test_a_malformed_event_of_a_stage_fails_its_request_naming_the_stage(bad):
    """A stage's link event of a known kind with fields of the wrong type (a stage's bug) was
    a 500 with a traceback, or an HTTP status line the client could not read (an outside
    review): the request now fails as that stage's error, a 502."""
    session_box = {}

    async def thinker(request: web.Request) -> web.Response:
        body = await request.json()
        request_id, endpoint, token = origin_of(body)
        async with session_box["s"].ws_connect(link_url(endpoint, request_id, "talker"),
                                               headers={LINK_TOKEN_HEADER: token}) as link:
            await link.send_str(encode_event("taken"))
            await link.send_str(json.dumps(bad))
        return web.json_response({"choices": [{"finish_reason": "length"}]})

    async def go():
        async with aiohttp.ClientSession() as session:
            session_box["s"] = session
            async with endpoint_before(thinker) as front_url:
                async with session.post(front_url + "/v1/completions",
                                        json={"model": "m", "prompt": [1], "max_tokens": 2}) as resp:
                    return resp.status, await resp.json()

    status, answer = asyncio.run(go())
    assert status == 502, answer
    assert answer["error"]["stage"] == "talker" and "malformed event" in answer["error"]["message"], answer


def test_a_link_token_that_is_not_utf8_is_a_wrong_token():
    """A link whose token header is not UTF-8 broke the link handler (a traceback, no close
    code): it is refused as any wrong token is (4403), and the request goes on."""
    async def thinker(request: web.Request) -> web.Response:
        body = await request.json()
        request_id, endpoint, token = origin_of(body)
        host, port = endpoint.split("//")[1].split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET " + link_url(endpoint, request_id, "talker").split(port, 1)[1].encode()
                     + b" HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                     b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
                     + LINK_TOKEN_HEADER.encode() + b": \xff\xfe\r\n\r\n")
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        frame = await reader.read(2)  # a close frame: opcode 8
        rest = await reader.read(2)
        writer.close()
        request.app["seen"] = (head.split(b"\r\n")[0], frame[0] & 0x0F, int.from_bytes(rest, "big"))
        return web.json_response({"error": {"message": "done", "param": None}}, status=400)

    async def go():
        apps = {}

        async def first(request):
            apps["app"] = request.app
            return await thinker(request)

        async with endpoint_before(first) as front_url, aiohttp.ClientSession() as session:
            async with session.post(front_url + "/v1/completions",
                                    json={"model": "m", "prompt": [1], "max_tokens": 2}) as resp:
                await resp.read()
        return apps["app"]["seen"]

    status_line, opcode, code = asyncio.run(go())
    assert status_line.startswith(b"HTTP/1.1 101") and opcode == 8 and code == 4403, (status_line, opcode, code)


def test_a_client_that_goes_away_mid_stream_ends_its_request_with_no_error_logged(caplog):
    """The client closes its connection after the first chunk while the stage still sends: the
    endpoint's next write finds the connection gone, the request is aborted at its stage, and
    nothing is logged as an error (it was aiohttp's "Error handling request" with a traceback,
    at ERROR: an outside review under real clients)."""
    import logging

    caplog.set_level(logging.INFO)

    async def go():
        session = aiohttp.ClientSession()
        client_gone, aborted = asyncio.Event(), asyncio.Event()
        said: list[str] = []

        async def thinker(request: web.Request) -> web.Response:
            request_id, endpoint, token = origin_of(await request.json())
            async with session.ws_connect(link_url(endpoint, request_id, "talker"),
                                          headers={LINK_TOKEN_HEADER: token}) as link:
                await link.send_str(encode_event("taken"))
                await link.send_str(encode_event("output", token_ids=[7], text="a"))
                await client_gone.wait()
                # Output keeps coming until the endpoint aborts the request here.
                while not link.closed:
                    await link.send_str(encode_event("output", token_ids=[8], text="b"))
                    try:  # between two outputs: has the endpoint said anything?
                        message = await link.receive(timeout=0.05)
                    except asyncio.TimeoutError:
                        continue
                    if message.type == aiohttp.WSMsgType.TEXT:
                        said.append(json.loads(message.data)["event"])
                        break
                aborted.set()
            return web.json_response({"choices": [{"finish_reason": "length"}]})

        try:
            async with endpoint_before(thinker) as front_url:
                client = aiohttp.ClientSession()
                resp = await client.post(front_url + "/v1/completions",
                                         json={"model": "m", "prompt": "hi", "max_tokens": 99, "stream": True})
                while not (await resp.content.readline()).startswith(b"data: {"):
                    pass
                resp.close()
                await client.close()
                client_gone.set()
                await asyncio.wait_for(aborted.wait(), 30)
        finally:
            await session.close()
        return said

    said = asyncio.run(go())
    assert said == ["abort"]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]


def test_a_stage_link_that_answers_no_heartbeat_is_lost_after_about_the_edges_deadline(monkeypatch):
    """The links' ping interval follows the edges' deadlines (two thirds of the longest, at
    least HEARTBEAT_S): a stage frozen for 9 s with 30 s deadlines lost every request at the
    fixed 5 s interval (an outside review). A link that answers no ping is still lost, the
    client told why."""
    from omni_runtime.pipeline.endpoint import Edge
    from omni_runtime.pipeline.protocol import HEARTBEAT_S

    config = parse_endpoint_config("p", "m", {
        "entry": {"stage": "thinker", "url": "http://127.0.0.1:1"}, "sink": "talker",
        "edges": [{"from": "thinker", "to": "talker", "timeoutSeconds": 30}], "advertise": "http://127.0.0.1:2"})
    assert config.link_heartbeat_s == 20
    short = parse_endpoint_config("p", "m", {
        "entry": {"stage": "thinker", "url": "http://127.0.0.1:1"}, "sink": "talker",
        "edges": [{"from": "thinker", "to": "talker", "timeoutSeconds": 1}], "advertise": "http://127.0.0.1:2"})
    assert short.link_heartbeat_s == HEARTBEAT_S and isinstance(short.edges[0], Edge)
    # A streamed edge: its gap is how long its stages may sit between chunks (a 12 s stall
    # under a 15 s gap lost the requests at the 10 s transfer deadline's interval: an
    # outside review), and the consumer takes the stream by its first-chunk deadline.
    streamed = parse_endpoint_config("p", "m", {
        "entry": {"stage": "thinker", "url": "http://127.0.0.1:1"}, "sink": "talker",
        "edges": [{"from": "thinker", "to": "talker", "timeoutSeconds": 10, "mode": "stream",
                   "stream": {"firstChunkSeconds": 12, "gapSeconds": 24}}],
        "advertise": "http://127.0.0.1:2"})
    assert streamed.link_heartbeat_s == 16 and streamed.edges[0].timeout_s == 12
    assert streamed.edges[0].deadline_name == "the stream's first-chunk deadline"
    with pytest.raises(EndpointConfigError, match=r"endpoint.edges\[0\].stream.gapSeconds must be a positive"):
        parse_endpoint_config("p", "m", {
            "entry": {"stage": "thinker", "url": "http://127.0.0.1:1"}, "sink": "talker",
            "edges": [{"from": "thinker", "to": "talker", "timeoutSeconds": 10, "mode": "stream",
                       "stream": {"gapSeconds": float("nan")}}], "advertise": "http://127.0.0.1:2"})

    def thinker(session: aiohttp.ClientSession):
        async def handler(request: web.Request) -> web.Response:
            request_id, endpoint, token = origin_of(await request.json())
            # A stage that stops answering pings (frozen): its link is open, and silent.
            link = await session.ws_connect(link_url(endpoint, request_id, "talker"),
                                            headers={LINK_TOKEN_HEADER: token}, autoping=False)
            await link.send_str(encode_event("taken"))
            await link.receive()  # what the endpoint sends (its pings go unanswered)
            return web.json_response({"choices": [{"finish_reason": "length"}]})
        return handler

    from omni_runtime.pipeline.endpoint import EndpointConfig

    monkeypatch.setattr(EndpointConfig, "link_heartbeat_s", property(lambda self: 0.2))  # not 20 s in a test
    status, body = asyncio.run(_one_request(thinker))
    assert status == 502, body
    assert "the stage exited, or answered no heartbeat for 0.3s" in body["error"]["message"], body


@pytest.mark.parametrize("at_fault, named", [("thinker", "thinker"), ("nowhere", "talker"), (None, "talker")])
def test_a_stage_reporting_its_producers_failure_names_the_producer(at_fault, named):
    """A consumer whose producer stopped sending reports the failure, naming the producer as
    the stage at fault: the client's error names the stage that stalled, not the one waiting
    for it (an outside review: a stalled talker was reported as the vocoder's fault). A stage
    the pipeline does not have is not taken from a report."""
    def thinker(session: aiohttp.ClientSession):
        async def handler(request: web.Request) -> web.Response:
            request_id, endpoint, token = origin_of(await request.json())
            async with session.ws_connect(link_url(endpoint, request_id, "talker"),
                                          headers={LINK_TOKEN_HEADER: token}) as link:
                await link.send_str(encode_event("taken"))
                fields = {"stage": at_fault} if at_fault else {}
                await link.send_str(encode_event("error", message="its stream to stage talker failed: expired",
                                                 **fields))
            return web.json_response({"choices": [{"finish_reason": "length"}]})
        return handler

    status, body = asyncio.run(_one_request(thinker))
    assert status == 502 and body["error"]["stage"] == named, body
    assert body["error"]["message"].startswith(f"stage {named}: its stream to stage talker failed"), body
    assert ("(reported by stage talker)" in body["error"]["message"]) == (named != "talker"), body
