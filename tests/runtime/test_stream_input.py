"""A downstream vLLM stage's streamed input (stages/stream_input.py) on a real engine (vLLM's
AsyncLLM, the tiny model, its engine core in its own process): each stream one
streaming-input session that its chunks extend, in order whatever order they come in, a
refused chunk failing its request alone.

The chunks are handed to StreamInputs directly here, as the stage's KV receiver hands them on;
the transport's own tests cover their way there."""

from __future__ import annotations

import asyncio

import pytest

from omni_contract.edges import StreamSettings
from omni_runtime.devtools.tiny_model import ensure_tiny_model
from omni_runtime.transfers.streams import ConsumerStreams, StreamOutcome
from omni_runtime.stages.stream_input import ChunkIn, StreamFailed, StreamInputs

pytestmark = pytest.mark.engine

S = StreamSettings(first_chunk_tokens=4, chunk_tokens=8, gap_seconds=30, chunks_in_flight=4)
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def loop():
    # One loop for the module: AsyncLLM's output handler runs as a task of the loop that
    # first used it.
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(loop):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=str(ensure_tiny_model()), max_model_len=MAX_MODEL_LEN, enforce_eager=True,
        kv_cache_memory_bytes=64 << 20, max_num_seqs=8))
    yield llm

    async def stop():
        # On the loop: vLLM closes its sockets there (from another thread it would only
        # schedule that on the loop, and a ZeroMQ context left with open sockets hangs
        # whoever garbage-collects it later, in another test).
        llm.shutdown()

    loop.run_until_complete(stop())


def params(_chunk):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                          output_kind=RequestOutputKind.DELTA)


class Outputs:
    def __init__(self):
        self.by_request = {}
        self.first = {}

    async def __call__(self, request_id, output):
        self.by_request.setdefault(request_id, []).append(output)
        self.first.setdefault(request_id, asyncio.get_running_loop().create_future())
        if not self.first[request_id].done():
            self.first[request_id].set_result(output)

    def final(self, request_id):
        return self.by_request[request_id][-1]


def chunk(rid, seq, tokens, last=False, settings=S):
    return ChunkIn(rid, "thinker", seq, last, tuple(tokens), 0.0, settings)




def test_a_stream_is_one_request_extended_chunk_by_chunk_and_speaks_before_its_end(engine, loop):
    async def go():
        outputs = Outputs()
        inputs = StreamInputs(engine, ConsumerStreams(), params, outputs)
        pieces = [list(range(10, 14)), list(range(20, 28)), list(range(30, 33))]
        assert await inputs.take(chunk("a", 0, pieces[0])) is None
        # The talker answers the first chunk while the rest has not come.
        first = await asyncio.wait_for(outputs.first.setdefault(
            "a", asyncio.get_running_loop().create_future()), 60)
        assert first.outputs[0].token_ids and not first.finished
        assert await inputs.take(chunk("a", 1, pieces[1])) is None
        assert await inputs.take(chunk("a", 2, pieces[2], last=True)) is None
        await inputs.ended("a", "thinker")
        final = outputs.final("a")
        assert final.finished
        # Its input is every chunk, in order, token for token (vLLM keeps each turn's
        # computed output in the sequence, between the chunks).
        prompt = list(final.prompt_token_ids)
        assert prompt == pieces[0] + pieces[1] + pieces[2]
        assert len(inputs.ledger) == 0
    loop.run_until_complete(go())


def test_chunks_out_of_order_are_applied_in_order_and_a_repeat_is_acked_not_applied(engine, loop):
    async def go():
        outputs = Outputs()
        inputs = StreamInputs(engine, ConsumerStreams(), params, outputs)
        early = asyncio.ensure_future(inputs.take(chunk("b", 1, [40, 41, 42])))
        await asyncio.sleep(0)  # one turn of the loop: the chunk reached the ledger
        assert not early.done()  # kept until chunk 0 comes
        assert await inputs.take(chunk("b", 0, [50, 51, 52, 53])) is None
        assert await early is None
        assert await inputs.take(chunk("b", 0, [50, 51, 52, 53])) is None  # a repeat
        assert await inputs.take(chunk("b", 2, [], last=True)) is None   # an empty last one
        await inputs.ended("b", "thinker")
        assert list(outputs.final("b").prompt_token_ids) == [50, 51, 52, 53, 40, 41, 42]
        # A late copy of a chunk of the finished stream never opens it again.
        assert "cannot be taken" in await inputs.take(chunk("b", 0, [50]))
    loop.run_until_complete(go())


