"""The KV extraction worker in a real vLLM engine (in-process engine core, CPU worker), with a
real connector receiver in the test process."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

from omni_runtime.kv.transport import KVInbox, KVReceiver
from omni_runtime.devtools.offline import drain_transfers, engine_core_of, omni_llm
from omni_runtime.sched.outputs import ACKS_FIELD, FAILURES_FIELD
from omni_runtime.devtools.tiny_model import ensure_tiny_model
from omni_runtime.transfers.ledger import Outcome, TransferObserver
from omni_runtime.kv.worker import _with_answers

ENGINE_ARGS = dict(
    kv_cache_memory_bytes=64 << 20,
    max_model_len=512,
    dtype="float32",
    enforce_eager=True,
    worker_cls="omni_runtime.kv.worker.OmniCPUWorker",
)
PREFILL = {"need_send_cache": True, "kv_transfer_criteria": {"type": "prefill_finished"}}


def test_the_shared_empty_output_is_never_mutated():
    out = _with_answers(EMPTY_MODEL_RUNNER_OUTPUT, ["a"], {"b": "receiver down"})
    assert out is not EMPTY_MODEL_RUNNER_OUTPUT
    assert getattr(out, ACKS_FIELD) == ["a"] and getattr(out, FAILURES_FIELD) == {"b": "receiver down"}
    assert not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, ACKS_FIELD)
    assert not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, FAILURES_FIELD)


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

    def make(**additional):
        kv = additional.pop("omni_kv_config", PREFILL)
        llm = omni_llm(str(ensure_tiny_model()), kv, additional_config=additional, **ENGINE_ARGS)
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
    gc.collect()


def test_acks_come_back_on_steps_with_nothing_scheduled(llm_factory, receiver):
    """max_tokens=1: each request finishes in its prefill step, so its transfer is handed off
    on a step with nothing to run, where vLLM's runner returns its shared empty output; the
    ack must still reach the scheduler (the reference project lost it and let it expire)."""
    from vllm import SamplingParams

    llm, resolved = llm_factory(
        omni_kv_config={**PREFILL, "timeout_seconds": 60},
        omni_kv_connector={"pipeline": "p", "endpoints": {"next": receiver.endpoint}},
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


def test_without_a_downstream_endpoint_every_transfer_fails_with_the_reason(llm_factory):
    from vllm import SamplingParams

    llm, resolved = llm_factory()
    llm.generate(["Hello world"], SamplingParams(max_tokens=3))
    drain_transfers(llm, timeout_s=30)
    (t,) = resolved
    assert t.outcome is Outcome.FAILED
    assert "no downstream endpoint" in t.reason
