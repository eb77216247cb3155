"""``OmniKVConnector``: the AR stage's KV data path on vLLM's own KV connector interface.

Loaded by vLLM, no worker class of ours::

    --kv-transfer-config '{"kv_connector": "OmniKVConnector",
        "kv_connector_module_path": "omni_runtime.kv.connector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"endpoints": {"next": "tcp://host:9600"},
                                      "pipeline": "demo"}}'

next to ``--scheduler-cls omni_runtime.sched.OmniARScheduler``. The scheduler decides *when*
(triggers, deadlines, the ledger); this connector decides *how* the bytes move:

scheduler side (in the engine core, next to the scheduler)
  * :meth:`build_connector_meta` puts the transfers the scheduler handed off in this step into
    the step's connector metadata (``{request id: seq_len, block_ids, attempt, deadline}``);
  * :meth:`request_finished` answers "delay the free" for a finished request whose transfer is
    unresolved (the "held" state); the scheduler frees the blocks when the transfer resolves
    (acked, failed, expired, or at shutdown / a prefix-cache reset);
  * :meth:`take_answers` hands the workers' answers (per attempt) to the scheduler.

worker side (in each worker process)
  * :meth:`register_kv_caches` keeps the per-layer cache tensors;
  * every layer's K and V of every transfer handed off in this step is copied into the
    transfer's reused host buffer (strided copies of runs of consecutive blocks for an affine
    block layout, else one ``index_select``): when the transport's CPUs (``io_cpus``,
    kv/cpu_affinity.py) are disjoint from the engine's OpenMP CPUs, by a copier thread there
    (kv/copier.py) from :meth:`bind_connector_metadata` on, concurrently with the forward;
    otherwise inline, by :meth:`save_kv_layer` right after each layer wrote its own KV; on a
    GPU, on a side CUDA stream into pinned host buffers (kv/device_copy.py: the engine's
    stream waits on the device for the reads only, a thread ships each transfer);
  * :meth:`wait_for_save` finishes the copies (the engine's thread takes those the copier
    has not started; inline, any layer the forward did not visit) and hands the payloads to
    the ZeroMQ sender, whose I/O thread, on ``io_cpus`` too, sends them without a copy;
  * :meth:`build_connector_worker_meta` reports, asynchronously, the sender's answers:
    ``{request id: (attempt, None | failure reason)}``.

Tensor parallelism: each rank's worker-side connector holds only its own KV heads and ships
them as shard ``rank`` of ``tensor_parallel_size`` (the receiver assembles the payload); its
worker metadata names its rank, vLLM's KVOutputAggregator folds the ranks' metadata of a step
together (:meth:`OmniKVWorkerMetadata.aggregate`), and the scheduler side
(:class:`ShardAnswers`) acks a transfer once every rank's shard was acked. All ranks run a
step together, so the invariant below holds for each of them.

Invariant (the block guarantee's worker half): the worker reads a transfer's blocks only
during the step whose metadata hands it off. So once that step has run, the scheduler may
free or re-use the blocks whatever the transfer's fate; before it has run, the blocks are
allocated (a finished request's are held, a preempted one's are pinned by the scheduler).

vLLM's ``finished_sending`` path is not used: a held transfer may also resolve on the
scheduler side (expiry, shutdown, reset), after which vLLM's ``_free_blocks`` of a request
reported by ``get_finished`` would find no request. The answers travel as worker metadata.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from omni_runtime.kv.connector_config import CONNECTOR_NAME, kv_transfer_config  # noqa: F401
from omni_runtime.kv.copier import BlockCopier
from omni_runtime.kv.cpu_affinity import disjoint_from_engine, transport_cpus
from omni_runtime.kv.device_copy import SideStreamCopier
from omni_runtime.kv.layout import (
    ProbedBlockLayout,
    UnsupportedKVCache,
    affine_strides,
    block_runs,
    copy_blocks,
    gather_index,
    gather_rows,
)
from omni_runtime.transfers.config import parse_omni_kv_config, raw_omni_kv_config


def _ids_not_randomized() -> bool:
    """vLLM keeps the client's request id as its internal id (no random suffix)."""
    import vllm.envs as envs

    return bool(envs.VLLM_DISABLE_REQUEST_ID_RANDOMIZATION)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

