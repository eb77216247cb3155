"""A real vLLM engine (LLM on the tiny model, in-process engine core) with our scheduler."""

from __future__ import annotations

import gc
import os

import pytest

from omni_runtime.devtools.offline import drain_transfers, engine_core_of, omni_llm
from omni_runtime.devtools.tiny_model import ensure_tiny_model
from omni_runtime.transfers.ledger import Outcome, TransferObserver, Trigger

pytestmark = pytest.mark.engine

PROMPTS = ["Hello world", "The quick brown fox jumps over", "An omni pipeline runs stages"]
ENGINE_ARGS = dict(
    kv_cache_memory_bytes=64 << 20, max_model_len=512, dtype="float32", enforce_eager=True, seed=0
)


@pytest.fixture(scope="module", autouse=True)
def in_process_engine_core():
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    yield
    if old is None:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old


def _generate(llm, max_tokens=12):
    from vllm import SamplingParams

    # ignore_eos: every request decodes max_tokens, whatever the random model's tokens.
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                ignore_eos=True))
    return outs


@pytest.fixture
def make_llm():
    made = []

    def make(**kw):
        if kw.pop("stock", False):
            from vllm import LLM

            llm = LLM(model=str(ensure_tiny_model()), **ENGINE_ARGS)
        else:
            llm = omni_llm(str(ensure_tiny_model()), kw.pop("omni_kv_config", None),
                           endpoints=kw.pop("endpoints", None), **ENGINE_ARGS)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.llm_engine.engine_core.shutdown()
    made.clear()
    gc.collect()


def test_with_transfers_off_greedy_outputs_equal_the_stock_scheduler(make_llm):
    stock = [o.outputs[0].token_ids for o in _generate(make_llm(stock=True))]
    ours = [o.outputs[0].token_ids for o in _generate(make_llm())]
    assert ours == stock
    assert len({tuple(t) for t in stock}) == len(PROMPTS), "the oracle must discriminate"


@pytest.fixture
def silent_endpoint():
    """A ZeroMQ ROUTER that takes every message and never answers (a receiver that hangs:
    not even the hello is answered)."""
    import zmq

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    yield f"tcp://127.0.0.1:{port}"
    router.close(linger=0)
    ctx.term()


def test_unacked_transfers_resolve_by_their_deadline_and_generation_still_finishes(make_llm, silent_endpoint):
    llm = make_llm(
        omni_kv_config={
            "need_send_cache": True,
            "kv_transfer_criteria": {"type": "prefill_finished"},
            "timeout_seconds": 0.5,
        },
        endpoints={"next": silent_endpoint},
    )
    scheduler = engine_core_of(llm).scheduler
    assert type(scheduler).__name__ == "OmniARScheduler"
    resolved = []

    class Keep(TransferObserver):
        def on_resolved(self, ledger, transfer):
            resolved.append(transfer)

    scheduler.transfer_ledger.add_observer(Keep())
    free_at_start = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    outs = _generate(llm)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs), "generation finished"
    for o in outs:
        meta = o.kv_transfer_params["kv_metadata"]
        assert meta["trigger"] == "prefill_finished"
        assert meta["seq_len"] == len(o.prompt_token_ids)
    drain_transfers(llm, timeout_s=30)
    # The engine core knows requests by internal ids: "<external id>-<suffix>".
    assert sorted(t.request_id.split("-")[0] for t in resolved) == sorted(o.request_id for o in outs)
    # The sender gives up just before the deadline (failed, "no ack"); an answer that comes
    # too late is overtaken by the scheduler's expiry. Either way by the deadline.
    assert {t.trigger for t in resolved} == {Trigger.PREFILL_FINISHED}
    assert {t.outcome for t in resolved} <= {Outcome.FAILED, Outcome.EXPIRED}
    assert all("no ack" in t.reason or t.outcome is Outcome.EXPIRED for t in resolved)
    assert not scheduler.has_requests()
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == free_at_start


def test_make_demo_scheduler_runs_as_the_readme_shows():
    """`make demo-scheduler` (the README's): the scheduler alone, its transfers to a stage
    that is gone each failing or expiring, no block leaked (an outside review: it ended in a
    traceback once the connector refused a set-up with no downstream endpoint)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "omni_runtime.devtools.demo"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "none leaked" in done.stdout, done.stdout[-2000:]
    assert done.stdout.count(" failed ") + done.stdout.count(" expired ") >= 3, done.stdout[-2000:]
