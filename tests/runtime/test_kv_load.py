"""A downstream stage's KV prefix loaded through vLLM's connector load path (kv/load.py), in a
real vLLM engine (in-process engine core, CPU worker, the tiny model): the request computes
only what the loaded KV does not cover, and its output is exactly what it would have been
had it computed everything; a KV that does not fit, or cannot be read, is recomputed."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from vllm import SamplingParams

from omni_runtime.devtools.offline import omni_llm
from omni_runtime.devtools.tiny_model import ensure_tiny_model
from omni_runtime.kv.load import LOAD_PARAMS, write_payload

ENGINE_ARGS = dict(kv_cache_memory_bytes=32 << 20, max_model_len=256, dtype="float32",
                   enforce_eager=True, enable_prefix_caching=False)
PROMPT = [(i * 37 + 11) % 500 for i in range(40)]


@pytest.fixture(scope="module")
def llm():
    """One engine for the module (the tests do not change it): it loads KV prefixes."""
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    engine = omni_llm(str(ensure_tiny_model()), {"need_send_cache": False}, loads=True,
                      **ENGINE_ARGS)
    yield engine
    engine.llm_engine.engine_core.shutdown()
    mp.undo()


def true_kv(token_ids: list[int]) -> np.ndarray:
    """The payload [layers, 2, kv_heads, tokens, head_size] Hugging Face transformers
    computes for these tokens with the same model (the oracle)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ensure_tiny_model()), dtype=torch.float32)
    with torch.no_grad():
        pkv = model.eval()(torch.tensor([token_ids]), use_cache=True).past_key_values
    return np.stack([np.stack([layer.keys[0].numpy(), layer.values[0].numpy()])
                     for layer in pkv.layers])


def generate(llm, prompt, load=None):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                            extra_args={"kv_transfer_params": {LOAD_PARAMS: load}}
                            if load is not None else None)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return list(out.outputs[0].token_ids), out.num_cached_tokens


@pytest.fixture(scope="module")
def computed(llm):
    """The request's output when it computes its whole prompt."""
    tokens, cached = generate(llm, PROMPT)
    assert cached == 0
    return tokens


def test_a_loaded_prefix_is_not_computed_again_and_gives_the_same_output(llm, computed,
                                                                         tmp_path):
    source = write_payload(true_kv(PROMPT), "float32", str(tmp_path), "kv")
    tokens, cached = generate(llm, PROMPT, source.as_params())
    assert cached == len(PROMPT) - 1, "every prompt token but the last came from the load"
    assert tokens == computed


def test_a_prefix_shorter_than_the_prompt_loads_what_it_covers(llm, computed, tmp_path):
    source = write_payload(true_kv(PROMPT[:20]), "float32", str(tmp_path), "kv")
    tokens, cached = generate(llm, PROMPT, source.as_params())
    assert (cached, tokens) == (20, computed)


def test_the_loaded_kv_is_what_the_request_attends_to(llm, computed, tmp_path):
    """A prefix of other values (here noise): the output changes, so the load is really what
    the model read, not a recompute."""
    rng = np.random.default_rng(0)
    noise = rng.standard_normal(true_kv(PROMPT).shape).astype(np.float32)
    source = write_payload(noise, "float32", str(tmp_path), "kv")
    tokens, cached = generate(llm, PROMPT, source.as_params())
    assert cached == len(PROMPT) - 1 and tokens != computed


def test_a_prefix_that_cannot_be_read_is_recomputed(llm, computed, tmp_path, caplog):
    source = write_payload(true_kv(PROMPT), "float32", str(tmp_path), "kv")
    (tmp_path / "kv").unlink()  # gone before the engine reads it
    with caplog.at_level(logging.WARNING):
        tokens, _ = generate(llm, PROMPT, source.as_params())
    assert tokens == computed
    assert any("not loaded" in m and "vLLM recomputes it" in m for m in caplog.messages)


@pytest.mark.parametrize("shape_change, words", [
    ({"layers": 3}, "is not this model's"),
    ({"dtype": "float16"}, "is not this model's"),
    ({"tokens": 0}, "tokens must be in"),
])
def test_a_prefix_of_another_shape_is_never_loaded(llm, computed, tmp_path, caplog,
                                                   shape_change, words):
    kv = true_kv(PROMPT)
    if "layers" in shape_change:
        kv = np.concatenate([kv, kv[:1]])
    source = write_payload(kv, "float32", str(tmp_path), "kv").as_params()
    if "dtype" in shape_change:
        source["dtype"] = "float16"
    if "tokens" in shape_change:
        source["tokens"] = 0
    with caplog.at_level(logging.WARNING):
        tokens, cached = generate(llm, PROMPT, source)
    assert (cached, tokens) == (0, computed)
    assert any("computes its prefix" in m and words in m for m in caplog.messages), caplog.messages
