"""The KV extraction worker: the AR stage's vLLM worker that ships handed-off KV caches.

Plugged in with vLLM's ``worker_cls`` (``--worker-cls omni_runtime.kv.worker.OmniCPUWorker`` on
CPU, ``omni_runtime.kv.worker.OmniGPUWorker`` on GPU). Each step:

1. ``execute_model`` reads ``finished_requests_needing_kv_transfer`` from the scheduler
   output and, *before* the forward pass, copies every listed request's blocks of every layer,
   cut to ``seq_len``, into one host array ``[L, 2, H, seq_len, D]`` (the scheduler only lists
   KV that is already computed, so copying before the forward is exact). The copy is the only
   work done in the step; the connector's I/O thread sends it in the background.
2. The connector's answers (delivered = the receiver stored it and acked; failed, with a
   reason) go back to the scheduler on the ModelRunnerOutput of a later step as
   ``kv_extracted_req_ids`` and ``kv_extraction_failures`` — on every output, including the
   empty one vLLM returns on steps with no scheduled tokens (the reference project lost acks
   there). vLLM's shared empty output object is never mutated: it is copied first.

Settings come from ``additional_config["omni_kv_connector"]``:
``{"endpoints": {"<downstream stage>": "tcp://host:port", ...}, "pipeline": "<name>"}``.
A transfer is delivered when every endpoint has acked it. Only tensor_parallel_size 1 is
supported: with TP each rank holds a shard of the heads.
"""

from __future__ import annotations

import logging
from copy import copy
from typing import Any

import numpy as np
import torch
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from vllm.v1.worker.cpu_worker import CPUWorker

from omni_runtime.transfers.config import parse_omni_kv_config, raw_omni_kv_config
from omni_runtime.kv.layout import BlockLayout, ProbedBlockLayout, UnsupportedKVCache, extract
from omni_runtime.sched.outputs import ACKS_FIELD, FAILURES_FIELD, TRANSFERS_FIELD

logger = logging.getLogger(__name__)

CONNECTOR_KEY = "omni_kv_connector"
#: How long an idle step (nothing scheduled, transfers in flight) waits for an answer before
#: returning: long enough that the engine loop does not spin, short enough that a request
#: arriving meanwhile waits at most this long.
IDLE_WAIT_S = 0.005


