"""OmniARScheduler over the real vLLM 0.32 Scheduler, driven with hand-made
ModelRunnerOutputs as vLLM's own scheduler tests do (no model runner: none is needed to
exercise the scheduler's decisions, and none runs fast enough here for hundreds of cases)."""

from __future__ import annotations

import logging
import random
import time

import pytest
from vllm.config import SpeculativeConfig
from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput
from vllm.v1.request import RequestStatus

from omni_runtime.transfers.config import OmniKVConfigError
from omni_runtime.kv.metadata import OmniKVWorkerMetadata
from omni_runtime.sched.handoff import Answer
from omni_runtime.sched.outputs import OmniNewRequestData
from omni_runtime.devtools.sched_harness import (
    free_blocks,
    hand_off_attempts,
    handed_off,
    held_notices,
    make_request,
    make_scheduler,
    make_vllm_config,
    runner_output,
    step,
    withdrawn,
)
from omni_runtime.sched import scheduler as sched_module
from omni_runtime.sched.scheduler import OmniARScheduler
from omni_runtime.transfers.ledger import Outcome, Phase, TransferObserver, Trigger

SENTINEL = 9
PREFILL = {"need_send_cache": True, "kv_transfer_criteria": {"type": "prefill_finished"}}
SPECIAL = {
    "need_send_cache": True,
    "kv_transfer_criteria": {"type": "special_token", "token_id": SENTINEL},
}
ON_FINISH = {"need_send_cache": True}


class Recorder(TransferObserver):
    def __init__(self):
        self.resolved = []
        self.marked = []

    def on_marked(self, ledger, transfer):
        self.marked.append(transfer)

    def on_resolved(self, ledger, transfer):
        self.resolved.append(transfer)


def omni(kv_config, log_stats=False, **kw):
    sched = make_scheduler(OmniARScheduler, make_vllm_config(kv_config, **kw),
                           log_stats=log_stats)
    rec = Recorder()
    sched.transfer_ledger.add_observer(rec)
    sched.recorder = rec
    return sched


def outputs_by_id(engine_core_outputs):
    return {o.request_id: o for eco in engine_core_outputs.values() for o in eco.outputs}


def assert_quiescent(sched, start_free):
    """Nothing left: no request, no transfer, no tracking state, every block back."""
    assert not sched.has_requests() and not sched.has_unfinished_requests()
    assert not sched.requests
    assert not sched.transfer_ledger.has_unresolved()
    assert not sched.transfer_ledger._triggered
    assert not sched._awaiting_trigger and not sched._pinned
    assert free_blocks(sched) == start_free
    sched.transfer_ledger.check_invariants()


def assert_same_outputs(outs):
    """Two schedulers' outputs of one step in lock step: the same finishes, transfer params
    included."""
    assert ({r: (o.finish_reason, o.kv_transfer_params) for r, o in outputs_by_id(outs[0]).items()}
            == {r: (o.finish_reason, o.kv_transfer_params) for r, o in outputs_by_id(outs[1]).items()})


def abort_one_and_compare(rng, chance, a, b):
    """Two schedulers in lock step: with ``chance``, abort the same random live request on
    both; then they must hold the same blocks and transfers, and agree on having requests."""
    live = sorted(r.request_id for r in a.requests.values() if not r.is_finished())
    if live and rng.random() < chance:
        victim = rng.choice(live)
        for s in (a, b):
            s.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
    assert free_blocks(a) == free_blocks(b)
    assert repr(a.transfer_ledger) == repr(b.transfer_ledger)
    assert a.has_requests() == b.has_requests()


def assert_ended_alike(a, b, starts):
    """Two schedulers after a lock-step run: the same transfers resolved the same way, in the
    same order, and nothing left behind by either."""
    assert [(t.request_id, t.outcome) for t in a.recorder.resolved] == \
        [(t.request_id, t.outcome) for t in b.recorder.resolved]
    for s, start in zip((a, b), starts):
        assert_quiescent(s, start)


# ---------------------------------------------------------------------------- triggers


def test_prefill_finished_marks_the_prompt_and_decoding_goes_on():
    s = omni(PREFILL)
    start = free_blocks(s)
    r = make_request(40, max_tokens=4)
    s.add_request(r)
    so, _ = step(s)
    assert handed_off(so) == {}
    t = s.transfer_ledger.get(r.request_id)
    assert (t.trigger, t.seq_len, list(t.block_ids), t.phase) == (
        Trigger.PREFILL_FINISHED,
        40,
        s.kv_cache_manager.get_block_ids(r.request_id)[0][:3],
        Phase.PENDING,
    )
    so, _ = step(s)
    info = handed_off(so)[r.request_id]
    assert list(handed_off(so)) == [r.request_id]
    assert (info.seq_len, info.block_ids) == (40, tuple(t.block_ids))
    assert 0 < info.deadline_in_s <= s.omni_kv_config.timeout_seconds
    assert r.request_id in so.num_scheduled_tokens, "the request keeps decoding"
    assert t.phase is Phase.ACTIVE
    so, _ = step(s, acked=[r.request_id])
    assert t.outcome is Outcome.ACKED
    while s.has_requests():
        so, _ = step(s)
        assert handed_off(so) == {}, "at most one transfer"
    assert r.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert len(s.recorder.marked) == 1
    assert_quiescent(s, start)


def test_chunked_prefill_triggers_when_the_last_chunk_is_computed():
    s = omni(PREFILL, max_num_batched_tokens=16, max_num_seqs=4)
    r = make_request(40, max_tokens=2)
    s.add_request(r)
    step(s)
    step(s)
    assert r.num_computed_tokens == 32 and s.transfer_ledger.get(r.request_id) is None
    step(s)
    t = s.transfer_ledger.get(r.request_id)
    assert t is not None and t.seq_len == 40 and len(t.block_ids) == 3


def test_special_token_cuts_the_snapshot_at_the_first_sentinel():
    s = omni(SPECIAL)
    start = free_blocks(s)
    r = make_request(20, max_tokens=8)
    s.add_request(r)
    step(s)  # prefill: samples token 5 at position 20
    step(s)  # position 21
    assert s.transfer_ledger.get(r.request_id) is None
    step(s, {r.request_id: [SENTINEL]})  # the sentinel is sampled at position 22
    t = s.transfer_ledger.get(r.request_id)
    assert (t.trigger, t.seq_len) == (Trigger.SPECIAL_TOKEN, 22)
    assert t.seq_len <= r.num_computed_tokens, "only KV that exists is shipped"
    so, _ = step(s, {r.request_id: [SENTINEL]})  # a second sentinel starts nothing new
    assert list(handed_off(so)) == [r.request_id]
    step(s, acked=[r.request_id])
    while s.has_requests():
        step(s)
    assert [m.trigger for m in s.recorder.marked] == [Trigger.SPECIAL_TOKEN], "once per request"
    assert_quiescent(s, start)


def _spec_scheduler():
    cfg = make_vllm_config(SPECIAL)
    cfg.speculative_config = SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=3,
        prompt_lookup_max=3,
        prompt_lookup_min=1,
        target_model_config=cfg.model_config,
        target_parallel_config=cfg.parallel_config,
    )
    return make_scheduler(OmniARScheduler, cfg)


def test_sentinel_in_the_middle_of_a_multi_token_step_and_block_truncation():
    """Speculative decoding accepts several tokens in one step; the snapshot is cut at the
    first sentinel among them, and its block ids at ceil(seq_len / block_size) although
    the request already holds a block more."""
    s = _spec_scheduler()
    r = make_request(30, max_tokens=20)
    s.add_request(r)
    step(s)  # prefill, samples position 30
    s.update_draft_token_ids(DraftTokenIds([r.request_id], [[5, SENTINEL, SENTINEL]]))
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens[r.request_id] == [5, SENTINEL, SENTINEL]
    # All drafts accepted plus a bonus token: positions 31..34, first sentinel at 32.
    s.update_from_output(so, runner_output(so, {r.request_id: [5, SENTINEL, SENTINEL, 5]}))
    t = s.transfer_ledger.get(r.request_id)
    held = s.kv_cache_manager.get_block_ids(r.request_id)[0]
    assert t.seq_len == 32
    assert len(held) == 3 and list(t.block_ids) == held[:2]


def test_request_finished_trigger_holds_blocks_until_the_ack():
    s = omni(ON_FINISH)
    start = free_blocks(s)
    r = make_request(33, max_tokens=3)
    s.add_request(r)
    step(s)
    step(s)
    assert s.transfer_ledger.get(r.request_id) is None
    _, outs = step(s)  # third token: length-capped
    out = outputs_by_id(outs)[r.request_id]
    t = s.transfer_ledger.get(r.request_id)
    assert (t.trigger, t.seq_len, t.held, t.phase) == (Trigger.REQUEST_FINISHED, 35, True, Phase.PENDING)
    assert out.finish_reason is not None
    assert out.kv_transfer_params["kv_metadata"]["seq_len"] == 35
    assert out.kv_transfer_params["past_key_values"] == list(t.block_ids)
    assert out.kv_transfer_params["kv_metadata"]["state"] == "pending"
    assert free_blocks(s) == start - 3, "held: the finished request's blocks stay allocated"
    assert s.has_requests() and s.has_unfinished_requests()
    so, _ = step(s)
    assert list(handed_off(so)) == [r.request_id]
    assert free_blocks(s) == start - 3
    step(s, acked=[r.request_id])
    assert t.outcome is Outcome.ACKED
    assert_quiescent(s, start)


