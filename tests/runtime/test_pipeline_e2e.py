"""Two stages as real processes: an AR stage (real vLLM server, multi-process engine core,
tiny model, OmniARScheduler, the omni KV connector) ships every request's KV after
prefill to a receiving stage over the ZeroMQ connector.

Correctness oracle that owes nothing to our code: the received K and V equal the
``past_key_values`` Hugging Face transformers computes for the same prompt with the same model.
"""

from __future__ import annotations

import contextlib
import io
import signal
import json
import urllib.request
import uuid

import numpy as np
import pytest
import torch
from procs import StageProcess, free_port, http_get, metric_value, wait_until

from omni_runtime.devtools.tiny_model import ensure_tiny_model

pytestmark = pytest.mark.engine

PROMPTS = {
    "short": "Hello world",
    "medium": "The quick brown fox jumps over the lazy dog.",
    # More than one KV block (the CPU backend's blocks hold 128 tokens).
    "long": " ".join(["Kubernetes reconciles the desired state of every pipeline."] * 20),
}


#: The local model recipes (omni_runtime.devtools.tiny_model): {recipe: (served name, KV cache
#: bytes)}. kv7b has the KV shape of a 7B-class thinker (28 layers, 4 KV heads, head size 128,
#: 112 KiB per token): its cache needs more room for max-model-len 1024.
RECIPES = {"tiny": ("tiny-qwen2", 64 << 20), "kv7b": ("kv7b-qwen2", 256 << 20)}


def stage_configs(tmp_path, *, timeout_seconds=8, recipe="tiny", engine_args=None):
    """Stage configs as the operator renders them, with local ports (as omni-pipeline up)."""
    from omni_operator.local.run import local_stage_configs
    from omni_operator.pipeline.model import parse_pipeline

    name, kv_cache_bytes = RECIPES[recipe]
    ports = {name: {"http": free_port(), "kv": free_port()} for name in ("ar", "receiver")}
    body = {
        "apiVersion": "omnipipeline.dev/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": "e2e", "namespace": "test"},
        "spec": {
            "image": "omni-stage:test",
            "model": {"name": name, "path": str(ensure_tiny_model(recipe=recipe))},
            "stages": [
                {
                    "name": "ar",
                    "role": "ar",
                    "gpus": 0,
                    "engineArgs": {
                        "dtype": "float32",
                        "max-model-len": 1024,
                        "kv-cache-memory-bytes": kv_cache_bytes,
                        "enforce-eager": True,
                        **(engine_args or {}),
                    },
                    "kvTransfer": {
                        "send": True,
                        "criteria": {"type": "prefill_finished"},
                        "timeoutSeconds": timeout_seconds,
                    },
                },
                {"name": "receiver", "role": "generation", "gpus": 0, "inputs": ["ar"]},
            ],
        },
    }
    return local_stage_configs(parse_pipeline(body), ports)


