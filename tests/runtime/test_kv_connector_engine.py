"""The omni KV connector in a real vLLM engine (in-process engine core, CPU worker), with a
real receiver in the test process reading the engine's KV cache over NIXL."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest
import torch
from omni_runtime.kv.transport import KVInbox, KVReceiver
from omni_runtime.devtools.offline import drain_transfers, engine_core_of, omni_llm
from omni_runtime.devtools.tiny_model import ensure_tiny_model
from omni_runtime.transfers.ledger import Outcome, TransferObserver
from procs import free_port

pytestmark = pytest.mark.engine

ENGINE_ARGS = dict(
    kv_cache_memory_bytes=64 << 20,
    max_model_len=512,
    dtype="float32",
    enforce_eager=True,
)
PREFILL = {"need_send_cache": True, "kv_transfer_criteria": {"type": "prefill_finished"}}


@pytest.fixture
def in_process(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture
def receiver():
    inbox = KVInbox()
    rx = KVReceiver("tcp://127.0.0.1:0", inbox, pipeline="p", stage="next").start()
    yield rx
    rx.close()


@pytest.fixture
def llm_factory(in_process):
    made = []

    def make(omni_kv_config=PREFILL, endpoints=None, model=None, compose_with=None, **engine_args):
        llm = omni_llm(model or str(ensure_tiny_model()), omni_kv_config, endpoints=endpoints,
                       pipeline="p", compose_with=compose_with, **{**ENGINE_ARGS, **engine_args})
        made.append(llm)
        resolved = []

        class Keep(TransferObserver):
            def on_resolved(self, ledger, transfer):
                resolved.append(transfer)

        engine_core_of(llm).scheduler.transfer_ledger.add_observer(Keep())
        return llm, resolved

    yield make
    for llm in made:
        llm.llm_engine.engine_core.shutdown()
    # An engine that failed to start leaves vLLM's process-wide KV connector behind (only a
    # shutdown clears it): the next engine of this process would run that one.
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    ensure_kv_transfer_shutdown()
    gc.collect()


def test_acks_come_back_on_steps_with_nothing_scheduled(llm_factory, receiver):
    """max_tokens=1: each request finishes in its prefill step, so its transfer is handed off
    on a step with nothing to run, where vLLM's runner returns its shared empty output; the
    ack must still reach the scheduler (the reference project lost it and let it expire)."""
    from vllm import SamplingParams

    llm, resolved = llm_factory(
        omni_kv_config={**PREFILL, "timeout_seconds": 60},
        endpoints={"next": receiver.endpoint},
    )
    outs = llm.generate(["Hello world", "The quick brown fox"], SamplingParams(max_tokens=1))
    drain_transfers(llm, timeout_s=30)  # well inside the 60 s deadline: acked, not expired
    assert [t.outcome for t in resolved] == [Outcome.ACKED, Outcome.ACKED]
    for out in outs:
        payload = next(
            receiver.inbox.get(t.request_id) for t in resolved if t.request_id.startswith(out.request_id + "-")
        )
        assert payload.seq_len == len(out.prompt_token_ids)
        assert payload.kv.shape[:4] == (2, 2, 2, payload.seq_len)
        assert np.isfinite(payload.kv).all() and np.abs(payload.kv).sum() > 0
    scheduler = engine_core_of(llm).scheduler
    assert not scheduler.has_requests()


def test_the_host_kv_cache_is_on_huge_pages_when_the_receivers_read_it(llm_factory, receiver):
    """The AR's host KV cache is moved onto transparent huge pages before NIXL registers it
    (kv/huge_pages.py): a receiver's READ pins 2 MiB pages instead of 4 KiB ones; the
    transfers deliver as before (the byte-exact oracle tests run on the same path)."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from omni_runtime.kv.huge_pages import huge_page_bytes, huge_page_size

    llm, resolved = llm_factory(omni_kv_config={**PREFILL, "timeout_seconds": 60},
                                endpoints={"next": receiver.endpoint})
    worker = get_kv_transfer_group().worker_half
    storages = {c.untyped_storage().data_ptr(): c.untyped_storage().nbytes() for c in worker.caches}
    outcome = worker.host_huge_pages
    if not outcome.unsupported:  # this project's machines: Linux 6.1+, THP in madvise mode
        size = huge_page_size()
        assert outcome.why_not == "", outcome
        assert outcome.bytes >= sum(storages.values()) - 2 * size * len(storages), (outcome, storages)
        assert huge_page_bytes(storages.items()) >= outcome.bytes
    llm.generate(["Hello world"], SamplingParams(max_tokens=2))
    drain_transfers(llm, timeout_s=30)
    assert [t.outcome for t in resolved] == [Outcome.ACKED]