FAN_OUT = {"talker": "tcp://127.0.0.1:9", "vocoder": "tcp://127.0.0.1:10"}


@pytest.mark.parametrize("endpoints", [FAN_OUT, None], ids=["fan-out", "one-edge"])
def test_a_fan_out_hears_which_of_its_transfers_are_held_and_since_when(endpoints):
    """Per-edge held state (edge_metrics): a fan-out's workers feed it, so they are told. A
    transfer handed off while its request runs is announced held in the step after the finish
    (attempt, the blocks kept, when), once; one whose request had finished before its hand-off
    carries that in the hand-off itself (HandOff.held) and is never announced. A stage with one
    downstream stage announces nothing (its ledger feeds the edge)."""
    for config, held_at_hand_off in ((PREFILL, False), (ON_FINISH, True)):
        s = omni(config, endpoints=endpoints)
        r = make_request(33, max_tokens=3)
        s.add_request(r)
        hand_offs, notices = {}, []
        before = time.time()
        for _ in range(8):
            so, _ = step(s)
            hand_offs.update(handed_off(so))
            notices.append(held_notices(so))
        h = hand_offs[r.request_id]
        t = s.transfer_ledger.get(r.request_id)
        assert t.held and t.phase is Phase.ACTIVE
        if held_at_hand_off:
            assert h.held == (pytest.approx(s.transfer_ledger.wall_time(t.held_since)), t.held_blocks)
            assert not any(notices)
        else:
            assert h.held is None
            announced = [n for n in notices if n]
            if endpoints is None:
                assert announced == []
            else:
                assert announced == [{r.request_id: (h.attempt, t.held_blocks, pytest.approx(
                    s.transfer_ledger.wall_time(t.held_since)))}]
                assert before <= announced[0][r.request_id][2] <= time.time()
        step(s, acked=[r.request_id])
        assert t.outcome is Outcome.ACKED


@pytest.mark.parametrize("config", [PREFILL, ON_FINISH], ids=["prefill_finished", "request_finished"])
def test_held_notices_under_preemption_aborts_resets_and_random_answers_name_only_live_hand_offs(config):
    """A fan-out's held notices under churn (a small KV cache that preempts, aborts, prefix-cache
    resets with running requests, acks and failures at random, answers never sent): each names
    a transfer attempt handed off earlier and still unresolved, once, with the blocks the
    ledger holds for it (request_finished: none, each hand-off carries its hold instead); and
    everything still resolves and every block comes back."""
    rng = random.Random(str(config))
    s = omni({**config, "timeout_seconds": 30}, endpoints=FAN_OUT, max_num_seqs=8,
             max_num_batched_tokens=64, num_blocks=40)
    start = free_blocks(s)
    handed: dict[str, int] = {}  # request id -> attempt handed off, not answered
    announced: set[tuple[str, int]] = set()
    held_at_hand_off = 0
    for i in range(600):
        if i < 500 and rng.random() < 0.3:
            s.add_request(make_request(rng.randint(1, 70), max_tokens=rng.randint(1, 24),
                                       request_id=f"r{i}"))
        live = [r for r in s.requests.values() if not r.is_finished()]
        roll = rng.random()
        if live and roll < 0.04:
            s.finish_requests(rng.choice(live).request_id, RequestStatus.FINISHED_ABORTED)
        elif live and roll < 0.07:
            s.reset_prefix_cache(reset_running_requests=True)
        acked, failed = [], {}
        for rid in list(handed):
            roll = rng.random()
            if roll < 0.3:
                acked.append((rid, handed.pop(rid)))
            elif roll < 0.35:
                failed[(rid, handed.pop(rid))] = "receiver busy"
            elif roll < 0.36:
                handed.pop(rid)  # never answered: expires
        so = s.schedule()
        for rid, (attempt, blocks, at) in held_notices(so).items():
            assert (rid, attempt) not in announced, "announced twice"
            announced.add((rid, attempt))
            t = s.transfer_ledger.get(rid)
            assert t is not None and t.attempt == attempt and t.held_blocks == blocks > 0
            assert at == pytest.approx(s.transfer_ledger.wall_time(t.held_since))
        for rid, h in handed_off(so).items():
            handed[rid] = h.attempt
            t = s.transfer_ledger.get(rid)
            assert (h.held is not None) == t.held
            held_at_hand_off += h.held is not None
        s.update_from_output(so, runner_output(so, scheduler=s, acked=acked, failed=failed))
        s.transfer_ledger.check_invariants()
    for _ in range(200):
        if not s.has_requests():
            break
        so = s.schedule()
        s.update_from_output(so, runner_output(so, scheduler=s, acked=list(handed.items())))
        handed = {rid: h.attempt for rid, h in handed_off(so).items()}
    if config is PREFILL:
        assert announced, "nothing was held in flight: the test did not test"
    else:
        assert not announced and held_at_hand_off > 0
    assert_quiescent(s, start)


def test_kv_transfer_params_carry_the_outcome_when_resolved_before_the_finish():
    s = omni(PREFILL)
    r = make_request(16, max_tokens=3)
    s.add_request(r)
    step(s)
    step(s)
    _, outs = step(s, acked=[r.request_id])
    meta = outputs_by_id(outs)[r.request_id].kv_transfer_params["kv_metadata"]
    assert (meta["trigger"], meta["outcome"], meta["state"]) == ("prefill_finished", "acked", "resolved")


# ---------------------------------------------------------------------------- resolution


def test_runner_failure_frees_held_blocks_and_keeps_the_reason(caplog):
    s = omni(ON_FINISH)
    start = free_blocks(s)
    r = make_request(16, max_tokens=1)
    s.add_request(r)
    step(s)
    step(s)  # hand-off
    with caplog.at_level(logging.WARNING, logger="omni_runtime.sched.scheduler"):
        step(s, failed={r.request_id: "receiver rejected: checksum mismatch"})
    (t,) = s.recorder.resolved
    assert (t.outcome, t.reason) == (Outcome.FAILED, "receiver rejected: checksum mismatch")
    assert sum("checksum mismatch" in m for m in caplog.messages) == 1
    assert_quiescent(s, start)


def test_the_connectors_stats_record_each_resolution_once_with_the_answers_figures():
    """vLLM's connector-stats path (kv/stats.py) records what the scheduler's ledger
    resolves: each transfer the workers' answers resolve, once, with the answer's bytes and
    seconds; an answer about another attempt, or repeated, records nothing; a handed-off
    transfer the scheduler resolves itself (expiry) with its outcome, no bytes, and the
    seconds from its hand-off (the ledger's clock)."""
    now = [1000.0]
    s = omni({**PREFILL, "timeout_seconds": 30}, log_stats=True)  # as a served engine
    s.transfer_ledger._clock = lambda: now[0]
    given = []  # what vLLM's update_from_output takes from the connector, once per step
    real = s._omni.get_kv_connector_stats
    s._omni.get_kv_connector_stats = lambda: given.append(real()) or given[-1]

    def recorded():
        """The stats vLLM took since the last call (one step's at most), or None."""
        taken = [t for t in given if t is not None]
        given.clear()
        assert len(taken) <= 1
        return taken[0] if taken else None

    for rid in ("a", "b", "c", "d"):
        s.add_request(make_request(16, max_tokens=20, request_id=rid))
    step(s)  # the prefills: marked
    now[0] += 1.0
    so = s.schedule()  # handed off at 1001.0
    attempts = {rid: h.attempt for rid, h in handed_off(so).items()}
    assert set(attempts) == {"a", "b", "c", "d"} and recorded() is None

    def answered(so, answers):
        out = runner_output(so)
        out.kv_connector_output = KVConnectorOutput(
            kv_connector_worker_meta=OmniKVWorkerMetadata(answers))
        s.update_from_output(so, out)

    answered(so, {"a": Answer(attempts["a"], None, 4096, 0.25),
                  "b": Answer(attempts["b"], "receiver gone", 0, 0.5),
                  "c": Answer(attempts["c"] + 100, None, 7, 0.1)})  # another attempt
    stats = recorded()
    assert stats.data["outcome"] == ["acked", "failed"]
    assert stats.data["bytes"] == [4096, 0] and stats.data["duration_s"] == [0.25, 0.5]
    answered(s.schedule(), {"a": Answer(attempts["a"], None, 4096, 0.25)})  # repeated
    assert recorded() is None
    now[0] += 31.0  # c and d expire, 31 s after their hand-off
    step(s)
    stats = recorded()
    assert stats.data["outcome"] == ["expired", "expired"]
    assert stats.data["bytes"] == [0, 0] and stats.data["duration_s"] == [31.0, 31.0]
    assert {t.request_id: t.outcome for t in s.recorder.resolved} == {
        "a": Outcome.ACKED, "b": Outcome.FAILED, "c": Outcome.EXPIRED, "d": Outcome.EXPIRED}


