"""The pipeline's endpoint: one OpenAI-compatible front door for the whole pipeline.

A client sends ``POST /v1/completions`` or ``/v1/chat/completions`` here (the ``openai``
client with ``base_url=<endpoint>/v1``); the endpoint sends the request to the pipeline's
first stage with its origin (protocol.py), and answers with the output of its last stage:

* the last stage is a vLLM stage: its tokens and text, as an OpenAI completion or chat
  completion (streamed as server-sent events with ``"stream": true``), each choice with its
  ``token_ids``;
* the last stage is a receiving stage: its stored payload's summary, as the choice's
  ``omni_payload`` (its request ids, tokens, shape, dtype, bytes).

Every stage that takes the request from a hand-off links to this endpoint (link.py). The
endpoint follows the request across them: a stage that reports an error, a link that drops,
a hand-off that its next stage does not take within the edge's deadline (plus
:data:`HOP_GRACE_S`), or a first stage that answers an error, end the client's request with
an error naming the stage; a client that goes away aborts the request at every stage holding
it. ``X-Request-Id`` (the client's, else a new one) is the request's id at every stage, and
the W3C trace context goes with it (one trace across the stages).

Other routes: ``GET /v1/models`` (the first stage's), ``GET /health``, and the stages' links
(``/v1/omni/requests/{id}/stages/{stage}``, WebSocket).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import re
import secrets
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from pydantic import TypeAdapter, ValidationError

from omni_contract.edges import STREAM
from omni_contract.ports import ENDPOINT_PORT
from omni_contract.vllm_args import json_kind
from omni_runtime.pipeline.protocol import (
    CLOSE_UNKNOWN_REQUEST,
    CLOSE_WRONG_TOKEN,
    FINAL_EVENTS,
    HEARTBEAT_S,
    KV_PARAMS_KEY,
    LINK_TOKEN_HEADER,
    MalformedEvent,
    MAX_EVENT_BYTES,
    ProtocolError,
    encode_event,
    origin,
    parse_event,
    request_id_problem,
)

logger = logging.getLogger(__name__)

#: Seconds a hand-off's next stage gets beyond the edge's transfer deadline to say it took it.
HOP_GRACE_S = 2.0
#: The default bound on a request's whole time in the pipeline.
DEFAULT_REQUEST_TIMEOUT_S = 600.0
#: How long a connection to the first stage may idle before it is closed rather than re-used:
#: below the keep-alive of vLLM's server (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s by default),
#: so that a request is never sent on a connection the server is closing (it would fail,
#: "Server disconnected", and a request is not sent twice).
ENTRY_KEEPALIVE_S = 2.0
#: How vLLM's request models read the fields the endpoint acts on (pydantic, lax: "false" is
#: False, "2" is 2): read the same way here, the endpoint and its first stage never disagree
#: on what a request asks.
_BOOL, _INT = TypeAdapter(bool), TypeAdapter(int)


class EndpointConfigError(ValueError):
    """A bad endpoint config; the message names the key."""


@dataclass(frozen=True)
class Edge:
    """``timeout_s``: the time the target has to take a request's input (a whole edge's
    transfer deadline; a streamed edge's first-chunk deadline); ``stall_s``: the longest its
    stages may legitimately sit without progress (a whole edge's transfer deadline; a
    streamed one's gap between chunks)."""

    source: str
    target: str
    timeout_s: float
    streamed: bool = False  # fed as a stream (omni_contract.edges): what a message calls it
    stall_s: float = 0.0

    @property
    def deadline_name(self) -> str:
        return "the stream's first-chunk deadline" if self.streamed else "the edge's transfer deadline"


@dataclass(frozen=True)
class EndpointConfig:
    """``entry``: the first stage and its base URL; ``sink``: the last stage (whose output
    is the answer); ``edges``: the stage graph, each with its transfer deadline;
    ``advertise``: this replica's base URL as the stages reach it."""

    pipeline: str
    model_name: str
    entry_stage: str
    entry_url: str
    sink: str
    edges: tuple[Edge, ...]
    advertise: str
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S

    def downstream(self, stage: str) -> list[Edge]:
        return [e for e in self.edges if e.source == stage]

    @property
    def stages(self) -> frozenset[str]:
        return frozenset({self.entry_stage, self.sink} | {e.source for e in self.edges}
                         | {e.target for e in self.edges})

    @property
    def link_heartbeat_s(self) -> float:
        """The ping interval of the stages' links here. A link that answers no ping is lost
        after about one and a half intervals, with every request it holds: that is at most
        the longest edge deadline, so a stage that stalls for less than its deadlines keeps
        its requests (at the fixed interval a 7.5 s pause failed them all; a streamed edge's
        gap, longer than its transfer deadline, lost a stream's requests mid-gap)."""
        return max(HEARTBEAT_S, max((max(e.timeout_s, e.stall_s) for e in self.edges),
                                    default=0.0) * 2 / 3)


def parse_endpoint_config(pipeline: str, model_name: str, raw: Any) -> EndpointConfig:
    """The stage config's ``endpoint`` mapping; EndpointConfigError naming the key."""
    if not isinstance(raw, Mapping):
        raise EndpointConfigError("endpoint must be a mapping")

    def text(mapping: Mapping[str, Any], key: str, where: str) -> str:
        value = mapping.get(key)
        if not isinstance(value, str) or not value:
            raise EndpointConfigError(f"{where}{key} must be a non-empty string")
        return value

    entry = raw.get("entry")
    if not isinstance(entry, Mapping):
        raise EndpointConfigError("endpoint.entry must be a mapping with stage and url")
    def seconds(value: Any, key: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                0 < value < float("inf")):
            raise EndpointConfigError(f"{key} must be a positive number of seconds, got "
                                      f"{value!r}")
        return float(value)

    edges = []
    for i, edge in enumerate(raw.get("edges") or []):
        where = f"endpoint.edges[{i}]."
        if not isinstance(edge, Mapping):
            raise EndpointConfigError(f"endpoint.edges[{i}] must be a mapping")
        timeout_s = seconds(edge.get("timeoutSeconds"), f"{where}timeoutSeconds")
        streamed = edge.get("mode") == STREAM
        stream = edge.get("stream") if streamed else None
        if stream is not None and not isinstance(stream, Mapping):
            raise EndpointConfigError(f"{where}stream must be a mapping")
        stream = stream or {}
        take_s, stall_s = (seconds(stream.get(key, timeout_s), f"{where}stream.{key}")
                           for key in ("firstChunkSeconds", "gapSeconds"))
        edges.append(Edge(text(edge, "from", where), text(edge, "to", where), take_s,
                          streamed=streamed, stall_s=stall_s))
    timeout = seconds(raw.get("requestTimeoutSeconds", DEFAULT_REQUEST_TIMEOUT_S),
                      "endpoint.requestTimeoutSeconds")
    urls = {}
    for key in ("entry.url", "advertise"):
        value = raw.get("advertise") if key == "advertise" else entry.get("url")
        if isinstance(value, str):
            value = _expand(value, f"endpoint.{key}")
        if not (isinstance(value, str) and value.startswith(("http://", "https://"))):
            raise EndpointConfigError(f"endpoint.{key} must be an http(s) URL, got {value!r}")
        urls[key] = value.rstrip("/")
    config = EndpointConfig(
        pipeline=pipeline, model_name=model_name,
        entry_stage=text(entry, "stage", "endpoint.entry."),
        entry_url=urls["entry.url"], sink=text(raw, "sink", "endpoint."),
        edges=tuple(edges), advertise=urls["advertise"],
        request_timeout_s=timeout)
    stages = {config.entry_stage} | {e.source for e in edges} | {e.target for e in edges}
    if config.sink not in stages:
        raise EndpointConfigError(f"endpoint.sink {config.sink!r} is not a stage of the "
                                  f"edges ({sorted(stages)})")
    return config


def _expand(value: str, key: str) -> str:
    """``${NAME}`` in a URL is the process's environment variable NAME (on Kubernetes the
    pod's own address: ``${POD_IP}``, from the downward API)."""
    def variable(match: re.Match) -> str:
        name = match.group(1)
        if name not in os.environ:
            raise EndpointConfigError(f"{key} names ${{{name}}}, which this process's "
                                      "environment does not set")
        return os.environ[name]

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", variable, value)


class StageFailed(Exception):
    """The request failed at a stage: (stage, message, HTTP status for the client, the
    request's parameter it names, when the stage named one)."""

    def __init__(self, stage: str, message: str, status: int = 502, param: str | None = None) -> None:
        super().__init__(f"stage {stage}: {message}")
        self.stage, self.message, self.status, self.param = stage, message, status, param


@dataclass(eq=False)
class _Request:
    id: str
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    #: stage -> its link, while the stage holds the request (until its final event)
    links: dict[str, web.WebSocketResponse] = field(default_factory=dict)
    taken: set[str] = field(default_factory=set)
    #: stage -> when (unix) its hand-off was offered and taken, its first output reached the
    #: endpoint (the last stage's), and it finished: the answer's ``omni.stages`` (where a
    #: request's time went).
    timings: dict[str, dict[str, float]] = field(default_factory=dict)
    #: stage -> (monotonic deadline by which it must take the request, the edge)
    expected: dict[str, tuple[float, Edge]] = field(default_factory=dict)
    #: Set each time the last stage holding the request (an open link that has not said
    #: its final event) lets it go.
    unlinked: asyncio.Event = field(default_factory=asyncio.Event)
    #: The secret its origin carries to the stages: a link must present it (a request's id
    #: can be a client's own X-Request-Id, and the links' path is on the clients' port).
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))


