"""A real ``PipelineEndpoint`` in front of a stand-in first stage, for tests of the endpoint.

The stand-in is a small aiohttp app whose handler the test writes (it records what reaches it
and reports over links what a stage would): the endpoint is the part under test, and no real
engine can be made to answer in a chosen order or with a chosen body on cue.
"""

from __future__ import annotations

import socket
from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, Callable

from aiohttp import web

from omni_runtime.pipeline.endpoint import PipelineEndpoint, parse_endpoint_config
from omni_runtime.pipeline.protocol import KV_PARAMS_KEY, origin_token, parse_origin

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


def origin_of(body: dict) -> tuple[str, str, str]:
    """The request id, the endpoint's URL and the request's link token that the endpoint put
    in the body it sent its first stage."""
    origin = body["kv_transfer_params"][KV_PARAMS_KEY]
    request_id, endpoint = parse_origin(origin)
    return request_id, endpoint, origin_token(origin)


@asynccontextmanager
async def endpoint_before(first_stage: Handler, chain: tuple[str, ...] = ("thinker", "talker"),
                          kind: str = "completions") -> AsyncIterator[str]:
    """The URL of an endpoint for ``chain`` (every edge 30 s) whose first stage is served by
    ``first_stage`` on its OpenAI path for ``kind``; both servers stop on leaving."""
    app = web.Application()
    app.router.add_post(f"/v1/{'chat/' if kind == 'chat' else ''}completions", first_stage)
    runners: list[web.AppRunner] = []
    try:
        stage_sock, front_sock = _listening(), _listening()
        front_url = "http://127.0.0.1:%d" % front_sock.getsockname()[1]
        front = PipelineEndpoint(parse_endpoint_config("p", "m", {
            "entry": {"stage": chain[0], "url": "http://127.0.0.1:%d" % stage_sock.getsockname()[1]},
            "sink": chain[-1],
            "edges": [{"from": a, "to": b, "timeoutSeconds": 30} for a, b in zip(chain, chain[1:])],
            "advertise": front_url}))
        for served, sock in ((app, stage_sock), (front.app, front_sock)):
            runner = web.AppRunner(served)
            runners.append(runner)
            await runner.setup()
            await web.SockSite(runner, sock).start()
        yield front_url
    finally:
        for runner in reversed(runners):
            await runner.cleanup()