#: How long a step with nothing scheduled (transfers in flight) waits for an answer: the engine
#: loop does not spin, and a request arriving meanwhile waits at most this long.
IDLE_WAIT_S = 0.005
#: Host buffers kept for re-use after their transfer was acked (bounded: payloads of one size
#: repeat, e.g. the same prompt length; others are dropped to the allocator).
POOL_BYTES = 1 << 30


@dataclass
class OmniKVConnectorMetadata(KVConnectorMetadata):
    #: request id -> {"seq_len", "block_ids", "attempt", "deadline_in_s", "trace_headers"?}
    transfers: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Nothing is scheduled in this step: the worker may wait briefly for answers.
    idle: bool = False


@dataclass
class OmniKVWorkerMetadata(KVConnectorWorkerMetadata):
    #: One worker's answers: request id -> (attempt, None when delivered else the reason).
    answers: dict[str, tuple[int, str | None]] = field(default_factory=dict)
    #: Its tensor-parallel rank (it shipped that rank's KV-head shard).
    rank: int = 0
    #: The other ranks' answers, folded in by :meth:`aggregate` (vLLM's KVOutputAggregator
    #: merges the workers' metadata of one step this way before the scheduler sees it).
    other_ranks: dict[int, dict[str, tuple[int, str | None]]] = field(default_factory=dict)

    def by_rank(self) -> dict[int, dict[str, tuple[int, str | None]]]:
        return {**self.other_ranks, self.rank: self.answers}

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = {rank: dict(answers) for rank, answers in self.other_ranks.items()}
        if isinstance(other, OmniKVWorkerMetadata):
            for rank, answers in other.by_rank().items():
                merged.setdefault(rank, {}).update(answers)
        return OmniKVWorkerMetadata(dict(self.answers), self.rank, merged)