def test_an_io_cpus_the_process_cannot_use_refuses_the_engine_at_start_up(llm_factory):
    """Bad input is refused before the engine serves, naming the field and the fix (not at the
    first transfer, where it would fail every transfer)."""
    from omni_runtime.kv.cpu_affinity import CPUListError, available_cpus

    outside = max(available_cpus()) + 1
    with pytest.raises(CPUListError) as err:
        llm_factory(endpoints={"next": "tcp://127.0.0.1:9"}, io_cpus=str(outside))
    assert "kv_connector_extra_config.io_cpus" in str(err.value)
    assert f"names CPUs [{outside}] this process cannot use" in str(err.value)


def test_without_a_downstream_endpoint_the_engine_refuses_to_start(llm_factory):
    with pytest.raises(Exception, match="no downstream endpoint and loads nothing: set "
                                        "kv_transfer_config"):
        llm_factory()


def test_a_kv_cache_nixl_cannot_register_refuses_the_engine_at_start_up(llm_factory, monkeypatch):
    """A registration failure (here injected into NIXL's register_memory: a mock of the fault
    only; vLLM, the connector and NIXL's agent are real) stops the engine's start with the
    cause named, instead of a stage that serves and fails every transfer."""
    from nixl import _api

    def refuse(self, *args, **kwargs):
        raise RuntimeError("NIXL_ERR_BACKEND: cannot pin memory")

    monkeypatch.setattr(_api.nixl_agent, "register_memory", refuse)
    with pytest.raises(Exception, match="registering .* DRAM regions .* with NIXL failed: "
                                        "RuntimeError: NIXL_ERR_BACKEND: cannot pin memory"):
        llm_factory(endpoints={"next": "tcp://127.0.0.1:9"})


def test_a_receiver_expecting_another_model_refuses_every_transfer_loudly(llm_factory):
    """The compatibility check at the handshake: a receiver that expects another model
    refuses the AR's hello (code ``incompatible``, counted), reads nothing, and every
    transfer fails with the reason, instead of a payload of the wrong shape or meaning."""
    from vllm import SamplingParams

    inbox = KVInbox()
    rx = KVReceiver("tcp://127.0.0.1:0", inbox, pipeline="p", stage="next",
                    expect={"model": "some/other-model"}).start()
    try:
        llm, resolved = llm_factory(endpoints={"next": rx.endpoint},
                                    omni_kv_config={**PREFILL, "timeout_seconds": 20})
        llm.generate(["Hello world"], SamplingParams(max_tokens=2))
        drain_transfers(llm, timeout_s=30)
        (t,) = resolved
        assert t.outcome is Outcome.FAILED
        assert "refused this sender: incompatible" in t.reason
        assert "this stage expects 'some/other-model'" in t.reason
        assert rx.num_rejected >= 1 and rx.num_delivered == 0 and len(inbox) == 0
        assert rx.known_agents == []
    finally:
        rx.close()