def test_without_log_stats_the_connector_records_nothing_and_the_transfers_resolve():
    """An engine that collects no stats (--disable-log-stats): vLLM's make_stats would drop
    a connector's stats, so none are recorded, neither an answer's nor an expiry's; the
    ledger resolves the same (the figures themselves: the test above, with log_stats)."""
    now = [1000.0]
    s = omni({**PREFILL, "timeout_seconds": 30})
    assert not s.log_stats
    s.transfer_ledger._clock = lambda: now[0]
    given = []  # what vLLM's update_from_output takes from the connector, once per step
    real = s._omni.get_kv_connector_stats
    s._omni.get_kv_connector_stats = lambda: given.append(real()) or given[-1]
    for rid in ("a", "b"):
        s.add_request(make_request(16, max_tokens=20, request_id=rid))
    step(s)
    so = s.schedule()
    attempts = {rid: h.attempt for rid, h in handed_off(so).items()}
    out = runner_output(so)
    out.kv_connector_output = KVConnectorOutput(kv_connector_worker_meta=OmniKVWorkerMetadata(
        {"a": Answer(attempts["a"], None, 4096, 0.25)}))
    s.update_from_output(so, out)
    now[0] += 31.0  # b expires
    step(s)
    assert {t.request_id: t.outcome for t in s.recorder.resolved} == {
        "a": Outcome.ACKED, "b": Outcome.EXPIRED}
    assert len(given) == 3 and given == [None, None, None]


def test_a_finish_that_raises_leaves_no_delayed_free_behind(monkeypatch):
    """The bare finish answers vLLM's "delay the free" for the request being freed only
    (from its transfer's state): if vLLM's _free_request raises after asking, the next
    finish is not delayed by it, and the held request is still answered as held."""
    s = omni(ON_FINISH)
    assert s._bare_finish
    s.add_request(make_request(16, max_tokens=1, request_id="held"))
    so = s.schedule()

    def boom(request):
        raise RuntimeError("encoder cache")

    monkeypatch.setattr(s.encoder_cache_manager, "free", boom)
    with pytest.raises(RuntimeError, match="encoder cache"):
        s.update_from_output(so, runner_output(so))
    assert s._connector_finished(make_request(4, request_id="other")) == (False, None)
    assert s._connector_finished(s.requests["held"]) == (True, None)


def test_a_lost_ack_expires_frees_the_blocks_and_the_engine_loop_ends():
    s = omni({**ON_FINISH, "timeout_seconds": 0.2})
    start = free_blocks(s)
    r = make_request(16, max_tokens=1)
    s.add_request(r)
    step(s)
    deadline = time.monotonic() + 10
    steps = 0
    while s.has_requests():  # what EngineCore's loop asks before each step
        assert time.monotonic() < deadline, "the transfer never expired"
        step(s)
        steps += 1
    (t,) = s.recorder.resolved
    assert t.outcome is Outcome.EXPIRED and t.held
    assert steps > 1
    assert_quiescent(s, start)


def test_a_transfer_the_scheduler_resolves_itself_is_withdrawn_in_the_step_that_frees_its_blocks():
    """The block guarantee at a distance: a receiver reads the blocks in place until it is
    answered. When the scheduler resolves a handed-off transfer itself (expiry, a reset), the
    step whose schedule() frees its blocks withdraws it in its connector metadata, so the
    worker refuses to commit any read of it before that step's forward can write them; a
    transfer the workers answered, or one never handed off, is not withdrawn."""
    s = omni({**ON_FINISH, "timeout_seconds": 0.2})
    start = free_blocks(s)
    r = make_request(16, max_tokens=1, request_id="r")
    s.add_request(r)
    step(s)
    so, _ = step(s)
    (attempt,) = [h.attempt for h in handed_off(so).values()]
    deadline = time.monotonic() + 10
    while s.transfer_ledger.get("r") is not None:
        assert time.monotonic() < deadline, "the transfer never expired"
        so, _ = step(s)
    assert withdrawn(so) == {"r": attempt}, "withdrawn in the step that freed the blocks"
    assert free_blocks(s) == start
    so, _ = step(s)
    assert withdrawn(so) == {}, "once"

    s = omni(PREFILL, enable_prefix_caching=True)
    a = make_request(40, max_tokens=20, request_id="a", block_size=16)
    b = make_request(40, max_tokens=20, request_id="b", block_size=16)
    s.add_request(a)
    step(s)
    so, _ = step(s)  # a handed off
    (a_attempt,) = [h.attempt for h in handed_off(so).values()]
    s.add_request(b)  # b marked after the reset below, never handed off before it
    assert s.reset_prefix_cache(reset_running_requests=True) is True
    so = s.schedule()
    assert withdrawn(so) == {"a": a_attempt}


def test_acks_for_unknown_requests_are_ignored_and_an_ack_may_come_with_the_hand_off_step():
    s = omni(PREFILL)
    r = make_request(16, max_tokens=4)
    s.add_request(r)
    step(s, acked=["nobody"], failed={"nobody-else": "?"})
    assert s.transfer_ledger.get(r.request_id).phase is Phase.PENDING
    # A runner that extracts synchronously answers in the output of the hand-off step.
    step(s, acked=[r.request_id])
    assert s.recorder.resolved[0].outcome is Outcome.ACKED
    # (An answer for a transfer still pending is refused by the ledger: test_ledger.py.)


@pytest.mark.parametrize("layout", ["vllm", "unknown"])
def test_marking_reads_the_blocks_vllms_get_blocks_reads_and_adds_no_entry(layout, monkeypatch):
    """The scheduler reads a request's blocks from the coordinator's one manager (no
    KVCacheBlocks per marking, the lookup chosen at start-up): the same list vLLM's
    get_blocks gives, for a running request and for one vLLM does not know (none; the lookup
    adds no entry to vLLM's defaultdict). Where the coordinator is laid out otherwise, it asks
    get_blocks itself."""
    if layout == "unknown":
        monkeypatch.setattr(sched_module, "_req_to_blocks", lambda kv_cache_manager: None)
    s = omni(PREFILL)
    manager = s.kv_cache_manager.coordinator.single_type_managers[0]
    if layout == "vllm":
        assert s._group_blocks == manager.req_to_blocks.get
    else:
        assert s._group_blocks == s._blocks_from_manager
    r = make_request(40, max_tokens=3)
    s.add_request(r)
    step(s)
    assert s._group_blocks(r.request_id) is s.kv_cache_manager.get_blocks(r.request_id).blocks[0]
    assert len(s._group_blocks(r.request_id)) == 3
    assert list(s._group_blocks("never-added") or ()) == []
    assert "never-added" not in manager.req_to_blocks
    (t,) = s.recorder.marked
    assert list(t.block_ids) == [b.block_id for b in s._group_blocks(r.request_id)]


@pytest.mark.parametrize("lookup", ["raises", "too_few_blocks"])
def test_failed_marking_resolves_as_failed_and_is_logged_once(caplog, monkeypatch, lookup):
    """The block lookup at marking raises, or finds fewer blocks than the snapshot covers
    (the invariant that a snapshot only names computed KV, broken): the transfer resolves
    failed with the reason, logged once, and ships nothing, rather than blocks that do not
    hold the snapshot."""
    s = omni(PREFILL)
    start = free_blocks(s)
    r = make_request(40, max_tokens=3)
    s.add_request(r)
    real = s._group_blocks

    def broken(request_id):
        if lookup == "raises":
            raise KeyError(request_id)
        return real(request_id)[:1]

    monkeypatch.setattr(s, "_group_blocks", broken)
    with caplog.at_level(logging.ERROR, logger="omni_runtime.sched.scheduler"):
        step(s)
    monkeypatch.undo()
    (t,) = s.recorder.resolved
    expected = ("marking failed: KeyError" if lookup == "raises" else
                "marking failed: RuntimeError: request holds 1 KV blocks, 3 needed for seq_len 40")
    assert t.outcome is Outcome.FAILED and t.reason.startswith(expected)
    assert list(t.block_ids) == [] and t.seq_len == 40
    assert len([m for m in caplog.messages if "marking failed" in m]) == 1
    so, _ = step(s)
    assert handed_off(so) == {}, "a failed marking ships nothing"
    while s.has_requests():
        so, _ = step(s)
        assert handed_off(so) == {}
    assert len(s.recorder.marked) == 1, "the trigger is spent: no second transfer"
    assert_quiescent(s, start)


def test_a_failed_marking_among_a_steps_triggers_is_resolved_before_the_next_is_marked(
        monkeypatch):
    """A step's triggers are marked together; when one lookup fails, the ledger changes
    as with one trigger at a time: that transfer fails before the next one is marked (a
    per-change observer sees it so), and each request keeps its own transfer."""
    s = omni(ON_FINISH)  # marks only at a finish: the step's marks below are made by hand
    events = []

    class Order(TransferObserver):
        def on_marked(self, ledger, transfer):
            events.append(("marked", transfer.request_id))

        def on_resolved(self, ledger, transfer):
            events.append((transfer.outcome.value, transfer.request_id))

    s.transfer_ledger.add_observer(Order())
    requests = [make_request(40, max_tokens=3, request_id=rid) for rid in ("a", "b", "c")]
    for request in requests:
        s.add_request(request)
    step(s)  # the prompts' KV computed
    real = s._group_blocks
    monkeypatch.setattr(s, "_group_blocks",
                        lambda rid: real(rid)[:1] if rid == "b" else real(rid))
    made = s._mark_many(Trigger.PREFILL_FINISHED, requests, [40, 40, 40])
    assert events == [("marked", "a"), ("marked", "b"), ("failed", "b"), ("marked", "c")]
    assert [t.request_id for t in made] == ["a", "b", "c"]
    assert [getattr(r, "omni_kv_transfer") for r in requests] == made
    assert made[1].reason.startswith("marking failed: RuntimeError: request holds 1 KV blocks")