@contextlib.contextmanager
def start_pipeline(workdir, recipe="tiny", engine_args=None, env=None):
    """The two stages, started: {"ar", "receiver"}; both stopped on leaving."""
    configs = stage_configs(workdir, recipe=recipe, engine_args=engine_args)
    receiver = StageProcess(configs["receiver"], workdir)
    ar = StageProcess(configs["ar"], workdir,
                      env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1", **(env or {})})
    stages = {"ar": ar, "receiver": receiver}
    try:
        receiver.start(timeout=60)
        ar.start(timeout=240)
        yield stages
    finally:
        # The tests may replace a stage (a restarted receiver): stop what is there now, and
        # what was there first.
        for stage in {*stages.values(), ar, receiver}:
            stage.stop()


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    with start_pipeline(tmp_path_factory.mktemp("pipeline")) as stages:
        yield stages


def complete(ar: StageProcess, prompt: str, max_tokens: int = 4) -> dict:
    body = json.dumps(
        {"model": ar.config["model"]["name"], "prompt": prompt, "max_tokens": max_tokens,
         "temperature": 0}
    ).encode()
    req = urllib.request.Request(
        ar.url + "/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def received(receiver: StageProcess) -> list[dict]:
    status, body, _ = http_get(receiver.url + "/v1/kv")
    assert status == 200
    return json.loads(body)["payloads"]


def fetch_kv(receiver: StageProcess, request_id: str) -> np.ndarray:
    status, body, headers = http_get(f"{receiver.url}/v1/kv/{request_id}?wait=5")
    assert status == 200, body
    return np.load(io.BytesIO(body), allow_pickle=False)


def hf_past_key_values(token_ids: list[int], recipe: str = "tiny"
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ensure_tiny_model(recipe=recipe)),
                                                 dtype=torch.float32)
    with torch.no_grad():
        pkv = model.eval()(torch.tensor([token_ids]), use_cache=True).past_key_values
    return [(layer.keys[0], layer.values[0]) for layer in pkv.layers]


def test_at_the_7b_kv_shape_every_request_kv_arrives_and_equals_transformers(tmp_path):
    """The oracle below through real processes with the kv7b model (28 layers, 4 KV heads,
    head size 128: 112 KiB of KV per token). First in the module, so that it runs before
    the module's tiny pipeline starts (two AR stages at once would share the 2 cores)."""
    with start_pipeline(tmp_path, recipe="kv7b") as stages:
        assert_oracle(stages, "kv7b")


def test_at_tensor_parallel_size_2_the_assembled_shards_equal_transformers(tmp_path):
    """The AR stage at tensor-parallel-size 2 (vLLM's CPU backend, two worker processes, one
    core each; without the binding it refuses to start for lack of NUMA nodes): each rank
    ships its KV heads, the receiving stage assembles them, and the payloads pass the same
    oracle as at TP 1 (the ranks' all-reduce sums in another order, inside its tolerance)."""
    tp2 = {"tensor-parallel-size": 2, "distributed-executor-backend": "mp"}
    with start_pipeline(tmp_path, engine_args=tp2,
                        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) as stages:
        assert_oracle(stages, "tiny")
        text = stages["receiver"].metrics()
        delivered = metric_value(text, "omni_kv_received_total", outcome="delivered")
        assert delivered == 2 * len(PROMPTS), "one shard per rank and transfer"


def test_every_request_kv_arrives_and_equals_transformers(pipeline):
    assert_oracle(pipeline, "tiny")


def test_a_client_finds_its_kv_by_its_own_request_id(pipeline):
    """The whole pipeline, keyed as a client knows the request: a completion sent with
    X-Request-Id is filed at the receiving stage under the client-facing id too
    (``cmpl-<X-Request-Id>-<choice>``, docs/stages.md), next to vLLM's internal id."""
    ar, receiver = pipeline["ar"], pipeline["receiver"]
    client_id = f"client-{uuid.uuid4().hex[:12]}"
    body = json.dumps({"model": ar.config["model"]["name"], "prompt": PROMPTS["short"],
                       "max_tokens": 2, "temperature": 0}).encode()
    req = urllib.request.Request(ar.url + "/v1/completions", body,
                                 {"Content-Type": "application/json", "X-Request-Id": client_id})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert client_id in json.loads(resp.read())["id"]
    status, by_client, headers = http_get(
        f"{receiver.url}/v1/kv/cmpl-{client_id}-0?wait=8")
    assert status == 200, by_client
    internal = headers["X-Omni-Request-Id"]
    assert internal != f"cmpl-{client_id}-0" and internal.startswith(f"cmpl-{client_id}-0")
    np.testing.assert_array_equal(np.load(io.BytesIO(by_client), allow_pickle=False),
                                  fetch_kv(receiver, internal))


def assert_oracle(pipeline, recipe: str) -> None:
    from transformers import AutoTokenizer

    ar, receiver = pipeline["ar"], pipeline["receiver"]
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_tiny_model(recipe=recipe)))
    before = {p["request_id"] for p in received(receiver)}
    for prompt in PROMPTS.values():
        out = complete(ar, prompt)
        assert out["choices"][0]["text"] is not None
    payloads = wait_until(
        lambda: [p for p in received(receiver) if p["request_id"] not in before]
        if len(received(receiver)) - len(before) >= len(PROMPTS) else None,
        60, "every request's KV at the receiver",
    )
    by_len = {p["seq_len"]: p for p in payloads}
    for name, prompt in PROMPTS.items():
        ids = tokenizer(prompt).input_ids
        assert len(ids) in by_len, f"{name}: no payload of {len(ids)} tokens in {sorted(by_len)}"
        kv = fetch_kv(receiver, by_len[len(ids)]["request_id"])
        reference = hf_past_key_values(ids, recipe)
        assert kv.shape == (len(reference), 2, *reference[0][0].shape)
        for layer, (k, v) in enumerate(reference):
            np.testing.assert_allclose(kv[layer, 0], k.numpy(), atol=2e-4, rtol=1e-4, err_msg=f"{name} K{layer}")
            np.testing.assert_allclose(kv[layer, 1], v.numpy(), atol=2e-4, rtol=1e-4, err_msg=f"{name} V{layer}")
    assert max(by_len) > 128, "a payload spanning several KV blocks"