@pytest.mark.parametrize("recipe", ["tiny", "kv7b"])
def test_payloads_equal_transformers_past_key_values_at_both_model_sizes(
        llm_factory, receiver, recipe):
    """The oracle at both scales: the 7B KV shape (28 layers, 4 KV heads, head size 128) too.
    The payload the receiver assembles from the blocks it read over NIXL is exactly
    transformers' past_key_values ([layers, 2, kv_heads, seq_len, head_size]) for the prompt;
    the engine's step copies nothing (its worker only offers the blocks)."""
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    from omni_runtime.devtools.tiny_model import ensure_tiny_model as ensure

    model_dir = str(ensure(recipe=recipe))
    llm, resolved = llm_factory(model=model_dir, endpoints={"next": receiver.endpoint},
                                kv_cache_memory_bytes=256 << 20,
                                omni_kv_config={**PREFILL, "timeout_seconds": 60})
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40, 150)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0))
    drain_transfers(llm, timeout_s=60)
    assert [t.outcome for t in resolved] == [Outcome.ACKED] * 3
    assert len(receiver.known_agents) == 1, "one NIXL agent said hello: the engine's worker"
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for out in outs:
        ids = list(out.prompt_token_ids)
        (t,) = [t for t in resolved if t.request_id.startswith(out.request_id + "-")]
        kv = receiver.inbox.get(t.request_id).kv
        with torch.no_grad():
            pkv = hf(torch.tensor([ids]), use_cache=True).past_key_values
        reference = [(layer.keys[0], layer.values[0]) for layer in pkv.layers]
        assert kv.shape == (len(reference), 2, *reference[0][0].shape)
        for layer, (k, v) in enumerate(reference):
            np.testing.assert_allclose(kv[layer, 0], k.numpy(), atol=2e-4, rtol=1e-4, err_msg=f"K{layer}")
            np.testing.assert_allclose(kv[layer, 1], v.numpy(), atol=2e-4, rtol=1e-4, err_msg=f"V{layer}")


def test_under_preemption_every_transfer_is_delivered_and_no_block_is_left(
        llm_factory, receiver):
    """A KV cache too small for the load (the real engine preempts): every request's prompt KV
    still arrives whole and exact (its blocks were pinned while the receiver read them, with
    forwards writing other blocks meanwhile), and every block comes back."""
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    llm, resolved = llm_factory(endpoints={"next": receiver.endpoint}, kv_cache_memory_bytes=1 << 20,
                                omni_kv_config={**PREFILL, "timeout_seconds": 60})
    scheduler = engine_core_of(llm).scheduler
    start = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    preempted = []
    original = scheduler._preempt_request

    def counting(request, *args, **kwargs):
        preempted.append(request.request_id)
        return original(request, *args, **kwargs)

    scheduler._preempt_request = counting
    prompts = [{"prompt_token_ids": [3 + (i + j) % 400 for j in range(90 + i)]} for i in range(8)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True))
    drain_transfers(llm, timeout_s=60)
    assert preempted, "the KV cache must be small enough to force preemptions"
    assert [t.outcome for t in resolved] == [Outcome.ACKED] * len(prompts)
    hf = AutoModelForCausalLM.from_pretrained(str(ensure_tiny_model()), dtype=torch.float32).eval()
    for out in outs:
        (t,) = [t for t in resolved if t.request_id.startswith(out.request_id + "-")]
        payload = receiver.inbox.get(t.request_id)
        assert payload.seq_len == len(out.prompt_token_ids) and np.isfinite(payload.kv).all()
        with torch.no_grad():
            pkv = hf(torch.tensor([list(out.prompt_token_ids)]), use_cache=True).past_key_values
        for layer, cache in enumerate(pkv.layers):
            np.testing.assert_allclose(payload.kv[layer, 0], cache.keys[0].numpy(), atol=2e-4, rtol=1e-4)
            np.testing.assert_allclose(payload.kv[layer, 1], cache.values[0].numpy(), atol=2e-4, rtol=1e-4)
    assert not scheduler._pinned and not scheduler.has_requests()
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == start


def _payloads_by_prompt_len(llm, resolved, outs, receiver):
    """{prompt length: the stored payload's KV (a copy)} of every request of ``outs``."""
    by_len = {}
    for out in outs:
        (t,) = [t for t in resolved if t.request_id.startswith(out.request_id + "-")]
        by_len[len(out.prompt_token_ids)] = np.array(receiver.inbox.get(t.request_id).kv)
    return by_len


