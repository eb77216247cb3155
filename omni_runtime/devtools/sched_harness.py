"""Real vLLM 0.32 schedulers (stock or ours) without a model runner, and the
ModelRunnerOutputs a runner would return, the way vLLM's own scheduler tests build them.

For the scheduler tests and the benchmarks: exercising the scheduler's decisions needs no
model, and no model runs fast enough here for hundreds of cases."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from omni_runtime.devtools.offline import SCHEDULER_CLS
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
    endpoints: Mapping[str, str] | None = None,
    tensor_parallel_size: int = 1,
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
        # What the harness builds (make_scheduler): the omni connector checks it runs under it.
        scheduler_cls=SCHEDULER_CLS,
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

        connector = kv_transfer_config(endpoints or {"next": "tcp://127.0.0.1:9"})
        if compose_with is not None:  # under vLLM's MultiConnector, as omni-stage composes it
            connector = composed_kv_transfer_config(connector, compose_with)
        kv_transfer = KVTransferConfig(**connector)
    return VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        # The engine's tensor parallelism as the scheduler sees it (no worker runs here).
        parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel_size),
        additional_config=additional,
        kv_transfer_config=kv_transfer,
    )


def make_scheduler(
    cls: type[Scheduler], vllm_config: VllmConfig, *, kv_cache_groups: int = 1,
    log_stats: bool = False,
) -> Scheduler:
    """``log_stats``: vLLM's scheduler stats, as a served engine makes them."""
    block_size = vllm_config.cache_config.block_size
    num_blocks = vllm_config.cache_config.num_gpu_blocks
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer" if i == 0 else f"layer{i}"],
                FullAttentionSpec(
                    block_size=block_size, num_kv_heads=1, head_size=32, dtype=torch.float32
                ),
            )
            for i in range(kv_cache_groups)
        ],
    )
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        log_stats=log_stats,
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
    resumable: bool = False,
) -> Request:
    """A request of ``num_prompt_tokens`` copies of ``prompt_token``; give ``block_size`` to
    hash its blocks as vLLM's engine does (prefix caching needs it). ``resumable``: a
    streaming-input session (or, added under an existing session's id, its next input)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, temperature=0.0)
    params.update_from_generation_config({}, EOS)
    return Request(
        request_id=request_id or f"req-{next(_ids)}",
        prompt_token_ids=[prompt_token] * num_prompt_tokens,
        sampling_params=params,
        pooling_params=None,
        trace_headers=trace_headers,
        block_hasher=_block_hasher(block_size) if block_size else None,
        resumable=resumable,
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


def held_notices(scheduler_output: SchedulerOutput) -> dict[str, tuple[int, int, float]]:
    """The handed-off transfers a step tells a fan-out's workers are held (their request
    finished): ``{request id: (attempt, blocks kept, unix time it finished)}``."""
    return dict(_omni_meta(scheduler_output, "held") or {})


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


def model_output(
    scheduler: Scheduler,
    scheduler_output: SchedulerOutput,
    token_at: Callable[[str, int], int],
    *,
    acked: Iterable[Any] = (),
    failed: Mapping[Any, str] | None = None,
) -> ModelRunnerOutput:
    """What a deterministic greedy model returns for ``scheduler_output``; call it right after
    that schedule(), when the runner executes the step (before a later step is scheduled).
    A request whose step is a prefill chunk (vLLM's ``is_prefill_chunk``) samples nothing;
    any other samples ``token_at(request id, position)``, the position being the request's
    ``num_computed_tokens`` after the schedule() (the one position the step samples, also
    under async scheduling, whose placeholders it counts). A request recomputed after a
    preemption therefore samples the same tokens again, as a greedy model does. One token
    per request and step (no speculative decoding)."""
    assert not scheduler_output.scheduled_spec_decode_tokens, "one token per step only"
    tokens = {}
    for req_id in scheduler_output.num_scheduled_tokens:
        request = scheduler.requests[req_id]
        tokens[req_id] = (
            [] if request.is_prefill_chunk else [token_at(req_id, request.num_computed_tokens)]
        )
    return runner_output(scheduler_output, tokens, scheduler=scheduler, acked=acked,
                         failed=failed)


def hand_off_attempts(scheduler_output: SchedulerOutput) -> list[tuple[str, int]]:
    """``(request id, attempt)`` of each transfer a step hands off: what answers name."""
    return [(rid, h.attempt) for rid, h in handed_off(scheduler_output).items()]


def ack_hand_offs(scheduler_output: SchedulerOutput) -> tuple[list[tuple[str, int]], dict]:
    """The runner's answers in a step's own output: every transfer handed off in it acked
    (a runner that extracts synchronously)."""
    return hand_off_attempts(scheduler_output), {}


class EngineLoop:
    """Steps a scheduler as vLLM 0.32's EngineCore does, with a deterministic model
    (:func:`model_output`) in place of the executor.

    ``depth`` 1 is ``EngineCore.step``: schedule, execute, update, nothing in flight between
    steps. ``depth`` 2 is ``EngineCore.step_with_batch_queue``, the loop of async scheduling
    (with vLLM's ``AsyncScheduler``) and of pipeline parallelism (with the synchronous
    ``Scheduler``): the next step is scheduled before the output of the one in flight is
    processed, so what happens between two calls (an abort, ``reset_prefix_cache``, which
    EngineCore runs between iterations) happens with a step in flight. ``answers`` gives the
    KV connector workers' answers in a step's output (default: :func:`ack_hand_offs`)."""

    def __init__(
        self,
        scheduler: Scheduler,
        token_at: Callable[[str, int], int],
        *,
        depth: int = 1,
        answers: Callable[[SchedulerOutput], tuple[Iterable[Any], Mapping[Any, str]]]
        = ack_hand_offs,
    ) -> None:
        assert depth in (1, 2)
        self.scheduler = scheduler
        self.token_at = token_at
        self.depth = depth
        self.answers = answers
        self.in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()

    @property
    def is_async(self) -> bool:
        """Whether the scheduler is really vLLM's AsyncScheduler (placeholders and all)."""
        return isinstance(self.scheduler, AsyncScheduler)

    def schedule(self) -> SchedulerOutput:
        """Schedules a step and 'executes' it (its output is ready, not yet processed)."""
        so = self.scheduler.schedule()
        acked, failed = self.answers(so)
        out = model_output(self.scheduler, so, self.token_at, acked=acked, failed=failed)
        self.in_flight.append((so, out))
        return so

    def update(self) -> dict[int, EngineCoreOutputs]:
        """Processes the output of the oldest step in flight."""
        so, out = self.in_flight.popleft()
        return self.scheduler.update_from_output(so, out)

    def step(self) -> dict[int, EngineCoreOutputs] | None:
        """One iteration of EngineCore's loop (None when it only filled the queue)."""
        assert len(self.in_flight) < self.depth, "EngineCore never starts a full iteration"
        s = self.scheduler
        if s.has_requests():
            so = self.schedule()
            executed = so.total_num_scheduled_tokens > 0
            if len(self.in_flight) < self.depth and (executed or s.has_requests()):
                return None
        elif not self.in_flight:
            return None
        return self.update()

    def run(self, max_iterations: int = 10_000) -> None:
        """Steps until nothing is left: no request, no transfer, no step in flight."""
        for _ in range(max_iterations):
            if not (self.scheduler.has_requests() or self.in_flight):
                return
            self.step()
        raise AssertionError(f"still busy after {max_iterations} iterations")