# ---------------------------------------------------------------------------- aborts


def test_abort_before_hand_off_cancels_and_ships_no_freed_blocks():
    s = omni(PREFILL)
    start = free_blocks(s)
    r = make_request(32, max_tokens=8)
    s.add_request(r)
    step(s)
    assert s.transfer_ledger.get(r.request_id).phase is Phase.PENDING
    s.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
    assert free_blocks(s) == start, "an aborted request's blocks are freed at once"
    so, _ = step(s)
    assert handed_off(so) == {}
    (t,) = s.recorder.resolved
    assert t.outcome is Outcome.CANCELLED
    assert_quiescent(s, start)


def test_abort_after_hand_off_keeps_blocks_until_the_transfer_resolves():
    s = omni(PREFILL)
    start = free_blocks(s)
    r = make_request(32, max_tokens=8)
    s.add_request(r)
    step(s)
    step(s)  # handed off
    s.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
    assert free_blocks(s) < start, "the runner may still be reading them"
    assert s.has_requests()
    s.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)  # twice: no effect
    step(s, acked=[r.request_id])
    assert s.recorder.resolved[0].outcome is Outcome.ACKED
    assert_quiescent(s, start)


def test_an_aborted_request_starts_no_transfer():
    s = omni(ON_FINISH)
    start = free_blocks(s)
    r = make_request(32, max_tokens=8)
    s.add_request(r)
    step(s)
    s.finish_requests(r.request_id, RequestStatus.FINISHED_ABORTED)
    step(s)  # tells the runner the request finished
    assert not s.recorder.marked
    assert_quiescent(s, start)


# ---------------------------------------------------------------------------- preemption


def _blocks_of_others(s, rid):
    return {b for r in s.requests.values() if r.request_id != rid
            for b in (s.kv_cache_manager.get_block_ids(r.request_id)[0]
                      if r.status is RequestStatus.RUNNING else ())}


def test_preemption_of_a_pending_transfer_pins_its_blocks_and_still_hands_it_off():
    """Two requests fill the KV cache; when the first needs a new block, vLLM preempts the
    second and frees its blocks. Its pending transfer is handed off in that same step, so
    its blocks stay out of the free pool until it resolves; then everything completes."""
    s = omni(PREFILL, num_blocks=9, max_num_seqs=4)  # 8 usable blocks of 16 tokens
    start = free_blocks(s)
    a = make_request(64, max_tokens=6, request_id="a")  # 4 blocks, the 5th on its 1st decode
    b = make_request(60, max_tokens=2, request_id="b")  # 4 blocks
    s.add_request(a)
    s.add_request(b)
    step(s)  # prefill both; both transfers pending
    b_blocks = list(s.kv_cache_manager.get_block_ids("b")[0])
    so, _ = step(s)  # a needs a 5th block: b is preempted
    assert b.status is RequestStatus.PREEMPTED
    handed = handed_off(so)
    assert list(handed["b"].block_ids) == b_blocks and handed["b"].seq_len == 60
    assert not set(b_blocks) & _blocks_of_others(s, "b"), "pinned blocks given to another"
    while s.has_requests():
        so, _ = step(s, acked=list(handed))
        assert not s._pinned.get("b") or not set(b_blocks) & _blocks_of_others(s, "b")
        handed = handed_off(so)
    outcomes = sorted((t.request_id, t.outcome) for t in s.recorder.resolved)
    assert outcomes == [("a", Outcome.ACKED), ("b", Outcome.ACKED)]
    assert_quiescent(s, start)


# ---------------------------------------------------------------------------- scale


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_hundreds_of_concurrent_requests_leave_nothing_behind(mode):
    """400 requests, random acks, failures and aborts, on the synchronous class stepped as
    EngineCore.step does and on the async class (through vLLM's async_scheduling flag) stepped
    as its batch queue does, a step always in flight."""
    from omni_runtime.devtools.sched_harness import EngineLoop
    from omni_runtime.sched.scheduler import OmniARAsyncScheduler

    rng = random.Random(7)
    kv, kw = {**PREFILL, "timeout_seconds": 0.5}, {"max_num_seqs": 256, "num_blocks": 4000}
    s = omni(kv, **kw) if mode == "sync" else _async_scheduler(kv, **kw)
    assert type(s) is (OmniARScheduler if mode == "sync" else OmniARAsyncScheduler)
    start = free_blocks(s)
    n = 400
    for i in range(n):
        s.add_request(make_request(rng.randint(1, 70), max_tokens=rng.randint(1, 12)))
    in_flight: set[str] = set()

    def answers(so):
        nonlocal in_flight
        acked = {r for r in in_flight if rng.random() < 0.4}
        failed = {r: "receiver busy" for r in in_flight - acked if rng.random() < 0.1}
        in_flight -= acked | set(failed)
        in_flight |= set(handed_off(so))
        return acked, failed

    loop = EngineLoop(s, lambda rid, pos: 5, depth=1 if mode == "sync" else 2, answers=answers)
    deadline = time.monotonic() + 120
    placeholders = False
    while s.has_requests() or loop.in_flight:
        assert time.monotonic() < deadline
        loop.step()
        placeholders |= any(r.num_output_placeholders > 0 for r in s.running)
        live = [r for r in s.requests.values() if not r.is_finished()]
        if live and rng.random() < 0.05:
            s.finish_requests(rng.choice(live).request_id, RequestStatus.FINISHED_ABORTED)
        s.transfer_ledger.check_invariants()
    assert placeholders is (mode == "async"), "the async scheduler's own bookkeeping ran"
    outcomes = {o: sum(t.outcome is o for t in s.recorder.resolved) for o in Outcome}
    assert len(s.recorder.resolved) == len(s.recorder.marked) >= n * 0.8
    assert outcomes[Outcome.ACKED] and outcomes[Outcome.FAILED]
    assert len({id(t) for t in s.recorder.resolved}) == len(s.recorder.resolved)
    assert_quiescent(s, start)


# ---------------------------------------------------------------------------- misc


def test_transfers_off_behaves_like_the_stock_scheduler():
    ours = make_scheduler(OmniARScheduler, make_vllm_config(None))
    stock = make_scheduler(Scheduler, make_vllm_config(None))
    rng = random.Random(3)
    specs = [(rng.randint(1, 50), rng.randint(1, 10)) for _ in range(30)]
    for sched in (ours, stock):
        for i, (p, m) in enumerate(specs):
            sched.add_request(make_request(p, max_tokens=m, request_id=f"r{i}"))
    while stock.has_requests():
        so_a, out_a = step(ours)
        so_b, out_b = step(stock)
        assert so_a.num_scheduled_tokens == so_b.num_scheduled_tokens
        assert {k: (o.new_token_ids, o.finish_reason) for k, o in outputs_by_id(out_a).items()} == {
            k: (o.new_token_ids, o.finish_reason) for k, o in outputs_by_id(out_b).items()
        }
        assert handed_off(so_a) == {}
    assert not ours.has_requests()


def test_request_payloads_reach_the_runner_only_for_requests_that_carry_them():
    s = omni(PREFILL)
    plain = make_request(8, request_id="plain")
    rich = make_request(8, request_id="rich")
    rich.additional_information = {"speaker": [1.0, 2.0]}
    s.add_request(plain)
    s.add_request(rich)
    so = s.schedule()
    by_id = {nr.req_id: nr for nr in so.scheduled_new_reqs}
    assert type(by_id["plain"]) is NewRequestData
    assert isinstance(by_id["rich"], OmniNewRequestData)
    assert by_id["rich"].additional_information == {"speaker": [1.0, 2.0]}


def test_request_payloads_reach_the_workers_even_with_transfers_off():
    s = make_scheduler(OmniARScheduler, make_vllm_config(None))
    rich = make_request(8, max_tokens=2, request_id="rich")
    rich.additional_information = {"speaker": [1.0]}
    s.add_request(rich)
    first = s.schedule()
    (new,) = first.scheduled_new_reqs
    assert isinstance(new, OmniNewRequestData) and new.additional_information == {"speaker": [1.0]}
    s.update_from_output(first, runner_output(first))
    while s.has_requests():
        step(s)
    assert not s.requests


def test_trace_headers_travel_with_the_transfer():
    s = omni(PREFILL)
    headers = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    r = make_request(8, trace_headers=headers)
    s.add_request(r)
    step(s)
    assert s.transfer_ledger.get(r.request_id).trace_headers == headers
    so, _ = step(s)
    assert handed_off(so)[r.request_id].trace_headers == headers


