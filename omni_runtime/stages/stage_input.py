"""A downstream vLLM stage's input: each hand-off that arrives becomes a request in its engine.

Runs inside vLLM's OpenAI API server process, loaded with vLLM's own plug-in point for it
(``--middleware omni_runtime.stages.stage_input.StageInputMiddleware``) and configured by
``--additional-config '{"omni_stage_input": {...}}'`` (:class:`InputSettings`; ``omni-stage``
writes both from the stage config). At the server's start it starts the stage's KV receiver
(the ``kv`` port) in consumer mode; for each payload stored:

1. the input hook (inputs.py) makes the request's input from the hand-off: by default every
   upstream token, so the request continues the upstream's sequence;
2. where the upstream's KV can be the request's prefix (the same model, the prompt begins
   with the tokens it covers), it is written to shared memory and the request names it in
   ``kv_transfer_params["omni_load"]``: the engine's omni KV connector loads it into the
   request's blocks instead of computing it (kv/load.py);
3. the request links to the pipeline's endpoint when it came from one (its origin, carried
   with the hand-off; pipeline/link.py), and is added to the engine (``AsyncLLM.add_request``,
   vLLM's own validation: a prompt over ``max-model-len`` is refused there);
4. the hand-off is acked only then, the request holding its input; anything that refuses it
   (the hook raising, the engine's validation, more than ``max_inputs`` waiting past the
   transfer's deadline, a pipeline request gone) fails the upstream's transfer with the
   reason (``input_refused``) and tells the endpoint, naming this stage;
5. the request goes on as any: the last stage of a pipeline streams its output to the
   endpoint; another hands its own KV on (its ``kvTransfer``), the origin with it. An abort
   from the endpoint (or its link dropping) aborts the request.

The receiver's thread failing fails the server's ``/health`` (503, naming it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import glob
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omni_runtime.observability.logs import log_like_vllm
from omni_runtime.kv.load import LOAD_PARAMS, model_kv_identity, payload_into_file
from omni_runtime.pipeline.protocol import KV_PARAMS_KEY, ProtocolError, origin_token, parse_origin
from omni_runtime.stages.inputs import InputHookError, Upstream, load_hook, request_of
from omni_runtime.transfers.streams import EndedStreams, check_interval

logger = logging.getLogger(__name__)

#: The ``additional_config`` key of the stage input's settings.
SETTINGS_KEY = "omni_stage_input"
DEFAULT_MAX_INPUTS = 64
DEFAULT_PAYLOAD_DIR = "/dev/shm"
#: A payload up to this size is made into its request on the server's event loop itself: its
#: assembly costs less than handing it to a thread and back.
INLINE_BYTES = 4 << 20


class InputSettingsError(ValueError):
    """Bad ``omni_stage_input`` settings; the message names the key."""


@dataclass(frozen=True)
class InputSettings:
    """``listen``: the KV receiver's address (``tcp://0.0.0.0:9600``); ``inputs``: the
    upstream stages; ``downstream``: the stages this one hands its own KV to (none: it is the
    pipeline's last stage, whose output goes to the endpoint); ``hook``: the input hook's
    import path; ``sampling_params``: the requests' (vLLM's SamplingParams fields);
    ``max_inputs``: requests from hand-offs admitted and unfinished at once;
    ``payload_dir``: where KV prefixes wait for the engine (shared memory); ``load_kv``:
    whether the upstream's KV may be loaded as a prefix at all."""

    listen: str
    pipeline: str = ""
    stage: str = ""
    revision: str | None = None
    inputs: tuple[str, ...] = ()
    downstream: tuple[str, ...] = ()
    hook: str | None = None
    sampling_params: Mapping[str, Any] = field(default_factory=dict)
    max_inputs: int = DEFAULT_MAX_INPUTS
    payload_dir: str = DEFAULT_PAYLOAD_DIR
    load_kv: bool = True
    #: The inputs fed as streams (upstream stage -> its settings): each stream is one
    #: request, a vLLM streaming-input session its chunks extend (stream_input.py).
    streams: Mapping[str, Any] = field(default_factory=dict)
    #: The downstream stages this stage streams to (its requests' output goes in chunks).
    streams_out: tuple[str, ...] = ()

    @classmethod
    def parse(cls, raw: Any) -> InputSettings:
        where = f"additional_config.{SETTINGS_KEY}."
        if not isinstance(raw, Mapping):
            raise InputSettingsError(f"additional_config.{SETTINGS_KEY} must be a mapping")

        def get(key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
            if key not in raw or raw[key] is None:
                if default is ...:
                    raise InputSettingsError(f"{where}{key} is required")
                return default
            value = raw[key]
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise InputSettingsError(f"{where}{key} must be a "
                                         f"{getattr(kind, '__name__', kind)}, got {value!r}")
            return value

        names = {}
        for key in ("inputs", "downstream", "streams_out"):
            value = get(key, list, [])
            if not all(isinstance(v, str) and v for v in value):
                raise InputSettingsError(f"{where}{key} must be a list of stage names")
            names[key] = tuple(value)
        max_inputs = get("max_inputs", int, DEFAULT_MAX_INPUTS)
        if max_inputs < 1:
            raise InputSettingsError(f"{where}max_inputs must be at least 1, got {max_inputs}")
        unknown = set(raw) - {"listen", "pipeline", "stage", "revision", "inputs",
                              "downstream", "hook", "sampling_params", "max_inputs",
                              "payload_dir", "load_kv", "streams", "streams_out"}
        if unknown:
            raise InputSettingsError(f"{where}{sorted(unknown)[0]} is not a setting")
        return cls(listen=get("listen", str), pipeline=get("pipeline", str, ""),
                   stage=get("stage", str, ""), revision=get("revision", str, None),
                   inputs=names["inputs"], downstream=names["downstream"],
                   hook=get("hook", str, None),
                   sampling_params=dict(get("sampling_params", dict, {})),
                   max_inputs=max_inputs, payload_dir=get("payload_dir", str,
                                                          DEFAULT_PAYLOAD_DIR),
                   load_kv=get("load_kv", bool, True),
                   streams=_streams(get("streams", dict, {}), where),
                   streams_out=names["streams_out"])


def _streams(raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    from omni_contract.edges import EdgeError, parse_stream

    try:
        return {str(stage): parse_stream(settings, f"{where}streams.{stage}")
                for stage, settings in raw.items()}
    except EdgeError as exc:
        raise InputSettingsError(str(exc)) from None


class Refused(Exception):
    """An input this stage does not take: (code, reason) for the upstream's transfer;
    ``status``: the HTTP status the pipeline's client gets (400: what the client asked
    cannot be done, e.g. too many tokens for this stage; 502 otherwise)."""

    def __init__(self, reason: str, code: str = "input_refused", status: int = 502,
                 param: str | None = None) -> None:
        super().__init__(reason)
        self.code, self.reason, self.status, self.param = code, reason, status, param


def _refused_by_vllm(exc: Exception) -> Refused:
    """What the engine raised when it was given the request (its validation, say), with the
    status vLLM's server gives it: 400 for what vLLM counts the request's fault (a prompt over
    this stage's max-model-len), 502 for the rest."""
    from vllm.exceptions import VLLMClientError

    return Refused(f"{type(exc).__name__}: {exc}",
                   status=400 if isinstance(exc, VLLMClientError) else 502)


class StageInput:
    def __init__(self, settings: InputSettings, engine_client: Any, vllm_config: Any) -> None:
        from vllm import SamplingParams

        self.settings = settings
        self._engine = engine_client
        model_config = vllm_config.model_config
        self._model_name = str(model_config.served_model_name or model_config.model)
        self._identity = model_kv_identity(vllm_config)
        self._hook = load_hook(settings.hook)
        try:  # the stage's own sampling parameters, checked once at start-up
            SamplingParams(**settings.sampling_params)
        except (TypeError, ValueError) as exc:
            raise InputSettingsError(f"additional_config.{SETTINGS_KEY}.sampling_params: "
                                     f"{exc}") from None
        self._admission = asyncio.Semaphore(settings.max_inputs)
        # Its own threads for the payloads' assembly and files: off the server's event loop,
        # and not the loop's default executor, which the server's shutdown closes first.
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix=f"omni-input-{settings.stage}")
        self._stopping = False
        #: The stage stops (drain_streams): no new hand-off or stream; open streams go on.
        self.draining = False
        self._drain_changed: asyncio.Event | None = None
        self._tasks: set[asyncio.Task] = set()
        self._files = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session = None
        self.receiver = None
        #: The streamed inputs (stream_input.py), when the stage has any.
        self.streams = None
        #: (producer's request id, upstream stage) -> the pipeline request's id and link.
        self._stream_requests: dict[tuple[str, str], str] = {}
        self._stream_links: dict[str, Any] = {}
        #: The streams (producer's request id, upstream stage) that ended here, each until its
        #: streamSeconds pass: a late chunk of one is refused, never taken as the first chunk
        #: of a new stream of its pipeline request (whose id a client may use again).
        self._ended_streams = EndedStreams(self.MAX_ENDED_STREAMS)

    # ------------------------------------------------------------------ life
    async def start(self) -> None:
        import aiohttp

        from omni_runtime.kv.transport import KVInbox, KVReceiver
        from omni_runtime.observability.receiver_metrics import ReceiverMetrics

        self._loop = asyncio.get_running_loop()
        os.makedirs(self.settings.payload_dir, exist_ok=True)
        for stale in glob.glob(os.path.join(self.settings.payload_dir, self._file_prefix("*"))):
            os.unlink(stale)  # a previous run of this stage died with prefixes waiting
        self._session = aiohttp.ClientSession()
        settings = self.settings
        self.receiver = KVReceiver(
            settings.listen, KVInbox(), pipeline=settings.pipeline, stage=settings.stage,
            metrics=ReceiverMetrics(stage=settings.stage, model_name=self._model_name,
                                    from_stages=settings.inputs),
            # Any model's hand-off is an input (its tokens); only its KV needs this model.
            expect={"revision": settings.revision},
            consumer=self._arrived,
            # Taken even by a stage fed whole: a stream sent to it (its upstream reads the
            # edge as streamed) is refused here, its request's endpoint told why at once.
            streams=self._chunk_arrived).start()
        if settings.streams:
            from omni_runtime.stages.stream_input import StreamInputs
            from omni_runtime.transfers.streams import ConsumerStreams

            from prometheus_client import REGISTRY

            from omni_runtime.observability.stream_metrics import StreamMetrics

            ledger = ConsumerStreams()
            self._stream_metrics = StreamMetrics(
                settings.stage, self._model_name, REGISTRY, from_stages=settings.streams)
            ledger.add_observer(self._stream_metrics)
            self.streams = StreamInputs(self._engine, ledger, self._stream_params,
                                        self._stream_output)
            self._track(self._loop.create_task(self._expire_streams()))
        logger.info("stage %s: taking hand-offs from %s on %s as requests (input hook %s)",
                    settings.stage, ", ".join(settings.inputs) or "any stage",
                    self.receiver.endpoint, settings.hook or "the default: every token")

    async def stop(self) -> None:
        self._stopping = True
        if self.receiver is not None:
            self.receiver.close()
        if self.streams is not None:
            await self.streams.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ a stop's drain
    def open_streams(self) -> int:
        """The streamed inputs open here (their streams begun, not ended)."""
        if self.streams is None:
            return 0
        return int(sum(c.get("open", 0) for c in self.streams.ledger.counts().values()))

    async def drain_streams(self, timeout: float) -> int:
        """The stage is stopping: from now on a hand-off or a chunk that would begin a new
        stream is refused (the stage is stopping), while each open stream goes on to its
        last chunk, its producer's end or a deadline; returns once none is open, or after
        ``timeout`` seconds, with the number still open. Before vLLM's own drain, which
        would end a streamed request waiting for its next chunk as if it had finished
        (the stage's supervisor calls it first: ar.py)."""
        self.draining = True
        if self.streams is None:
            return 0
        if self._drain_changed is None:
            from omni_runtime.transfers.streams import StreamObserver

            loop, changed = self._loop, asyncio.Event()

            class Ended(StreamObserver):  # each stream's end wakes the drain
                def on_resolved(self, end: Any, stream: Any, now: float) -> None:
                    loop.call_soon_threadsafe(changed.set)

            self._drain_changed = changed
            self.streams.ledger.add_observer(Ended())
        deadline = self._loop.time() + timeout
        while True:
            self._drain_changed.clear()
            left, remaining = self.open_streams(), deadline - self._loop.time()
            if not left or remaining <= 0:
                return left
            try:
                await asyncio.wait_for(self._drain_changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    @property
    def dead(self) -> str | None:
        """Why the stage cannot take inputs any more (its receiver's thread died), or None."""
        if self.receiver is None or self.receiver.running:
            return None
        return f"the KV receiver's thread died: {self.receiver.died or 'stopped'}"

    def _file_prefix(self, suffix: str) -> str:
        return f"omni-kv-{self.settings.pipeline}-{self.settings.stage}-{os.getpid()}-{suffix}"

    # ------------------------------------------------------------------ an input
    def _arrived(self, payload: Any, ticket: Any) -> None:
        """On the receiver's thread: a payload stored, its transfer awaiting our answer."""
        self._loop.call_soon_threadsafe(self._spawn, payload.request_id, ticket)

    def _spawn(self, request_id: str, ticket: Any) -> None:
        if self._stopping or self.draining:
            self.receiver.settle(ticket, ("stopping", f"stage {self.settings.stage} is "
                                                      "stopping"))
            return
        task = self._loop.create_task(self._take(request_id, ticket))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _take(self, request_id: str, ticket: Any) -> None:
        # Not assembled here: the input hook and the KV prefix's file decide where (below).
        payload = self.receiver.inbox.get(request_id, assemble=False)
        link = linking = path = None
        try:
            if payload is None:
                raise Refused("the payload left the inbox before the stage took it")
            pipeline_id, endpoint, token = self._origin(payload)
            if endpoint is not None:  # opens while the request is made
                linking = self._loop.create_task(self._link(endpoint, pipeline_id, token))
            if payload.nbytes <= INLINE_BYTES:
                prompt, params, path = self._prepare(payload, pipeline_id)
            else:  # a large payload's assembly off the server's event loop
                prompt, params, path = await self._loop.run_in_executor(
                    self._executor, self._prepare, payload, pipeline_id)
            await self._admit(ticket)
            try:
                collector = await self._engine.add_request(
                    pipeline_id, prompt, params, trace_headers=payload.trace_context)
            except BaseException:
                self._admission.release()
                raise
        except asyncio.CancelledError:
            if linking is not None:
                linking.cancel()
            self.receiver.settle(ticket, ("input_refused", "the stage is stopping"))
            _remove(path)
            raise
        except Exception as exc:
            if linking is not None:  # whatever refused the input is told at the endpoint
                link = await _opened(linking)
            refused = exc if isinstance(exc, Refused) else _refused_by_vllm(exc)
            await self._refuse(ticket, refused, link, path, request_id)
            return
        if linking is not None and linking.done() and linking.exception() is not None:
            # The pipeline request was gone before its request was: no work, the input refused.
            await self._engine.abort(collector.request_id, internal=True)
            collector.close()
            self._admission.release()
            await self._refuse(ticket, linking.exception(), None, path, request_id)
            return
        # The request holds its input: the hand-off is acked (when: unix, for the endpoint).
        self.receiver.settle(ticket)
        taken_at = time.time()
        try:
            if linking is not None:
                link = await _opened(linking)
                if link is None:  # the pipeline request went away meanwhile: its work too
                    await self._engine.abort(collector.request_id, internal=True)
                    collector.close()
                    return
                await link.send("taken", offered_at=payload.sent_at, taken_at=taken_at)
            await self._follow(collector, link, path)
        finally:
            self._admission.release()
            _remove(path)
            if link is not None:
                await link.close()

    # ------------------------------------------------------------------ a streamed input
    def _track(self, task: asyncio.Task) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _chunk_arrived(self, message: Any, ticket: Any) -> None:
        """On the receiver's thread: a stream's chunk (with its ticket) or its early end."""
        self._loop.call_soon_threadsafe(self._spawn_chunk, message, ticket)

    def _spawn_chunk(self, message: Any, ticket: Any) -> None:
        if self._stopping or (self.draining and ticket is not None and (
                message.request_id, message.from_stage) not in self._stream_requests):
            if ticket is not None:  # stopping, or a new stream while the open ones drain
                self.receiver.settle(ticket, ("stopping",
                                              f"stage {self.settings.stage} is stopping"))
            return
        if ticket is None and self.streams is None:
            return  # a stream's end where none is taken: nothing of it is here
        self._track(self._loop.create_task(
            self._take_chunk(message, ticket) if ticket is not None
            else self._end_stream(message)))

    async def _take_chunk(self, chunk: Any, ticket: Any) -> None:
        from omni_runtime.stages.stream_input import ChunkIn

        settings = self.settings.streams.get(chunk.from_stage)
        key = (chunk.request_id, chunk.from_stage)
        try:
            if settings is None:
                raise Refused(f"stage {self.settings.stage} takes {chunk.from_stage}'s output "
                              "whole, not streamed: both ends must read the same edge")
            tokens = chunk.token_ids
            opened = False
            if self._ended(key):
                raise Refused(f"chunk {chunk.seq} of the stream of request {chunk.request_id} from "
                              f"{chunk.from_stage} cannot be taken: its stream ended here")
            if chunk.seq == 0 and key not in self._stream_requests:
                pipeline_id, endpoint, token = self._origin(chunk)
                if self.streams.ledger.get(pipeline_id, chunk.from_stage) is not None:
                    raise Refused(f"a stream of pipeline request {pipeline_id} from stage {chunk.from_stage} "
                                  "is still open here: a second request of that id (X-Request-Id) cannot "
                                  "be taken until it ends", status=409, param="X-Request-Id")
                # A new producer request: a stream of an earlier pipeline request of the same
                # id that ended here (a client's X-Request-Id used again) is not this one.
                self.streams.ledger.reopen(pipeline_id, chunk.from_stage)
                opened = True
                made = self._request(_ChunkUpstream(chunk), pipeline_id)
                tokens = tuple(made.prompt.get("prompt_token_ids") or ())
                self._stream_requests[key] = pipeline_id
                # [the task opening its link to the endpoint, tokens said, the hook's
                # sampling parameters, the pipeline context its own hand-offs carry on]
                entry = [None, 0, made.sampling_params, chunk.origin]
                self._stream_links[pipeline_id] = entry
                if endpoint is not None:
                    # Opened beside the request, not before it: the engine starts at once.
                    entry[0] = self._loop.create_task(self._open_stream_link(
                        endpoint, pipeline_id, chunk.from_stage, chunk.sent_at, token))
            pipeline_id = self._stream_requests.get(key)
            if pipeline_id is None:  # a chunk of a stream whose first chunk never came here
                pipeline_id = chunk.request_id
        except Refused as refused:
            self.receiver.settle(ticket, (refused.code, refused.reason[:512]))
            if chunk.seq == 0 and key not in self._stream_requests:
                # No link of this request says anything here yet: the endpoint hears why now,
                # not at the stream's first-chunk deadline (an outside review: a client's
                # X-Request-Id used again while the stream of its first use was still open
                # here waited for that deadline and was told the stage did not take it).
                self._track(self._loop.create_task(self._tell_refused(chunk, refused)))
            return
        why = await self.streams.take(ChunkIn(pipeline_id, chunk.from_stage, chunk.seq,
                                              chunk.last, tuple(tokens), chunk.produced_at,
                                              settings, chunk.trace_context))
        self.receiver.settle(ticket, None if why is None else ("input_refused", why[:512]))
        if why is not None and opened and pipeline_id in self._stream_links:
            # Its first chunk refused, no request began: the link already said "taken", so
            # the endpoint hears why now (not at its request timeout).
            from omni_runtime.stages.stream_input import StreamFailed

            await self._stream_output(pipeline_id, StreamFailed(why))

    def _ended(self, key: tuple[str, str]) -> bool:
        """Whether the stream ``key`` ended here within its streamSeconds (forgotten after)."""
        now = time.monotonic()
        self._ended_streams.forget_due(now)
        return self._ended_streams.remembers(key, now)

    async def _open_stream_link(self, endpoint: str, pipeline_id: str, from_stage: str,
                                offered_at: float, token: str | None) -> Any:
        """The streamed request's link to the endpoint, its input taken said; None when the
        pipeline request is gone (its stream then ends here)."""
        from omni_runtime.transfers.streams import StreamOutcome

        taken_at = time.time()
        try:
            link = await self._link(endpoint, pipeline_id, token)
        except Refused as refused:
            await self.streams.end(pipeline_id, from_stage, StreamOutcome.ABORTED,
                                   refused.reason)
            return None
        await link.send("taken", offered_at=offered_at, taken_at=taken_at)
        self._track(self._loop.create_task(self._abort_on(link, pipeline_id, from_stage)))
        return link

    async def _tell_refused(self, chunk: Any, refused: Refused) -> None:
        """A stream's first chunk refused: its pipeline request's endpoint told, naming why."""
        try:
            pipeline_id, endpoint, token = self._origin(chunk)
            if endpoint is None:
                return
            link = await self._link(endpoint, pipeline_id, token)
        except Refused:
            return  # no context to tell, or the request is gone
        try:
            await link.send("error", message=f"refused its streamed input from stage "
                            f"{chunk.from_stage}: {refused.reason}", status=refused.status,
                            param=refused.param)
        finally:
            await link.close()

    async def _end_stream(self, end: Any) -> None:
        from omni_runtime.transfers.streams import StreamOutcome

        pipeline_id = self._stream_requests.get((end.request_id, end.from_stage),
                                                end.request_id)
        outcome = StreamOutcome.PRODUCER_ERROR if end.outcome == "producer_error" else (
            StreamOutcome(end.outcome))
        await self.streams.end(pipeline_id, end.from_stage, outcome,
                               f"stage {end.from_stage} ended the stream: {end.reason}")

    def _stream_params(self, chunk: Any) -> Any:
        entry = self._stream_links.get(chunk.request_id)
        params = self._sampling_params(entry[2] if entry is not None else {})
        if entry is not None and entry[3]:
            # The request's own output goes on with the pipeline request's context.
            params.extra_args = {**(params.extra_args or {}),
                                 "kv_transfer_params": {KV_PARAMS_KEY: dict(entry[3])}}
        return params

    async def _stream_output(self, pipeline_id: str, output: Any) -> None:
        """A streamed input's request said something: its output to the endpoint (the last
        stage), its end, or (``output`` None, or a failure) an error."""
        from omni_runtime.stages.stream_input import StreamFailed

        entry = self._stream_links.get(pipeline_id)
        link = await _opened(entry[0]) if entry is not None and entry[0] is not None else None
        if isinstance(output, StreamFailed):
            self._forget_stream(pipeline_id)
            if link is not None:
                # The producer's doing: it is the stage named (else this one, the endpoint's default).
                named = {} if output.producer is None else {"stage": output.producer}
                which = f"its stream to stage {self.settings.stage}" if named else "its streamed input"
                await link.send("error", message=f"{which} failed: {output}", status=output.status,
                                param=output.param, **named)
                await link.close()
            return
        completion = output.outputs[0]
        entry[1] += len(completion.token_ids)
        sink = not self.settings.downstream
        if link is not None and sink and (completion.token_ids or completion.text):
            await link.send("output", token_ids=list(completion.token_ids),
                            text=completion.text)
        if output.finished:
            self._forget_stream(pipeline_id)
            try:
                await self._finished(output, link, sink, entry[1])
            finally:
                if link is not None:
                    await link.close()

    async def _abort_on(self, link: Any, pipeline_id: str, from_stage: str) -> None:
        """An abort from the endpoint (or its link dropping) ends the stream's request."""
        from omni_runtime.transfers.streams import StreamOutcome

        await link.aborted.wait()
        if pipeline_id in self._stream_links:
            logger.info("request %s aborted: %s", pipeline_id, link.abort_reason)
            await self.streams.end(pipeline_id, from_stage, StreamOutcome.ABORTED,
                                   f"aborted at the endpoint: {link.abort_reason}")

    #: Ended streams remembered at most (each for its streamSeconds).
    MAX_ENDED_STREAMS = 65536

    def _forget_stream(self, pipeline_id: str) -> None:
        self._stream_links.pop(pipeline_id, None)
        now = time.monotonic()
        for key in [k for k, v in self._stream_requests.items() if v == pipeline_id]:
            del self._stream_requests[key]
            settings = self.settings.streams.get(key[1])
            self._ended_streams.add(key, now + (settings.stream_seconds if settings is not None else 0.0))

    async def _expire_streams(self) -> None:
        """The consumer's stream deadlines (a chunk that never comes), on a timer; the gauges
        are set there too."""
        every = check_interval(self.settings.streams.values())
        while True:
            await asyncio.sleep(every)
            self._stream_metrics.refresh(self.streams.ledger)
            for stream in await self.streams.expire():
                pipeline_id = stream.request_id
                entry = self._stream_links.get(pipeline_id)
                self._forget_stream(pipeline_id)
                link = await _opened(entry[0]) if entry is not None and entry[0] else None
                if link is not None:
                    await link.send("error", message=stream.reason or "stream expired")
                    await link.close()

    def _origin(self, payload: Any) -> tuple[str, str | None, str | None]:
        """The pipeline request's id, its endpoint (None: it came from none) and the token its
        links present."""
        try:
            found, token = parse_origin(payload.origin), origin_token(payload.origin)
        except ProtocolError as exc:
            raise Refused(f"its pipeline context is malformed: {exc}") from None
        if found is not None:
            return (*found, token)
        return payload.external_request_id or payload.request_id, None, None

    def _request(self, payload: Any, pipeline_id: str):
        upstream = Upstream(pipeline_id, payload.from_stage, tuple(payload.token_ids),
                            payload.prompt_len, payload.seq_len,
                            None if isinstance(payload, _ChunkUpstream) else payload)
        if not upstream.token_ids and self.settings.hook is None:
            raise Refused(f"the hand-off from stage {payload.from_stage} carries no tokens "
                          "(an upstream of an older version?) and no input hook makes an "
                          "input without them")
        try:
            return request_of(self._hook, upstream)
        except ValueError as exc:
            raise Refused(str(exc)) from None

    def _sampling_params(self, overrides: Mapping[str, Any]):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        try:
            params = SamplingParams(**{**self.settings.sampling_params, **overrides})
        except (TypeError, ValueError) as exc:
            raise Refused(f"the input hook's sampling parameters: {exc}") from None
        params.output_kind = RequestOutputKind.DELTA
        return params

    def _kv_fits(self, payload: Any, prompt: Mapping[str, Any]) -> bool:
        """Whether the payload's KV can be the request's prefix: allowed, the same model of
        the same shape, and a prompt that begins with the tokens it covers."""
        if not self.settings.load_kv or payload.model != self._model_name:
            return False
        layers, _, heads, seq_len, head_size = payload.shape
        if (layers, heads, head_size, payload.dtype_name) != self._identity:
            return False
        tokens = prompt.get("prompt_token_ids")
        return (isinstance(tokens, (list, tuple)) and len(tokens) > 1
                and list(tokens[:seq_len]) == list(payload.token_ids[:seq_len]))

    def _prepare(self, payload: Any, pipeline_id: str) -> tuple[dict, Any, str | None]:
        """On a thread of ours: the request's prompt, its sampling parameters (with its
        pipeline context and, where the upstream's KV is its prefix, the file the engine
        loads it from), and that file's path; Refused when it cannot be made."""
        made = self._request(payload, pipeline_id)
        params = self._sampling_params(made.sampling_params)
        prompt = dict(made.prompt)
        kv_params: dict[str, Any] = {}
        if payload.origin is not None:
            kv_params[KV_PARAMS_KEY] = dict(payload.origin)
        path = None
        if made.reuse_kv and self._kv_fits(payload, prompt):
            self._files += 1
            source = payload_into_file(payload, self.settings.payload_dir,
                                       self._file_prefix(str(self._files)))
            path = source.path
            kv_params[LOAD_PARAMS] = source.as_params()
        if kv_params:
            params.extra_args = {**(params.extra_args or {}), "kv_transfer_params": kv_params}
        return prompt, params, path

    async def _link(self, endpoint: str, pipeline_id: str, token: str | None):
        from omni_runtime.pipeline.link import EndpointLink, LinkError

        try:
            return await EndpointLink.open(self._session, endpoint, pipeline_id,
                                           self.settings.stage, token=token)
        except LinkError as exc:
            raise Refused(f"the pipeline request is gone: {exc}") from None

    async def _admit(self, ticket: Any) -> None:
        if not self._admission.locked():  # room now: taken without a task to time it out
            await self._admission.acquire()
            return
        left = ticket.deadline - time.monotonic()  # the receiver's clock
        try:
            await asyncio.wait_for(self._admission.acquire(), max(0.0, left))
        except asyncio.TimeoutError:
            raise Refused(f"stage {self.settings.stage} is busy: {self.settings.max_inputs} "
                          "requests from hand-offs are in flight, none ended before the "
                          "transfer's deadline") from None

    async def _refuse(self, ticket: Any, refused: Refused, link: Any, path: str | None,
                      request_id: str) -> None:
        logger.warning("stage %s refused the hand-off of request %s: %s", self.settings.stage,
                       request_id, refused.reason)
        self.receiver.settle(ticket, (refused.code, refused.reason[:512]))
        _remove(path)
        if link is not None:
            await link.send("error", message=f"refused its input: {refused.reason}",
                            status=refused.status)
            await link.close()

    async def _follow(self, collector: Any, link: Any, path: str | None) -> None:
        """The request's outputs, to the endpoint when this is the pipeline's last stage;
        its end told; an abort from the endpoint aborts it."""
        sink = not self.settings.downstream
        aborted = asyncio.ensure_future(link.aborted.wait()) if link is not None else None
        generated = 0
        try:
            while True:
                output = collector.get_nowait()
                if output is None:
                    getting = asyncio.ensure_future(collector.get())
                    waits = {getting} | ({aborted} if aborted is not None else set())
                    done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    if getting not in done:
                        getting.cancel()
                        logger.info("request %s aborted: %s", collector.request_id,
                                    link.abort_reason)
                        await self._engine.abort(collector.request_id, internal=True)
                        return
                    output = getting.result()
                _remove(path)  # scheduled at least once: the engine has loaded its prefix
                path = None
                completion = output.outputs[0]
                generated += len(completion.token_ids)
                if link is not None and sink and (completion.token_ids or completion.text):
                    await link.send("output", token_ids=list(completion.token_ids),
                                    text=completion.text)
                if output.finished:
                    await self._finished(output, link, sink, generated)
                    return
        except asyncio.CancelledError:
            await self._engine.abort(collector.request_id, internal=True)
            raise
        except Exception as exc:  # the engine failed the request
            logger.warning("request %s failed: %s: %s", collector.request_id,
                           type(exc).__name__, exc)
            if link is not None:
                await link.send("error", message=f"{type(exc).__name__}: {exc}")
        finally:
            if aborted is not None:
                aborted.cancel()
            collector.close()

    async def _finished(self, output: Any, link: Any, sink: bool, generated: int) -> None:
        if link is None:
            return
        completion = output.outputs[0]
        if completion.finish_reason not in ("stop", "length"):
            await link.send("error", message=f"its request ended with finish_reason "
                            f"{completion.finish_reason!r}")
        elif sink:
            prompt_tokens = len(output.prompt_token_ids or ())
            await link.send("done", finish_reason=completion.finish_reason, usage={
                "prompt_tokens": prompt_tokens, "completion_tokens": generated,
                "total_tokens": prompt_tokens + generated,
                "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens}})
        elif (output.kv_transfer_params or {}).get("kv_metadata") is not None or (
                self.settings.streams_out):
            # Whole: its transfer was made; streamed: its chunks went while it decoded.
            await link.send("handed_off", to=list(self.settings.downstream))
        else:
            await link.send("done", finish_reason=completion.finish_reason)


class _ChunkUpstream:
    """A stream's first chunk as the input hook's Upstream needs it (its tokens, how many
    the prompt; no KV payload)."""

    def __init__(self, chunk: Any) -> None:
        self.from_stage = chunk.from_stage
        self.token_ids = chunk.token_ids
        self.prompt_len = chunk.prompt_len
        self.seq_len = 0
        self.external_request_id = chunk.external_request_id
        self.request_id = chunk.request_id
        self.origin = chunk.origin


async def _opened(linking: asyncio.Task) -> Any:
    """The link the task opened, or None (it could not: the request is gone)."""
    try:
        return await linking
    except Refused as refused:
        logger.info("no link: %s", refused.reason)
        return None


def _remove(path: str | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


#: The route by which the stage's supervisor drains its streamed inputs before vLLM stops
#: (StageInputMiddleware._drain; ar.py).
DRAIN_PATH = "/omni/drain"


class StageInputMiddleware:
    """vLLM's ``--middleware`` hook (an ASGI middleware): starts the stage input with the
    server (its lifespan; the engine client is on the app's state by then), stops it with
    the server, and fails ``/health`` while it cannot take inputs."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.stage_input: StageInput | None = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, self._lifespan_receive(scope, receive), send)
            return
        if (scope["type"] == "http" and scope.get("path") == "/health"
                and self.stage_input is not None and (dead := self.stage_input.dead)):
            await _respond(send, 503, f'{{"error": "{dead}"}}'.encode())
            return
        if scope["type"] == "http" and scope.get("path") == DRAIN_PATH:
            await self._drain(scope, send)
            return
        if (scope["type"] == "http" and scope.get("path") == "/health"
                and self.stage_input is not None and self.stage_input.draining):
            await _respond(send, 503, b'{"error": "stopping"}')
            return
        await self.app(scope, receive, send)

    async def _drain(self, scope: dict, send: Any) -> None:
        """``POST /omni/drain?wait=SECONDS``, from the stage's own supervisor only (the same
        host: the port is open to every client): the stage's streamed inputs drain
        (StageInput.drain_streams), answered with the number still open when they are done
        or the wait is over."""
        client = (scope.get("client") or ("",))[0]
        server = (scope.get("server") or ("",))[0]
        if client not in ("127.0.0.1", "::1", server):
            await _respond(send, 403, b'{"error": "only the stage itself may drain it"}')
            return
        if scope.get("method") != "POST":
            await _respond(send, 405, b'{"error": "POST"}')
            return
        import json
        import urllib.parse

        try:
            query = dict(urllib.parse.parse_qsl(scope.get("query_string", b"").decode()))
            wait = max(0.0, float(query.get("wait", "0")))
        except ValueError:
            await _respond(send, 400, b'{"error": "wait must be a number of seconds"}')
            return
        left = 0 if self.stage_input is None else await self.stage_input.drain_streams(wait)
        await _respond(send, 200, json.dumps({"open": left}).encode())

    def _lifespan_receive(self, scope: dict, receive: Any) -> Any:
        async def wrapped() -> dict:
            message = await receive()
            if message["type"] == "lifespan.startup":
                log_like_vllm()
                state = scope["app"].state
                settings = InputSettings.parse(
                    (state.vllm_config.additional_config or {}).get(SETTINGS_KEY))
                self.stage_input = StageInput(settings, state.engine_client, state.vllm_config)
                await self.stage_input.start()
            elif message["type"] == "lifespan.shutdown" and self.stage_input is not None:
                await self.stage_input.stop()
            return message
        return wrapped


async def _respond(send: Any, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


__all__ = ["InputSettings", "InputSettingsError", "StageInput", "StageInputMiddleware",
           "InputHookError"]