def test_metrics_show_the_deliveries_on_both_stages(pipeline):
    ar, receiver = pipeline["ar"], pipeline["receiver"]
    complete(ar, "one more for the metrics")

    def delivered():
        # One scrape for every value: the engine writes a resolution's counters and gauges
        # one after another, and a scrape may fall between them.
        text = ar.metrics()
        acked = metric_value(text, "omni_kv_transfers_resolved_total", outcome="acked")
        in_flight = sum(metric_value(text, "omni_kv_transfers", state=s) for s in ("pending", "active", "held"))
        sent = metric_value(text, "omni_kv_transfer_bytes_count")
        return (acked, text) if acked >= 1 and in_flight == 0 and sent == acked else None

    acked, text = wait_until(
        delivered, 30, "acked transfers, each with its payload size, and none in flight"
    )
    assert metric_value(text, "omni_kv_held_blocks") == 0
    assert metric_value(text, "omni_kv_transfers_resolved_total", outcome="failed") == 0
    assert metric_value(receiver.metrics(), "omni_kv_received_total", outcome="delivered") >= acked


# ---------------------------------------------------------------------------- faults


def _transfer_counts(ar: StageProcess) -> dict[str, float]:
    text = ar.metrics()
    counts = {o: metric_value(text, "omni_kv_transfers_resolved_total", outcome=o)
              for o in ("acked", "failed", "expired", "cancelled")}
    counts["in_flight"] = sum(
        metric_value(text, "omni_kv_transfers", state=s) for s in ("pending", "active", "held")
    )
    counts["held_blocks"] = metric_value(text, "omni_kv_held_blocks")
    return counts


def test_receiver_killed_then_restarted(pipeline, tmp_path):
    ar, receiver = pipeline["ar"], pipeline["receiver"]
    before = wait_until(lambda: (c := _transfer_counts(ar))["in_flight"] == 0 and c, 30, "a quiet AR stage")
    receiver.kill()
    for prompt in ("sent while the receiver is down", "and another one"):
        assert complete(ar, prompt)["choices"], "the AR stage keeps serving"

    def lost_and_freed():
        c = _transfer_counts(ar)
        lost = (c["failed"] - before["failed"]) + (c["expired"] - before["expired"])
        return c if lost >= 2 and c["in_flight"] == 0 and c["held_blocks"] == 0 else None

    after_kill = wait_until(lost_and_freed, 60, "transfers to the dead receiver to fail or expire")
    assert after_kill["acked"] == before["acked"]

    restarted = StageProcess(receiver.config, tmp_path).start(timeout=60)
    pipeline["receiver"] = restarted  # the module fixture stops this one
    complete(ar, "after the restart")
    wait_until(lambda: _transfer_counts(ar)["acked"] == after_kill["acked"] + 1, 60,
               "a transfer delivered to the restarted receiver")
    assert len(received(restarted)) == 1