def test_tensor_parallel_2_ships_shards_that_assemble_to_the_tensor_parallel_1_payloads(
        llm_factory, receiver, monkeypatch):
    """vLLM's CPU backend at tensor_parallel_size 2 (two worker processes, one core each):
    each rank ships its own KV heads as one shard, the receiver assembles them, and the
    assembled payloads equal the TP 1 ones for the same prompts (within the oracle test's
    tolerance: the ranks' all-reduce sums in another order)."""
    from vllm import SamplingParams

    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40, 150)]
    params = SamplingParams(max_tokens=3, temperature=0.0)
    kv_config = {**PREFILL, "timeout_seconds": 60}

    llm, resolved = llm_factory(endpoints={"next": receiver.endpoint}, omni_kv_config=kv_config)
    outs = llm.generate(prompts, params)
    drain_transfers(llm, timeout_s=60)
    assert [t.outcome for t in resolved] == [Outcome.ACKED] * 3
    tp1 = _payloads_by_prompt_len(llm, resolved, outs, receiver)
    tp1_tokens = [list(o.outputs[0].token_ids) for o in outs]
    llm.llm_engine.engine_core.shutdown()
    messages_tp1 = receiver.num_delivered

    # Without the binding the CPU backend refuses TP 2 here (no NUMA nodes to split).
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    llm, resolved = llm_factory(endpoints={"next": receiver.endpoint}, omni_kv_config=kv_config,
                                tensor_parallel_size=2, distributed_executor_backend="mp")
    scheduler = engine_core_of(llm).scheduler
    assert scheduler._omni.scheduler_half.shard_answers.world_size == 2
    start = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    outs = llm.generate(prompts, params)
    drain_transfers(llm, timeout_s=60)
    assert [t.outcome for t in resolved] == [Outcome.ACKED] * 3
    assert receiver.num_delivered - messages_tp1 == 2 * 3, "one shard per rank and transfer"
    tp2 = _payloads_by_prompt_len(llm, resolved, outs, receiver)
    assert [list(o.outputs[0].token_ids) for o in outs] == tp1_tokens
    assert len(receiver.inbox) == 0 and receiver.inbox.bytes == 0, "no shard left behind"
    for n, kv in tp1.items():
        assert tp2[n].shape == kv.shape == (2, 2, 2, n, 32)  # all 2 KV heads, assembled
        np.testing.assert_allclose(tp2[n], kv, atol=2e-4, rtol=1e-4, err_msg=f"{n} tokens")
    assert not scheduler.has_requests() and not scheduler._omni.scheduler_half.shard_answers
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == start


def test_composed_with_vllms_example_connector_through_multi_connector(
        llm_factory, receiver, tmp_path):
    """A user's connector (vLLM's ExampleConnector, saving KV to disk) and ours under vLLM's
    MultiConnector: both run; the scheduler finds ours among the children; a finished
    request's transfer keeps its blocks pinned (not through vLLM's delayed free, which the
    MultiConnector shares) until it is acked, and every block comes back."""
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    storage = tmp_path / "example-connector"
    storage.mkdir()
    example = {"kv_connector": "ExampleConnector", "kv_role": "kv_producer",
               "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    llm, resolved = llm_factory(endpoints={"next": receiver.endpoint}, compose_with=example,
                                omni_kv_config={"need_send_cache": True, "timeout_seconds": 60})
    scheduler = engine_core_of(llm).scheduler
    assert type(scheduler.connector).__name__ == "MultiConnector"
    assert scheduler._omni in scheduler.connector._connectors and scheduler._composed
    start = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    held = []
    original = scheduler._pin

    def recording(transfer):
        held.append(transfer.request_id)
        return original(transfer)

    scheduler._pin = recording
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    drain_transfers(llm, timeout_s=60)
    assert [t.outcome for t in resolved] == [Outcome.ACKED] * 2
    assert sorted(held) == sorted(t.request_id for t in resolved), "held by pins"
    hf = AutoModelForCausalLM.from_pretrained(str(ensure_tiny_model()), dtype=torch.float32).eval()
    for out in outs:
        (t,) = [t for t in resolved if t.request_id.startswith(out.request_id + "-")]
        ids = (list(out.prompt_token_ids) + list(out.outputs[0].token_ids))[:t.seq_len]
        assert t.seq_len == len(out.prompt_token_ids) + 3  # request finished: computed tokens
        kv = receiver.inbox.get(t.request_id).kv
        with torch.no_grad():
            pkv = hf(torch.tensor([ids]), use_cache=True).past_key_values
        for layer, cache in enumerate(pkv.layers):
            np.testing.assert_allclose(kv[layer, 0], cache.keys[0].numpy(), atol=2e-4, rtol=1e-4)
            np.testing.assert_allclose(kv[layer, 1], cache.values[0].numpy(), atol=2e-4, rtol=1e-4)
    assert list(storage.rglob("*.safetensors")), "the ExampleConnector saved KV too"
    assert not scheduler._pinned and not scheduler.has_requests()
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == start


