"""A downstream stage's KV prefix, loaded through vLLM's connector load path.

A stage whose requests are made from an upstream stage's hand-offs (stages/stage_input.py)
gets, with each such request, the upstream's KV of its first tokens, where the two stages'
KV agree (the same model: layers, KV heads, head size, dtype). The arriving payload is
written to a file in shared memory (:func:`write_payload`) and the request names it in
``kv_transfer_params["omni_load"]`` (:class:`LoadSource`). vLLM then asks the connector:

* scheduler side (:class:`LoadPlanner`): ``get_num_new_matched_tokens`` answers how many of
  the request's tokens past its local prefix-cache hit the file covers (never its last
  prompt token, which vLLM computes to sample from); ``update_state_after_alloc`` learns the
  blocks vLLM allocated for them; the step's metadata carries a :class:`Load` per request;
* worker side (:func:`load_into_cache`): before the step's forward, each layer's K and V of
  those tokens are written into the allocated blocks through the attention backend's own
  cache write (``do_kv_cache_update``, what the forward itself uses: exact for any layout),
  each tensor-parallel rank its own KV heads.

The load is synchronous (vLLM's ``load_kv_async`` False): the bytes are already on this
host, and the copy takes less than the forward it saves; the request is scheduled in the same
step, its prefill computing only the tokens the file does not cover. Each request loads
once: after a preemption vLLM recomputes it (the file is gone by then). A file that cannot be
read fails the load of those blocks (vLLM's ``get_block_ids_with_load_errors``), and vLLM
recomputes them (the connector's ``kv_load_failure_policy`` is ``recompute``).
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

#: The key of a request's ``kv_transfer_params`` naming the KV it loads (:class:`LoadSource`).
LOAD_PARAMS = "omni_load"
#: Payload dtype names (kv/transport/payload.py's) -> the numpy dtype of the file's array.
_FILE_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
#: torch dtypes (as str() names them) -> payload dtype names.
_DTYPE_NAMES = {"torch.float32": "float32", "torch.float16": "float16",
                "torch.bfloat16": "bfloat16"}


def model_kv_identity(vllm_config: Any) -> tuple[int, int, int, str]:
    """What a KV prefix must match to be loaded into this engine's cache: (layers, KV heads
    in all, head size, dtype name)."""
    model_config = vllm_config.model_config
    dtype = model_config.dtype
    cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
    return (model_config.get_num_layers(vllm_config.parallel_config),
            model_config.get_total_num_kv_heads(), model_config.get_head_size(),
            _DTYPE_NAMES.get(str(dtype), str(dtype)) if cache_dtype in ("auto", None)
            else str(cache_dtype))


class LoadError(ValueError):
    """A ``kv_transfer_params["omni_load"]`` that cannot be loaded, with the reason."""


@dataclass(frozen=True)
class LoadSource:
    """Where a request's KV prefix is: a file of one array ``[layers, 2 (K, V), kv_heads,
    tokens, head_size]`` (the payload's layout) holding the KV of its first ``tokens``
    prompt tokens."""

    path: str
    tokens: int
    shape: tuple[int, ...]
    dtype: str

    def as_params(self) -> dict[str, Any]:
        return {"path": self.path, "tokens": self.tokens, "shape": list(self.shape),
                "dtype": self.dtype}

    @classmethod
    def from_params(cls, params: Any) -> LoadSource:
        if not isinstance(params, Mapping):
            raise LoadError(f"{LOAD_PARAMS} must be a mapping")
        path, tokens, shape, dtype = (params.get(k) for k in ("path", "tokens", "shape",
                                                               "dtype"))
        if not isinstance(path, str) or not path:
            raise LoadError(f"{LOAD_PARAMS}.path must name the file")
        if not isinstance(shape, Sequence) or len(shape) != 5 or not all(
                isinstance(x, int) and x > 0 for x in shape):
            raise LoadError(f"{LOAD_PARAMS}.shape must be [layers, 2, kv_heads, tokens, "
                            f"head_size], got {shape!r}")
        if dtype not in _FILE_DTYPES:
            raise LoadError(f"{LOAD_PARAMS}.dtype must be one of {sorted(_FILE_DTYPES)}")
        if not isinstance(tokens, int) or not 0 < tokens <= shape[3] or shape[1] != 2:
            raise LoadError(f"{LOAD_PARAMS}.tokens must be in [1, {shape[3]}]")
        return cls(path, tokens, tuple(shape), dtype)


def write_payload(kv: np.ndarray, dtype: str, directory: str, name: str) -> LoadSource:
    """``kv`` (a payload's ``[layers, 2, kv_heads, seq_len, head_size]`` array) into a new
    file ``directory/name`` (shared memory: /dev/shm), for an engine process to load."""
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, max(1, kv.nbytes))
        with mmap.mmap(fd, max(1, kv.nbytes)) as m:
            np.ndarray(kv.shape, kv.dtype, buffer=m)[...] = kv
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return LoadSource(path, int(kv.shape[3]), tuple(int(x) for x in kv.shape), dtype)


def payload_into_file(payload: Any, directory: str, name: str) -> LoadSource:
    """A received payload (kv/transport/payload.py's KVPayload) into a new file
    ``directory/name``, assembled straight into the file when it is not yet (no copy in
    between)."""
    path = os.path.join(directory, name)
    dtype = np.dtype(_FILE_DTYPES[payload.dtype_name])
    nbytes = int(np.prod(payload.shape)) * dtype.itemsize
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, max(1, nbytes))
    finally:
        os.close(fd)
    try:
        if payload.kv is None:
            payload.materialize(lambda shape, kind: np.memmap(path, kind, "r+", shape=shape))
        else:
            np.memmap(path, dtype, "r+", shape=payload.shape)[...] = payload.kv
    except BaseException:
        os.unlink(path)
        raise
    return LoadSource(path, payload.seq_len, tuple(int(x) for x in payload.shape),
                      payload.dtype_name)


def read_payload(source: LoadSource) -> tuple[np.ndarray, mmap.mmap]:
    """The file's array, mapped read-only (close the map when done)."""
    fd = os.open(source.path, os.O_RDONLY)
    try:
        m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    dtype = np.dtype(_FILE_DTYPES[source.dtype])
    if len(m) < int(np.prod(source.shape)) * dtype.itemsize:
        m.close()
        raise LoadError(f"{source.path} holds {len(m)} bytes, less than its shape")
    return np.ndarray(source.shape, dtype, buffer=m), m


@dataclass(frozen=True)
class Load:
    """One request's load in a step: the KV of its tokens [start, end) into the blocks vLLM
    allocated for it (``block_ids``: all of the request's blocks of its one KV cache group,
    from token 0)."""

    request_id: str
    source: LoadSource
    start: int
    end: int
    block_ids: tuple[int, ...]


class LoadPlanner:
    """The scheduler side (see the module docstring). ``expects``: the model's KV (layers,
    KV heads in all, head size, dtype name): a file of another shape is refused (its request
    then computes its prefix)."""

    def __init__(self, expects: tuple[int, int, int, str]) -> None:
        self._expects = expects
        #: request id -> (its source, the token its load ends at): answered by
        #: get_num_new_matched_tokens, taken by update_state_after_alloc.
        self._planned: dict[str, tuple[LoadSource, int]] = {}
        #: Requests that loaded once (a preempted one recomputes): dropped at their finish.
        self._loaded: set[str] = set()
        self._loads: list[Load] = []

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        params = request.kv_transfer_params
        raw = params.get(LOAD_PARAMS) if params else None
        if raw is None or request.request_id in self._loaded:
            return 0
        try:
            source = LoadSource.from_params(raw)
            layers, _, heads, _, head_size = source.shape
            if (layers, heads, head_size, source.dtype) != self._expects:
                raise LoadError(f"the KV of shape {list(source.shape)} {source.dtype} is not "
                                f"this model's ({self._expects})")
        except LoadError as exc:
            logger.warning("request %s computes its prefix: %s", request.request_id, exc)
            self._loaded.add(request.request_id)
            return 0
        # vLLM computes at least the last prompt token (its logits sample the first output).
        end = min(source.tokens, request.num_prompt_tokens - 1)
        if end <= num_computed_tokens:
            return 0
        self._planned[request.request_id] = (source, end)
        return end - num_computed_tokens

    def allocated(self, request: Any, block_ids: Sequence[int], num_external_tokens: int
                  ) -> None:
        planned = self._planned.pop(request.request_id, None)
        if planned is None or num_external_tokens <= 0:
            return
        source, end = planned
        self._loaded.add(request.request_id)
        self._loads.append(Load(request.request_id, source, end - num_external_tokens, end,
                                tuple(block_ids)))

    def take_loads(self) -> list[Load]:
        loads, self._loads = self._loads, []
        return loads

    def finished(self, request_id: str) -> None:
        self._planned.pop(request_id, None)
        self._loaded.discard(request_id)

    def __len__(self) -> int:
        return len(self._planned) + len(self._loaded) + len(self._loads)


def load_into_cache(load: Load, layers: Sequence[tuple[Any, Any]], block_size: int,
                    heads: tuple[int, int]) -> None:
    """Write ``load``'s KV into the cache: ``layers``, per layer in order, (the attention
    layer, its KV cache tensor); ``heads``: this rank's KV heads [first, end)."""
    kv, mapped = read_payload(load.source)
    try:
        _write(kv, load, layers, block_size, heads)
    finally:
        del kv  # the map closes only once no array exports it
        mapped.close()


def _write(kv: np.ndarray, load: Load, layers: Sequence[tuple[Any, Any]], block_size: int,
           heads: tuple[int, int]) -> None:
    import torch

    if len(layers) != kv.shape[0]:
        raise LoadError(f"{load.source.path} has {kv.shape[0]} layers, the model "
                        f"{len(layers)}")
    positions = torch.arange(load.start, load.end, dtype=torch.int64)
    blocks = torch.tensor(load.block_ids, dtype=torch.int64)
    device = layers[0][1].device
    slots = (blocks[positions // block_size] * block_size + positions % block_size).to(device)
    h0, h1 = heads
    for index, (layer, cache) in enumerate(layers):
        # [2, heads, tokens, head_size], copied out of the map
        part = torch.from_numpy(np.array(kv[index, :, h0:h1, load.start:load.end]))
        if load.source.dtype == "bfloat16":
            part = part.view(torch.bfloat16)
        part = part.to(device=device, dtype=cache.dtype)
        key = part[0].transpose(0, 1).contiguous()  # [tokens, heads, head_size]
        value = part[1].transpose(0, 1).contiguous()
        layer.impl.do_kv_cache_update(layer, key, value, cache, slots)


class CacheLoader:
    """The worker side (see the module docstring): this worker's layers and caches, learned
    at registration, and the blocks of loads that failed, for vLLM to recompute."""

    def __init__(self, vllm_config: Any, rank: int, world_size: int) -> None:
        self._vllm_config = vllm_config
        self._block_size = vllm_config.cache_config.block_size
        heads = vllm_config.model_config.get_total_num_kv_heads() // world_size
        self._heads = (rank * heads, (rank + 1) * heads)
        self._layers: list[tuple[Any, Any]] = []
        self._failed_blocks: set[int] = set()

    def register(self, kv_caches: Mapping[str, Any]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        context = self._vllm_config.compilation_config.static_forward_context
        self._layers = [(context[name], cache) for name, cache in
                        sorted(kv_caches.items(), key=lambda item: extract_layer_index(item[0]))]

    def load(self, loads: Sequence[Load]) -> None:
        for load in loads:
            try:
                load_into_cache(load, self._layers, self._block_size, self._heads)
            except Exception as exc:  # vLLM recomputes what was not loaded
                first = load.start // self._block_size
                last = -(-load.end // self._block_size)
                self._failed_blocks.update(load.block_ids[first:last])
                logger.warning("KV prefix of request %s not loaded (%s: %s); vLLM recomputes "
                               "it", load.request_id, type(exc).__name__, exc)

    def take_failed_blocks(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed
