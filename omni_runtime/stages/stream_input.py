"""A streamed input of a downstream vLLM stage: each stream one request in the engine, which
its chunks extend as they come, on vLLM's own mechanism for it.

vLLM 0.32 has streaming-input sessions: ``AsyncLLM.generate`` takes an async generator of
``StreamingInput``; the first input starts a *resumable* request, each later one is appended
to it (the request waits in ``WAITING_FOR_STREAMING_REQ`` between inputs, its KV kept), and
the generator's end finishes it. Each input is a turn: the engine prefills the new tokens and
generates up to the turn's ``max_tokens`` before it waits for the next (vLLM keeps the turn's
computed output as part of the sequence). So a talker speaks after each chunk of its
thinker's output instead of after the whole of it, and no request is ever taken out of
vLLM's queues and put back (vllm-omni's ``process_pending_chunks``/``restore_queues``).

Order and acks come from the stream ledger (:class:`~omni_runtime.transfers.streams.ConsumerStreams`):
a chunk ahead of its turn waits for the missing one, a repeated one is acked again without
being applied, and a chunk is acked once it is in the request (the engine's input task has
added it: the generator was resumed past it). A chunk the engine refuses (over the model's
length, a bad token) ends that request and its stream (``consumer_error``, with vLLM's
reason), never the engine. The chunks' tokens are what the request is extended with: the
stage's input hook has made them (stage_input.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from omni_contract.edges import StreamSettings
from omni_runtime.transfers.streams import PRODUCERS_DOING, ConsumerStreams, Stream, StreamOutcome

logger = logging.getLogger(__name__)


class StreamFailed(Exception):
    """What ``on_output`` hears when a stream's request ends without finishing: the reason
    (vLLM refused a chunk, the producer ended the stream, a deadline passed, an abort), and
    the HTTP status the pipeline's client gets (400: its request asked for more tokens than
    this stage's request can hold)."""

    def __init__(self, reason: str, status: int = 502, param: str | None = None,
                 producer: str | None = None) -> None:
        super().__init__(reason)
        #: ``param``: the client's request parameter it names (OpenAI's error ``param``);
        #: ``producer``: the upstream stage at fault, where the producer stopped sending or
        #: failed (the consumer only reports it).
        self.status, self.param, self.producer = status, param, producer


@dataclass(frozen=True, slots=True)
class ChunkIn:
    """A chunk as it arrived: its stream (the pipeline request, the producing stage), its
    number, whether it is the last, the tokens it extends the request with, and when (unix)
    the producer cut it."""

    request_id: str
    from_stage: str
    seq: int
    last: bool
    token_ids: tuple[int, ...]
    produced_at: float
    settings: StreamSettings
    #: The producing request's W3C trace headers: the stream's request joins its trace.
    trace_headers: Mapping[str, str] | None = None


class _Session:
    """One stream's request in the engine and the chunks on their way into it."""

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.inputs: asyncio.Queue[tuple[int, tuple[int, ...], bool]] = asyncio.Queue()
        #: Chunks fed and not yet in the request, by seq: their answers.
        self.answers: dict[int, asyncio.Future[str | None]] = {}
        self.task: asyncio.Task | None = None
        #: Tokens of the chunks fed to its request, and the turns they made (a chunk with
        #: tokens is a turn).
        self.fed = 0
        self.turns = 0
        #: What one turn may say (its sampling parameters' max_tokens; None: up to the model's
        #: length).
        self.turn_tokens: int | None = None
        #: The HTTP status of its failure, and the client's parameter it names, for the
        #: pipeline's client.
        self.status = 502
        self.param: str | None = None
        #: Its request's task has begun (a task cancelled before it began runs none of its
        #: own end: the report, the forgetting).
        self.started = False

    def length_with(self, tokens: int, max_len: int) -> int:
        """An upper bound on the request's length once ``tokens`` more are applied: a chunk
        that comes while a turn runs waits in vLLM's queue until the turns before it end,
        each saying up to its max_tokens, and is then appended whole."""
        said = max_len if self.turn_tokens is None and self.turns else self.turns * (self.turn_tokens or 0)
        return self.fed + said + tokens


