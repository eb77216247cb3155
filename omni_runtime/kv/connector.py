"""``OmniKVConnector``: the AR stage's KV data plane on vLLM's own KV connector interface.

Loaded by vLLM, no worker class of ours::

    --kv-transfer-config '{"kv_connector": "OmniKVConnector",
        "kv_connector_module_path": "omni_runtime.kv.connector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"endpoints": {"next": "tcp://host:9600"},
                                      "pipeline": "demo"}}'

next to ``--scheduler-cls omni_runtime.sched.OmniARScheduler``. The scheduler decides *when*
(triggers, deadlines, the ledger); this connector decides *how*: the bytes move on NIXL, read
by the receiving stage straight out of this engine's registered KV cache (docs/connector.md).

A thin facade, laid out like vLLM's own NixlConnector: it dispatches by role to the scheduler
half (kv/scheduler_side.py, in the engine core) or the worker half (kv/worker_side.py, in each
worker); what they tell each other per step is typed in kv/metadata.py, and the contract with
the scheduler (:class:`~omni_runtime.sched.handoff.HandOff`, ``Answer``) in sched/handoff.py.

vLLM's ``finished_sending`` path is not used: a held transfer may also resolve on the
scheduler side (expiry, shutdown, reset), after which vLLM's ``_free_blocks`` of a request
reported by ``get_finished`` would find no request. The answers travel as worker metadata.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from omni_runtime.kv.connector_config import CONNECTOR_NAME, ConnectorConfigError, kv_transfer_config  # noqa: F401
from omni_runtime.kv.cpu_affinity import transport_cpus
from omni_runtime.kv.layout import UnsupportedKVCache
from omni_runtime.kv.load import CacheLoader, LoadPlanner, model_kv_identity
from omni_runtime.kv.metadata import (  # noqa: F401  (public names)
    OmniKVConnectorMetadata,
    OmniKVWorkerMetadata,
    ShardAnswers,
)
from omni_runtime.kv.scheduler_side import OmniKVConnectorScheduler
from omni_runtime.observability.logs import log_like_vllm
from omni_runtime.kv.stats import OmniKVStatsMixin, StreamStats
from omni_runtime.kv.worker_side import (
    OmniKVConnectorWorker,
    connector_settings_of,
    tensor_parallel_shard,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

    from omni_runtime.sched.handoff import Answer, ChunkAnswer, ChunkOut, HandOff


class OmniKVConnector(OmniKVStatsMixin, KVConnectorBase_V1):
    """See the module docstring. Its figures also go through vLLM's own connector-stats path
    (:class:`~omni_runtime.kv.stats.OmniKVStatsMixin`: a plain ``vllm serve`` logs them and
    shows them on ``/metrics``): the scheduler half records each transfer once, its ranks'
    answers combined."""

    #: Marks the connector for OmniARScheduler, which finds it without importing this module.
    omni_kv_connector = True
    #: The keys of ``kv_connector_extra_config`` a subclass reads besides the connector's
    #: own (any other is refused at start, naming it: a typo would be ignored).
    extra_config_keys: tuple[str, ...] = ()

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        log_like_vllm()
        world_size = _check_parallelism(vllm_config)
        settings = connector_settings_of(vllm_config, self.extra_config_keys)
        # A bad io_cpus refuses the engine at start-up (not at the first transfer).
        transport_cpus(settings.io_cpus)
        #: It ships KV downstream (its endpoints), and/or loads the KV prefixes its requests
        #: name (a downstream stage: kv/load.py); at least one.
        self.sends_kv = bool(settings.endpoints)
        self.loads_kv = settings.loads
        if not (self.sends_kv or self.loads_kv):
            raise UnsupportedKVCache(
                "the omni KV connector has no downstream endpoint and loads nothing: set "
                "kv_transfer_config.kv_connector_extra_config.endpoints ({stage: address}), "
                "or loads: true")
        self.scheduler_half: OmniKVConnectorScheduler | None = None
        self.worker_half: OmniKVConnectorWorker | None = None
        self.load_planner: LoadPlanner | None = None
        self.cache_loader: CacheLoader | None = None
        if role == KVConnectorRole.SCHEDULER:
            if self.sends_kv:
                _check_scheduler(vllm_config)
                self.scheduler_half = OmniKVConnectorScheduler(
                    world_size, self.omni_kv_stats, settings.to_stages,
                    fans_out=len(settings.endpoints) > 1)
            if self.loads_kv:
                self.load_planner = LoadPlanner(model_kv_identity(vllm_config))
        else:
            if self.sends_kv:
                self.worker_half = OmniKVConnectorWorker(vllm_config, kv_cache_config, settings)
            if self.loads_kv:
                self.cache_loader = CacheLoader(vllm_config,
                                                *tensor_parallel_shard(vllm_config))

    # ================================================================ scheduler side
    def hand_off(self, hand_offs: list[HandOff]) -> None:
        self.scheduler_half.hand_off(hand_offs)

    def withdraw(self, request_id: str, attempt: int, outcome: str = "failed",
                 seconds: float = 0.0) -> None:
        self.scheduler_half.withdraw(request_id, attempt, outcome, seconds)

    def send_chunks(self, chunks: list[ChunkOut]) -> None:
        self.scheduler_half.send_chunks(chunks)

    def take_chunk_answers(self, output: Any) -> list[ChunkAnswer]:
        return self.scheduler_half.take_chunk_answers(output)

    def stream_stats(self) -> StreamStats:
        """An observer of the scheduler's stream ledger: each chunk and stream it resolves
        goes into this connector's stats (vLLM's connector-stats path)."""
        return StreamStats(lambda: self.omni_kv_stats)

    def stop_stats(self) -> None:
        if self.scheduler_half is not None:
            self.scheduler_half.stop_stats()
        # Nothing is recorded from now on: vLLM's get_kv_connector_stats(), called every
        # step, answers None at once.
        self.omni_kv_stats = None

    def hold_on_finish(self, request_id: str) -> None:
        self.scheduler_half.hold_on_finish(request_id)

    def held_on_finish(self, request_id: str, attempt: int, blocks: int, at: float) -> None:
        self.scheduler_half.held_on_finish(request_id, attempt, blocks, at)

    def take_answers(self, output: Any) -> dict[str, Answer]:
        return self.scheduler_half.take_answers(output)

    def record_answers(self, answers: Mapping[str, Answer]) -> None:
        self.scheduler_half.record_answers(answers)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        if self.load_planner is None:
            return 0, False  # a producer only: nothing to load
        # Loaded before the step's forward (kv/load.py): not vLLM's asynchronous load.
        return self.load_planner.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int):
        if self.load_planner is not None and num_external_tokens:
            self.load_planner.allocated(request, blocks.get_block_ids()[0],
                                        num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        if self.scheduler_half is not None:
            meta = self.scheduler_half.build_connector_meta(scheduler_output)
        else:
            meta = OmniKVConnectorMetadata(
                idle=scheduler_output.total_num_scheduled_tokens == 0)
        if self.load_planner is not None:
            meta.loads = self.load_planner.take_loads()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]):
        if self.load_planner is not None:
            self.load_planner.finished(request.request_id)
        if self.scheduler_half is None:
            return False, None
        return self.scheduler_half.request_finished(request, block_ids)

    # ================================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.worker_half is not None:
            self.worker_half.register_kv_caches(kv_caches)
        if self.cache_loader is not None:
            self.cache_loader.register(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker_half is not None and isinstance(
                connector_metadata, OmniKVConnectorMetadata) and (
                connector_metadata.hand_offs or connector_metadata.withdrawn
                or connector_metadata.held or connector_metadata.chunks):
            self.worker_half.bind(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if self.cache_loader is not None and getattr(meta, "loads", None):
            self.cache_loader.load(meta.loads)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.cache_loader.take_failed_blocks() if self.cache_loader else set()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None  # the receivers read the blocks in place: nothing to do in the forward

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if self.worker_half is not None and getattr(meta, "idle", False):
            self.worker_half.idle_wait()

    def build_connector_worker_meta(self) -> OmniKVWorkerMetadata | None:
        if self.worker_half is None:
            return None
        answers = self.worker_half.poll()
        chunk_answers = self.worker_half.poll_chunks()
        if not (answers or chunk_answers):
            return None
        return OmniKVWorkerMetadata(answers, self.worker_half.shard,
                                    chunk_answers=chunk_answers)

    def shutdown(self) -> None:
        if self.worker_half is not None:
            self.worker_half.shutdown()


def _check_scheduler(vllm_config: VllmConfig) -> None:
    """A connector that sends runs under the omni scheduler, which decides when each request
    is handed off; under vLLM's own nothing ever would be, and the stage would serve with
    every omni figure at 0 as if idle."""
    scheduler = vllm_config.scheduler_config.get_scheduler_cls()
    if not getattr(scheduler, "omni_kv_scheduler", False):
        raise ConnectorConfigError(
            f"the omni KV connector sends KV (kv_connector_extra_config.endpoints) but the "
            f"engine's scheduler is {scheduler.__module__}.{scheduler.__qualname__}, which never "
            "hands a request off: add --scheduler-cls omni_runtime.sched.OmniARScheduler "
            "(omni_runtime.sched.OmniARAsyncScheduler with --async-scheduling)")


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