class PipelineEndpoint:
    def __init__(self, config: EndpointConfig) -> None:
        self.config = config
        self._requests: dict[str, _Request] = {}
        self._session: aiohttp.ClientSession | None = None
        self._tracer = None
        self.app = web.Application(client_max_size=16 << 20, middlewares=[_errors_as_json])
        self.app.router.add_post("/v1/completions", self._completions)
        self.app.router.add_post("/v1/chat/completions", self._chat_completions)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/v1/omni/requests/{request_id}/stages/{stage}", self._link)
        self.app.on_startup.append(self._start)
        self.app.on_cleanup.append(self._stop)

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    async def _start(self, app: web.Application) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(keepalive_timeout=ENTRY_KEEPALIVE_S),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        from omni_runtime.observability.tracing import resolve_tracer

        self._tracer = resolve_tracer()

    async def _stop(self, app: web.Application) -> None:
        for pending in list(self._requests.values()):
            await self._abort_links(pending, "the pipeline endpoint is stopping")
        if self._session is not None:
            await self._session.close()

    # ------------------------------------------------------------------ routes
    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "in_flight": self.in_flight})

    async def _models(self, request: web.Request) -> web.Response:
        try:
            async with self._session.get(f"{self.config.entry_url}/v1/models") as resp:
                return web.Response(body=await resp.read(), status=resp.status,
                                    content_type="application/json")
        except (aiohttp.ClientError, OSError) as exc:
            logger.warning("GET /v1/models: stage %s unreachable: %s", self.config.entry_stage, exc)
            return _error(StageFailed(self.config.entry_stage,
                                      f"unreachable ({type(exc).__name__}; the endpoint's log has the cause)"))

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completion")

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def _link(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(heartbeat=self.config.link_heartbeat_s, max_msg_size=MAX_EVENT_BYTES)
        await ws.prepare(request)
        stage = request.match_info["stage"]
        pending = self._requests.get(request.match_info["request_id"])
        if pending is None:
            await ws.close(code=CLOSE_UNKNOWN_REQUEST, message=b"no such request")
            return ws
        # surrogateescape: a header that is not UTF-8 (aiohttp keeps its bytes so) is a wrong
        # token, not an error of the handler.
        if not hmac.compare_digest(request.headers.get(LINK_TOKEN_HEADER, "").encode("utf-8", "surrogateescape"),
                                   pending.token.encode()):
            logger.warning("a link for request %s as stage %s without the request's token: "
                           "refused", pending.id, stage)
            await ws.close(code=CLOSE_WRONG_TOKEN, message=b"not the request's token")
            return ws
        pending.links[stage] = ws
        final = False
        try:
            async for message in ws:
                if message.type != aiohttp.WSMsgType.TEXT:
                    continue
                try:
                    event = parse_event(message.data)
                except MalformedEvent as exc:  # the stage's bug: its request fails, naming it
                    logger.warning("link of stage %s for request %s: %s", stage, pending.id, exc)
                    event = {"event": "error", "message": f"sent a malformed event: {exc}"}
                except ProtocolError as exc:
                    logger.warning("link of stage %s for request %s: %s", stage, pending.id,
                                   exc)
                    continue
                pending.events.put_nowait((stage, event))
                if event["event"] in FINAL_EVENTS and not final:
                    final = True
                    self._unlink(pending, stage, ws)  # it holds the request no more
        finally:
            self._unlink(pending, stage, ws)
            if not final:
                # No close frame: the stage's process ended, or it answered no ping.
                dropped = ws.close_code == aiohttp.WSCloseCode.ABNORMAL_CLOSURE
                pending.events.put_nowait((stage, {"event": "lost", "dropped": dropped}))
        return ws

    @staticmethod
    def _unlink(pending: _Request, stage: str, ws: web.WebSocketResponse) -> None:
        if pending.links.get(stage) is ws:
            del pending.links[stage]
            if not pending.links:
                pending.unlinked.set()

    # ------------------------------------------------------------------ a request
    async def _serve(self, request: web.Request, kind: str) -> web.StreamResponse:
        given_id = request.headers.get("X-Request-Id")
        if given_id is not None:
            problem = request_id_problem(given_id)
            if problem is not None:  # not echoed: it cannot be (a header of text)
                return _error_body(400, problem, param="X-Request-Id")
        if request.content_type != "application/json":  # vLLM's validate_json_request
            return _error_body(400, "Unsupported Media Type: Only 'application/json' is allowed",
                               request_id=given_id)
        try:
            # utf-8-sig: a byte-order mark before the JSON is taken, as vLLM's server takes it.
            body = json.loads((await request.read()).decode("utf-8-sig"))
        except (ValueError, UnicodeDecodeError):
            return _error_body(400, "the request body must be a JSON object", request_id=given_id)
        except RecursionError:
            return _error_body(400, "the request body is JSON nested too deeply", request_id=given_id)
        except RequestPayloadError as exc:  # a Content-Encoding it does not have
            refused = _error_body(400, "the request body could not be read as its Content-Encoding says "
                                       f"({request.headers.get('Content-Encoding')}): {exc.args[0] if exc.args else exc}",
                                  request_id=given_id)
            # The rest of the body cannot be read: the connection ends with this answer, and
            # the body is taken as ended (aiohttp would read on after the answer, fail again and
            # log it as an unhandled exception).
            refused.force_close()
            request.content.feed_eof()
            return refused
        if not isinstance(body, dict):
            return _error_body(400, "the request body must be a JSON object", request_id=given_id)
        refused = _refused(body, kind, several_stages=self.config.entry_stage != self.config.sink)
        if refused is not None:
            return _error_body(400, refused[1], param=refused[0], request_id=given_id)
        request_id = given_id or f"omni-{uuid.uuid4().hex}"
        if request_id in self._requests:
            return _error_body(409, f"a request with X-Request-Id {request_id} is in flight",
                               param="X-Request-Id", request_id=request_id)
        stream = bool(_as_vllm_reads(_BOOL, body.get("stream")))
        options = body.get("stream_options")
        include_usage = stream and isinstance(options, dict) and bool(
            _as_vllm_reads(_BOOL, options.get("include_usage")))
        pending = self._requests[request_id] = _Request(request_id)
        pending.timings[self.config.entry_stage] = {"sent_at": time.time()}
        span, headers = self._start_span(request, request_id)
        writer = _Writer(request, kind, request_id, body.get("model") or self.config.model_name,
                         stream, include_usage)
        entry = asyncio.get_running_loop().create_task(
            self._call_entry(pending, kind, body, headers))
        ended = "the request ended at the pipeline endpoint"
        try:
            await self._follow(pending, writer, entry)
        except StageFailed as failed:
            logger.warning("pipeline request %s failed: %s", request_id, failed)
            if span is not None:
                from opentelemetry.trace import Status, StatusCode

                span.set_status(Status(StatusCode.ERROR, str(failed)))
            await writer.error(failed)
        except asyncio.CancelledError:
            ended = "the client went away"
            raise
        except ConnectionResetError:
            # The client closed the connection while its answer was written: its request
            # ends here (the finally below aborts it at every stage), as routine as a cancel.
            ended = "the client went away"
            logger.info("pipeline request %s: the client went away while its answer was written", request_id)
        finally:
            entry.cancel()
            self._requests.pop(request_id, None)
            await asyncio.shield(self._abort_links(pending, ended))
            if span is not None:
                span.end()
        return writer.response

    def _start_span(self, request: web.Request, request_id: str
                    ) -> tuple[Any, dict[str, str]]:
        """The request's span (a child of the client's trace, when it sent one) and the
        headers that carry its context to the first stage."""
        headers = {"X-Request-Id": request_id}
        if self._tracer is None:
            if "traceparent" in request.headers:
                headers["traceparent"] = request.headers["traceparent"]
                if "tracestate" in request.headers:
                    headers["tracestate"] = request.headers["tracestate"]
            return None, headers
        from opentelemetry import context as otel_context
        from opentelemetry.trace import SpanKind, set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from omni_runtime.observability.tracing import ATTR_REQUEST_ID

        propagator = TraceContextTextMapPropagator()
        parent = propagator.extract(dict(request.headers))
        span = self._tracer.start_span(
            "omni.pipeline_request", context=parent, kind=SpanKind.SERVER,
            attributes={"omni.pipeline": self.config.pipeline, ATTR_REQUEST_ID: request_id})
        propagator.inject(headers, context=set_span_in_context(span, otel_context.get_current()))
        return span, headers

    async def _call_entry(self, pending: _Request, kind: str, body: dict[str, Any],
                          headers: dict[str, str]) -> None:
        """The request at the first stage; its end (or failure) goes to the request's events
        as the entry stage's."""
        stage = self.config.entry_stage
        try:
            await self._ask_entry(pending, kind, body, headers)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here: this request alone fails, and says so
            logger.exception("pipeline request %s: asking stage %s failed", pending.id, stage)
            pending.events.put_nowait((stage, {"event": "error", "status": 500, "message":
                                               f"the pipeline endpoint failed to ask it "
                                               f"({type(exc).__name__}; its log has the cause)"}))

    async def _ask_entry(self, pending: _Request, kind: str, body: dict[str, Any],
                         headers: dict[str, str]) -> None:
        stage = self.config.entry_stage
        forwarded = dict(body)
        params = dict(forwarded.get("kv_transfer_params") or {})
        params[KV_PARAMS_KEY] = origin(pending.id, self.config.advertise, pending.token)
        forwarded["kv_transfer_params"] = params
        sink = stage == self.config.sink
        if not sink:
            forwarded["stream"] = False  # its own output is not the answer
            forwarded.pop("stream_options", None)  # vLLM refuses them on a request not streamed
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        try:
            async with self._session.post(f"{self.config.entry_url}{path}", json=forwarded,
                                          headers=headers) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:2000]
                    message, param = _error_of(text)
                    pending.events.put_nowait((stage, {"event": "error", "status": resp.status,
                                                       "message": message, "param": param}))
                    return
                if sink:  # a one-stage pipeline: its answer is the client's, as it comes
                    proxied = asyncio.Event()
                    pending.events.put_nowait((stage, {"event": "proxy", "response": resp,
                                                       "proxied": proxied}))
                    await proxied.wait()
                    return
                answer = await resp.json()
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            # The cause (which may name the stage's address) goes to the log, not the client.
            logger.warning("pipeline request %s: stage %s unreachable or broken: %s", pending.id,
                           stage, exc)
            pending.events.put_nowait((stage, {"event": "error", "message":
                                               f"unreachable or broken ({type(exc).__name__}; the "
                                               "endpoint's log has the cause)"}))
            return
        choice = (answer.get("choices") or [{}])[0]
        pending.events.put_nowait((stage, {"event": "finished",
                                           "finish_reason": choice.get("finish_reason"),
                                           "kv_transfer_params": answer.get("kv_transfer_params")}))

    async def _follow(self, pending: _Request, writer: _Writer, entry: asyncio.Task) -> None:
        """Follow the request's events until the last stage's answer is written."""
        config = self.config
        deadline = time.monotonic() + config.request_timeout_s
        while True:
            now = time.monotonic()
            wake = min([deadline, *(d for d, _ in pending.expected.values())])
            try:
                stage, event = await asyncio.wait_for(pending.events.get(), max(0.0, wake - now))
            except asyncio.TimeoutError:
                now = time.monotonic()
                if now >= deadline:
                    raise StageFailed(self._holder(pending), "the request did not finish "
                                      f"within {config.request_timeout_s:g}s", 504) from None
                for target, (due, edge) in list(pending.expected.items()):
                    if now >= due:
                        what = "stream" if edge.streamed else "hand-off"
                        raise StageFailed(target, f"did not take the {what} of request "
                                          f"{pending.id} from stage {edge.source} within "
                                          f"{edge.timeout_s:g}s ({edge.deadline_name})",
                                          504) from None
                continue
            kind = event["event"]
            if kind == "error":
                param = event.get("param")
                message = str(event.get("message") or "failed")
                at_fault = event.get("stage")
                if at_fault in config.stages and at_fault != stage:  # its producer's doing
                    message, stage = f"{message} (reported by stage {stage})", at_fault
                raise StageFailed(stage, message, int(event.get("status") or 502),
                                  param if isinstance(param, str) else None)
            if kind == "lost":
                why = ("its link to the pipeline endpoint dropped before it finished: the stage exited, or "
                       f"answered no heartbeat for {1.5 * config.link_heartbeat_s:g}s" if event.get("dropped")
                       else "its link to the pipeline endpoint closed before it finished")
                raise StageFailed(stage, f"lost request {pending.id} ({why})")
            _note_time(pending, stage, event)
            if kind == "taken":
                pending.taken.add(stage)
                pending.expected.pop(stage, None)
                # A stage past the first holds the request: the pipeline took it, and a
                # client's stream begins (what the first stage refuses before this is
                # answered with its own status, as vLLM answers a request it refuses).
                await writer.accepted()
            elif kind == "proxy":
                try:
                    await writer.proxy(event["response"])
                finally:
                    event["proxied"].set()
                return
            elif kind == "finished":
                self._entry_finished(pending, stage, event)
            elif kind == "handed_off":
                self._expect_downstream(pending, stage)
            elif stage == config.sink and kind == "output":
                pending.timings.setdefault(stage, {}).setdefault("first_output_at", time.time())
                await writer.output(event.get("text") or "", list(event.get("token_ids") or ()))
            elif stage == config.sink and kind == "payload":
                await self._settle(pending, entry)
                await writer.payload(stage, event.get("payload") or {}, pending.timings)
                return
            elif stage == config.sink and kind == "done":
                await self._settle(pending, entry)
                await writer.done(event.get("finish_reason"), event.get("usage"), pending.timings)
                return
            elif kind == "done":
                raise StageFailed(stage, "its request finished without a hand-off to "
                                  + ", ".join(e.target for e in config.downstream(stage)))

    @staticmethod
    async def _settle(pending: _Request, entry: asyncio.Task) -> None:
        """The last stage has answered. Over a streamed edge an upstream stage's own end
        can come after it (its last chunk went out as it finished, and the two race here):
        the first stage's answer, and every linked stage's final event, are waited for, at most
        :data:`HOP_GRACE_S` together, so that the answer's timings name every stage's end
        and no stage that has finished is sent an abort. What came meanwhile is only timed:
        the client's answer is already whole."""
        waits: set[asyncio.Future] = set() if entry.done() else {entry}
        unlinked = None
        if pending.links:
            pending.unlinked.clear()
            unlinked = asyncio.ensure_future(pending.unlinked.wait())
            waits.add(unlinked)
        if waits:
            await asyncio.wait(waits, timeout=HOP_GRACE_S)
        if unlinked is not None:
            unlinked.cancel()
        while not pending.events.empty():
            _note_time(pending, *pending.events.get_nowait())

    def _entry_finished(self, pending: _Request, stage: str, event: dict[str, Any]) -> None:
        reason = event.get("finish_reason")
        if reason not in ("stop", "length"):
            raise StageFailed(stage, f"its request ended with finish_reason {reason!r}")
        meta = ((event.get("kv_transfer_params") or {}).get("kv_metadata") or {})
        if meta.get("outcome") in ("failed", "expired", "cancelled"):
            raise StageFailed(stage, f"its hand-off {meta.get('outcome')}: "
                              f"{meta.get('reason') or 'no reason given'}")
        self._expect_downstream(pending, stage)

    def _expect_downstream(self, pending: _Request, stage: str) -> None:
        now = time.monotonic()
        for edge in self.config.downstream(stage):
            if edge.target not in pending.taken:
                pending.expected.setdefault(edge.target,
                                            (now + edge.timeout_s + HOP_GRACE_S, edge))

    def _holder(self, pending: _Request) -> str:
        """The stage the request waits on (for a timeout's message)."""
        return next(iter(pending.links), None) or next(iter(pending.expected), None) or \
            self.config.entry_stage

    async def _abort_links(self, pending: _Request, reason: str) -> None:
        if pending.links:
            logger.info("pipeline request %s: aborting it at stage(s) %s: %s", pending.id,
                        ", ".join(pending.links), reason)
        for stage, ws in list(pending.links.items()):
            pending.links.pop(stage, None)
            try:
                await ws.send_str(encode_event("abort", reason=reason))
                await ws.close()
            except (ConnectionError, RuntimeError, aiohttp.ClientError):
                pass


#: The request's event that marks each time in the answer's ``omni.stages`` timings.
_TIMED_EVENTS = {"taken": "taken_at", "finished": "finished_at", "handed_off": "finished_at",
                 "done": "finished_at", "payload": "stored_at"}


def _note_time(pending: _Request, stage: str, event: dict[str, Any]) -> None:
    """The stage's time for the event (its arrival here), and the offer's and take's times
    that a ``taken`` event carries from the stage."""
    kind = event["event"]
    if kind not in _TIMED_EVENTS:
        return
    times = pending.timings.setdefault(stage, {})
    times[_TIMED_EVENTS[kind]] = time.time()
    if kind == "taken":
        times.update({k: float(event[k]) for k in ("offered_at", "taken_at")
                      if isinstance(event.get(k), (int, float))})


class _Writer:
    """The client's answer, OpenAI-shaped: one JSON object, or server-sent events."""

    def __init__(self, request: web.Request, kind: str, request_id: str, model: str,
                 stream: bool, include_usage: bool = False) -> None:
        self._request = request
        self._chat = kind == "chat"
        #: A stream's usage: only with stream_options.include_usage, in a last chunk of its
        #: own with no choices (as vLLM and OpenAI send it); a whole answer always has it.
        self._include_usage = include_usage
        self._role_said = False
        self._id = ("chatcmpl-" if self._chat else "cmpl-") + request_id
        self._request_id = request_id
        self._model = model
        self._stream = stream
        self._created = int(time.time())
        self._text: list[str] = []
        self._tokens: list[int] = []
        self.response: web.StreamResponse | None = None

    def _headers(self) -> dict[str, str]:
        return {"X-Request-Id": self._request_id}

    async def accepted(self) -> None:
        """The pipeline took the request: a stream begins now."""
        if self._stream:
            await self.start()

    async def start(self) -> None:
        """Begin the server-sent events (the response's headers)."""
        if self.response is None:
            self.response = web.StreamResponse(headers={
                **self._headers(), "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache"})
            await self.response.prepare(self._request)

    async def _sse(self, data: dict[str, Any] | str) -> None:
        await self.start()
        text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
        await self.response.write(f"data: {text}\n\n".encode())

    def _choice(self, text: str, token_ids: list[int], finish: str | None,
                extra: dict[str, Any] | None = None) -> dict[str, Any]:
        if self._chat:
            message = {"content": text}
            if not (self._stream and self._role_said):  # a stream says the role once
                message = {"role": "assistant", **message}
                self._role_said = True
            body = {"delta" if self._stream else "message": message}
        else:
            body = {"text": text, "logprobs": None}
        return {"index": 0, **body, "finish_reason": finish, "token_ids": token_ids,
                **(extra or {})}

    def _object(self, choice: dict[str, Any], usage: Any = None,
                timings: dict[str, Any] | None = None) -> dict[str, Any]:
        kind = "chat.completion" if self._chat else "text_completion"
        if self._chat and self._stream:
            kind = "chat.completion.chunk"
        body = {"id": self._id, "object": kind, "created": self._created, "model": self._model,
                "choices": [choice]}
        if usage is not None:
            body["usage"] = usage
        if timings is not None:  # the last object: where the request's time went, per stage
            body["omni"] = {"request_id": self._request_id, "stages": timings}
        return body

    async def output(self, text: str, token_ids: list[int]) -> None:
        if self._stream:
            await self._sse(self._object(self._choice(text, token_ids, None)))
        else:
            self._text.append(text)
            self._tokens.extend(token_ids)

    async def done(self, finish_reason: str | None, usage: Any,
                   timings: dict[str, Any]) -> None:
        if self._stream:
            await self._sse(self._object(self._choice("", [], finish_reason), None, timings))
            if self._include_usage and usage is not None:
                await self._sse({**self._object(self._choice("", [], None)), "choices": [],
                                 "usage": usage})
            await self._sse("[DONE]")
            await self.response.write_eof()
            return
        self.response = web.json_response(self._object(
            self._choice("".join(self._text), self._tokens, finish_reason), usage, timings),
            headers=self._headers())

    async def payload(self, stage: str, payload: dict[str, Any],
                      timings: dict[str, Any]) -> None:
        extra = {"omni_payload": {"stage": stage, **payload}}
        if self._stream:
            await self._sse(self._object(self._choice("", [], "stop", extra), None, timings))
            await self._sse("[DONE]")
            await self.response.write_eof()
            return
        self.response = web.json_response(
            self._object(self._choice("", [], "stop", extra), None, timings),
            headers=self._headers())

    async def proxy(self, upstream: aiohttp.ClientResponse) -> None:
        """A one-stage pipeline: the first stage's own answer, as it comes."""
        self.response = web.StreamResponse(status=upstream.status, headers={
            **self._headers(),
            "Content-Type": upstream.headers.get("Content-Type", "application/json")})
        await self.response.prepare(self._request)
        async for chunk in upstream.content.iter_any():
            await self.response.write(chunk)
        await self.response.write_eof()

    async def error(self, failed: StageFailed) -> None:
        body = _stage_error_body(failed)
        if self.response is not None and self.response.prepared:
            try:  # the events have begun: the error, then the stream's end, as vLLM's server
                await self._sse(body)
                await self._sse("[DONE]")
                await self.response.write_eof()
            except (ConnectionError, RuntimeError):
                pass
            return
        self.response = web.json_response(body, status=failed.status, headers=self._headers())