def test_a_hand_off_whose_deadline_already_passed_fails_at_once_and_sends_nothing(
        llm_factory, receiver, monkeypatch):
    """Issue 15: a hand-off with ``deadline_in_s == 0`` (its deadline passed before the step
    that hands it off) was taken by the worker as "no deadline" and sent anyway. The worker
    must answer failed in that very step, with the reason, and send nothing (the receiver here
    is up and would have acked it)."""
    from vllm import SamplingParams

    from omni_runtime.sched.handoff import HandOff

    original = HandOff.of

    def deadline_passed(transfer, *args):
        return original(transfer, *args)._replace(deadline_in_s=0.0)

    monkeypatch.setattr(HandOff, "of", deadline_passed)
    llm, resolved = llm_factory(endpoints={"next": receiver.endpoint},
                                omni_kv_config={**PREFILL, "timeout_seconds": 60})
    llm.generate(["Hello world"], SamplingParams(max_tokens=3))
    drain_transfers(llm, timeout_s=30)  # far inside the 60 s deadline: not an expiry
    (t,) = resolved
    assert t.outcome is Outcome.FAILED
    assert t.reason == "deadline passed before the send started"
    assert receiver.num_delivered == 0 and len(receiver.inbox) == 0


@pytest.mark.parametrize(
    "tp, pp, message",
    [(3, 1, "KV-head count divisible by it .* this model has 2"),
     (1, 2, "pipeline_parallel_size 1 \\(got 2\\)")],
)
def test_parallelism_the_payload_cannot_describe_is_refused_at_start_up(tp, pp, message):
    """Pipeline parallelism (a rank holds some layers only) and a KV-head count the ranks do
    not split evenly (vLLM then replicates heads) are refused, saying what to change."""
    from types import SimpleNamespace

    from vllm.config import ModelConfig

    from omni_runtime.kv.connector import _check_parallelism
    from omni_runtime.kv.layout import UnsupportedKVCache

    config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        model_config=ModelConfig(model=str(ensure_tiny_model()), dtype="float32"))
    with pytest.raises(UnsupportedKVCache, match=message):
        _check_parallelism(config)
    config.parallel_config.tensor_parallel_size, config.parallel_config.pipeline_parallel_size = 2, 1
    assert _check_parallelism(config) == 2