class StreamInputs:
    """The streamed inputs of one stage: ``take`` each arriving chunk; ``expire`` on a timer.

    ``params`` makes the session's sampling parameters (each turn's, the stage's
    ``input.samplingParams``) for a stream's first chunk; ``on_output(request_id, output)``
    hears every output of a session (the pipeline's endpoint or the next hand-off), and a
    :class:`StreamFailed` as the output when the session ended without finishing."""

    def __init__(self, engine: Any, ledger: ConsumerStreams, params: Callable[[ChunkIn], Any],
                 on_output: Callable[[str, Any], Awaitable[None]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._engine = engine
        self.ledger = ledger
        self._params = params
        self._on_output = on_output
        self._clock = clock
        self._sessions: dict[tuple[str, str], _Session] = {}
        #: The engine's max-model-len: a chunk that would take a request past it is refused
        #: here, before vLLM sees it (vLLM 0.32's engine core fails on a streaming-input
        #: session extended past its max-model-len, every request with it).
        self._max_len = getattr(getattr(engine, "model_config", None), "max_model_len", None)
        #: Chunks that arrived ahead of their turn, with their answers.
        self._early: dict[tuple[str, str, int], tuple[ChunkIn, asyncio.Future]] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    async def take(self, chunk: ChunkIn) -> str | None:
        """The chunk's answer, once there is one: None when it is in its request (or was
        already: a repeated chunk), else why it was refused."""
        verdict, ready = self.ledger.arrive(chunk.request_id, chunk.from_stage, chunk.seq,
                                            chunk.last, chunk.produced_at, chunk.settings,
                                            self._clock())
        if verdict == "duplicate":
            return None
        if verdict == "refused":
            return (f"chunk {chunk.seq} of the stream of request {chunk.request_id} from "
                    f"{chunk.from_stage} cannot be taken: its stream ended here or it is more "
                    f"than {chunk.settings.chunks_in_flight} chunks ahead")
        answer: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        if verdict == "early":
            self._early[(chunk.request_id, chunk.from_stage, chunk.seq)] = (chunk, answer)
            return await answer
        key = (chunk.request_id, chunk.from_stage)
        stream = self.ledger.get(*key)
        session = self._sessions.get(key)
        if session is None:
            session = self._sessions[key] = _Session(stream)
            params = self._params(chunk)
            session.turn_tokens = getattr(params, "max_tokens", None)
            session.task = asyncio.ensure_future(self._run(session, params, chunk.trace_headers))
        for taken in ready:
            if taken.seq == chunk.seq:
                item, fut = chunk, answer
            else:
                item, fut = self._early.pop((chunk.request_id, chunk.from_stage, taken.seq))
            session.answers[item.seq] = fut
            if self._max_len is not None and item.token_ids and (
                    session.length_with(len(item.token_ids), self._max_len) >= self._max_len):
                await self._over_length(session, item)
                break
            session.fed += len(item.token_ids)
            session.turns += bool(item.token_ids)
            session.inputs.put_nowait((item.seq, item.token_ids, item.last))
        return await answer

    async def _over_length(self, session: _Session, chunk: ChunkIn) -> None:
        """Chunk ``chunk`` would take its request to the engine's max-model-len: the stream
        ends for that request alone (``consumer_error``), its request aborted."""
        said = (f"up to {session.turn_tokens} said after each"
                if session.turn_tokens is not None else "no max_tokens per chunk")
        reason = (f"over this stage's max-model-len {self._max_len}: chunk {chunk.seq} adds "
                  f"{len(chunk.token_ids)} tokens to a streamed request that may already hold "
                  f"{session.length_with(0, self._max_len)} ({session.fed} fed in "
                  f"{session.turns} chunks, {said})")
        self.ledger.refused(session.stream, chunk.seq, reason, self._clock())
        # What the client asked for does not fit: its request's fault, its max_tokens (the
        # producer's output, which the chunks carry, follows from it).
        session.status, session.param = 400, "max_tokens"
        started = session.started
        if session.task is not None and not session.task.done():
            session.task.cancel()
            await asyncio.gather(session.task, return_exceptions=True)
        self._end(session, StreamOutcome.CONSUMER_ERROR, reason)
        if not started:
            # Its first chunk over the length: the task never began, so neither its report
            # (the client's 400 naming max_tokens, not a 502 it would retry) nor its forgetting
            # ran.
            self._sessions.pop(session.stream.key, None)
            await self._failed(session, reason)

    async def _inputs(self, session: _Session) -> AsyncIterator[Any]:
        from vllm.engine.protocol import StreamingInput

        while True:
            seq, tokens, last = await session.inputs.get()
            if tokens:
                yield StreamingInput(prompt={"prompt_token_ids": list(tokens)})
            # Resumed: the engine's input task added the chunk to the request (an empty last
            # chunk adds nothing: the generator's end finishes the request).
            self._applied(session, seq)
            if last:
                return

    def _applied(self, session: _Session, seq: int) -> None:
        self.ledger.applied(session.stream, seq, self._clock())
        answer = session.answers.pop(seq, None)
        if answer is not None and not answer.done():
            answer.set_result(None)

    async def _run(self, session: _Session, params: Any,
                   trace_headers: Mapping[str, str] | None = None) -> None:
        stream = session.stream
        session.started = True
        finished = False
        try:
            async for output in self._engine.generate(
                    self._inputs(session), params, stream.request_id,
                    trace_headers=dict(trace_headers) if trace_headers else None):
                if self._on_output is not None:
                    await self._on_output(stream.request_id, output)
                finished = output.finished
        except asyncio.CancelledError:
            await self._engine.abort(stream.request_id)
            self._end(session, StreamOutcome.ABORTED, "the stream was aborted")
            await self._failed(session, "the stream was aborted")
            raise
        except Exception as exc:  # vLLM refused an input or failed the request
            reason = f"{type(exc).__name__}: {exc}"
            logger.warning("the stream of request %s from %s failed: %s", stream.request_id,
                           stream.peer, reason)
            self._end(session, StreamOutcome.CONSUMER_ERROR, reason)
            await self._failed(session, reason)
        else:
            self._end(session, None, "the request ended before the stream did")
            if not finished:
                await self._failed(session, stream.reason or "the request ended before the "
                                   "stream did")
        finally:
            self._sessions.pop(stream.key, None)

    async def _failed(self, session: _Session, reason: str) -> None:
        stream = session.stream
        if self._on_output is not None:
            try:
                producer = stream.peer if stream.outcome in PRODUCERS_DOING else None
                await self._on_output(stream.request_id,
                                      StreamFailed(stream.reason or reason, session.status, session.param, producer))
            except Exception:  # telling must not break the session's end
                logger.exception("reporting the end of the stream of request %s failed",
                                 stream.request_id)

    def _end(self, session: _Session, outcome: StreamOutcome | None, reason: str) -> None:
        """The session is over: its stream resolves (if it has not), and every chunk still
        waiting for its answer, queued or early, is refused with the reason."""
        stream = session.stream
        if not stream.resolved:
            seq = min(session.answers, default=stream.next_seq)
            if outcome is StreamOutcome.CONSUMER_ERROR:
                self.ledger.refused(stream, seq, reason, self._clock())
            else:
                self.ledger.resolve(stream.request_id, outcome or StreamOutcome.CONSUMER_ERROR,
                                    reason, self._clock(), peer=stream.peer)
        for fut in session.answers.values():
            if not fut.done():
                fut.set_result(stream.reason or reason)
        session.answers.clear()
        for key in [k for k in self._early if k[:2] == stream.key]:
            _, fut = self._early.pop(key)
            if not fut.done():
                fut.set_result(stream.reason or reason)

    async def ended(self, request_id: str, from_stage: str) -> None:
        """Returns once the stream's request has left the engine (now, if it has)."""
        session = self._sessions.get((request_id, from_stage))
        if session is not None and session.task is not None:
            await asyncio.gather(session.task, return_exceptions=True)

    async def end(self, request_id: str, from_stage: str, outcome: StreamOutcome,
                  reason: str) -> None:
        """The other end ended the stream (the producer's error or abort) or this stage
        aborts it: its request is aborted, its chunks answered."""
        session = self._sessions.get((request_id, from_stage))
        if session is None:
            self.ledger.resolve(request_id, outcome, reason, self._clock(), peer=from_stage)
            return
        self.ledger.resolve(request_id, outcome, reason, self._clock(), peer=from_stage)
        if session.task is not None and not session.task.done():
            session.task.cancel()
            await asyncio.gather(session.task, return_exceptions=True)

    async def expire(self) -> Sequence[Stream]:
        """Resolves the streams past a deadline (``expired``) and aborts their requests."""
        expired = self.ledger.expire_due(self._clock())
        for stream in expired:
            session = self._sessions.get(stream.key)
            if session is not None and session.task is not None and not session.task.done():
                session.task.cancel()
                await asyncio.gather(session.task, return_exceptions=True)
            for key in [k for k in self._early if k[:2] == stream.key]:
                _, fut = self._early.pop(key)
                if not fut.done():
                    fut.set_result(stream.reason)
        return expired

    async def close(self) -> None:
        for session in list(self._sessions.values()):
            if session.task is not None:
                session.task.cancel()
        await asyncio.gather(*(s.task for s in self._sessions.values() if s.task),
                             return_exceptions=True)