def _stage_error_body(failed: StageFailed) -> dict[str, Any]:
    return {"error": {"message": str(failed), "type": "omni_stage_error", "code": failed.status,
                      "param": failed.param, "stage": failed.stage}}


def _error(failed: StageFailed) -> web.Response:
    return web.json_response(_stage_error_body(failed), status=failed.status)


@web.middleware
async def _errors_as_json(request: web.Request, handler: Any) -> web.StreamResponse:
    """aiohttp's own refusals (a body over the size limit, an unknown path, a method a path
    does not take) as OpenAI-shaped JSON errors with the client's X-Request-Id, as every
    other answer of the endpoint (they were plain text)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        given = request.headers.get("X-Request-Id")
        response = _error_body(exc.status, exc.text or exc.reason,
                               request_id=given if given is not None and request_id_problem(given) is None else None)
        if isinstance(exc, web.HTTPMethodNotAllowed):
            response.headers["Allow"] = ", ".join(sorted(exc.allowed_methods))
        return response


def _error_body(status: int, message: str, param: str | None = None,
                request_id: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error",
                                         "code": status, "param": param}}, status=status,
                             headers={"X-Request-Id": request_id} if request_id else None)


def _as_vllm_reads(adapter: TypeAdapter, value: Any) -> Any:
    """``value`` as vLLM's request model reads it; None when absent or unreadable (then the
    first stage refuses it, or the endpoint does)."""
    if value is None:
        return None
    try:
        return adapter.validate_python(value)
    except ValidationError:
        return None


def _refused(body: Mapping[str, Any], kind: str, several_stages: bool) -> tuple[str, str] | None:
    """(the parameter, why) where the endpoint refuses a request before any stage holds it;
    None when it takes it. What the endpoint itself reads must read as vLLM reads it:
    ``stream`` a boolean, ``stream_options`` only with a stream (vLLM's rule: the endpoint
    asks the first stage without one, so it checks it here), ``kv_transfer_params`` an object
    (the endpoint adds the request's origin to it). Then, in a pipeline of several stages,
    :func:`_refused_past_one_stage`."""
    if body.get("stream") is not None and _as_vllm_reads(_BOOL, body["stream"]) is None:
        return "stream", f"stream must be true or false, got {body['stream']!r}"
    options = body.get("stream_options")
    if options is not None and not _as_vllm_reads(_BOOL, body.get("stream")):
        return "stream_options", "Stream options can only be defined when stream=True."
    if options is not None and not isinstance(options, dict):
        return "stream_options", f"stream_options must be a JSON object, got a JSON {json_kind(options)}"
    for key in ("include_usage", "continuous_usage_stats"):
        if (options or {}).get(key) is not None and _as_vllm_reads(_BOOL, options[key]) is None:
            return f"stream_options.{key}", f"stream_options.{key} must be true or false, got {options[key]!r}"
    params = body.get("kv_transfer_params")
    if params is not None and not isinstance(params, dict):
        return "kv_transfer_params", ("kv_transfer_params must be a JSON object (or left out), "
                                      f"got a JSON {json_kind(params)}")
    return _refused_past_one_stage(body, kind) if several_stages else None


#: What a client may ask of the answer's tokens that only the stage sampling them gives,
#: per kind of request: the pipeline's answer is its last stage's, sampled with that stage's
#: own parameters (its input.samplingParams), and the request's go to the first stage only.
#: Each field as vLLM's request model reads it, and the values of it that ask nothing (a
#: completion's ``logprobs: 0`` asks for the sampled token's; a chat's ``top_logprobs: 0``
#: is its default).
_OF_THE_ANSWER = {"completion": (("logprobs", _INT, (None,)), ("echo", _BOOL, (None, False)),
                                 ("prompt_logprobs", _INT, (None,))),
                  "chat": (("logprobs", _BOOL, (None, False)), ("top_logprobs", _INT, (None, 0)),
                           ("prompt_logprobs", _INT, (None,)), ("echo", _BOOL, (None, False)))}


def _refused_past_one_stage(body: Mapping[str, Any], kind: str = "completion"
                            ) -> tuple[str, str] | None:
    """(the parameter, why) where a request's parameters cannot go past the first stage of a
    pipeline of several; None when they can. Refused here, before any stage holds it:
    - stop strings: vLLM's API server ends a request on one by aborting it in the engine, so
      the stage sees an abort, and an aborted request hands nothing off (its next stage would
      wait for the hand-off until the edge's deadline);
    - several outputs (``n``, ``best_of``) or several prompts: a pipeline request carries one
      output from stage to stage."""
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (
            isinstance(stop, list) and all(isinstance(item, str) for item in stop))):
        return "stop", f"stop must be a string or a list of strings, got a JSON {json_kind(stop)}"
    if stop:
        return "stop", ("stop strings cannot end a request of a pipeline of several stages: "
                        "vLLM ends a request on one by aborting it, and an aborted request "
                        "hands nothing to the next stage; use stop_token_ids, which end it "
                        "in the engine")
    for key in ("n", "best_of"):
        value = _as_vllm_reads(_INT, body.get(key))
        if value is not None and value > 1:
            return key, (f"{key}={value}: a pipeline request carries one output from stage to "
                         f"stage; send {value} requests instead")
    for key, adapter, asks_nothing in _OF_THE_ANSWER[kind]:
        if _as_vllm_reads(adapter, body.get(key)) not in asks_nothing:
            return key, (f"{key}: a pipeline's answer is its last stage's output, sampled with that "
                         "stage's own parameters (input.samplingParams); the request's reach its "
                         "first stage only, so what it asks of the answer's tokens cannot be given; "
                         "leave it out")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and all(
            isinstance(p, (str, list)) for p in prompt):
        return "prompt", (f"{len(prompt)} prompts in one request: a pipeline request carries "
                          "one prompt from stage to stage; send one request per prompt")
    return None


def _error_of(text: str) -> tuple[str, str | None]:
    """An OpenAI-style error body's (message, param), or (the text, None)."""
    try:
        body = json.loads(text)
        error = body.get("error") if isinstance(body, dict) else None
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            param = error.get("param")
            return error["message"], param if isinstance(param, str) else None
    except ValueError:
        pass
    return text.strip() or "no answer", None


def run(config: EndpointConfig, host: str, port: int) -> int:
    """Serve until SIGTERM/SIGINT; then stop taking requests and let those in flight end
    (aiohttp's graceful shutdown)."""
    endpoint = PipelineEndpoint(config)
    logger.info("pipeline %s: endpoint on %s:%d (first stage %s at %s, last stage %s)",
                config.pipeline, host, port, config.entry_stage, config.entry_url, config.sink)
    web.run_app(endpoint.app, host=host, port=port, handler_cancellation=True,
                shutdown_timeout=config.request_timeout_s, print=None, access_log=None)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m omni_runtime.pipeline.endpoint``: a pipeline's endpoint in front of stages
    started by hand (``vllm serve``, docs/stages.md); ``omni-stage`` runs the same from a
    stage config with ``role: endpoint``."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m omni_runtime.pipeline.endpoint",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--entry", required=True, metavar="STAGE=URL",
                        help="the first stage and its API's base URL: thinker=http://127.0.0.1:8000")
    parser.add_argument("--edge", action="append", default=[], metavar="FROM:TO:SECONDS",
                        help="a hand-off between two stages and its transfer deadline "
                             "(kvTransfer.timeoutSeconds); once per edge")
    parser.add_argument("--sink", required=True, help="the last stage, whose output is the answer")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=ENDPOINT_PORT)
    parser.add_argument("--advertise", help="this endpoint's URL as the stages reach it "
                                            "(default http://127.0.0.1:PORT)")
    parser.add_argument("--model", default="", help="the model name answers carry by default")
    parser.add_argument("--pipeline", default="pipeline")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stage, _, url = args.entry.partition("=")
    edges = []
    for edge in args.edge:
        parts = edge.split(":")
        if len(parts) != 3:
            parser.error(f"--edge {edge!r} must be FROM:TO:SECONDS")
        try:
            edges.append({"from": parts[0], "to": parts[1], "timeoutSeconds": float(parts[2])})
        except ValueError:
            parser.error(f"--edge {edge!r}: SECONDS must be a number")
    raw = {"entry": {"stage": stage, "url": url}, "sink": args.sink, "edges": edges,
           "advertise": args.advertise or f"http://127.0.0.1:{args.port}"}
    try:
        config = parse_endpoint_config(args.pipeline, args.model, raw)
    except EndpointConfigError as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2
    return run(config, args.host, args.port)


if __name__ == "__main__":
    raise SystemExit(main())