def test_a_bad_omni_kv_config_fails_start_up_naming_the_key():
    bad = {"need_send_cache": True, "kv_transfer_criteria": {"type": "special_token", "token_id": 10_000}}
    with pytest.raises(OmniKVConfigError, match=r"kv_transfer_criteria\.token_id.*vocabulary"):
        omni(bad)


def test_the_async_variant_marks_the_same_snapshots_with_a_step_in_flight():
    """vLLM's AsyncScheduler schedules step N+1 before step N's output arrives, so a
    request's computed-token count runs one step ahead when its trigger fires; the snapshot
    must still be the prompt. (vLLM's CPU platform turns async scheduling off, so this is
    covered here rather than in a real engine.)"""
    from omni_runtime.sched.scheduler import OmniARAsyncScheduler

    s = make_scheduler(OmniARAsyncScheduler, make_vllm_config(PREFILL))
    start = free_blocks(s)
    r = make_request(40, max_tokens=6)
    s.add_request(r)
    first = s.schedule()  # the prefill
    second = s.schedule()  # the first decode, scheduled while the prefill runs
    assert r.num_computed_tokens == 41
    s.update_from_output(first, runner_output(first))
    t = s.transfer_ledger.get(r.request_id)
    assert (t.seq_len, len(t.block_ids)) == (40, 3)
    s.update_from_output(second, runner_output(second))
    # The rest one step at a time; the runner acks in the output of the hand-off step.
    while s.has_requests():
        so = s.schedule()
        s.update_from_output(so, runner_output(so, acked=[(r, i.attempt) for r, i in handed_off(so).items()]))
    assert t.outcome is Outcome.ACKED
    assert r.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert_quiescent(s, start)


def test_a_request_stopped_by_the_repetition_detector_ships_its_kv():
    """FINISHED_REPETITION is a normal end (vLLM's check_stop), not an abort."""
    from vllm.sampling_params import RepetitionDetectionParams

    s = omni(ON_FINISH)
    start = free_blocks(s)
    r = make_request(16, max_tokens=50)
    r.sampling_params.repetition_detection = RepetitionDetectionParams(
        max_pattern_size=1, min_pattern_size=1, min_count=3
    )
    s.add_request(r)
    while r.request_id not in {t.request_id for t in s.recorder.marked}:
        step(s)  # the same token every step: the detector stops it on the third
    assert r.status is RequestStatus.FINISHED_REPETITION
    assert s.recorder.marked[0].trigger is Trigger.REQUEST_FINISHED
    step(s)
    step(s, acked=[r.request_id])
    assert s.recorder.resolved[0].outcome is Outcome.ACKED
    assert_quiescent(s, start)


def test_preemption_of_an_active_transfer_never_gives_its_blocks_to_another_request():
    """The hole vLLM's own preemption opens: _preempt_request frees an active transfer's blocks
    and the same schedule() may give them to another request while the runner still reads
    them. With the transfer in flight, its blocks stay allocated and unchanged (no other
    request holds them) until it resolves; the transfer then completes as acked."""
    s = omni(PREFILL, num_blocks=10, max_num_seqs=4)  # 9 usable blocks
    start = free_blocks(s)
    a = make_request(63, max_tokens=6, request_id="a")  # 4 blocks; a 5th at token 65
    b = make_request(60, max_tokens=6, request_id="b")  # 4 blocks
    s.add_request(a)
    s.add_request(b)
    step(s)  # prefill both, both marked
    b_blocks = set(s.kv_cache_manager.get_block_ids("b")[0])
    so, _ = step(s)  # hand-off of both
    assert set(handed_off(so)) == {"a", "b"}
    c = make_request(16, max_tokens=2, request_id="c")  # would take b's blocks
    s.add_request(c)
    preempted_at = None
    for i in range(6):
        step(s, acked=["a"] if i == 0 else ())
        if b.status is RequestStatus.PREEMPTED and preempted_at is None:
            preempted_at = i
        assert not b_blocks & _blocks_of_others(s, "b"), "an in-flight transfer's block reused"
    assert preempted_at is not None, "the scenario must preempt b during its transfer"
    assert s.transfer_ledger.get("b").phase is Phase.ACTIVE, "still in flight, not failed"
    so, _ = step(s, acked=["b"])
    assert not s._pinned
    while s.has_requests():  # c's own transfer answered as it is handed off (not left to expire)
        so, _ = step(s, acked=list(handed_off(so)))
    b_transfers = [t for t in s.recorder.marked if t.request_id == "b"]
    assert [(t.seq_len, t.outcome) for t in b_transfers] == [(60, Outcome.ACKED)]
    assert_quiescent(s, start)


def test_a_late_answer_of_an_earlier_attempt_resolves_nothing():
    s = omni(PREFILL)
    r = make_request(20, max_tokens=8, request_id="r")
    s.add_request(r)
    step(s)
    so, _ = step(s)
    attempt = handed_off(so)["r"].attempt
    step(s, failed={("r", attempt - 1): "stale"}, acked=[("r", attempt + 1)])
    assert s.transfer_ledger.get("r").phase is Phase.ACTIVE, "a stale answer resolved it"
    step(s, acked=[("r", attempt)])
    assert s.transfer_ledger.get("r") is None
    assert [t.outcome for t in s.recorder.resolved] == [Outcome.ACKED]


def test_reset_prefix_cache_succeeds_with_held_transfers_and_frees_them():
    s = omni(ON_FINISH, enable_prefix_caching=True)
    start = free_blocks(s)
    r = make_request(40, max_tokens=2, request_id="r", block_size=16)
    s.add_request(r)
    while r.request_id in s.requests and not r.is_finished():
        step(s)
    assert s.transfer_ledger.num_held == 1
    assert s.reset_prefix_cache() is True
    (t,) = s.recorder.resolved
    assert t.outcome is Outcome.FAILED and "reset" in t.reason
    assert free_blocks(s) == start and not s.requests


def test_reset_prefix_cache_with_running_requests_does_not_raise_with_transfers_in_flight():
    s = omni(PREFILL, enable_prefix_caching=True)
    a = make_request(40, max_tokens=20, request_id="a", block_size=16)
    s.add_request(a)
    step(s)
    step(s)  # handed off, active
    assert s.reset_prefix_cache(reset_running_requests=True) is True
    assert not s._pinned and not s.transfer_ledger.has_unresolved()


def test_shutdown_frees_held_blocks_and_forgets_their_requests():
    s = omni(ON_FINISH)
    start = free_blocks(s)
    r = make_request(40, max_tokens=2, request_id="r")
    s.add_request(r)
    while not r.is_finished():
        step(s)
    assert s.transfer_ledger.num_held == 1 and "r" in s.requests
    s.shutdown()
    assert free_blocks(s) == start and not s.requests
    assert [t.outcome for t in s.recorder.resolved] == [Outcome.FAILED]


def test_with_prefix_caching_a_cached_prompt_still_ships_its_whole_snapshot():
    s = omni(PREFILL, enable_prefix_caching=True)
    start = free_blocks(s)
    first = make_request(64, max_tokens=2, request_id="first", block_size=16)
    s.add_request(first)
    while s.has_requests():
        so, _ = step(s, acked=list(s.transfer_ledger._active))
    second = make_request(64, max_tokens=2, request_id="second", block_size=16)
    s.add_request(second)
    so, _ = step(s)
    t = s.transfer_ledger.get("second")
    assert (t.seq_len, len(t.block_ids)) == (64, 4)
    first_blocks = list(s.recorder.marked[0].block_ids)
    assert list(t.block_ids[:3]) == first_blocks[:3], "the prompt's full blocks came from the prefix cache"
    while s.has_requests():
        step(s, acked=list(s.transfer_ledger._active))
    assert t.outcome is Outcome.ACKED
    assert free_blocks(s) == start


def test_the_plain_class_name_gives_the_async_variant_under_async_scheduling():
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from omni_runtime.sched.scheduler import OmniARAsyncScheduler

    cfg = make_vllm_config(PREFILL)
    cfg.scheduler_config.async_scheduling = True
    s = make_scheduler(OmniARScheduler, cfg)
    assert type(s) is OmniARAsyncScheduler and isinstance(s, AsyncScheduler)
    assert isinstance(s, OmniARScheduler) and s.transfer_ledger is not None
    assert type(make_scheduler(OmniARScheduler, make_vllm_config(PREFILL))) is OmniARScheduler


