"""Real vLLM 0.32 schedulers (stock or ours) without a model runner, and the
ModelRunnerOutputs a runner would return, the way vLLM's own scheduler tests build them.

For the scheduler tests and the benchmarks: exercising the scheduler's decisions needs no
model, and no model runs fast enough here for hundreds of cases."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from omni_runtime.devtools.tiny_model import ensure_tiny_model

EOS = 0  # <|endoftext|> is the first special token of the tiny tokenizer
_ids = itertools.count()


def make_vllm_config(
    omni_kv_config: Mapping[str, Any] | None = None,
    *,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 8192,
    max_model_len: int = 2048,
    block_size: int = 16,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = False,
    num_blocks: int = 10_000,
    compose_with: Mapping[str, Any] | None = None,
) -> VllmConfig:
    model_config = ModelConfig(
        model=str(ensure_tiny_model()), dtype="float32", seed=0, max_model_len=max_model_len
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(
        block_size=block_size, enable_prefix_caching=enable_prefix_caching
    )
    cache_config.num_gpu_blocks = num_blocks
    additional = {"omni_kv_config": dict(omni_kv_config)} if omni_kv_config is not None else {}
    kv_transfer = None
    if omni_kv_config and omni_kv_config.get("need_send_cache"):
        # The omni KV connector's scheduler side (its worker side never runs here).
        from vllm.config import KVTransferConfig

        from omni_runtime.kv.connector_config import composed_kv_transfer_config, kv_transfer_config

        connector = kv_transfer_config({"next": "tcp://127.0.0.1:9"})
        if compose_with is not None:  # under vLLM's MultiConnector, as omni-stage composes it
            connector = composed_kv_transfer_config(connector, compose_with)
        kv_transfer = KVTransferConfig(**connector)
    return VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        additional_config=additional,
        kv_transfer_config=kv_transfer,
    )


def make_scheduler(cls: type[Scheduler], vllm_config: VllmConfig) -> Scheduler:
    block_size = vllm_config.cache_config.block_size
    num_blocks = vllm_config.cache_config.num_gpu_blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=block_size, num_kv_heads=1, head_size=32, dtype=torch.float32
                ),
            )
        ],
    )
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        log_stats=False,
    )


def make_request(
    num_prompt_tokens: int,
    *,
    max_tokens: int = 16,
    request_id: str | None = None,
    trace_headers: Mapping[str, str] | None = None,
    ignore_eos: bool = True,
    prompt_token: int = 7,
    block_size: int | None = None,
) -> Request:
    """A request of ``num_prompt_tokens`` copies of ``prompt_token``; give ``block_size`` to
    hash its blocks as vLLM's engine does (prefix caching needs it)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, temperature=0.0)
    params.update_from_generation_config({}, EOS)
    return Request(
        request_id=request_id or f"req-{next(_ids)}",
        prompt_token_ids=[prompt_token] * num_prompt_tokens,
        sampling_params=params,
        pooling_params=None,
        trace_headers=trace_headers,
        block_hasher=_block_hasher(block_size) if block_size else None,
    )


def _block_hasher(block_size: int):
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(block_size, sha256)


def runner_output(
    scheduler_output: SchedulerOutput,
    tokens: Mapping[str, list[int]] | None = None,
    *,
    scheduler: Scheduler | None = None,
    default_token: int = 5,
    acked: Iterable[Any] = (),
    failed: Mapping[Any, str] | None = None,
) -> ModelRunnerOutput:
    """What a runner returns for ``scheduler_output``: ``tokens[req_id]`` where given, else
    one ``default_token`` per request — none for a partial prefill chunk, which needs the
    ``scheduler`` (after its schedule()) to tell.

    ``acked`` / ``failed`` are the KV connector workers' answers: a request id answers the
    attempt last handed off for it (found in the ``scheduler``'s ledger), a
    ``(request id, attempt)`` pair names its attempt."""
    tokens = dict(tokens or {})
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        if req_id in tokens:
            sampled.append(list(tokens[req_id]))
        elif scheduler is not None and _is_partial_prefill(scheduler, req_id):
            sampled.append([])
        else:
            sampled.append([default_token])
    out = ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )
    from omni_runtime.sched.handoff import Answer

    answers = {}
    for key in acked:
        rid, attempt = _attempt_of(key, scheduler)
        answers[rid] = Answer(attempt)
    for key, reason in (failed or {}).items():
        rid, attempt = _attempt_of(key, scheduler)
        answers[rid] = Answer(attempt, reason)
    if answers:
        from vllm.v1.outputs import KVConnectorOutput

        from omni_runtime.kv.metadata import OmniKVWorkerMetadata

        out.kv_connector_output = KVConnectorOutput(
            kv_connector_worker_meta=OmniKVWorkerMetadata(answers)
        )
    return out


def _attempt_of(key: Any, scheduler: Scheduler | None) -> tuple[str, int]:
    if isinstance(key, tuple):
        return key
    transfer = scheduler.transfer_ledger.get(key) if scheduler is not None else None
    return key, transfer.attempt if transfer is not None else -1


def handed_off(scheduler_output: SchedulerOutput) -> dict[str, Any]:
    """The transfers a step hands to the KV connector's workers: ``{request id: HandOff}``."""
    return {h.request_id: h for h in _omni_meta(scheduler_output, "hand_offs") or ()}


def withdrawn(scheduler_output: SchedulerOutput) -> dict[str, int]:
    """The handed-off transfers a step withdraws (resolved by the scheduler itself):
    ``{request id: attempt}``."""
    return dict(_omni_meta(scheduler_output, "withdrawn") or {})


def _omni_meta(scheduler_output: SchedulerOutput, field: str) -> Any:
    meta = scheduler_output.kv_connector_metadata
    for child in getattr(meta, "metadata", None) or ():  # a MultiConnector's: ours is a child
        if hasattr(child, field):
            meta = child
    return getattr(meta, field, None)


def _is_partial_prefill(scheduler: Scheduler, req_id: str) -> bool:
    request = scheduler.requests.get(req_id)
    return request is not None and request.num_computed_tokens < request.num_tokens


def step(
    scheduler: Scheduler,
    tokens: Mapping[str, list[int]] | None = None,
    *,
    acked: Iterable[str] = (),
    failed: Mapping[str, str] | None = None,
    default_token: int = 5,
):
    """One engine step: schedule, 'run' the model, update. Returns (scheduler_output,
    engine_core_outputs)."""
    so = scheduler.schedule()
    mro = runner_output(
        so, tokens, scheduler=scheduler, acked=acked, failed=failed, default_token=default_token
    )
    return so, scheduler.update_from_output(so, mro)


def free_blocks(scheduler: Scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