class ShardAnswers:
    """The scheduler side's view of the ranks' answers (tensor parallelism).

    Each rank ships its own KV-head shard and answers for it, in whatever step its sender
    resolves it, so the answers of one transfer arrive over several steps. A transfer is
    delivered when every rank's shard was acked; it failed as soon as any rank's shard
    failed (reported once, the remaining answers of that attempt are then only counted).
    State per request: the attempt being answered and the ranks' answers so far; an answer
    for a newer attempt starts over, one for an older attempt is ignored. An entry leaves
    when every rank answered, so the state is bounded by the transfers in flight (each rank
    answers every attempt it was handed, or a newer one supersedes it).
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        #: request id -> (attempt, {rank: reason}, failure already reported)
        self._partial: dict[str, tuple[int, dict[int, str | None], bool]] = {}

    def combine(self, by_rank: Mapping[int, Mapping[str, tuple[int, str | None]]]
                ) -> dict[str, tuple[int, str | None]]:
        if self.world_size == 1:
            return dict(by_rank.get(0, {}))
        result: dict[str, tuple[int, str | None]] = {}
        for rank, answers in sorted(by_rank.items()):
            for rid, (attempt, reason) in answers.items():
                current = self._partial.get(rid)
                if current is None or attempt > current[0]:
                    current = (attempt, {}, False)
                elif attempt < current[0]:
                    continue  # a superseded attempt: resolves nothing
                seen, reported = current[1], current[2]
                seen[rank] = reason
                if reason is not None and not reported:
                    result[rid] = (attempt, f"tensor-parallel rank {rank}: {reason}")
                    reported = True
                if len(seen) < self.world_size:
                    self._partial[rid] = (attempt, seen, reported)
                    continue
                self._partial.pop(rid, None)
                if not reported:
                    result[rid] = (attempt, None)  # every rank's shard was acked
        return result

    def __len__(self) -> int:
        return len(self._partial)


def find_omni_connector(connector: Any) -> OmniKVConnector | None:
    """Our connector in the scheduler's (possibly a MultiConnector's children)."""
    if isinstance(connector, OmniKVConnector):
        return connector
    for child in getattr(connector, "_connectors", None) or ():
        if isinstance(child, OmniKVConnector):
            return child
    return None


class OmniKVConnector(KVConnectorBase_V1):
    """See the module docstring."""

    #: Marks the connector for OmniARScheduler, which finds it without importing this module.
    omni_kv_connector = True

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        world_size = _check_parallelism(vllm_config)
        # A bad io_cpus refuses the engine at start-up (not at the first transfer).
        transport_cpus(_extra_config(vllm_config).get("io_cpus"))
        # Scheduler side.
        self._hand_offs: dict[str, dict[str, Any]] = {}
        self._hold: set[str] = set()
        self._shard_answers = ShardAnswers(world_size)
        # Worker side (set up lazily, on the first hand-off: the caches exist by then).
        self._caches: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}
        self._worker: _WorkerState | None = None

    # ================================================================ scheduler side
    def hand_off(self, transfers: dict[str, dict[str, Any]]) -> None:
        """The scheduler's hand-offs for the step being scheduled."""
        self._hand_offs.update(transfers)

    def hold_on_finish(self, request_id: str) -> None:
        """The next request_finished() of this request keeps its blocks (held)."""
        self._hold.add(request_id)

    def take_answers(self, output: KVConnectorOutput | None) -> dict[str, tuple[int, str | None]]:
        """The transfers the workers' answers of this step resolve: ``{request id: (attempt,
        None | reason)}``; with tensor parallelism a transfer is acked once every rank's
        shard was (:class:`ShardAnswers`)."""
        meta = getattr(output, "kv_connector_worker_meta", None) if output else None
        if meta is not None and not isinstance(meta, OmniKVWorkerMetadata):
            # A MultiConnector's: ours is the one of our type.
            meta = next((m for m in getattr(meta, "metadata", ())
                         if isinstance(m, OmniKVWorkerMetadata)), None)
        if meta is None:
            return {}
        return self._shard_answers.combine(meta.by_rank())

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        return 0, False  # a producer: nothing to load

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int):
        return None

    def build_connector_meta(self, scheduler_output: Any) -> OmniKVConnectorMetadata:
        transfers, self._hand_offs = self._hand_offs, {}
        return OmniKVConnectorMetadata(
            transfers=transfers, idle=scheduler_output.total_num_scheduled_tokens == 0
        )

    def request_finished(self, request: Request, block_ids: list[int]):
        rid = request.request_id
        if rid in self._hold:
            self._hold.discard(rid)
            return True, None
        return False, None

    # ================================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        ordered = sorted(kv_caches.items(), key=lambda item: extract_layer_index(item[0]))
        self._caches = [tensor for _, tensor in ordered]
        self._layer_index = {name: i for i, (name, _) in enumerate(ordered)}

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        transfers = getattr(connector_metadata, "transfers", None)
        if transfers:
            if self._worker is None:
                self._worker = _WorkerState(self._vllm_config, self._caches)
            self._worker.start_step(transfers)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        worker = self._worker
        if worker is not None and worker.jobs and not worker.copying:
            index = self._layer_index.get(layer_name)
            if index is not None:
                worker.copy_layer(index, kv_layer)

    def wait_for_save(self) -> None:
        worker = self._worker
        if worker is None:
            return
        if worker.jobs:
            worker.finish_step()
        meta = self._connector_metadata
        if getattr(meta, "idle", False):
            worker.idle_wait()

    def build_connector_worker_meta(self) -> OmniKVWorkerMetadata | None:
        if self._worker is None:
            return None
        answers = self._worker.poll()
        return OmniKVWorkerMetadata(answers, self._worker.shard) if answers else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()


@dataclass(eq=False)
class _Job:
    request_id: str
    attempt: int
    seq_len: int
    deadline_in_s: float
    trace_headers: dict[str, str] | None
    #: Runs of consecutive blocks (affine layouts: strided copies), else None and ...
    runs: list[tuple[int, int, int]] | None
    #: ... rows of `run` elements of one layer's cache, in payload order (an index gather).
    index: torch.Tensor | None
    run: int
    strides: tuple[tuple[int, int, int, int], ...] | None  # affine_strides() of the layout
    block_size: int
    buffer: torch.Tensor  # [L, 2, H, seq_len, D]: host, or device staging on a GPU ...
    copied: list[bool]
    error: str | None = None  # the copier's failure
    host: torch.Tensor | None = None  # ... with this pinned host buffer (GPU only)