def test_a_chunk_the_engine_refuses_fails_its_request_alone(engine, loop):
    async def go():
        outputs = Outputs()
        ledger = ConsumerStreams()
        inputs = StreamInputs(engine, ledger, params, outputs)
        assert await inputs.take(chunk("ok", 0, [1, 2, 3, 4])) is None
        assert await inputs.take(chunk("big", 0, [5, 6, 7, 8])) is None
        refused = await inputs.take(chunk("big", 1, list(range(100, 100 + MAX_MODEL_LEN))))
        assert refused and "big" in refused and str(MAX_MODEL_LEN) in refused
        await inputs.ended("big", "thinker")
        # Its request's end, heard with the status its client gets: 400, it asked for more
        # than this stage's request can hold.
        failed = outputs.final("big")
        assert isinstance(failed, StreamFailed) and failed.status == 400, failed
        # The other stream goes on in the same engine.
        assert await inputs.take(chunk("ok", 1, [9, 10], last=True)) is None
        await inputs.ended("ok", "thinker")
        assert not inputs._sessions and outputs.final("ok").finished
        assert list(outputs.final("ok").prompt_token_ids) == [1, 2, 3, 4, 9, 10]
    loop.run_until_complete(go())


def test_a_first_chunk_over_the_length_fails_its_request_with_a_400_and_leaves_nothing(engine, loop):
    """Chunk 0 over max-model-len: its request's task was cancelled before it began, so its
    report never ran: the client got the stage input's 502 (which a default openai client
    sends three times) and not the 400 naming max_tokens, and the session stayed (an
    outside review)."""
    async def go():
        outputs = Outputs()
        inputs = StreamInputs(engine, ConsumerStreams(), params, outputs)
        refused = await inputs.take(chunk("long", 0, list(range(100, 100 + MAX_MODEL_LEN))))
        assert refused and f"chunk 0 adds {MAX_MODEL_LEN} tokens" in refused, refused
        await inputs.ended("long", "thinker")
        failed = outputs.final("long")
        assert isinstance(failed, StreamFailed) and (failed.status, failed.param) == (400, "max_tokens"), failed
        assert not inputs._sessions
    loop.run_until_complete(go())


def test_a_chunk_that_would_overflow_once_the_turns_before_it_have_spoken_is_refused(engine, loop):
    """A chunk that comes while a turn runs waits in vLLM's queue until that turn has said its
    max_tokens, then is appended whole: counted on what was said so far it fitted (100 + 20 <
    128), appended it made 135 tokens and vLLM 0.32's worker failed on it ("could not
    broadcast input array from shape (135,) into shape (128,)"), and the engine with it (a
    stress run of the streamed example found it). Refused here, that request alone."""
    def speaks_16(_chunk):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True,
                              output_kind=RequestOutputKind.DELTA)

    async def go():
        outputs = Outputs()
        inputs = StreamInputs(engine, ConsumerStreams(), speaks_16, outputs)
        assert await inputs.take(chunk("long", 0, list(range(100, 200)))) is None
        refused = await inputs.take(chunk("long", 1, list(range(200, 220))))
        assert refused and "max-model-len 128" in refused and "100 fed in 1 chunks" in refused, refused
        await inputs.ended("long", "thinker")
        # The engine lives: the next stream is answered.
        assert await inputs.take(chunk("next", 0, [1, 2, 3], last=True)) is None
        await inputs.ended("next", "thinker")
        assert outputs.final("next").finished and len(outputs.final("next").outputs[0].token_ids) > 0
        assert not inputs._sessions
    loop.run_until_complete(go())


def test_an_ended_or_silent_stream_aborts_its_request_and_answers_its_chunks(engine, loop):
    async def go():
        now = [0.0]
        quick = StreamSettings(first_chunk_tokens=4, chunk_tokens=8, gap_seconds=1.0,
                               chunks_in_flight=4)
        ledger = ConsumerStreams()
        inputs = StreamInputs(engine, ledger, params, Outputs(), clock=lambda: now[0])
        assert await inputs.take(chunk("gone", 0, [1, 2, 3, 4])) is None
        early = asyncio.ensure_future(inputs.take(chunk("gone", 2, [7])))
        await asyncio.sleep(0)  # one turn of the loop: the chunk reached the ledger
        await inputs.end("gone", "thinker", StreamOutcome.PRODUCER_ERROR,
                         "stage thinker: the engine failed")
        assert "thinker" in await early
        assert not inputs._sessions and len(ledger) == 0
        assert await inputs.take(chunk("quiet", 0, [1, 2, 3, 4], settings=quick)) is None
        now[0] = 0.5
        assert await inputs.expire() == []
        now[0] = 1.5
        [expired] = await inputs.expire()
        assert expired.outcome is StreamOutcome.EXPIRED and "gap deadline" in expired.reason
        assert not inputs._sessions and len(ledger) == 0
    loop.run_until_complete(go())
