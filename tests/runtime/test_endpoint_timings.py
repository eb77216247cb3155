"""The endpoint's answer names every stage's times, whichever order their ends reach it in.

Over a streamed edge the first stage's own HTTP answer and the last stage's ``done`` race at
the endpoint (the first stage's last chunk goes out as it finishes). On real engines the
order is up to the machine's load (make test once had the talker's ``done`` first). Here a
stand-in first stage (a small aiohttp app; the endpoint is the part under test, and no real
engine can be made to lose the race on cue) fixes the order: it reports the last stage's
``taken``, ``output`` and ``done`` over the link, and only then answers.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
from aiohttp import web

from omni_runtime.pipeline import endpoint as endpoint_module
from omni_runtime.pipeline.protocol import LINK_TOKEN_HEADER, encode_event, link_url

from stand_in_stage import endpoint_before, origin_of

#: How long after the last stage's end an upstream stand-in reports its own: a stage slow to
#: report its end (its output processor busy), well inside the endpoint's grace.
UPSTREAM_LAG_S = 0.3


DONE = {"finish_reason": "length",
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


async def _ask(thinker, chain=("thinker", "talker")) -> tuple[dict, float]:
    """One request through ``chain`` whose first stage is a stand-in:
    ``thinker(session, endpoint, request_id, ended)`` reports what it likes over links and
    returns its answer (``ended`` is set once the client has its answer). Returns the
    client's answer and when it had it."""
    session = aiohttp.ClientSession()
    link_sessions: list[aiohttp.ClientSession] = []
    ended = asyncio.Event()

    async def thinker_completions(request: web.Request) -> web.Response:
        request_id, endpoint, token = origin_of(await request.json())
        # The stand-in's links present the request's token, as a stage's do.
        links = aiohttp.ClientSession(headers={LINK_TOKEN_HEADER: token})
        link_sessions.append(links)  # closed at the end: a stand-in's links may outlive it
        return await thinker(links, endpoint, request_id, ended)

    try:
        async with endpoint_before(thinker_completions, chain) as front_url:
            async with session.post(f"{front_url}/v1/completions",
                                    json={"model": "m", "prompt": [1, 2, 3],
                                          "max_tokens": 2}) as resp:
                assert resp.status == 200, await resp.text()
                answer = await resp.json()
            ended.set()
            return answer, time.time()
    finally:
        ended.set()
        await session.close()
        for links in link_sessions:
            await links.close()


def _answering_after_talker_done(lag_s: float | None, answered: list[float]):
    """A thinker that reports the talker's whole request, then answers ``lag_s`` later (or,
    when None, not before the client has its answer)."""
    async def thinker(session, endpoint, request_id, ended):
        async with session.ws_connect(link_url(endpoint, request_id, "talker")) as link:
            await link.send_str(encode_event("taken"))
            await link.send_str(encode_event("output", token_ids=[7, 8], text="hi"))
            await link.send_str(encode_event("done", **DONE))
        if lag_s is None:
            await ended.wait()
            return web.json_response({"error": "too late"}, status=500)
        await asyncio.sleep(lag_s)  # the modelled slowness, not a synchronisation
        answered.append(time.time())
        return web.json_response({"choices": [{"finish_reason": "length"}]})
    return thinker


def test_a_first_stage_answering_after_the_last_stages_done_still_has_its_end_timed():
    answered: list[float] = []
    answer, _ = asyncio.run(_ask(_answering_after_talker_done(UPSTREAM_LAG_S, answered)))
    assert answer["choices"][0]["text"] == "hi"
    assert answer["choices"][0]["token_ids"] == [7, 8]
    stages = answer["omni"]["stages"]
    # The endpoint waited for the thinker's answer: its end is in the answer, after the
    # talker's, and the talker's take before it (the streamed order the chain tests assert).
    assert answered, "the endpoint gave up on the thinker's answer"
    assert stages["thinker"]["finished_at"] >= stages["talker"]["finished_at"]
    assert stages["talker"]["taken_at"] < stages["thinker"]["finished_at"]


def test_a_first_stage_that_never_answers_delays_the_answer_by_the_grace_alone(monkeypatch):
    monkeypatch.setattr(endpoint_module, "HOP_GRACE_S", 0.5)
    started = time.time()
    answered: list[float] = []
    answer, finished = asyncio.run(_ask(_answering_after_talker_done(None, answered)))
    # The client has the talker's whole answer, once the grace has passed, without the
    # thinker's end (it never came).
    assert answer["choices"][0]["text"] == "hi"
    assert answer["usage"]["completion_tokens"] == 2
    assert not answered
    assert "finished_at" not in answer["omni"]["stages"]["thinker"]
    assert finished - started >= 0.5


def test_a_middle_stage_handing_off_after_the_last_stages_done_is_timed_and_not_aborted(
        caplog):
    caplog.set_level(logging.INFO, logger=endpoint_module.__name__)

    async def thinker(session, endpoint, request_id, ended):
        async def talker() -> None:
            async with session.ws_connect(link_url(endpoint, request_id, "talker")) as link:
                await link.send_str(encode_event("taken"))
                await vocoder_done.wait()
                await asyncio.sleep(UPSTREAM_LAG_S)  # the modelled slowness
                await link.send_str(encode_event("handed_off", to=["vocoder"]))

        async def vocoder() -> None:
            async with session.ws_connect(link_url(endpoint, request_id, "vocoder")) as link:
                await link.send_str(encode_event("taken"))
                await link.send_str(encode_event("payload", payload={"tokens": 2}))
            vocoder_done.set()

        vocoder_done = asyncio.Event()
        # The thinker has finished (the endpoint expects its talker), and both later
        # stages report as they would on a streamed chain: the vocoder stores its payload
        # before the talker's own end reaches the endpoint.
        asyncio.get_running_loop().call_soon(
            lambda: tasks.extend([asyncio.ensure_future(talker()),
                                  asyncio.ensure_future(vocoder())]))
        return web.json_response({"choices": [{"finish_reason": "length"}]})

    tasks: list[asyncio.Future] = []

    async def run() -> dict:
        answer, _ = await _ask(thinker, chain=("thinker", "talker", "vocoder"))
        await asyncio.gather(*tasks, return_exceptions=True)
        return answer

    answer = asyncio.run(run())
    stages = answer["omni"]["stages"]
    assert answer["choices"][0]["omni_payload"] == {"stage": "vocoder", "tokens": 2}
    assert stages["talker"]["finished_at"] >= stages["vocoder"]["stored_at"]
    # Nothing was aborted: every stage had finished its part.
    assert not [r.message for r in caplog.records if "aborting" in r.message]
