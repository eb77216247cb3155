"""A stage's link to the pipeline's endpoint for one request (protocol.py): its events to the
endpoint, and the endpoint's abort back. asyncio, on aiohttp's WebSocket client.

:meth:`EndpointLink.open` connects (a refused or unknown request raises :class:`LinkError`:
the request is gone, the stage drops its input); :meth:`send` reports; :attr:`aborted` is set
when the endpoint aborts the request or the link drops, with :attr:`abort_reason`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp

from omni_runtime.pipeline.protocol import (
    CLOSE_UNKNOWN_REQUEST,
    CLOSE_WRONG_TOKEN,
    FINAL_EVENTS,
    HEARTBEAT_S,
    LINK_TOKEN_HEADER,
    MAX_EVENT_BYTES,
    ProtocolError,
    encode_event,
    link_url,
    parse_event,
)

logger = logging.getLogger(__name__)

#: How long a stage waits for the endpoint to accept its link.
CONNECT_TIMEOUT_S = 5.0


class LinkError(RuntimeError):
    """The link could not be opened (the request is gone, or the endpoint unreachable)."""


class EndpointLink:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse, request_id: str,
                 stage: str) -> None:
        self._ws = ws
        self.request_id = request_id
        self.stage = stage
        self.aborted = asyncio.Event()
        self.abort_reason = ""
        self._final_sent = False
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def open(cls, session: aiohttp.ClientSession, endpoint: str, request_id: str,
                   stage: str, *, token: str | None = None,
                   timeout_s: float = CONNECT_TIMEOUT_S) -> EndpointLink:
        """``token``: the origin's, which the endpoint asks of every link of the request."""
        url = link_url(endpoint, request_id, stage)
        try:
            ws = await asyncio.wait_for(
                session.ws_connect(url, heartbeat=HEARTBEAT_S, max_msg_size=MAX_EVENT_BYTES,
                                   headers={LINK_TOKEN_HEADER: token} if token else None),
                timeout_s)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise LinkError(f"the pipeline endpoint {endpoint} did not take the link of "
                            f"request {request_id}: {type(exc).__name__}: {exc}") from None
        return cls(ws, request_id, stage)

    async def _read(self) -> None:
        ws = self._ws
        reason = "the pipeline endpoint closed the link"
        try:
            async for message in ws:
                if message.type != aiohttp.WSMsgType.TEXT:
                    continue
                try:
                    event = parse_event(message.data)
                except ProtocolError as exc:
                    logger.warning("link of request %s: %s", self.request_id, exc)
                    continue
                if event["event"] == "abort":
                    reason = str(event.get("reason") or "aborted at the pipeline endpoint")
                    break
            else:
                if ws.close_code == CLOSE_UNKNOWN_REQUEST:
                    reason = "the pipeline endpoint has no such request (it ended)"
                elif ws.close_code == CLOSE_WRONG_TOKEN:
                    reason = "the pipeline endpoint refused the link: not the request's token"
                elif ws.exception() is not None:
                    reason = f"the link to the pipeline endpoint broke: {ws.exception()}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            reason = f"the link to the pipeline endpoint broke: {exc}"
        finally:
            if not self._final_sent:
                self.abort_reason = reason
                self.aborted.set()

    @property
    def closed(self) -> bool:
        return self._ws.closed

    async def send(self, event: str, **fields: Any) -> bool:
        """Report ``event``; False when the link is gone (the request is then aborted)."""
        if self._ws.closed:
            return False
        try:
            await self._ws.send_str(encode_event(event, **fields))
        except (aiohttp.ClientError, ConnectionError, RuntimeError) as exc:
            logger.info("link of request %s: %s not sent: %s", self.request_id, event, exc)
            return False
        if event in FINAL_EVENTS:
            self._final_sent = True
        return True

    async def close(self) -> None:
        self._final_sent = True
        if not self._ws.closed:
            try:
                await self._ws.close()
            except (aiohttp.ClientError, ConnectionError, RuntimeError):
                pass
        self._reader.cancel()
        try:
            await self._reader
        except (asyncio.CancelledError, Exception):
            pass