def _async_scheduler(kv_config, kv_role=None, log_stats=False, **kw):
    """The async variant through the public class name, as vLLM builds it under async
    scheduling (the harness's VllmConfig skips the CPU platform's check that turns async
    scheduling off, so this is vLLM's real AsyncScheduler)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    from omni_runtime.sched.scheduler import OmniARAsyncScheduler

    cfg = make_vllm_config(kv_config, **kw)
    cfg.scheduler_config.async_scheduling = True
    if kv_role is not None:
        cfg.kv_transfer_config.kv_role = kv_role
    s = make_scheduler(OmniARScheduler, cfg, log_stats=log_stats)
    assert type(s) is OmniARAsyncScheduler and isinstance(s, AsyncScheduler)
    s.transfer_ledger.add_observer(rec := Recorder())
    s.recorder = rec
    return s


@pytest.mark.parametrize("kv_role", ["kv_producer", "kv_consumer"])
def test_async_a_sentinel_in_the_output_of_a_request_preempted_meanwhile_is_dropped(kv_role):
    """Async scheduling: step N+1 is scheduled (and may preempt) before step N's output is
    processed. vLLM drops the output that was in flight for a request it preempted (drop
    mode: the omni scheduler sets vLLM's requires_kv_delivery, whatever the connector's
    role says), so a sentinel in it never happened: nothing is marked on freed blocks, and
    the request awaits its trigger on."""
    s = _async_scheduler(SPECIAL, kv_role, num_blocks=9, max_num_seqs=4)
    assert s.connector.requires_kv_delivery is (kv_role == "kv_producer")
    assert s.requires_kv_delivery is True
    rec = s.recorder
    start = free_blocks(s)
    a = make_request(63, max_tokens=8, request_id="a")
    b = make_request(60, max_tokens=8, request_id="b")
    s.add_request(a)
    s.add_request(b)
    prev = s.schedule()  # both prefill
    while True:
        nxt = s.schedule()
        assert b.num_output_placeholders or b.status is RequestStatus.PREEMPTED, "really async"
        if b.status is RequestStatus.PREEMPTED:
            break
        s.update_from_output(prev, runner_output(prev))
        prev = nxt
    # `prev` was computed with b still running; its output carries b's sentinel. (Then
    # `nxt`, which no longer has b, is processed by the loop below.)
    tokens_before = b.num_tokens
    s.update_from_output(prev, runner_output(prev, {"b": [SENTINEL]}))
    assert b.num_tokens == tokens_before and SENTINEL not in b.output_token_ids, "vLLM dropped it"
    assert not rec.marked and "b" in s._awaiting_trigger
    s.update_from_output(nxt, runner_output(nxt))
    while s.has_requests():
        so = s.schedule()
        s.update_from_output(so, runner_output(so, scheduler=s, acked=hand_off_attempts(so)))
    (t,) = [t for t in rec.marked if t.request_id == "b"]
    assert (t.trigger, t.seq_len, t.outcome) == (Trigger.REQUEST_FINISHED, b.num_tokens - 1, Outcome.ACKED)
    assert free_blocks(s) == start


def test_async_a_stop_token_in_the_output_of_a_request_preempted_meanwhile_is_dropped(caplog):
    """Async scheduling: b's stop token is in the output of the step in flight when the next
    schedule() preempts b. vLLM drops that output: b does not finish while preempted (its KV
    freed), it is recomputed and finishes later, shipping the KV it then has, once."""
    from omni_runtime.devtools.sched_harness import EOS

    s = _async_scheduler(ON_FINISH, num_blocks=9, max_num_seqs=4)
    rec = s.recorder
    start = free_blocks(s)
    a = make_request(63, max_tokens=8, request_id="a")
    b = make_request(60, max_tokens=8, request_id="b", ignore_eos=False)
    s.add_request(a)
    s.add_request(b)
    prev = s.schedule()
    while True:
        nxt = s.schedule()
        if b.status is RequestStatus.PREEMPTED:
            break
        s.update_from_output(prev, runner_output(prev))
        prev = nxt
    s.update_from_output(prev, runner_output(prev, {"b": [EOS]}))
    assert not b.is_finished() and EOS not in b.output_token_ids, "vLLM dropped it"
    s.update_from_output(nxt, runner_output(nxt))
    while s.has_requests():
        so = s.schedule()
        s.update_from_output(so, runner_output(so, scheduler=s, acked=hand_off_attempts(so)))
    assert b.status is RequestStatus.FINISHED_LENGTH_CAPPED
    (t,) = [t for t in rec.resolved if t.request_id == "b"]
    assert (t.trigger, t.seq_len, t.outcome) == (Trigger.REQUEST_FINISHED, b.num_tokens - 1, Outcome.ACKED)
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    assert free_blocks(s) == start


# ---------------------------------------------------------------------------- tensor parallelism


def tp2(kv_config=PREFILL, **kw):
    """The scheduler of a tensor_parallel_size 2 engine: its connector's scheduler side
    combines two ranks' answers (no second rank runs here: the outputs are hand-made; more in
    test_tensor_parallel.py)."""
    return omni(kv_config, tensor_parallel_size=2, **kw)


def ranks_step(s, answers_by_rank):
    """One step whose workers answered ``{rank: {request id: (attempt, reason)}}``, merged
    by vLLM's own KVOutputAggregator as the multiprocess executor does."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput

    from omni_runtime.kv.metadata import OmniKVWorkerMetadata

    so = s.schedule()
    outputs = []
    for rank in (0, 1):
        out = runner_output(so, scheduler=s)
        answers = answers_by_rank.get(rank)
        if answers:
            out.kv_connector_output = KVConnectorOutput(
                kv_connector_worker_meta=OmniKVWorkerMetadata(
                    {rid: Answer(*a) for rid, a in answers.items()}, rank))
        outputs.append(out)
    merged = KVOutputAggregator(expected_finished_count=2).aggregate(outputs)
    return so, s.update_from_output(so, merged)


def test_tp2_a_transfer_is_acked_only_when_every_rank_acked_its_shard():
    s = tp2()
    start = free_blocks(s)
    r = make_request(40, max_tokens=6, request_id="r")
    s.add_request(r)
    step(s)
    so, _ = step(s)
    attempt = handed_off(so)["r"].attempt
    ranks_step(s, {0: {"r": (attempt, None)}})
    assert s.transfer_ledger.get("r").phase is Phase.ACTIVE, "one shard of two is not delivered"
    ranks_step(s, {})
    assert s.transfer_ledger.get("r") is not None
    ranks_step(s, {1: {"r": (attempt, None)}})
    assert s.transfer_ledger.get("r") is None
    assert [t.outcome for t in s.recorder.resolved] == [Outcome.ACKED]
    while s.has_requests():
        step(s)
    assert not s._omni.scheduler_half.shard_answers
    assert_quiescent(s, start)


def test_tp2_one_failed_shard_fails_the_transfer_at_once_and_frees_held_blocks():
    s = tp2(ON_FINISH)
    start = free_blocks(s)
    r = make_request(40, max_tokens=2, request_id="r")
    s.add_request(r)
    while not r.is_finished():
        so, _ = step(s)
    so, _ = step(s)
    attempt = handed_off(so)["r"].attempt
    assert s.transfer_ledger.num_held == 1
    ranks_step(s, {0: {"r": (attempt, None)}, 1: {"r": (attempt, "stage next rejected: x")}})
    (t,) = s.recorder.resolved
    assert t.outcome is Outcome.FAILED and t.reason == "tensor-parallel rank 1: stage next rejected: x"
    assert not s._omni.scheduler_half.shard_answers, "every rank answered: nothing kept"
    assert_quiescent(s, start)


def test_tp2_answers_of_a_superseded_attempt_resolve_nothing_and_are_not_kept():
    from omni_runtime.kv.metadata import ShardAnswers

    answers = ShardAnswers(2)
    answers.expect("r", 1)
    assert answers.combine({0: {"r": Answer(1)}}) == ({}, {})
    answers.expect("r", 2)  # attempt 2 starts over
    assert answers.combine({0: {"r": Answer(2)}}) == ({}, {})
    assert answers.combine({1: {"r": Answer(1)}}) == ({}, {}), "a late answer of attempt 1"
    assert answers.combine({1: {"r": Answer(2)}}) == ({"r": Answer(2)}, {})
    assert not answers
    answers.expect("f", 3)
    assert answers.combine({0: {"f": Answer(3, "boom")}}) == (
        {"f": Answer(3, "tensor-parallel rank 0: boom")}, {"f": 3})
    assert answers.combine({1: {"f": Answer(3, "again")}}) == ({}, {}), \
        "a failure is reported once"
    assert not answers


# ---------------------------------------------------------------------------- composed (MultiConnector)

DELAYING = {"kv_connector": "DelayingConnector", "kv_role": "kv_producer",
            "kv_connector_module_path": "delaying_connector"}