class _WorkerState:
    """The worker half: layout, buffers, sender, and the answers not yet reported."""

    def __init__(self, vllm_config: Any, caches: list[torch.Tensor]) -> None:
        self.jobs: list[_Job] = []
        #: The step's jobs are being copied by the copier thread (not by save_kv_layer).
        self.copying = False
        self._caches = caches
        self._sender = None
        self._copier: BlockCopier | None = None
        self._side: SideStreamCopier | None = None  # the copy on a GPU (kv/device_copy.py)
        self._copy_tasks: deque[tuple[_Job, int]] = deque()  # the copier's, this step
        self._strides = None
        self._layout: ProbedBlockLayout | None = None
        self._error: str | None = None
        # Answers and sends are made by the engine's thread or, on a GPU, the side-stream
        # copier's thread, and read by the engine's thread (poll): under _lock.
        self._lock = threading.Lock()
        self._local: dict[str, tuple[int, str | None]] = {}
        self._in_flight: dict[str, tuple[int, torch.Tensor]] = {}  # rid -> (attempt, buffer)
        self._pool: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        self._pool_bytes = 0
        # This worker's KV-head shard: its tensor-parallel rank of the world.
        self.shard, self.num_shards = _tensor_parallel_shard(vllm_config)
        try:
            self._setup(vllm_config)
        except Exception as exc:
            # Every transfer then fails with this reason (the scheduler frees its blocks);
            # the stage keeps serving requests.
            self._error = f"KV connector unavailable: {exc}"
            logger.error("%s", self._error)

    def _setup(self, vllm_config: Any) -> None:
        kv_cfg = parse_omni_kv_config(raw_omni_kv_config(vllm_config))
        extra = _extra_config(vllm_config)
        endpoints = dict(extra.get("endpoints") or {})
        if not endpoints:
            raise UnsupportedKVCache(
                "no downstream endpoint: set kv_transfer_config.kv_connector_extra_config."
                "endpoints"
            )
        if not self._caches:
            raise UnsupportedKVCache("no KV cache tensors were registered")
        if getattr(vllm_config.cache_config, "cache_dtype", "auto") not in ("auto", None):
            raise UnsupportedKVCache("quantized KV caches cannot be extracted")
        cache = self._caches[0]
        spec_block = vllm_config.cache_config.block_size
        if cache.dim() != 4 or cache.shape[2] != spec_block or not cache.is_contiguous():
            raise UnsupportedKVCache(
                f"unexpected KV cache view {tuple(cache.shape)} for blocks of {spec_block} tokens"
            )
        model_config = vllm_config.model_config
        num_kv_heads = model_config.get_num_kv_heads(vllm_config.parallel_config)
        self._layout = ProbedBlockLayout(
            _attention_layer(vllm_config), cache, num_kv_heads, model_config.get_head_size()
        )
        self._strides = affine_strides(self._layout)
        on_gpu = cache.device.type == "cuda"
        if on_gpu:
            # One index_select kernel per layer and transfer: strided copies would launch two
            # per run of blocks and layer, from the engine's thread.
            self._strides = None
        from omni_runtime.kv.transport import KVSender
        from omni_runtime.observability.metrics import transfer_bytes_observer
        from omni_runtime.observability.transport_metrics import thread_up_setter

        io_cpus = transport_cpus(extra.get("io_cpus"))

        self._pipeline = str(extra.get("pipeline", ""))
        self._stage = kv_cfg.stage_name
        model_name = model_config.served_model_name or model_config.model
        self._sender = KVSender(
            endpoints=endpoints,
            pipeline=self._pipeline,
            stage=kv_cfg.stage_name,
            send_timeout_s=max(0.1, 0.95 * kv_cfg.timeout_seconds),
            observe_bytes=transfer_bytes_observer(stage=kv_cfg.stage_name, model_name=model_name),
            # omni_kv_transport_thread_up{thread="sender"}: the AR supervisor's health check.
            on_thread_state=thread_up_setter(stage=kv_cfg.stage_name, model_name=model_name,
                                             thread="sender"),
            # Off the engine's OpenMP cores: a core the transport takes from OpenMP stalls
            # every parallel region of every step (docs/connector.md, "Measured").
            io_cpus=io_cpus,
        )
        if on_gpu:
            # Gathers and device-to-host copies on a side CUDA stream; the engine's stream
            # never waits for the copy to host (kv/device_copy.py).
            self._side = SideStreamCopier(cache.device, self._ship_copied)
        elif disjoint_from_engine(io_cpus):
            # The copy runs there too, concurrently with the forward (kv/copier.py says why
            # that is exact); on a core shared with OpenMP it stays inline, per layer.
            self._copier = BlockCopier(io_cpus)

    # -------------------------------------------------------------- a step
    def start_step(self, transfers: dict[str, dict[str, Any]]) -> None:
        if self.copying:
            # The previous step ended without wait_for_save (its forward raised): its copies
            # end here, and its jobs are sent with this step's.
            self._run_copy_tasks()
            self._copier.wait()
            self.copying = False
        for rid, info in transfers.items():
            attempt = int(info.get("attempt", 0))
            if self._error is not None:
                self._answer(rid, attempt, self._error)
                continue
            try:
                layout = self._layout
                seq_len = int(info["seq_len"])
                block_ids = info["block_ids"]
                if seq_len > len(block_ids) * layout.block_size:
                    raise ValueError(f"seq_len {seq_len} exceeds the {len(block_ids)} blocks "
                                     f"of {layout.block_size} tokens")
                runs, index, run = None, None, 1
                if self._strides is not None:
                    runs = block_runs(block_ids, -(-seq_len // layout.block_size))
                else:
                    index, run = gather_rows(
                        gather_index(layout, block_ids, seq_len, self._caches[0].device),
                        layout.head_size,
                    )
                shape = (len(self._caches), 2, layout.num_kv_heads, seq_len, layout.head_size)
                dtype = self._caches[0].dtype
                host = self._buffer(shape, dtype)
                if self._side is None:
                    buffer, host = host, None  # the copy writes the host buffer itself
                else:  # the side stream gathers into a device staging buffer first
                    buffer = torch.empty(shape, dtype=dtype, device=self._caches[0].device)
            except Exception as exc:
                self._answer(rid, attempt, f"extraction failed: {type(exc).__name__}: {exc}")
                continue
            self.jobs.append(_Job(rid, attempt, seq_len, float(info.get("deadline_in_s", 0.0)),
                                  info.get("trace_headers"), runs, index, run,
                                  self._strides, layout.block_size, buffer,
                                  [False] * len(self._caches), host=host))
        if self._side is not None and self.jobs:
            caches = self._caches
            self._side.start(self.jobs, lambda job, layer: _gather(caches[layer], job, layer),
                             len(caches), staging=lambda job: job.buffer, host=lambda job: job.host)
        elif self._copier is not None and self.jobs:
            self._copy_tasks.extend((job, layer) for job in self.jobs
                                    for layer in range(len(self._caches)))
            self._copier.start(self._copy_tasks_inference_mode)
            self.copying = True

    def _copy_tasks_inference_mode(self) -> None:
        # Inference mode is per thread: the buffers and caches are the worker's inference
        # tensors.
        with torch.inference_mode():
            self._run_copy_tasks()

    def _run_copy_tasks(self) -> None:
        """Copy (transfer, layer) tasks until none is left: the copier thread from the start
        of the step, the engine's thread too once its forward is done (wait_for_save), so a
        copy longer than the forward ends sooner. deque.popleft is atomic: each task runs
        once; tasks write disjoint slices of the buffers."""
        tasks = self._copy_tasks
        while True:
            try:
                job, layer = tasks.popleft()
            except IndexError:
                return
            if job.error is None:
                try:
                    _gather(self._caches[layer], job, layer)
                except Exception as exc:
                    job.error = f"extraction failed: {type(exc).__name__}: {exc}"

    def copy_layer(self, layer: int, cache: torch.Tensor) -> None:
        """Inline (no copier): one layer of every transfer of the step, right after the
        forward wrote it."""
        for job in self.jobs:
            if not job.copied[layer]:
                _gather(cache, job, layer)

    def finish_step(self) -> None:
        """End of the step (wait_for_save): every copy is done before the step is (the block
        guarantee's worker half), then every transfer of the step ships (or fails).

        Not earlier, as each transfer's own copy ends: measured at the 7B shape with one I/O
        CPU (docs/connector.md, "Measured"), sending the first transfer while the others are
        copied slowed both, the copy and the send sharing that CPU: the hand-off step took
        +140-220 ms instead of +35 ms, and the last ack came no sooner."""
        jobs, self.jobs = self.jobs, []
        if self._side is not None:
            # The side stream ships them once copied to host; the engine's stream waits on
            # the device for the reads of the cache only.
            self._side.end_step()
            return
        if self.copying:
            # This thread takes the tasks the copier has not started.
            self.copying = False
            self._run_copy_tasks()
            error = self._copier.wait()
            if error is not None:
                for job in jobs:
                    job.error = job.error or f"extraction failed: {type(error).__name__}: {error}"
        for job in jobs:
            if job.error is None:
                # Inline: layers the forward did not visit (a step with nothing scheduled).
                try:
                    for layer, done in enumerate(job.copied):
                        if not done:
                            _gather(self._caches[layer], job, layer)
                except Exception as exc:
                    job.error = f"extraction failed: {type(exc).__name__}: {exc}"
            self._ship(job)

    def _ship_copied(self, job: _Job, error: str | None) -> None:
        """From the side-stream copier's thread: the job's host buffer holds its KV."""
        job.error = job.error or error
        job.buffer = None  # the device staging buffer: the copy from it is done
        self._ship(job)

    def _ship(self, job: _Job) -> None:
        """Hand a copied transfer to the sender, or answer its failure; once per job, from
        the engine's thread (finish_step) or the side-stream copier's (GPU)."""
        from omni_runtime.kv.transport import KVPayload
        from omni_runtime.kv.transport.wire import vllm_external_request_id

        job.index = job.runs = None
        if job.error is not None:
            self._answer(job.request_id, job.attempt, job.error)
            return
        if job.deadline_in_s <= 0.0:
            # The scheduler's deadline has already passed: sending would only keep trying
            # a transfer the scheduler expires on its next step.
            self._answer(job.request_id, job.attempt, "deadline passed before the send started")
            return
        kv = job.host if job.host is not None else job.buffer
        try:
            dtype = None
            if kv.dtype == torch.bfloat16:
                # NumPy has no bfloat16: ship the bits, named in the header.
                array, dtype = kv.view(torch.int16).numpy().view(np.uint16), "bfloat16"
            else:
                array = kv.numpy()
            payload = KVPayload(
                request_id=job.request_id,
                # The receiver also files it under the client-facing id.
                external_request_id=vllm_external_request_id(
                    job.request_id, randomized=not _ids_not_randomized()),
                seq_len=job.seq_len,
                kv=array,
                dtype=dtype,
                pipeline=self._pipeline,
                from_stage=self._stage,
                trace_context=job.trace_headers,
                extra={"block_size": self._layout.block_size, "attempt": job.attempt},
                shard=self.shard,
                num_shards=self.num_shards,
            )
        except Exception as exc:
            self._answer(job.request_id, job.attempt,
                         f"extraction failed: {type(exc).__name__}: {exc}")
            return
        with self._lock:
            # Both under the lock, against poll(): submit() drops any unpolled answer of an
            # earlier attempt of this request, so no answer is read against the wrong attempt.
            self._in_flight[job.request_id] = (job.attempt, kv)
            # Give up just before the scheduler would expire it, so the failure (with its
            # reason) reaches the scheduler first.
            self._sender.submit(payload, timeout_s=max(0.05, 0.95 * job.deadline_in_s))

    def _answer(self, rid: str, attempt: int, reason: str | None) -> None:
        with self._lock:
            self._local[rid] = (attempt, reason)

    def idle_wait(self) -> None:
        if self._sender is not None and self._sender.pending():
            self._sender.wait(IDLE_WAIT_S)

    def poll(self) -> dict[str, tuple[int, str | None]]:
        with self._lock:
            answers, self._local = self._local, {}
            if self._sender is None:
                return answers
            # Under the lock: a transfer submitted meanwhile is in _in_flight before its
            # answer can come back.
            acked, failed = self._sender.poll()
            recycle = []
            for rid in acked:
                attempt, buffer = self._in_flight.pop(rid, (0, None))
                answers[rid] = (attempt, None)
                if buffer is not None:
                    # Acked by every receiver: ZeroMQ has sent (and let go of) the bytes.
                    recycle.append(buffer)
            for rid, reason in failed.items():
                # A failed send may still be in ZeroMQ's hands: its buffer is not re-used.
                attempt, _ = self._in_flight.pop(rid, (0, None))
                answers[rid] = (attempt, str(reason))
        for buffer in recycle:
            self._recycle(buffer)
        return answers

    def close(self) -> None:
        if self._copier is not None:
            self._copier.close()
        if self._side is not None:
            self._side.close()
        if self._sender is not None:
            try:
                self._sender.close(linger_s=1.0)
            except Exception:  # never block vLLM's own shutdown
                logger.exception("closing the KV sender failed")

    # -------------------------------------------------------------- buffers
    def _buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = int(np.prod(shape))
        free = self._pool.get((dtype, numel))
        if free:
            buffer = free.pop()
            self._pool_bytes -= buffer.numel() * buffer.element_size()
            return buffer.view(shape)
        # Host memory; pinned when the caches are on a GPU, so the side stream's copy to it
        # is asynchronous.
        return torch.empty(shape, dtype=dtype, device="cpu",
                           pin_memory=self._caches[0].device.type == "cuda")

    def _recycle(self, buffer: torch.Tensor) -> None:
        nbytes = buffer.numel() * buffer.element_size()
        if self._pool_bytes + nbytes > POOL_BYTES:
            return
        self._pool.setdefault((buffer.dtype, buffer.numel()), []).append(buffer.view(-1))
        self._pool_bytes += nbytes


def _gather(cache: torch.Tensor, job: _Job, layer: int) -> None:
    """One layer of a transfer straight into the payload's slot: strided copies of runs of
    consecutive blocks when the layout is affine, else one gather of rows of ``job.run``."""
    if job.runs is not None:
        copy_blocks(cache, job.strides, job.runs, job.block_size, job.buffer[layer])
    else:
        torch.index_select(cache.view(-1, job.run), 0, job.index,
                           out=job.buffer[layer].view(-1, job.run))
    job.copied[layer] = True


def _extra_config(vllm_config: Any) -> dict[str, Any]:
    return dict(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {})


def _check_parallelism(vllm_config: Any) -> int:
    """The tensor-parallel world size, after refusing what the payload cannot describe:
    pipeline parallelism (a rank holds only some layers), and a KV-head count the ranks do not
    split evenly (vLLM then replicates heads across ranks)."""
    parallel = vllm_config.parallel_config
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if pp != 1:
        raise UnsupportedKVCache(
            f"{CONNECTOR_NAME} supports pipeline_parallel_size 1 (got {pp}); set "
            "pipeline_parallel_size to 1 or kvTransfer.send to false"
        )
    model_config = vllm_config.model_config
    if tp > 1 and model_config is not None:
        heads = model_config.get_total_num_kv_heads()
        if heads % tp:
            raise UnsupportedKVCache(
                f"{CONNECTOR_NAME} with tensor_parallel_size {tp} needs a KV-head count "
                f"divisible by it (each rank ships its own heads); this model has {heads}: "
                "choose a tensor_parallel_size that divides it"
            )
    return tp


def _tensor_parallel_shard(vllm_config: Any) -> tuple[int, int]:
    """(this worker's tensor-parallel rank, the world size): its KV-head shard."""
    tp = vllm_config.parallel_config.tensor_parallel_size
    if tp == 1:
        return 0, 1
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank(), tp


def _attention_layer(vllm_config: Any) -> Any:
    """An attention layer of the model: its backend writes the cache the probe decodes (one KV
    cache group, so all layers share the backend and the layout)."""
    forward_context = vllm_config.compilation_config.static_forward_context
    for layer in forward_context.values():
        if hasattr(getattr(layer, "impl", None), "do_kv_cache_update"):
            return layer
    raise UnsupportedKVCache("no attention layer with a KV cache write to probe")
