"""Stale outputs: what vLLM drops never starts a transfer (issue 25).

With a step in flight (async scheduling, or pipeline parallelism with the synchronous class),
vLLM's ``reset_prefix_cache(reset_running_requests=True)`` preempts the running requests
outside ``schedule()``, and the next ``schedule()`` may resume them at once: when the output
of the step that was in flight arrives, the request is RUNNING again, and vLLM drops that
output as stale (``num_stale_output_tokens`` / ``drop_stale_output`` in its
``update_from_output``). A trigger must act only on what vLLM keeps.

Both scheduler classes run here for real, each test asserting which one ran:
``OmniARScheduler`` (vLLM's ``Scheduler``) and ``OmniARAsyncScheduler`` (vLLM's
``AsyncScheduler``, with its placeholders). vLLM's CPU platform turns async scheduling off
in ``VllmConfig``'s platform check, so an engine configured with it here would run the
synchronous class; the harness builds the VllmConfig without that check, sets
``async_scheduling`` and constructs the scheduler through the public class name, which
gives the async variant, as a GPU engine would. :class:`EngineLoop` steps it as EngineCore's
batch queue does (the next step scheduled before the output of the one in flight is
processed), and its deterministic model samples the same token at the same position again
when a request is recomputed, as a greedy model does.
"""

from __future__ import annotations

import logging
import random

import pytest
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.request import RequestStatus

from omni_runtime.devtools.sched_harness import (
    EOS,
    EngineLoop,
    free_blocks,
    hand_off_attempts,
    make_request,
    make_scheduler,
    make_vllm_config,
)
from omni_runtime.sched.outputs import OmniNewRequestData
from omni_runtime.sched.scheduler import OmniARAsyncScheduler, OmniARScheduler
from omni_runtime.transfers.ledger import Outcome, TransferObserver, Trigger

SENTINEL = 9
OTHER = 5  # what the model samples everywhere else
BLOCK = 16
CRITERIA = {
    "special_token": {
        "need_send_cache": True,
        "kv_transfer_criteria": {"type": "special_token", "token_id": SENTINEL},
    },
    "prefill_finished": {
        "need_send_cache": True, "kv_transfer_criteria": {"type": "prefill_finished"},
    },
    "request_finished": {"need_send_cache": True},
}
#: (scheduler class, steps in flight at most): the synchronous class as EngineCore.step runs
#: it (nothing in flight between steps) and as its batch queue runs it (pipeline
#: parallelism), the async class as async scheduling runs it.
MODES = {
    "sync": (OmniARScheduler, 1),
    "sync-batch-queue": (OmniARScheduler, 2),
    "async": (OmniARAsyncScheduler, 2),
}


class MarkRecorder(TransferObserver):
    """Every transfer marked, with the blocks its request held at that moment."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.marked = []  # (transfer, the request's group-0 blocks when it was marked)

    def on_marked(self, ledger, transfer):
        held = list(self.scheduler.kv_cache_manager.get_block_ids(transfer.request_id)[0])
        self.marked.append((transfer, held))

    def of(self, request_id):
        return [t for t, _ in self.marked if t.request_id == request_id]


def build(mode: str, criteria: str, kv_extra=None, **kw):
    """The omni scheduler of ``mode``, asserting that the class asked for is the one that
    runs: the async variant only through vLLM's async_scheduling flag, as in an engine."""
    cls, depth = MODES[mode]
    cfg = make_vllm_config({**CRITERIA[criteria], **(kv_extra or {})}, **kw)
    cfg.scheduler_config.async_scheduling = cls is OmniARAsyncScheduler
    s = make_scheduler(OmniARScheduler, cfg)
    assert type(s) is cls
    assert isinstance(s, AsyncScheduler) is (cls is OmniARAsyncScheduler)
    s.marks = MarkRecorder(s)
    s.transfer_ledger.add_observer(s.marks)
    return s, depth


