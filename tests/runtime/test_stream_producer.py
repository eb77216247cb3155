"""The producer's end of a streamed edge on vLLM's real schedulers (sched/streaming.py, no
model: the harness's runner outputs): the chunks are the request's output token for token,
in order, each sent once, under preemption and async scheduling, and nothing is left."""

from __future__ import annotations

import pytest
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from omni_contract.edges import StreamSettings, stream_config
from omni_runtime.devtools.sched_harness import (free_blocks, make_request, make_scheduler,
                                                 make_vllm_config, runner_output)
from omni_runtime.kv.metadata import OmniKVWorkerMetadata
from omni_runtime.sched import OmniARScheduler
from omni_runtime.sched.handoff import ChunkAnswer

SETTINGS = StreamSettings(first_chunk_tokens=2, chunk_tokens=3, chunks_in_flight=2)


def streaming_scheduler(async_scheduling: bool = False, log_stats: bool = False, **kw):
    config = make_vllm_config({"need_send_cache": True, "stage_name": "thinker",
                               "streams": {"talker": stream_config(SETTINGS)}},
                              endpoints={"talker": "tcp://127.0.0.1:9"}, **kw)
    config.scheduler_config.async_scheduling = async_scheduling
    return make_scheduler(OmniARScheduler, config, log_stats=log_stats)


def chunks_of(so: SchedulerOutput):
    meta = so.kv_connector_metadata
    return list(getattr(meta, "chunks", ()) or ())


def run(s, requests, token_of, answer=lambda chunk: None, stats=None,
        unanswered=lambda chunk: False):
    """Steps the scheduler until nothing is left; every chunk is answered in the step after
    it was sent (``answer(chunk)``: None acks, else the refusal; ``unanswered(chunk)``: the
    refusal is the sender giving up waiting). Returns the chunks sent;
    ``stats`` (a list) gets each step's connector stats as the engine core sends them."""
    sent, to_answer = [], []
    for _ in range(2000):
        if not (s.has_requests() or to_answer):
            break
        so = s.schedule()
        sent += chunks_of(so)
        out = runner_output(so, {r: [token_of(r, len(s.requests[r].output_token_ids))]
                                 for r in so.num_scheduled_tokens
                                 if s.requests[r].num_computed_tokens
                                 + so.num_scheduled_tokens[r] >= s.requests[r].num_prompt_tokens},
                            scheduler=s)
        answers = [ChunkAnswer(c.request_id, c.to_stage, c.seq, answer(c), unanswered(c))
                   for c in to_answer if c.end is None]
        to_answer = chunks_of(so)
        if answers:
            out.kv_connector_output = KVConnectorOutput(
                kv_connector_worker_meta=OmniKVWorkerMetadata(chunk_answers=answers))
        for outputs in s.update_from_output(so, out).values():
            got = outputs.scheduler_stats and outputs.scheduler_stats.kv_connector_stats
            if stats is not None and got:
                stats.append(got)
    else:
        raise AssertionError("still busy")
    return sent


def by_request(sent):
    found = {}
    for chunk in sent:
        found.setdefault(chunk.request_id, []).append(chunk)
    return found


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunks_are_the_output_in_order_once_even_under_preemption(async_scheduling):
    s = streaming_scheduler(async_scheduling, num_blocks=9, max_num_seqs=4)
    start = free_blocks(s)
    a = make_request(64, max_tokens=9, request_id="a")
    b = make_request(60, max_tokens=8, request_id="b")
    s.add_request(a)
    s.add_request(b)
    preempted = []
    original = s._preempt_request

    def preempt(request, *args, **kw):
        preempted.append(request.request_id)
        return original(request, *args, **kw)

    s._preempt_request = preempt
    token_of = lambda rid, i: 100 + 10 * ord(rid[0]) % 7 + i  # noqa: E731
    sent = run(s, [a, b], token_of)
    assert preempted, "the small KV cache preempts one of them"
    for rid, req in (("a", a), ("b", b)):
        chunks = by_request(sent)[rid]
        assert [c.seq for c in chunks] == list(range(len(chunks))), "in order, each once"
        assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]
        prompt = tuple(req.prompt_token_ids)
        assert chunks[0].token_ids[:chunks[0].prompt_len] == prompt
        said = chunks[0].token_ids[chunks[0].prompt_len:] + sum(
            (c.token_ids for c in chunks[1:]), ())
        assert list(said) == list(req.output_token_ids), "the output, token for token"
        assert [len(c.token_ids) for c in chunks[1:-1]] == [3] * (len(chunks) - 2)
    streams = s._streams
    assert len(streams) == 0 and not streams._open
    assert free_blocks(s) == start and not s.has_unfinished_requests()