def composed_step(s, *, acked=(), finished_sending=()):
    """One step whose workers answered under vLLM's MultiConnector: ours acks ``acked``, the
    other child (an asynchronous saver) reports ``finished_sending``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
        MultiKVConnectorWorkerMetadata,
    )
    from vllm.v1.outputs import KVConnectorOutput

    from omni_runtime.kv.metadata import OmniKVWorkerMetadata

    so = s.schedule()
    out = runner_output(so, scheduler=s)
    answers = {rid: Answer(s.transfer_ledger.get(rid).attempt) for rid in acked}
    meta = (MultiKVConnectorWorkerMetadata((None, OmniKVWorkerMetadata(answers)))
            if answers else None)
    out.kv_connector_output = KVConnectorOutput(
        finished_sending=set(finished_sending) or None, kv_connector_worker_meta=meta)
    return so, s.update_from_output(so, out)


@pytest.mark.parametrize("ours_first", [True, False])
def test_composed_with_a_connector_that_delays_frees_each_keeps_the_blocks_it_needs(ours_first):
    """Under vLLM's MultiConnector with a connector that saves asynchronously (it delays the
    free of every finished request until its finished_sending): a finished request's transfer
    pins its own blocks rather than joining the shared delayed free, so whichever of the two
    finishes first, the request's blocks are freed exactly once, by vLLM, when the other
    connector is done, and the transfer's stay out of the free pool until it is acked."""
    s = omni(ON_FINISH, compose_with=DELAYING)
    assert type(s.connector).__name__ == "MultiConnector" and s._omni is s.connector._connectors[1]
    start = free_blocks(s)
    r = make_request(40, max_tokens=2, request_id="r")
    s.add_request(r)
    while not r.is_finished():
        step(s)
    so, _ = step(s)  # hand-off
    assert "r" in handed_off(so)
    pinned = {b.block_id for b in s._pinned["r"]}
    assert len(pinned) == 3 and "r" in s.requests, "the other connector delays the free"
    assert s.transfer_ledger.num_held == 1
    if ours_first:
        composed_step(s, acked=["r"])
        assert s.transfer_ledger.get("r") is None and not s._pinned
        assert "r" in s.requests, "still the other connector's: not freed under it"
        composed_step(s, finished_sending=["r"])
    else:
        composed_step(s, finished_sending=["r"])
        assert "r" not in s.requests
        in_free_pool = {b.block_id for b in s.kv_cache_manager.block_pool.free_block_queue.get_all_free_blocks()}
        assert not pinned & in_free_pool, "the transfer's blocks stay pinned until its ack"
        composed_step(s, acked=["r"])
    assert [t.outcome for t in s.recorder.resolved] == [Outcome.ACKED]
    assert_quiescent(s, start)


def test_composed_an_abort_before_hand_off_cancels_and_drops_the_pin_at_once():
    """Composed: a finished request's transfer is pinned (not held through the delayed free);
    aborted before its hand-off, the transfer is cancelled and the pin dropped in the same
    call, so only the other connector's delayed free keeps the request, until it reports."""
    s = omni(PREFILL, compose_with=DELAYING)
    start = free_blocks(s)
    r = make_request(40, max_tokens=8, request_id="r")
    s.add_request(r)
    step(s)
    assert s.transfer_ledger.get("r").phase is Phase.PENDING
    s.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    (t,) = s.recorder.resolved
    assert t.outcome is Outcome.CANCELLED and not s._pinned
    assert "r" in s.requests, "the other connector delays the free"
    so, _ = composed_step(s, finished_sending=["r"])
    assert handed_off(so) == {}
    assert_quiescent(s, start)


def test_need_send_cache_refuses_to_start_without_what_a_transfer_needs():
    """Without the omni KV connector, or on a model of several KV cache groups (whose blocks
    a transfer of group 0's block ids would not cover), start-up fails naming the key."""
    no_connector = make_vllm_config(PREFILL)
    no_connector.kv_transfer_config = None
    with pytest.raises(OmniKVConfigError, match="need_send_cache needs the omni KV connector"):
        make_scheduler(OmniARScheduler, no_connector)
    with pytest.raises(OmniKVConfigError, match="one KV cache group; this one has 2"):
        make_scheduler(OmniARScheduler, make_vllm_config(PREFILL), kv_cache_groups=2)
    # Transfers off: any model, no connector needed.
    make_scheduler(OmniARScheduler, make_vllm_config(None), kv_cache_groups=2)


# ---------------------------------------------------------------------------- the bare finish


def test_the_bare_finish_only_where_vllms_preparation_changes_nothing():
    """The shortcut past vLLM's preparation for request_finished (_connector_finished) is on
    only for our connector alone, its own request_finished, over full attention."""
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    from omni_runtime.kv.connector import OmniKVConnector
    from omni_runtime.sched import scheduler as sched_mod

    assert omni(ON_FINISH)._bare_finish
    assert not omni(ON_FINISH, compose_with=DELAYING)._bare_finish
    assert not make_scheduler(OmniARScheduler, make_vllm_config(None))._bare_finish

    class Overriding(OmniKVConnector):
        def request_finished(self, request, block_ids):
            return super().request_finished(request, block_ids)

    assert sched_mod._reads_no_finish_blocks(object.__new__(OmniKVConnector))
    assert not sched_mod._reads_no_finish_blocks(object.__new__(Overriding))

    class Coordinator:
        single_type_managers = [object.__new__(SlidingWindowManager)]

    class Manager:
        coordinator = Coordinator()

    assert not sched_mod._frees_nothing_early(Manager())
    assert sched_mod._frees_nothing_early(omni(ON_FINISH).kv_cache_manager)


@pytest.mark.parametrize("kv", [ON_FINISH, PREFILL], ids=["request_finished", "prefill_finished"])
def test_the_bare_finish_gives_what_vllms_own_path_gives(kv):
    """Two schedulers stepped in lock step on the same requests, acks and aborts, one with
    the bare finish, one through vLLM's _connector_finished: the same outputs (transfer
    params included), the same transfers, the same free blocks at every step."""
    rng = random.Random(3)
    bare, stock_path = omni(kv, num_blocks=400), omni(kv, num_blocks=400)
    stock_path._bare_finish = False
    assert bare._bare_finish
    starts = [free_blocks(s) for s in (bare, stock_path)]
    for i in range(40):
        for s in (bare, stock_path):
            s.add_request(make_request(1 + (i * 7) % 50, max_tokens=1 + i % 6, request_id=f"q{i}"))
    acks: list = []
    in_flight: list = []
    while bare.has_requests():
        so_b, so_s = bare.schedule(), stock_path.schedule()
        assert ({r: (h.attempt, h.seq_len, h.block_ids) for r, h in handed_off(so_b).items()}
                == {r: (h.attempt, h.seq_len, h.block_ids) for r, h in handed_off(so_s).items()})
        outs = [s.update_from_output(so, runner_output(so, scheduler=s, acked=acks))
                for s, so in ((bare, so_b), (stock_path, so_s))]
        assert_same_outputs(outs)
        in_flight = [rid for rid in in_flight if rid not in acks] + list(handed_off(so_b))
        acks = [rid for rid in in_flight if rng.random() < 0.5]  # each acked sooner or later
        abort_one_and_compare(rng, 0.2, bare, stock_path)
    assert_ended_alike(bare, stock_path, starts)


def test_a_hand_off_is_the_named_tuple_its_fields_make():
    """HandOff.of builds the tuple directly (without the named tuple's Python __new__):
    every field, in order, as the named tuple's own constructor gives it, held or not; the
    block ids the marking's tuple itself (no copy)."""
    from omni_runtime.sched.handoff import HandOff
    from omni_runtime.transfers.ledger import TransferLedger

    ledger = TransferLedger(30.0)
    t = ledger.mark("r", Trigger.PREFILL_FINISHED, 40, (3, 4, 5),
                    trace_headers={"traceparent": "00-x"})
    ledger.hand_off_pending()
    h = HandOff.of(t, ledger.wall_time)
    assert type(h) is HandOff and len(h) == len(HandOff._fields)
    assert h == HandOff(request_id="r", attempt=t.attempt, seq_len=40, block_ids=(3, 4, 5),
                        deadline_in_s=h.deadline_in_s, trace_headers={"traceparent": "00-x"},
                        held=None)
    assert 0 < h.deadline_in_s <= 30.0 and h.block_ids is t.block_ids
    ledger.request_finished("r", 7, aborted=False)
    assert HandOff.of(t, ledger.wall_time).held == (ledger.wall_time(t.held_since), 7)


@pytest.mark.parametrize("config, tokens, seq_len", [
    (PREFILL, [3] * 20, 20),
    (SPECIAL, [3] * 20 + [11], 21),
    # at its finish every token, the last one's KV not computed
    (ON_FINISH, [3] * 20 + [11, SENTINEL, 12, 13], 23),
], ids=["prefill", "special", "finish"])
def test_a_hand_off_carries_the_requests_tokens_at_its_trigger_and_its_pipeline_context(
        config, tokens, seq_len):
    """The next stage's input travels with the KV: the request's tokens at the trigger (its
    prompt after prefill, the tokens before the sentinel, every token at its finish), how
    many are the prompt, and the pipeline context its kv_transfer_params["omni"] names."""
    s = omni(config)
    r = make_request(20, max_tokens=4, request_id="r", prompt_token=3)
    r.kv_transfer_params = {"omni": {"request_id": "p-1", "endpoint": "http://e:8000"}}
    s.add_request(r)
    got = {}
    outputs = [[11], [SENTINEL], [12], [13]]
    while s.has_requests():
        so = s.schedule()
        got.update(handed_off(so))
        sampled = {"r": outputs.pop(0)} if "r" in so.num_scheduled_tokens and outputs else {}
        s.update_from_output(so, runner_output(so, sampled, scheduler=s,
                                               acked=hand_off_attempts(so)))
    carried = got["r"].carried
    assert list(carried.token_ids) == tokens and carried.prompt_len == 20
    assert got["r"].seq_len == seq_len
    assert carried.origin == {"request_id": "p-1", "endpoint": "http://e:8000"}


def test_a_hand_off_of_a_request_from_no_pipeline_carries_no_context():
    s = omni(PREFILL)
    s.add_request(make_request(20, max_tokens=2, request_id="r"))
    step(s)
    so, _ = step(s)
    assert handed_off(so)["r"].carried.origin is None