class OmniKVWorkerMixin:
    """KV extraction over a vLLM worker (see the module docstring)."""

    _omni_ready = False

    # -------------------------------------------------------------- set-up (lazy)
    def _omni_setup(self) -> None:
        """Runs on the first hand-off: the KV caches exist only after vLLM's start-up."""
        self._omni_ready = True
        self._omni_sender = None
        self._omni_layout: BlockLayout | None = None
        self._omni_local_failures: dict[str, str] = {}
        self._omni_setup_error: str | None = None
        try:
            vllm_config = self.vllm_config
            parallel = vllm_config.parallel_config
            if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
                # Each rank would hold a shard of the heads or of the layers.
                raise UnsupportedKVCache(
                    "KV extraction supports tensor_parallel_size 1 and pipeline_parallel_size 1"
                )
            kv_cfg = parse_omni_kv_config(raw_omni_kv_config(vllm_config))
            settings = (vllm_config.additional_config or {}).get(CONNECTOR_KEY) or {}
            endpoints = dict(settings.get("endpoints") or {})
            if not endpoints:
                raise UnsupportedKVCache(
                    f"no downstream endpoint: set additional_config.{CONNECTOR_KEY}.endpoints"
                )
            self._omni_layout = self._omni_make_layout()
            from omni_runtime.kv.transport import KVSender
            from omni_runtime.observability.metrics import transfer_bytes_observer

            model_config = vllm_config.model_config
            self._omni_sender = KVSender(
                endpoints=endpoints,
                pipeline=str(settings.get("pipeline", "")),
                stage=kv_cfg.stage_name,
                # The connector gives up just before the scheduler would expire the transfer,
                # so that the failure reaches the scheduler with its reason.
                send_timeout_s=max(0.1, 0.95 * kv_cfg.timeout_seconds),
                observe_bytes=transfer_bytes_observer(
                    stage=kv_cfg.stage_name,
                    model_name=model_config.served_model_name or model_config.model,
                ),
            )
            self._omni_pipeline = str(settings.get("pipeline", ""))
            self._omni_stage = kv_cfg.stage_name
        except Exception as exc:
            # Every transfer then fails with this reason (the scheduler frees its blocks);
            # the stage keeps serving requests.
            self._omni_setup_error = f"KV extraction unavailable: {exc}"
            logger.error("%s", self._omni_setup_error)

    def _omni_make_layout(self) -> BlockLayout:
        runner = self.model_runner
        caches = runner.kv_caches
        if not caches:
            raise UnsupportedKVCache("the model runner has no KV cache tensors")
        spec = runner.kv_cache_config.kv_cache_groups[0].kv_cache_spec
        if getattr(self.vllm_config.cache_config, "cache_dtype", "auto") not in ("auto", None):
            raise UnsupportedKVCache("quantized KV caches cannot be extracted")
        cache = caches[0]
        if cache.dim() != 4 or cache.shape[2] != spec.block_size:
            # The scheduler's block ids count blocks of spec.block_size tokens; a backend that
            # splits them into smaller kernel blocks would need their mapping too.
            raise UnsupportedKVCache(
                f"unexpected KV cache view {tuple(cache.shape)} for blocks of "
                f"{spec.block_size} tokens"
            )
        return ProbedBlockLayout(self._omni_attention_layer(), cache, spec.num_kv_heads, spec.head_size)

    def _omni_attention_layer(self) -> Any:
        """An attention layer of the model: its backend writes the cache the probe decodes
        (one KV cache group, so all layers share the backend and the layout)."""
        forward_context = self.vllm_config.compilation_config.static_forward_context
        for layer in forward_context.values():
            if hasattr(getattr(layer, "impl", None), "do_kv_cache_update"):
                return layer
        raise UnsupportedKVCache("no attention layer with a KV cache write to probe")

    # -------------------------------------------------------------- the step
    def execute_model(self, scheduler_output: Any) -> Any:
        transfers = getattr(scheduler_output, TRANSFERS_FIELD, None)
        if transfers:
            self._omni_submit(transfers)
        output = super().execute_model(scheduler_output)
        if output is None:
            return None  # sample_tokens() returns this step's output
        if scheduler_output.total_num_scheduled_tokens == 0:
            self._omni_idle_wait()
        return self._omni_attach(output)

    def sample_tokens(self, grammar_output: Any) -> Any:
        return self._omni_attach(super().sample_tokens(grammar_output))

    def shutdown(self) -> None:
        sender = getattr(self, "_omni_sender", None)
        if sender is not None:
            sender.close(linger_s=1.0)
        super().shutdown()

    # -------------------------------------------------------------- helpers
    def _omni_submit(self, transfers: dict[str, dict[str, Any]]) -> None:
        if not self._omni_ready:
            self._omni_setup()
        if self._omni_setup_error is not None:
            for request_id in transfers:
                self._omni_local_failures[request_id] = self._omni_setup_error
            return
        from omni_runtime.kv.transport import KVPayload

        caches = self.model_runner.kv_caches
        for request_id, info in transfers.items():
            try:
                kv = extract(caches, self._omni_layout, info["block_ids"], info["seq_len"])
                dtype = None
                if kv.dtype == torch.bfloat16:
                    # NumPy has no bfloat16: ship the bits, named in the header.
                    kv, dtype = kv.view(torch.int16), "bfloat16"
                payload = KVPayload(
                    request_id=request_id,
                    seq_len=info["seq_len"],
                    kv=kv.numpy() if dtype is None else kv.numpy().view(np.uint16),
                    dtype=dtype,
                    pipeline=self._omni_pipeline,
                    from_stage=self._omni_stage,
                    trace_context=info.get("trace_headers"),
                    extra={"block_size": self._omni_layout.block_size},
                )
            except Exception as exc:
                self._omni_local_failures[request_id] = (
                    f"extraction failed: {type(exc).__name__}: {exc}"
                )
                continue
            # Give up when the scheduler's deadline for this transfer would pass anyway.
            timeout = info.get("deadline_in_s")
            self._omni_sender.submit(payload, timeout_s=max(0.05, 0.95 * timeout) if timeout else None)

    def _omni_idle_wait(self) -> None:
        sender = getattr(self, "_omni_sender", None)
        if sender is not None and sender.pending():
            sender.wait(IDLE_WAIT_S)

    def _omni_attach(self, output: Any) -> Any:
        if not self._omni_ready or output is None:
            return output  # None: vLLM had no output this call; answers wait for the next
        acked: list[str] = []
        failed: dict[str, str] = {}
        if self._omni_sender is not None:
            acked, failed = self._omni_sender.poll()
        if self._omni_local_failures:
            failed = {**failed, **self._omni_local_failures}
            self._omni_local_failures = {}
        if not acked and not failed:
            return output
        if not isinstance(output, ModelRunnerOutput):
            # AsyncModelRunnerOutput: attach when the scheduler asks for the output.
            inner = output.get_output

            def get_output() -> ModelRunnerOutput:
                return _with_answers(inner(), acked, failed)

            output.get_output = get_output
            return output
        return _with_answers(output, acked, failed)


def _with_answers(output: ModelRunnerOutput, acked: list[str], failed: dict[str, str]):
    if output is EMPTY_MODEL_RUNNER_OUTPUT:
        output = copy(output)  # the shared empty output must stay empty
    setattr(output, ACKS_FIELD, list(getattr(output, ACKS_FIELD, None) or ()) + acked)
    setattr(output, FAILURES_FIELD, {**(getattr(output, FAILURES_FIELD, None) or {}), **failed})
    return output


class OmniCPUWorker(OmniKVWorkerMixin, CPUWorker):
    """KV extraction over vLLM's CPU worker."""


def __getattr__(name: str) -> Any:
    # The GPU worker imports CUDA-only modules: build it only when asked for.
    if name == "OmniGPUWorker":
        from vllm.v1.worker.gpu_worker import Worker

        cls = type("OmniGPUWorker", (OmniKVWorkerMixin, Worker), {"__module__": __name__})
        globals()[name] = cls
        return cls
    raise AttributeError(name)