@pytest.fixture(scope="module")
def silent_downstream(pipeline):
    """The receiver's KV port taken over by a peer that reads transfers and never answers, so
    the AR stage's transfers stay active until the connector gives up (the tests below)."""
    import zmq

    receiver = pipeline["receiver"]
    receiver.kill()
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.bind(f"tcp://127.0.0.1:{receiver.kv_port}")
    yield silent
    silent.close(linger=0)
    ctx.term()


def test_a_request_aborted_during_its_transfer_leaves_nothing_held(pipeline, silent_downstream):
    """A streaming request whose client goes away while its prefill transfer is active: vLLM
    aborts it; its blocks stay held (the runner may still read them) until the transfer
    resolves, then nothing stays held or allocated."""
    import http.client

    ar = pipeline["ar"]
    body = json.dumps({"model": ar.config["model"]["name"], "prompt": "abort me " * 30, "max_tokens": 400,
                       "stream": True, "ignore_eos": True})
    # The client leaves while the transfer is active. Its deadline runs from the prefill, and
    # the sender reaches the silent peer only once ZeroMQ reconnects to the port the killed
    # receiver had (its back-off, seconds under make test's load): where the deadline has
    # already passed by then (seen once), the request is asked again.
    for _ in range(3):
        before = _transfer_counts(ar)
        conn = http.client.HTTPConnection("127.0.0.1", ar.http_port, timeout=60)
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.fp.readline()  # the first streamed chunk: the request is decoding
        wait_until(lambda: silent_downstream.poll(100), 30, "the transfer to reach the silent peer")
        if _transfer_counts(ar)["in_flight"] >= 1:
            break
        conn.close()
        wait_until(lambda: _transfer_counts(ar)["in_flight"] == 0, 60, "the request that came too late to end")
    else:
        raise AssertionError("no request's transfer was still active when it reached the silent peer")
    conn.close()  # the client leaves; vLLM aborts the request
    wait_until(lambda: (c := _transfer_counts(ar))["held_blocks"] > 0 and c, 30,
               "the aborted request's blocks held for its active transfer")

    def idle():
        text = ar.metrics()
        c = _transfer_counts(ar)
        running = metric_value(text, "vllm:num_requests_running")
        usage = metric_value(text, "vllm:kv_cache_usage_perc")
        return c if c["in_flight"] == 0 and c["held_blocks"] == 0 and running == 0 and usage == 0 else None

    after = wait_until(idle, 60, "the transfer to resolve and free the aborted request's blocks")
    assert after["failed"] + after["expired"] == before["failed"] + before["expired"] + 1


def test_sigterm_drains_transfers_in_flight_then_exits(pipeline, silent_downstream):
    """A transfer stays active (nobody answers); SIGTERM makes the AR stage's vLLM drain (its
    --shutdown-timeout is the grace period the fixture gives, 5 s: the engine keeps stepping
    while the transfer is unresolved), then stop and the stage exit cleanly. Runs last in
    this module: it stops the AR stage."""
    ar = pipeline["ar"]
    complete(ar, "a transfer nobody will answer")
    wait_until(lambda: _transfer_counts(ar)["in_flight"] >= 1, 30, "an active transfer")
    ar.proc.send_signal(signal.SIGTERM)
    assert ar.proc.wait(timeout=120) == 0
    log = ar.log_tail(200_000)
    assert "stopping vLLM: it drains requests and KV transfers for up to 5s" in log
    assert "start mode=drain timeout=5s" in log