def test_an_abort_ends_the_stream_with_word_to_the_consumer_and_a_refusal_ends_it_too():
    s = streaming_scheduler()
    a = make_request(8, max_tokens=20, request_id="a")
    b = make_request(8, max_tokens=20, request_id="b")
    s.add_request(a)
    s.add_request(b)
    for _ in range(4):
        so = s.schedule()
        s.update_from_output(so, runner_output(so, scheduler=s))
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    sent = run(s, [b], lambda rid, i: 9, answer=lambda c: "over max-model-len"
               if c.request_id == "b" and c.seq == 1 else None)
    ends = [c for c in sent if c.end is not None]
    assert [(c.request_id, c.end) for c in ends] == [("a", "aborted")]
    resolved = s._streams.ledger
    assert len(resolved) == 0
    # b's stream ended at the refusal: nothing was sent for it after chunk 1's answer.
    b_chunks = [c.seq for c in sent if c.request_id == "b" and c.end is None]
    assert max(b_chunks) <= 1 + SETTINGS.chunks_in_flight


def test_a_chunk_the_sender_gave_up_waiting_for_ends_the_stream_with_word_to_the_consumer():
    """No answer to chunk 1 in time (the consumer stopped, then resumed: an outside review):
    the stream ends here and the consumer is told, ``consumer_error`` naming the chunk (it
    waited for its next chunk until its gap deadline, then blamed the producer)."""
    s = streaming_scheduler()
    s.add_request(make_request(8, max_tokens=20, request_id="b"))
    gave_up = "no ack from stage talker at tcp://127.0.0.1:9 within 2.85s"
    sent = run(s, [], lambda rid, i: 9, answer=lambda c: gave_up if c.seq == 1 else None,
               unanswered=lambda c: c.seq == 1)
    ends = [c for c in sent if c.end is not None]
    assert [(c.request_id, c.to_stage, c.end) for c in ends] == [("b", "talker", "consumer_error")]
    assert gave_up in ends[0].reason and "chunk 1" in ends[0].reason, ends[0].reason
    assert len(s._streams.ledger) == 0


def test_a_served_engines_connector_stats_carry_each_chunk_and_stream_once():
    """With vLLM's stats on (a served engine), the step's connector stats that the engine
    core sends carry the producer's chunks and streams, each once, in the step they
    resolve: what a plain `vllm serve` logs and shows (docs/metrics.md)."""
    from omni_runtime.kv.stats import build_kv_connector_stats

    s = streaming_scheduler(log_stats=True)
    for rid in ("a", "b"):
        s.add_request(make_request(8, max_tokens=7, request_id=rid))
    payloads = []
    sent = run(s, [], lambda rid, i: 5, stats=payloads)
    total = build_kv_connector_stats(payloads[0])
    for payload in payloads[1:]:
        total.aggregate(build_kv_connector_stats(payload))
    records = list(zip(total.data["stream_record"], total.data["stream_outcome"]))
    assert records.count(("chunk", "acked")) == len(sent) > 2
    assert records.count(("stream", "finished")) == 2 and len(records) == len(sent) + 2
    assert set(total.data["stream_to_stage"]) == {"talker"}
    assert total.reduce()["Streams finished"] == 2