def test_a_fan_out_feeds_the_per_edge_families_once_per_edge(llm_factory):
    """A stage feeding two receiving stages: every transfer is read by both, and the
    per-edge families (omni_kv_edge_*, fed by rank 0's data path for a fan-out) count each
    edge's delivery with its bytes, and nothing is left active on an edge."""
    from prometheus_client import REGISTRY
    from vllm import SamplingParams

    def edge_sample(name, **labels):
        found = [s.value for m in REGISTRY.collect() for s in m.samples
                 if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
        return sum(found) if found else 0.0

    receivers = {s: KVReceiver("tcp://127.0.0.1:0", KVInbox(), pipeline="p", stage=s).start()
                 for s in ("talker", "vocoder")}
    try:
        before = {s: edge_sample("omni_kv_edge_transfers_resolved_total", to_stage=s,
                                 outcome="acked") for s in receivers}
        llm, resolved = llm_factory(endpoints={s: r.endpoint for s, r in receivers.items()},
                                    omni_kv_config={**PREFILL, "timeout_seconds": 60})
        llm.generate(["Hello world", "The quick brown fox"], SamplingParams(max_tokens=2))
        drain_transfers(llm, timeout_s=60)
        assert [t.outcome for t in resolved] == [Outcome.ACKED] * 2
        for stage, rx in receivers.items():
            assert rx.num_delivered == 2
            stored = sum(p["bytes"] for p in rx.inbox.list())
            assert edge_sample("omni_kv_edge_transfers_resolved_total", to_stage=stage,
                               outcome="acked") - before[stage] == 2
            assert edge_sample("omni_kv_edge_transfers_active", to_stage=stage) == 0
            assert edge_sample("omni_kv_edge_transfer_bytes_sum", to_stage=stage) >= stored
    finally:
        for rx in receivers.values():
            rx.close()


@pytest.mark.parametrize("trigger", ["prefill_finished", "request_finished"])
def test_a_fan_out_counts_a_finished_requests_blocks_held_on_the_edge_still_owing_an_answer(
        llm_factory, trigger):
    """A stage feeding two stages, one of which never answers (nothing listens there): once
    the request has finished, its blocks stay allocated for that edge, and the per-edge
    families fed by the data path say so (held 1, the blocks the ledger holds) while the
    edge that acked counts nothing held. The finish reaches the data path by the hand-off
    (request_finished: HandOff.held) or by the next step's metadata (prefill_finished: the
    request finished while its transfer was in flight)."""
    from prometheus_client import REGISTRY
    from vllm import SamplingParams

    def edge_sample(name, **labels):
        found = [s.value for m in REGISTRY.collect() for s in m.samples
                 if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
        return sum(found) if found else 0.0

    talker = KVReceiver("tcp://127.0.0.1:0", KVInbox(), pipeline="p", stage="talker").start()
    silent = f"tcp://127.0.0.1:{free_port()}"
    config = {"need_send_cache": True, "timeout_seconds": 60}
    if trigger == "prefill_finished":
        config["kv_transfer_criteria"] = {"type": trigger}
    try:
        acked = edge_sample("omni_kv_edge_transfers_resolved_total", to_stage="talker",
                            outcome="acked")
        llm, resolved = llm_factory(endpoints={"talker": talker.endpoint, "vocoder": silent},
                                    omni_kv_config=config)
        llm.generate(["Hello world"], SamplingParams(max_tokens=3), use_tqdm=False)
        core = engine_core_of(llm)
        deadline = time.monotonic() + 30
        while not (edge_sample("omni_kv_edge_transfers_resolved_total", to_stage="talker",
                               outcome="acked") > acked
                   and edge_sample("omni_kv_edge_transfers_held", to_stage="vocoder") == 1):
            assert time.monotonic() < deadline, "the talker's ack or the vocoder's hold never showed"
            core.step()
        ledger = core.scheduler.transfer_ledger
        assert not resolved and ledger.num_held == 1, "the transfer waits for the vocoder"
        assert edge_sample("omni_kv_edge_held_blocks", to_stage="vocoder") == ledger.num_held_blocks > 0
        assert edge_sample("omni_kv_edge_oldest_held_start_timestamp_seconds", to_stage="vocoder") > 0
        assert edge_sample("omni_kv_edge_transfers_active", to_stage="vocoder") == 1
        assert edge_sample("omni_kv_edge_transfers_held", to_stage="talker") == 0
        assert edge_sample("omni_kv_edge_held_blocks", to_stage="talker") == 0
    finally:
        talker.close()
