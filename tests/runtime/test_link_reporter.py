"""A receiving stage's links to the pipeline's endpoint (LinkReporter), against a real aiohttp
WebSocket server standing in for the endpoint's link route: a stream's link opens when its
first chunk is taken, saying so, and stays open (answering pings) until its end is reported
on it. An outside review stopped a receiving last stage mid-stream: it held no link, so no
ping missed it, and the client's error came only when it was resumed, blaming another
stage."""
from __future__ import annotations

import asyncio
import json
import threading

from aiohttp import WSMsgType, web

from omni_runtime.pipeline.link import LinkReporter
from procs import wait_until


class LinkRoute:
    """An aiohttp server on its own thread taking every link: what each link said, and
    whether it is still open."""

    def __init__(self) -> None:
        self.links: list[dict] = []
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/{tail:.*}", self._link)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self._ready.set()
        self._loop.run_forever()

    async def _link(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        link = {"path": request.path, "events": [], "open": True, "ws": ws}
        self.links.append(link)
        async for message in ws:
            if message.type == WSMsgType.TEXT:
                link["events"].append(json.loads(message.data)["event"])
        link["open"] = False
        return ws

    def drop(self, link: dict) -> None:
        asyncio.run_coroutine_threadsafe(link["ws"].close(), self._loop).result(5)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def test_a_held_link_says_taken_at_once_stays_open_and_carries_the_end():
    route, reporter = LinkRoute(), LinkReporter("vocoder")
    try:
        reporter.hold("k", route.url, "r1", [("taken", {"taken_at": 1.0})])
        wait_until(lambda: route.links and route.links[0]["events"] == ["taken"], 10, "taken said")
        assert route.links[0]["open"]  # held while the stream runs
        assert reporter.report(route.url, "r1", [("payload", {"payload": {}})], key="k",
                               opening=[("taken", {})]).result(10)
        wait_until(lambda: not route.links[0]["open"], 10, "the link closed after the end")
        assert route.links[0]["events"] == ["taken", "payload"] and len(route.links) == 1

        # No link held (none opened, or the endpoint dropped it): the end goes on a new one,
        # with what the held one would have said first.
        assert reporter.report(route.url, "r2", [("payload", {"payload": {}})], key="other",
                               opening=[("taken", {})]).result(10)
        wait_until(lambda: len(route.links) == 2 and not route.links[1]["open"], 10, "r2 reported")
        assert route.links[1]["events"] == ["taken", "payload"]
        reporter.hold("k3", route.url, "r3", [("taken", {})])
        wait_until(lambda: len(route.links) == 3 and route.links[2]["events"] == ["taken"], 10, "r3 held")
        route.drop(route.links[2])
        assert reporter.report(route.url, "r3", [("error", {"message": "x"})], key="k3").result(10)
        wait_until(lambda: len(route.links) == 4 and not route.links[3]["open"], 10, "r3 reported anew")
        assert route.links[3]["events"] == ["error"]
    finally:
        reporter.close()
        route.stop()


def test_closing_the_reporter_closes_the_links_it_holds():
    route, reporter = LinkRoute(), LinkReporter("vocoder")
    try:
        reporter.hold("k", route.url, "r1", [("taken", {})])
        wait_until(lambda: route.links and route.links[0]["events"] == ["taken"], 10, "taken said")
        reporter.close()
        wait_until(lambda: not route.links[0]["open"], 10, "the held link closed")
    finally:
        route.stop()