# ---------------------------------------------------------------------------- the bare schedule


def test_the_bare_schedule_only_for_our_connector_alone_with_its_own_load_side_hooks():
    """schedule() hides the connector from vLLM only where vLLM's connector work there would
    change nothing: our connector alone, none of the hooks vLLM's schedule() calls (the load
    side, the metadata) a subclass's override."""
    from omni_runtime.kv.connector import OmniKVConnector
    from omni_runtime.sched import scheduler as sched_mod

    assert omni(PREFILL)._bare_schedule
    assert not omni(ON_FINISH, compose_with=DELAYING)._bare_schedule
    assert not make_scheduler(OmniARScheduler, make_vllm_config(None))._bare_schedule

    def overriding(name):
        return type("Overriding", (OmniKVConnector,),
                    {name: lambda self, *args: getattr(super(type(self), self), name)(*args)})

    assert sched_mod._keeps_omni_hooks(object.__new__(OmniKVConnector), sched_mod._LOAD_SIDE_HOOKS)
    for name in sched_mod._LOAD_SIDE_HOOKS:
        assert not sched_mod._keeps_omni_hooks(object.__new__(overriding(name)),
                                                sched_mod._LOAD_SIDE_HOOKS), name
    assert not sched_mod._keeps_omni_hooks(object(), ("request_finished",))


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_bare_schedule_gives_what_vllms_own_path_gives(mode, prefix_caching):
    """Two schedulers stepped in lock step on the same requests, acks, failures and aborts,
    with too few blocks for all (preemptions), with and without prefix caching (prompts
    sharing prefixes: local hits, partial tails), one with the connector hidden from vLLM's
    schedule(), one through vLLM's connector calls: the same scheduled tokens, preemptions,
    connector metadata (hand-offs, withdrawals, held notices, idle), outputs (transfer params
    included), transfers and free blocks at every step; vLLM asked the hidden connector
    nothing in schedule(). The one difference, documented: vLLM's external prefix-cache
    stats (which count a connector's prefix matches) record nothing where it was hidden."""
    rng = random.Random(5)
    kv = {**PREFILL, "timeout_seconds": 300}
    kw = {"num_blocks": 24 if not prefix_caching else 18, "max_num_seqs": 16,
          "enable_prefix_caching": prefix_caching, "log_stats": True}  # as a served engine
    make = (lambda: omni(kv, **kw)) if mode == "sync" else (lambda: _async_scheduler(kv, **kw))
    bare, vllm_path = make(), make()
    external = {id(s): PrefixCacheStats() for s in (bare, vllm_path)}  # summed over steps
    local_hits = 0
    vllm_path._bare_schedule = False
    assert bare._bare_schedule
    asked = {id(s): 0 for s in (bare, vllm_path)}
    for s in (bare, vllm_path):
        def matched(request, num_computed, _s=s, _own=s.connector.get_num_new_matched_tokens):
            asked[id(_s)] += 1
            return _own(request, num_computed)
        s.connector.get_num_new_matched_tokens = matched
    starts = [free_blocks(s) for s in (bare, vllm_path)]
    for i in range(40):
        for s in (bare, vllm_path):  # hashed blocks: the prompts share their prefixes
            s.add_request(make_request(1 + (i * 7) % 50, max_tokens=1 + i % 40, request_id=f"q{i}",
                                       block_size=16 if prefix_caching else None))
    acks: list = []
    failed: dict = {}
    in_flight: list = []
    preempted = 0

    def meta(so):
        m = so.kv_connector_metadata
        return ([(h.request_id, h.attempt, h.seq_len, h.block_ids, h.held is None)
                 for h in m.hand_offs], m.withdrawn, m.idle, sorted(m.held))

    while bare.has_requests():
        so_b, so_v = bare.schedule(), vllm_path.schedule()
        assert so_b.kv_connector_block_state is None and so_v.kv_connector_block_state is None
        assert so_b.num_scheduled_tokens == so_v.num_scheduled_tokens
        assert so_b.preempted_req_ids == so_v.preempted_req_ids
        assert ([r.req_id for r in so_b.scheduled_new_reqs]
                == [r.req_id for r in so_v.scheduled_new_reqs])
        assert meta(so_b) == meta(so_v)
        preempted += len(so_b.preempted_req_ids or ())
        outs = [s.update_from_output(so, runner_output(so, scheduler=s, acked=acks,
                                                       failed=failed))
                for s, so in ((bare, so_b), (vllm_path, so_v))]
        assert_same_outputs(outs)
        local_hits += sum(eco.scheduler_stats.prefix_cache_stats.hits for eco in outs[0].values()
                          if eco.scheduler_stats)
        for s, out in zip((bare, vllm_path), outs):
            for eco in out.values():
                step_stats = eco.scheduler_stats and eco.scheduler_stats.connector_prefix_cache_stats
                if step_stats:
                    external[id(s)].requests += step_stats.requests
                    external[id(s)].queries += step_stats.queries
                    external[id(s)].hits += step_stats.hits
        in_flight = [rid for rid in in_flight if rid not in acks and rid not in failed]
        in_flight += list(handed_off(so_b))
        acks = [rid for rid in in_flight if rng.random() < 0.4]
        failed = {rid: "receiver busy" for rid in in_flight if rid not in acks
                  and rng.random() < 0.1}
        abort_one_and_compare(rng, 0.15, bare, vllm_path)
    assert preempted, "the workload preempted"
    assert asked[id(bare)] == 0 and asked[id(vllm_path)] >= 40
    assert (local_hits > 0) is prefix_caching, "the prompts hit the prefix cache"
    hidden, seen = external[id(bare)], external[id(vllm_path)]
    assert (hidden.requests, hidden.queries) == (0, 0)
    assert seen.requests > 0 and seen.queries > 0 and seen.hits == 0
    assert_ended_alike(bare, vllm_path, starts)


def test_the_bare_schedule_gives_the_connector_back_when_vllms_schedule_raises(monkeypatch):
    s = omni(PREFILL)
    connector = s.connector

    def broken(self, *args, **kwargs):
        assert self.connector is None  # hidden while vLLM schedules
        raise RuntimeError("scheduling failed")

    monkeypatch.setattr(Scheduler, "schedule", broken)
    with pytest.raises(RuntimeError, match="scheduling failed"):
        s.schedule()
    assert s.connector is connector
    monkeypatch.undo()
    s.add_request(make_request(8, max_tokens=3, request_id="r"))
    step(s)  # the prefill: marked
    so, _ = step(s)
    assert "r" in handed_off(so) and s.connector is connector


def test_the_transfer_metrics_are_written_at_most_every_telemetry_interval_and_exact_at_rest():
    """With transfers in flight the metrics wait for the telemetry interval (the first change
    after a quiet spell is written at once); when none is left, or at shutdown, they are
    written at once and exact."""
    from prometheus_client import REGISTRY

    from omni_runtime.observability.writer_thread import metrics_thread

    stage = "interval-test"

    def gauge(name, **labels):
        # What the reports so far handed to the writer thread, written (nothing reported here).
        assert metrics_thread().flush(timeout=10)
        return REGISTRY.get_sample_value(name, {"stage": stage, "model_name": sched_model, **labels})

    config = {**PREFILL, "telemetry_interval_seconds": 5, "stage_name": stage}
    sched = make_scheduler(OmniARScheduler, make_vllm_config(config))
    sched_model = sched.vllm_config.model_config.served_model_name or sched.vllm_config.model_config.model
    for rid in ("a", "b"):
        sched.add_request(make_request(32, request_id=rid))
    step(sched)  # both prefilled and marked: the first change after a quiet spell
    assert gauge("omni_kv_transfers", state="pending") == 2
    step(sched)  # handed off: within the interval, not written yet
    assert sched.transfer_ledger.num_active == 2
    assert gauge("omni_kv_transfers", state="pending") == 2
    assert gauge("omni_kv_transfers", state="active") == 0
    step(sched, acked=["a"])
    assert gauge("omni_kv_transfers_resolved_total", outcome="acked") == 0
    step(sched, acked=["b"])  # nothing unresolved: written at once, exact
    assert gauge("omni_kv_transfers", state="pending") == 0
    assert gauge("omni_kv_transfers", state="active") == 0
    assert gauge("omni_kv_transfers_resolved_total", outcome="acked") == 2
    assert gauge("omni_kv_transfer_duration_seconds_count", outcome="acked") == 2

    sched.add_request(make_request(32, request_id="c", max_tokens=1))
    step(sched)  # marked and finished (held), within the interval of the first report
    step(sched)
    assert sched.transfer_ledger.num_held == 1
    assert gauge("omni_kv_transfers", state="held") == 0, "not written yet"
    # (It finished in its prefill step: marked on finishing.)
    assert gauge("omni_kv_transfers_started_total", trigger="request_finished") == 0
    sched.shutdown()  # resolves it as failed and writes at once
    assert gauge("omni_kv_transfers_started_total", trigger="request_finished") == 1
    assert gauge("omni_kv_transfers_resolved_total", outcome="failed") == 1
    assert gauge("omni_kv_hold_duration_seconds_count") == 1
    assert gauge("omni_kv_transfers", state="held") == 0