def test_a_held_stream_goes_out_when_a_slot_frees_whatever_freed_it():
    """One open stream per edge: the second request's stream is held, its chunks queued. The
    first request is aborted (its stream ends without an answer to wait for) after the
    second had finished: the held stream's chunks go out in that very call, though its
    request is done and never steps again. (The producer's own bookkeeping, on plain request
    objects: sched/streaming.py imports no vLLM.)"""
    from types import SimpleNamespace

    from omni_runtime.sched.streaming import StreamProducer

    sent = []
    producer = StreamProducer({"talker": StreamSettings(first_chunk_tokens=2, chunk_tokens=2,
                                                        max_open_streams=1)}, sent.extend)

    def request(rid):
        return SimpleNamespace(request_id=rid, prompt_token_ids=[1, 2], output_token_ids=[],
                               kv_transfer_params=None, resumable=False)

    a, b = request("a"), request("b")
    producer.started([a, b])
    a.output_token_ids += [5, 6, 7]
    b.output_token_ids += [8, 9, 10]
    producer.stepped({"a": 1, "b": 1})
    assert [(c.request_id, c.seq) for c in sent] == [("a", 0)], "b's stream is held"
    producer.finished(b, completed=True)
    assert [(c.request_id, c.seq) for c in sent] == [("a", 0)]
    producer.finished(a, completed=False, reason="aborted by the client")
    assert [(c.request_id, c.seq, c.end) for c in sent[1:]] == [
        ("a", 1, "aborted"), ("b", 0, None), ("b", 1, None)]
    assert list(sent[-2].token_ids) == [1, 2, 8, 9] and list(sent[-1].token_ids) == [10]
    assert sent[-1].last


@pytest.mark.parametrize("per_step", [1, 3])
def test_each_chunk_is_cut_in_the_step_whose_output_completes_it(per_step):
    """The producer looks at a request only from the first step at which its output could
    complete a chunk (a step appends at most ``max_tokens_per_step`` tokens: 1, or 1 + the
    speculative tokens); still, each chunk is cut in the very step whose output completes it,
    whatever each step appended (none, some, the most), and the chunks are the output."""
    import random
    from types import SimpleNamespace

    from omni_runtime.sched.streaming import StreamProducer

    rng = random.Random(per_step)
    sent = []
    producer = StreamProducer({"talker": StreamSettings(first_chunk_tokens=4, chunk_tokens=5,
                                                        chunks_in_flight=1000)},
                              sent.extend, max_tokens_per_step=per_step)
    requests = [SimpleNamespace(request_id=f"r{i}", prompt_token_ids=[1], output_token_ids=[],
                                kv_transfer_params=None, resumable=False) for i in range(24)]
    producer.started(requests)
    for _ in range(80):
        for r in requests:
            if rng.random() < 0.7:  # some steps do not schedule a request
                r.output_token_ids += [rng.randrange(2, 999) for _ in range(rng.randint(0, per_step))]
        producer.stepped({r.request_id: 1 for r in requests})
        cut = by_request(sent)
        for r in requests:
            n = len(r.output_token_ids)
            complete = 0 if n < 4 else 1 + (n - 4) // 5
            chunks = cut.get(r.request_id, [])
            assert [c.seq for c in chunks] == list(range(complete)), (r.request_id, n)
            tokens = [t for c in chunks for t in c.token_ids[c.prompt_len:]]
            assert tokens == r.output_token_ids[:len(tokens)]
    with pytest.raises(ValueError, match="max_tokens_per_step"):
        StreamProducer({}, sent.extend, max_tokens_per_step=0)


# -- streaming-input sessions that stream on (a talker fed by a stream, streaming to a vocoder);
# an outside review's repros.

ONE_BY_ONE = StreamSettings(first_chunk_tokens=1, chunk_tokens=1, chunks_in_flight=1024)