def assert_marked_on_held_blocks(s):
    """Every transfer named the first ceil(seq_len / block size) blocks its request held
    when it was marked (so the blocks hold its KV: never blocks it no longer has)."""
    for t, held in s.marks.marked:
        needed = -(-t.seq_len // BLOCK)
        assert list(t.block_ids) == held[:needed] and len(held) >= needed, (t, held)


def assert_quiescent(s, start_free):
    assert not s.has_requests() and not s.requests
    assert not s.transfer_ledger.has_unresolved() and not s.transfer_ledger._triggered
    assert not s._awaiting_trigger and not s._pinned
    assert free_blocks(s) == start_free
    s.transfer_ledger.check_invariants()


def no_errors(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


# ------------------------------------------------------------------ reset with a step in flight

PROMPT = 40
STALE_AT = 44  # the position the step in flight samples when the reset comes


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-recompute", "chunked-recompute"])
@pytest.mark.parametrize("criteria", list(CRITERIA))
@pytest.mark.parametrize("mode", ["sync-batch-queue", "async"])
def test_reset_with_a_step_in_flight_starts_the_transfer_once_on_what_vllm_keeps(
        caplog, mode, criteria, chunked):
    """reset_prefix_cache(reset_running_requests=True) while a step is in flight, and the
    next schedule() resumes the request at once, recomputing it in one step or in chunks.
    The step in flight carries the request's trigger: the sentinel (special_token), the
    stop token (request_finished), or the request's first step, before its prompt is
    computed (prefill_finished: the whole prompt, or its first chunk; with a step in flight
    the trigger fires as soon as the last chunk is scheduled, so a reset cannot come between
    that and the trigger). vLLM drops its output; the recompute samples the same token again
    (a greedy model). The transfer is marked exactly once, at the real trigger, with the
    right length, on blocks the request holds, and acked; nothing is logged as an error."""
    s, depth = build(mode, criteria, enable_prefix_caching=True, max_num_seqs=4,
                     max_num_batched_tokens=BLOCK if chunked else 8192)
    start = free_blocks(s)
    r = make_request(PROMPT, max_tokens=12, request_id="r", block_size=BLOCK,
                     ignore_eos=criteria != "request_finished")
    stop_at = {"special_token": SENTINEL, "request_finished": EOS}.get(criteria)
    loop = EngineLoop(s, lambda rid, pos: stop_at if pos == STALE_AT and stop_at is not None
                      else OTHER, depth=depth)
    s.add_request(r)

    def carries_the_trigger():
        if criteria == "prefill_finished":
            return True  # its first step
        return not r.is_prefill_chunk and r.num_computed_tokens == STALE_AT

    # Step (as EngineCore's batch queue does) until the step just scheduled carries the
    # trigger; leave it in flight.
    while True:
        assert s.has_requests()
        loop.schedule()
        hit = carries_the_trigger()
        if len(loop.in_flight) == depth:
            loop.update()
        if hit:
            break
    assert len(loop.in_flight) == 1 and not s.marks.marked
    if s.__class__ is OmniARAsyncScheduler and criteria != "prefill_finished":
        assert r.num_output_placeholders == 1, "the async scheduler's own bookkeeping ran"
    tokens = list(r.all_token_ids)

    assert s.reset_prefix_cache(reset_running_requests=True) is True
    assert r.status is RequestStatus.PREEMPTED
    loop.schedule()  # resumes r at once: recomputes what it has (in chunks, or whole)
    assert r.status is RequestStatus.RUNNING and r.num_computed_tokens == (
        min(BLOCK, len(tokens)) if chunked else len(tokens))
    loop.update()  # the output of the step that was in flight: stale, dropped by vLLM
    assert list(r.all_token_ids) == tokens and not r.is_finished(), "vLLM kept none of it"
    if criteria == "special_token" or (criteria == "prefill_finished" and chunked):
        assert not s.marks.marked, "a transfer started on what vLLM dropped"
    # (prefill_finished with the whole prompt recomputed in the step just scheduled fires
    # here, on the request's state: its snapshot names the blocks it is recomputed into,
    # which assert_marked_on_held_blocks checks below.)
    loop.run()

    (t,) = s.marks.of("r")
    expected = {
        "special_token": (Trigger.SPECIAL_TOKEN, STALE_AT),  # the tokens before the sentinel
        "request_finished": (Trigger.REQUEST_FINISHED, STALE_AT),  # the computed tokens
        "prefill_finished": (Trigger.PREFILL_FINISHED, PROMPT),
    }[criteria]
    assert (t.trigger, t.seq_len) == expected
    assert t.outcome is Outcome.ACKED
    if stop_at is not None:
        assert r.all_token_ids[STALE_AT] == stop_at, "the real one, sampled after the reset"
    assert_marked_on_held_blocks(s)
    assert not no_errors(caplog)
    assert_quiescent(s, start)


@pytest.mark.parametrize("mode", ["sync-batch-queue", "async"])
def test_a_transfer_marked_before_the_reset_fails_and_the_trigger_stays_spent(caplog, mode):
    """The sentinel was kept (and its transfer handed off) before the reset: the reset fails
    that transfer (its blocks are taken back, docs/scheduler.md), and the request, resumed
    and recomputed with the sentinel among its tokens, starts no second one."""
    s, depth = build(mode, "special_token", enable_prefix_caching=True, max_num_seqs=4)
    start = free_blocks(s)
    r = make_request(PROMPT, max_tokens=12, request_id="r", block_size=BLOCK)
    loop = EngineLoop(s, lambda rid, pos: SENTINEL if pos == STALE_AT else OTHER, depth=depth,
                      answers=lambda so: ((), {}))  # no answer: still active at the reset
    s.add_request(r)
    while not s.marks.marked or not s.transfer_ledger.num_active:
        loop.step()
    s.reset_prefix_cache(reset_running_requests=True)
    loop.run()
    (t,) = s.marks.of("r")
    assert (t.trigger, t.seq_len, t.outcome) == (Trigger.SPECIAL_TOKEN, STALE_AT, Outcome.FAILED)
    assert "KV cache reset" in t.reason
    assert r.all_token_ids.count(SENTINEL) == 1
    assert not no_errors(caplog)
    assert_quiescent(s, start)


# ------------------------------------------------------------------ payloads on the same path


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_request_payloads_survive_a_reset_with_a_step_in_flight(runner):
    """A request resumed after the reset reaches the runner again: vLLM's V1 model runner
    keeps the request's state (the payload it got as a new request) and gets it as a resumed
    cached request; the V2 runner (vLLM's default on GPUs) gets it as a new request again,
    which must carry the payload again."""
    s, depth = build("async", "prefill_finished", enable_prefix_caching=True, max_num_seqs=4)
    assert s.use_v2_model_runner is False  # this CPU build: V2 needs Triton
    if runner == "v2":
        # What vLLM's Scheduler reads from VllmConfig.use_v2_model_runner on a GPU (the CPU
        # build refuses VLLM_USE_V2_MODEL_RUNNER=1 at config time, for want of Triton).
        s.use_v2_model_runner = True
    start = free_blocks(s)
    rich = make_request(PROMPT, max_tokens=6, request_id="rich", block_size=BLOCK)
    rich.additional_information = {"speaker": [1.0, 2.0]}
    plain = make_request(PROMPT, max_tokens=6, request_id="plain", block_size=BLOCK,
                         prompt_token=8)
    loop = EngineLoop(s, lambda rid, pos: OTHER, depth=depth)
    s.add_request(rich)
    s.add_request(plain)
    first = loop.schedule()
    assert {type(n) for n in first.scheduled_new_reqs} == {NewRequestData, OmniNewRequestData}
    loop.update()
    loop.schedule()  # a decode step in flight
    s.reset_prefix_cache(reset_running_requests=True)
    resumed = loop.schedule()
    loop.update()  # the stale output of the decode step
    new = {n.req_id: n for n in resumed.scheduled_new_reqs}
    if runner == "v2":
        assert set(new) == {"rich", "plain"}
        assert isinstance(new["rich"], OmniNewRequestData)
        assert new["rich"].additional_information == {"speaker": [1.0, 2.0]}
        assert type(new["plain"]) is NewRequestData
    else:
        assert not new
        assert resumed.scheduled_cached_reqs.resumed_req_ids == {"rich", "plain"}
    loop.run()
    assert_quiescent(s, start)


# ------------------------------------------------------------------ stress, both modes


@pytest.mark.parametrize("criteria", list(CRITERIA))
@pytest.mark.parametrize("mode", list(MODES))
def test_random_arrivals_aborts_preemptions_and_resets_keep_every_transfer_exact(
        caplog, mode, criteria):
    """Random arrivals, aborts, preemptions (a small KV cache), prefix-cache resets with
    running requests, late, failed and missing answers, over the real scheduler in each
    mode. Every request's tokens come from a deterministic model, so the truth is known at
    the end: a transfer is marked at most once per request, only on what vLLM kept (its
    length follows from the request's final tokens), on blocks the request held; every
    request that completed has one; nothing is logged as an error; everything resolves and
    every block comes back."""
    rng = random.Random(f"{mode}-{criteria}")
    s, depth = build(mode, criteria, {"timeout_seconds": 30}, enable_prefix_caching=True,
                     max_num_seqs=8, max_num_batched_tokens=64, num_blocks=40)
    # The ledger's clock counts engine iterations (a second each): deadlines are reproducible.
    iteration = 0
    s.transfer_ledger._clock = lambda: float(iteration)
    start = free_blocks(s)
    sentinel_at: dict[str, int] = {}
    eos_at: dict[str, int] = {}

    def token_at(rid, pos):
        return SENTINEL if sentinel_at.get(rid) == pos else EOS if eos_at.get(rid) == pos else OTHER

    handed: dict[str, int] = {}  # request id -> attempt, handed off and not answered yet

    def answers(so):
        handed.update(hand_off_attempts(so))
        acked, failed = [], {}
        for rid in list(handed):
            roll = rng.random()
            if roll < 0.3:
                acked.append((rid, handed.pop(rid)))
            elif roll < 0.35:
                failed[(rid, handed.pop(rid))] = "receiver busy"
            elif roll < 0.37:
                handed.pop(rid)  # never answered: expires
        return acked, failed

    loop = EngineLoop(s, token_at, depth=depth, answers=answers)
    requests = []
    resets, saw_placeholders = 0, False
    for i in range(1200):
        iteration += 1
        if len(requests) < 240 and rng.random() < 0.3:
            prompt = rng.randint(1, 70)
            max_tokens = rng.randint(1, 24)
            r = make_request(prompt, max_tokens=max_tokens, request_id=f"r{i}",
                             block_size=BLOCK, ignore_eos=rng.random() < 0.5)
            if rng.random() < 0.7:
                sentinel_at[r.request_id] = prompt + rng.randrange(max_tokens)
            if rng.random() < 0.3:
                eos_at[r.request_id] = prompt + rng.randrange(max_tokens)
            requests.append(r)
            s.add_request(r)
        live = [r for r in s.requests.values() if not r.is_finished()]
        roll = rng.random()
        if live and roll < 0.04:
            s.finish_requests(rng.choice(live).request_id, RequestStatus.FINISHED_ABORTED)
        elif live and roll < 0.08:
            assert s.reset_prefix_cache(reset_running_requests=True) is True
            resets += 1
        loop.step()
        saw_placeholders |= any(r.num_output_placeholders > 0 for r in s.requests.values())
        s.transfer_ledger.check_invariants()
    while s.has_requests() or loop.in_flight:
        iteration += 1
        assert iteration < 5000
        loop.step()

    assert resets > 20 and len(requests) > 200
    assert saw_placeholders is isinstance(s, AsyncScheduler), "the class that ran"
    completed = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED}
    for r in requests:
        marked = s.marks.of(r.request_id)
        assert len(marked) <= 1, (r.request_id, marked)
        tokens = list(r.all_token_ids)
        outputs = tokens[r.num_prompt_tokens:]
        if r.status in completed:
            assert len(marked) == 1, f"{r.request_id} completed without a transfer"
        if not marked:
            assert criteria != "special_token" or SENTINEL not in outputs, r.request_id
            continue
        (t,) = marked
        if criteria == "special_token" and SENTINEL in outputs:
            # Cut at the first sentinel of the request's tokens as vLLM kept them. (A
            # request that finishes in the step that samples it finishes first: then its
            # request_finished snapshot is the same tokens.)
            assert t.seq_len == tokens.index(SENTINEL), (r.request_id, t, outputs)
            assert t.trigger is Trigger.SPECIAL_TOKEN or (
                outputs.index(SENTINEL) == len(outputs) - 1 and r.status in completed)
        elif t.trigger is Trigger.PREFILL_FINISHED:
            assert t.seq_len == r.num_prompt_tokens
        else:
            assert t.trigger is Trigger.REQUEST_FINISHED, (r.request_id, t, outputs)
            assert r.status in completed and t.seq_len == len(tokens) - 1, (r.request_id, t)
    outcomes = {t.outcome for t, _ in s.marks.marked}
    assert Outcome.ACKED in outcomes and Outcome.FAILED in outcomes
    assert all(t.outcome is not None for t, _ in s.marks.marked)
    assert_marked_on_held_blocks(s)
    assert not no_errors(caplog)
    assert_quiescent(s, start)


# ------------------------------------------------------------------ streaming-input sessions


def test_a_session_turn_that_stops_with_a_step_in_flight_starts_nothing_on_its_output(caplog):
    """Async scheduling: a streaming-input session's turn stops (a stop token) while its
    next decode step is in flight (only the async class schedules a decode before the
    previous token is known): vLLM drops that step's output, its turn being over, and the
    request now waits for its next input (WAITING_FOR_STREAMING_REQ: neither running nor
    preempted). A sentinel in it starts nothing; the session's next input is taken in, and
    the sentinel sampled in that turn starts the session's one transfer, cut before it."""
    s, depth = build("async", "special_token", max_num_seqs=4)
    start = free_blocks(s)
    sentinel_at = {"s": 24}
    eos_at = 23

    def token_at(rid, pos):
        return SENTINEL if pos == sentinel_at["s"] else EOS if pos == eos_at else OTHER

    session = make_request(20, max_tokens=12, request_id="s", ignore_eos=False, resumable=True)
    loop = EngineLoop(s, token_at, depth=depth)
    s.add_request(session)
    while session.status is not RequestStatus.WAITING_FOR_STREAMING_REQ:
        loop.step()
    assert session.all_token_ids[eos_at] == EOS
    # The step after the stop token was scheduled before the stop token came: its output
    # (the sentinel at 24) is stale.
    (so, out), = loop.in_flight
    assert out.sampled_token_ids[out.req_id_to_index["s"]] == [SENTINEL]
    tokens = list(session.all_token_ids)
    loop.update()
    assert list(session.all_token_ids) == tokens, "vLLM dropped it"
    assert not s.marks.marked, "a transfer started on what vLLM dropped"
    s.add_request(make_request(8, max_tokens=6, request_id="s", ignore_eos=False,
                               resumable=True, prompt_token=8))  # the next input
    assert len(s.requests) == 1 and "s" in s._awaiting_trigger
    sentinel_at["s"] = session.num_tokens + 2
    while not s.marks.marked or loop.in_flight:
        loop.step()
    (t,) = s.marks.of("s")
    assert (t.trigger, t.seq_len) == (Trigger.SPECIAL_TOKEN, sentinel_at["s"])
    assert session.all_token_ids[t.seq_len] == SENTINEL
    while session.status is not RequestStatus.WAITING_FOR_STREAMING_REQ or loop.in_flight:
        loop.step()
    s.add_request(make_request(1, request_id="s"))  # not resumable: the session ends
    loop.run()
    assert session.status is RequestStatus.FINISHED_ABORTED
    assert t.outcome is Outcome.ACKED and len(s.marks.marked) == 1
    assert_marked_on_held_blocks(s)
    assert not no_errors(caplog)
    assert_quiescent(s, start)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_session_whose_turn_ends_on_the_sentinel_with_its_next_input_queued(caplog, mode):
    """The session's next input is queued while its turn runs, and the turn's last token
    (its length cap) is the sentinel: in that same output vLLM ends the turn and takes in
    the next input (dropping the turn's last token from the session's context and appending
    the input after the computed tokens). The transfer is cut before the sentinel, at the
    position it was sampled at, on KV the session keeps."""
    s, depth = build(mode, "special_token", max_num_seqs=4)
    start = free_blocks(s)
    session = make_request(20, max_tokens=4, request_id="s", resumable=True)
    loop = EngineLoop(s, lambda rid, pos: SENTINEL if pos == 23 else OTHER, depth=depth)
    s.add_request(session)
    loop.step()
    s.add_request(make_request(8, max_tokens=3, request_id="s", resumable=True,
                               prompt_token=8))  # queued: the turn is running
    while not s.marks.marked:
        loop.step()
    (t,) = s.marks.of("s")
    assert (t.trigger, t.seq_len) == (Trigger.SPECIAL_TOKEN, 23)
    assert session.num_prompt_tokens == 23 + 8, "the next input came in, after the frontier"
    while session.status is not RequestStatus.WAITING_FOR_STREAMING_REQ or loop.in_flight:
        loop.step()
    s.add_request(make_request(1, request_id="s"))  # not resumable: the session ends
    loop.run()
    assert t.outcome is Outcome.ACKED and len(s.marks.marked) == 1
    assert_marked_on_held_blocks(s)
    assert not no_errors(caplog)
    assert_quiescent(s, start)