class LinkReporter:
    """For a stage that is not asyncio (a receiving stage's threads): reports to pipeline
    endpoints from a thread of its own, each report a link opened, its events sent, closed;
    or, for a request the stage holds a while (a stream it takes chunk by chunk), a link
    :meth:`hold` opens and the report with the same key ends, which answers the endpoint's
    pings meanwhile: a stage that stops answering (hung, stopped) is seen there within the
    links' heartbeat, naming it. A report that cannot be delivered (the request gone, the
    endpoint unreachable) is logged; the stage goes on."""

    def __init__(self, stage: str) -> None:
        import threading

        self.stage = stage
        self._loop = asyncio.new_event_loop()
        self._session: aiohttp.ClientSession | None = None
        #: The links held open, by the caller's key: the task opening each (touched on the
        #: loop's thread only).
        self._held: dict[Any, asyncio.Task] = {}
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name=f"omni-links-{stage}", daemon=True)
        self._thread.start()

    def hold(self, key: Any, endpoint: str, request_id: str,
             events: list[tuple[str, dict[str, Any]]], token: str | None = None) -> None:
        """Open a link of ``request_id``, send ``events`` on it and keep it open until
        :meth:`report` with ``key`` (or :meth:`close`)."""
        self._loop.call_soon_threadsafe(self._hold, key, endpoint, request_id, events, token)

    def _hold(self, key: Any, endpoint: str, request_id: str,
              events: list[tuple[str, dict[str, Any]]], token: str | None) -> None:
        self._held[key] = self._loop.create_task(self._open(endpoint, request_id, events, token))

    def report(self, endpoint: str, request_id: str,
               events: list[tuple[str, dict[str, Any]]], token: str | None = None,
               key: Any = None, opening: list[tuple[str, dict[str, Any]]] = ()) -> Any:
        """Send ``events`` on a link of ``request_id`` (``token``: its origin's): the one held
        under ``key`` if there is one, else a new one, ``opening``'s events first (what the
        held one said when it opened); then closed. A future of whether they went."""
        return asyncio.run_coroutine_threadsafe(
            self._report(endpoint, request_id, events, token, key, list(opening)), self._loop)

    async def _open(self, endpoint: str, request_id: str,
                    events: list[tuple[str, dict[str, Any]]], token: str | None
                    ) -> EndpointLink | None:
        """A link of the request with ``events`` sent on it; None when it could not be."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        try:
            link = await EndpointLink.open(self._session, endpoint, request_id, self.stage,
                                           token=token)
        except LinkError as exc:
            logger.info("stage %s: nothing reported for request %s: %s", self.stage,
                        request_id, exc)
            return None
        for event, fields in events:
            if not await link.send(event, **fields):
                await link.close()
                return None
        return link

    async def _report(self, endpoint: str, request_id: str,
                      events: list[tuple[str, dict[str, Any]]], token: str | None,
                      key: Any, opening: list[tuple[str, dict[str, Any]]]) -> bool:
        held = self._held.pop(key, None) if key is not None else None
        link = await held if held is not None else None
        if link is not None and (link.aborted.is_set() or link.closed):
            await link.close()  # the endpoint dropped it: the report goes on a new one
            link = None
        if link is None:
            link = await self._open(endpoint, request_id, opening + events, token)
            if link is None:
                return False
            await link.close()
            return True
        try:
            for event, fields in events:
                if not await link.send(event, **fields):
                    return False
            return True
        finally:
            await link.close()

    def close(self) -> None:
        async def stop() -> None:
            for task in list(self._held.values()):
                link = await task
                if link is not None:
                    await link.close()
            self._held.clear()
            if self._session is not None:
                await self._session.close()

        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