class SessionDriver:
    """Steps a talker-like scheduler whose requests stream each output token as a chunk to
    ``vocoder``, each acked a step later; the tokens vLLM said, and the chunks sent."""

    def __init__(self, settings: StreamSettings = ONE_BY_ONE, **kw) -> None:
        import itertools

        config = make_vllm_config({"need_send_cache": True, "stage_name": "talker",
                                   "streams": {"vocoder": stream_config(settings)}},
                                  endpoints={"vocoder": "tcp://127.0.0.1:9"}, **kw)
        self.s = make_scheduler(OmniARScheduler, config)
        self.sent, self.said, self.pending = [], [], []
        self.token = itertools.count(100)

    def step(self, steps: int = 1) -> None:
        s = self.s
        for _ in range(steps):
            so = s.schedule()
            chunks = chunks_of(so)
            self.sent += chunks
            out = runner_output(so, {r: [next(self.token)] for r in so.num_scheduled_tokens
                                     if s.requests[r].num_computed_tokens
                                     >= s.requests[r].num_prompt_tokens}, scheduler=s)
            answers = [ChunkAnswer(c.request_id, c.to_stage, c.seq, None)
                       for c in self.pending if c.end is None]
            self.pending = chunks
            if answers:
                out.kv_connector_output = KVConnectorOutput(
                    kv_connector_worker_meta=OmniKVWorkerMetadata(chunk_answers=answers))
            for outputs in s.update_from_output(so, out).values():
                for o in outputs.outputs:
                    self.said += list(o.new_token_ids)

    def streamed(self) -> list[int]:
        return [t for c in self.sent if c.end is None for t in c.token_ids[c.prompt_len:]]


def test_a_sessions_every_turn_streams_every_token_it_said_whenever_its_next_input_comes():
    """A session's output list starts over at each turn (vLLM folds the turn into the
    prompt). Its next input may come after the turn ended (a one-token turn: its next turn's
    first token was lost, the list's length alone hiding the new turn) or while the turn runs
    (vLLM then ends the turn and clears the list in one update: that step's tokens were
    lost). Either way every token said is streamed, in order."""
    d = SessionDriver()
    d.s.add_request(make_request(4, max_tokens=1, request_id="t", resumable=True))
    d.step(3)
    assert d.s.requests["t"].status == RequestStatus.WAITING_FOR_STREAMING_REQ
    d.s.add_request(make_request(2, max_tokens=3, request_id="t", resumable=True))  # after
    d.step(1)
    d.s.add_request(make_request(2, max_tokens=2, request_id="t", resumable=True))  # during
    d.step(8)
    assert d.s.requests["t"].status == RequestStatus.WAITING_FOR_STREAMING_REQ
    assert len(d.said) == 1 + 3 + 2
    assert d.streamed() == d.said


def test_a_session_whose_input_ends_while_it_waits_ends_its_streams_finished():
    """vLLM ends a waiting session whose input ended (a final request of its id) as aborted;
    it completed: its streams end with their last chunk, not as aborted."""
    d = SessionDriver(StreamSettings(first_chunk_tokens=1, chunk_tokens=4, chunks_in_flight=64))
    d.s.add_request(make_request(4, max_tokens=3, request_id="t", resumable=True))
    d.step(5)
    assert d.s.requests["t"].status == RequestStatus.WAITING_FOR_STREAMING_REQ
    d.s.add_request(make_request(1, max_tokens=2, request_id="t"))  # the input ends
    d.step(3)
    ends = [(c.last, c.end) for c in d.sent if c.last or c.end is not None]
    assert ends == [(True, None)], ends
    assert d.streamed() == d.said and not d.s.has_requests()


