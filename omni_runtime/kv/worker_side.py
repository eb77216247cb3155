"""The omni KV connector's worker half, in each worker process (one per tensor-parallel rank).

At start-up (:meth:`OmniKVConnectorWorker.register_kv_caches`) it learns the cache's block
format from the attention backend (kv/layout.py), creates this rank's NIXL agent, registers
the KV cache with it once, and starts the rank's :class:`~omni_runtime.kv.transport.KVSender`,
which says hello to every downstream stage (the agent's metadata, the regions, the block
format, the compatibility hash). Any failure here refuses the engine's start, naming the
cause.

Per step (:meth:`bind`): each transfer handed off is offered to the receivers (its blocks as
runs of consecutive ids; nothing is copied: the receivers read the blocks in place), and each
transfer the scheduler withdrew is withdrawn from the sender's fence. The step itself does no
KV work. :meth:`poll` reports the sender's answers per attempt.

Tensor parallelism: each rank's cache holds its own KV heads; the receivers read each rank's
shard from that rank's agent and assemble the payload.

The block guarantee at a distance: a receiver reads a transfer's blocks between the hand-off
and the fence's verdict; the scheduler frees them only after every rank's answer, at its own
deadline (after the sender's), or with withdrawing the transfer from every rank (it resolved
it itself, or another rank failed it), which reaches this rank at the start of the next step,
before anything writes the freed blocks; the sender commits a read only while the transfer is
current (kv/transport/sender.py).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any

import torch

from omni_runtime.kv.connector_config import ConnectorSettings, connector_settings
from omni_runtime.kv.cpu_affinity import transport_cpus
from omni_runtime.kv.layout import UnsupportedKVCache, probe_block_format
from omni_runtime.kv.metadata import OmniKVConnectorMetadata
from omni_runtime.kv.transport.payload import vllm_external_request_id
from omni_runtime.kv.transport.protocol import Compat, Hello, Region, block_runs
from omni_runtime.kv.transport.sender import Unanswered
from omni_runtime.sched.handoff import Answer, ChunkAnswer, ChunkOut, HandOff
from omni_runtime.transfers.config import parse_omni_kv_config, raw_omni_kv_config

logger = logging.getLogger(__name__)

#: How long a step with nothing scheduled (transfers in flight) waits for an answer: the engine
#: loop does not spin, and a request arriving meanwhile waits at most this long.
IDLE_WAIT_S = 0.005


class OmniKVConnectorWorker:
    def __init__(self, vllm_config: Any, kv_cache_config: Any = None,
                 settings: ConnectorSettings | None = None) -> None:
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        settings = settings or connector_settings_of(vllm_config)
        self._endpoints = settings.endpoints  # some: the connector checked
        self._pipeline = settings.pipeline
        self._revision = settings.revision
        self._io_cpus = transport_cpus(settings.io_cpus)
        #: A host KV cache is moved onto huge pages before it is registered (huge_pages.py);
        #: ``kv_connector_extra_config.host_huge_pages: false`` leaves it as vLLM made it.
        self._host_huge_pages = settings.host_huge_pages
        self.host_huge_pages = None  # what register_kv_caches did: a HugePageOutcome
        self.shard, self.num_shards = tensor_parallel_shard(vllm_config)
        self._kv_cfg = parse_omni_kv_config(raw_omni_kv_config(vllm_config))
        #: The stages fed whole: a streamed edge's stage takes chunks, not whole transfers.
        self._whole = [s for s in self._endpoints if s not in self._kv_cfg.streams]
        self._randomized_ids = not _ids_not_randomized()
        self._sender = None
        self._agent = None
        self._edges = None  # per-edge metrics fed by this rank (rank 0 of a fan-out)
        self._entry_bytes = 0  # payload bytes per token (every layer's K and V of this shard)
        self._block_size = 0
        self._local: dict[str, Answer] = {}  # answers made here, without the sender
        #: Offered, not yet answered: request id -> (attempt, payload bytes, offered at).
        self._offered: dict[str, tuple[int, int, float]] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ start-up
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        from omni_runtime.kv.transport import KVSender
        from omni_runtime.kv.transport.nixl_agent import KVAgent
        from omni_runtime.observability.edge_metrics import (
            data_path_edge_metrics,
            edge_bytes_observer,
        )
        from omni_runtime.observability.metrics import transfer_bytes_observer
        from omni_runtime.observability.transport_metrics import thread_up_setter

        vllm_config = self._vllm_config
        caches = [t for _, t in sorted(kv_caches.items(),
                                       key=lambda item: extract_layer_index(item[0]))]
        if not caches:
            raise UnsupportedKVCache("no KV cache tensors were registered")
        if getattr(vllm_config.cache_config, "cache_dtype", "auto") not in ("auto", None):
            raise UnsupportedKVCache("quantized KV caches cannot be transferred: set "
                                     "cache_dtype to auto or kvTransfer.send to false")
        model_config = vllm_config.model_config
        block_size = vllm_config.cache_config.block_size
        fmt = probe_block_format(
            _attention_layer(vllm_config), caches[0], self._num_blocks(caches[0]), block_size,
            model_config.get_num_kv_heads(vllm_config.parallel_config),
            model_config.get_head_size())
        self.caches = caches  # vLLM's, per layer (the connector reads nothing from them)
        self._block_size = block_size
        self._entry_bytes = len(caches) * 2 * fmt.num_kv_heads * fmt.head_size * fmt.itemsize
        device = caches[0].device
        mem_type = "VRAM" if device.type == "cuda" else "DRAM"
        device_id = device.index or 0
        regions = []
        for cache in caches:
            plane_bytes = cache.numel() * cache.element_size() // fmt.planes
            regions.extend(Region(cache.data_ptr() + p * plane_bytes, plane_bytes, device_id)
                           for p in range(fmt.planes))
        name = (f"{self._pipeline or 'omni'}.{self._kv_cfg.stage_name}.tp{self.shard}."
                f"{uuid.uuid4().hex[:12]}")
        # Created from a thread on the transport's CPUs: threads UCX and NIXL start (its
        # progress thread, which serves the receivers' reads over TCP) inherit them.
        self._agent = _on_cpus(self._io_cpus, lambda: KVAgent(name, progress_thread=True))
        # One registration per underlying allocation (layers may be views of one).
        storages: dict[int, tuple[int, int, int]] = {}
        for cache in caches:
            storage = cache.untyped_storage()
            storages[storage.data_ptr()] = (storage.data_ptr(), storage.nbytes(), device_id)
        if device.type == "cpu" and self._host_huge_pages:
            self.host_huge_pages = _onto_huge_pages(list(storages.values()))
        self._agent.register(list(storages.values()), mem_type)
        compat = Compat(
            model=str(model_config.served_model_name or model_config.model),
            dtype=fmt.dtype, num_layers=len(caches),
            num_kv_heads=model_config.get_total_num_kv_heads(),
            head_size=fmt.head_size, block_size=block_size, layout=fmt.digest(),
            revision=self._revision)
        hello = Hello(
            agent=name, conn=0, pipeline=self._pipeline, from_stage=self._kv_cfg.stage_name,
            to_stage="", shard=self.shard, num_shards=self.num_shards, mem_type=mem_type,
            compat=compat, compat_hash=compat.hash(), block_format=fmt,
            regions=tuple(regions), metadata=self._agent.metadata())
        stage = self._kv_cfg.stage_name
        model_name = model_config.served_model_name or model_config.model
        on_edge = None
        if self.shard == 0:
            # The per-edge families (omni_kv_edge_*): fed once, by rank 0 (every rank's shard
            # travels the same edges; a gauge several ranks wrote would flap). With one
            # downstream stage the ledger feeds them and the data path adds the bytes; with
            # several, the data path says what happened on each edge.
            self._edges = data_path_edge_metrics(
                stage=stage, model_name=model_name, endpoints=self._endpoints,
                deadline_seconds=self._kv_cfg.timeout_seconds)
            if self._edges is None:
                (only,) = self._endpoints
                edge_bytes = edge_bytes_observer(stage=stage, model_name=model_name,
                                                 to_stage=only)
                on_edge = (lambda rid, attempt, to_stage, outcome, nbytes:
                           edge_bytes(nbytes) if outcome == "acked" else None)
            else:
                edges = self._edges
                on_edge = (lambda rid, attempt, to_stage, outcome, nbytes: edges.resolved(
                    (rid, attempt), to_stage, outcome,
                    nbytes=nbytes if outcome == "acked" else None))
        self._sender = KVSender(
            self._endpoints, hello=hello,
            agent=self._agent, send_timeout_s=max(0.1, 0.95 * self._kv_cfg.timeout_seconds),
            observe_bytes=transfer_bytes_observer(stage=stage, model_name=model_name),
            on_edge=on_edge,
            # omni_kv_transport_thread_up{thread="sender"}: the AR supervisor's health check.
            on_thread_state=thread_up_setter(stage=stage, model_name=model_name,
                                             thread="sender"),
            # Off the engine's OpenMP cores: a core the transport takes from OpenMP stalls
            # every parallel region of every step (docs/connector.md).
            io_cpus=self._io_cpus)
        logger.info("omni KV connector: NIXL agent %s registered %d %s layer caches (%d "
                    "planes, block format %s), offering to %s", name, len(caches), mem_type,
                    fmt.planes, fmt.digest(), sorted(self._endpoints))

    def _num_blocks(self, cache: torch.Tensor) -> int:
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        if num_blocks:
            return int(num_blocks)
        return int(self._vllm_config.cache_config.num_gpu_blocks or cache.shape[0])

    # ------------------------------------------------------------------ a step
    def bind(self, meta: OmniKVConnectorMetadata) -> None:
        sender = self._sender
        for rid, attempt in meta.withdrawn.items():
            sender.cancel(rid, attempt)
            offered = self._offered.get(rid)
            if offered is not None and offered[0] <= attempt:
                del self._offered[rid]
                if self._edges is not None:
                    self._edges.dropped((rid, offered[0]))
        for hand_off in meta.hand_offs:
            self._offer(hand_off)
        if meta.chunks and self.shard == 0:  # tokens only: one rank sends them
            self._send_chunks(meta.chunks)
        if self._edges is not None:
            for rid, (attempt, blocks, at) in meta.held.items():
                self._edges.held((rid, attempt), blocks, at=at)

    def _offer(self, h: HandOff) -> None:
        from omni_runtime.kv.transport import Offer

        needed = -(-h.seq_len // self._block_size)
        if h.seq_len <= 0 or len(h.block_ids) < needed:
            self._answer(h, f"extraction failed: seq_len {h.seq_len} needs {needed} blocks of "
                            f"{self._block_size} tokens, the hand-off names {len(h.block_ids)}")
            return
        if h.deadline_in_s <= 0.0:
            # The scheduler's deadline has already passed: offering it would only keep
            # receivers busy with a transfer the scheduler expires on its next step.
            self._answer(h, "deadline passed before the send started")
            return
        nbytes = h.seq_len * self._entry_bytes
        superseded = self._offered.get(h.request_id)
        self._offered[h.request_id] = (h.attempt, nbytes, time.monotonic())
        if self._edges is not None:
            if superseded is not None:
                self._edges.dropped((h.request_id, superseded[0]))
            self._edges.started((h.request_id, h.attempt), held=h.held)
        self._sender.submit(
            Offer(request_id=h.request_id, attempt=h.attempt, seq_len=h.seq_len,
                  runs=block_runs(h.block_ids[:needed]), nbytes=nbytes,
                  external_request_id=vllm_external_request_id(
                      h.request_id, randomized=self._randomized_ids),
                  trace_context=dict(h.trace_headers) if h.trace_headers else None,
                  token_ids=h.carried.token_ids, prompt_len=h.carried.prompt_len,
                  origin=dict(h.carried.origin) if h.carried.origin else None),
            # Give up just before the scheduler would expire it, so the failure (with its
            # reason) reaches the scheduler first.
            timeout_s=max(0.05, 0.95 * h.deadline_in_s), to_stages=self._whole)

    def _send_chunks(self, chunks: list[ChunkOut]) -> None:
        from omni_runtime.kv.transport.sender import ChunkOffer

        for c in chunks:
            self._sender.submit_chunk(
                ChunkOffer(request_id=c.request_id, seq=c.seq, last=c.last,
                           token_ids=c.token_ids, prompt_len=c.prompt_len,
                           produced_at=c.produced_at,
                           external_request_id=vllm_external_request_id(
                               c.request_id, randomized=self._randomized_ids),
                           trace_context=dict(c.trace_headers) if c.trace_headers else None,
                           origin=dict(c.origin) if c.origin else None,
                           end=c.end, reason=c.reason),
                c.to_stage, timeout_s=c.deadline_in_s)

    def poll_chunks(self) -> list[ChunkAnswer]:
        if self._sender is None or self.shard != 0:
            return []
        return [ChunkAnswer(*answer, unanswered=isinstance(answer[3], Unanswered))
                for answer in self._sender.poll_chunks()]

    def _answer(self, h: HandOff, reason: str) -> None:
        with self._lock:
            self._local[h.request_id] = Answer(h.attempt, reason)

    def idle_wait(self) -> None:
        if self._sender is not None and self._sender.pending():
            self._sender.wait(IDLE_WAIT_S)

    def poll(self) -> dict[str, Answer]:
        with self._lock:
            answers, self._local = self._local, {}
        if self._sender is not None:
            now = time.monotonic()
            for rid, (attempt, reason) in self._sender.poll().items():
                offered = self._offered.get(rid)
                nbytes = seconds = 0
                if offered is not None and offered[0] == attempt:
                    del self._offered[rid]
                    nbytes = offered[1] if reason is None else 0
                    seconds = now - offered[2]
                answers[rid] = Answer(attempt, reason, nbytes, seconds,
                                      expired=isinstance(reason, Unanswered))
        return answers

    def shutdown(self) -> None:
        if self._sender is not None:
            try:
                self._sender.close(linger_s=1.0)
            except Exception:  # never block vLLM's own shutdown
                logger.exception("closing the KV sender failed")
        if self._agent is not None:
            self._agent.close()


def _on_cpus(cpus: Any, make: Any) -> Any:
    """``make()`` run on a short-lived thread bound to ``cpus`` (None: here)."""
    if not cpus:
        return make()
    import os

    result: dict[str, Any] = {}

    def run() -> None:
        try:
            os.sched_setaffinity(0, cpus)
            result["value"] = make()
        except BaseException as exc:  # re-raised on the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=run, name="omni-kv-setup")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def _onto_huge_pages(storages: list[tuple[int, int, int]]) -> Any:
    """The host KV cache onto transparent huge pages, before NIXL registers it: the receivers'
    reads of it (UCX's cma pins the pages it copies) run at the memory's speed. Returns the
    outcome over every storage."""
    from omni_runtime.kv.huge_pages import HugePageOutcome, collapse_into_huge_pages

    total = sum(nbytes for _, nbytes, _ in storages)
    outcomes = [collapse_into_huge_pages(addr, nbytes) for addr, nbytes, _ in storages]
    whys = list(dict.fromkeys(o.why_not for o in outcomes if o.why_not))
    outcome = HugePageOutcome(bytes=sum(o.bytes for o in outcomes),
                              seconds=sum(o.seconds for o in outcomes), why_not="; ".join(whys),
                              unsupported=any(o.unsupported for o in outcomes))
    if whys:
        logger.info("omni KV connector: %d of %d MB of the host KV cache moved onto huge pages "
                    "in %.2f s (%s); the receivers' reads of the rest pin 4 KiB pages one by one",
                    outcome.bytes >> 20, total >> 20, outcome.seconds, outcome.why_not)
    else:
        logger.info("omni KV connector: the host KV cache (%d MB) moved onto huge pages in "
                    "%.2f s", outcome.bytes >> 20, outcome.seconds)
    return outcome


def _ids_not_randomized() -> bool:
    """vLLM keeps the client's request id as its internal id (no random suffix)."""
    import vllm.envs as envs

    return bool(envs.VLLM_DISABLE_REQUEST_ID_RANDOMIZATION)


def connector_settings_of(vllm_config: Any, also: tuple[str, ...] | None = ()) -> ConnectorSettings:
    """The connector's ``kv_connector_extra_config``, checked (connector_config.py)."""
    return connector_settings(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None),
                              also)


def tensor_parallel_shard(vllm_config: Any) -> tuple[int, int]:
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