def test_a_session_whose_stream_failed_opens_no_stream_at_its_next_turn():
    """The consumer refused a chunk: the stream resolved, the session goes on. Its next turn
    opened a new stream of the same key (a chunk 0 the consumer refuses again, or takes as a
    new stream once it has forgotten the old)."""
    d = SessionDriver()
    s = d.s
    s.add_request(make_request(4, max_tokens=2, request_id="t", resumable=True))
    d.step(1)
    so = s.schedule()
    assert [c.seq for c in chunks_of(so)] == [0]
    out = runner_output(so, {"t": [200]}, scheduler=s)
    out.kv_connector_output = KVConnectorOutput(kv_connector_worker_meta=OmniKVWorkerMetadata(
        chunk_answers=[ChunkAnswer("t", "vocoder", 0, "refused by the vocoder")]))
    s.update_from_output(so, out)
    d.pending = []
    d.step(3)
    assert s.requests["t"].status == RequestStatus.WAITING_FOR_STREAMING_REQ
    d.sent = []
    s.add_request(make_request(2, max_tokens=2, request_id="t", resumable=True))
    d.step(3)
    assert d.sent == []
    s.finish_requests("t", RequestStatus.FINISHED_ABORTED)
    assert s._streams._open == {}, "the request's entry goes once vLLM frees it"


def test_a_step_that_appends_a_canvas_has_its_chunk_cut_in_that_step():
    """The producer's bound on a step's output is vLLM's own (its scheduled tokens beside the
    sampled one: drafts, or a diffusion model's canvas, which vLLM counts as speculative
    tokens without a speculative config): a step that appends a whole canvas has its chunk
    cut in that very step, not steps later."""
    from vllm.config.diffusion import DiffusionConfig
    from vllm.v1.outputs import DraftTokenIds

    settings = StreamSettings(first_chunk_tokens=4, chunk_tokens=4, chunks_in_flight=1024)
    config = make_vllm_config({"need_send_cache": True, "stage_name": "thinker",
                               "streams": {"talker": stream_config(settings)}},
                              endpoints={"talker": "tcp://127.0.0.1:9"})
    config.diffusion_config = DiffusionConfig(canvas_length=4)
    s = make_scheduler(OmniARScheduler, config)
    s.add_request(make_request(4, max_tokens=64, request_id="r"))
    sent_at = {}
    for step in range(6):
        so = s.schedule()
        for c in chunks_of(so):
            sent_at.setdefault(c.seq, step)
        s.update_from_output(so, runner_output(
            so, {"r": [9] * (1 + len(so.scheduled_spec_decode_tokens.get("r", ())))}, scheduler=s))
        s.update_draft_token_ids(DraftTokenIds(["r"], [[9, 9, 9, 9]]))
    # step 0: the prefill's token; step 1: 1 + 4 drafts, chunk 0 complete: out with step 2's.
    assert sent_at.get(0) == 2, sent_at


def test_a_request_id_used_again_while_its_streams_wait_streams_nothing_and_says_so(caplog):
    """vLLM's request ids are unique unless their randomisation is off: a request of the id
    of one whose streams still wait for answers streams nothing (its own streams would be
    the other's) and says so, and its end does not end the other's streams."""
    from types import SimpleNamespace

    from omni_runtime.sched.streaming import StreamProducer

    sent = []
    producer = StreamProducer({"talker": StreamSettings(first_chunk_tokens=1, chunk_tokens=1)},
                              sent.extend)

    def request():
        return SimpleNamespace(request_id="x", prompt_token_ids=[1, 2], output_token_ids=[],
                               kv_transfer_params=None, resumable=False)

    old, new = request(), request()
    producer.started([old])
    old.output_token_ids += [5]
    producer.stepped({"x": 1})
    producer.finished(old, completed=True)  # its last chunk is not acked yet
    before = list(sent)
    producer.started([new])
    assert "its id is that of an earlier request" in caplog.text
    new.output_token_ids += [8, 9]
    producer.stepped({"x": 1})
    producer.finished(new, completed=False, reason="aborted")
    assert sent == before
