"""A synthetic AR rank for benchmarks and GPU checks: layers of a paged KV cache laid out as
a vLLM attention backend lays them out, registered with a real NIXL agent, with the hello the
real connector's worker half would send (omni_runtime/kv/worker_side.py) and a
:class:`~omni_runtime.kv.transport.KVSender` offering its blocks.

Two layouts: ``"cpu"`` (vLLM's CPU backend: ``[blocks, heads, block_size, 2 * head_size]``,
per head K transposed ``[head_size, block_size]`` then V ``[block_size, head_size]``) and
``"flash"`` (FlashAttention's ``[2, blocks, block_size, heads, head_size]``: K and V in two
planes). :meth:`SyntheticAR.expected` computes a transfer's payload from the tensors directly.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from omni_runtime.kv.layout import DTYPE_NAMES
from omni_runtime.kv.transport import KVSender, Offer
from omni_runtime.kv.transport.nixl_agent import KVAgent
from omni_runtime.kv.transport.protocol import (
    Affine,
    BlockFormat,
    Compat,
    Hello,
    Region,
    block_runs,
)


def block_format(layout: str, heads: int, block_size: int, head_size: int,
                 dtype: torch.dtype) -> BlockFormat:
    H, B, D = heads, block_size, head_size
    if layout == "cpu":
        slab = B * 2 * D  # one head's K^T then V
        return BlockFormat(B, H, D, DTYPE_NAMES[dtype], H * slab, 1,
                           k=Affine(0, slab, 1, B), v=Affine(D * B, slab, D, 1))
    if layout == "flash":
        return BlockFormat(B, H, D, DTYPE_NAMES[dtype], B * H * D, 2,
                           k=Affine(0, D, H * D, 1, plane=0), v=Affine(0, D, H * D, 1, plane=1))
    raise ValueError(f"layout must be cpu or flash, got {layout!r}")


class SyntheticAR:
    def __init__(self, *, layers: int, heads: int, head_size: int, block_size: int,
                 num_blocks: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 layout: str = "cpu", model: str = "synthetic", pipeline: str = "bench",
                 stage: str = "ar", shard: int = 0, num_shards: int = 1,
                 seed: int | None = 0) -> None:
        self.layout = layout
        self.fmt = block_format(layout, heads, block_size, head_size, dtype)
        shape = ((num_blocks, heads, block_size, 2 * head_size) if layout == "cpu"
                 else (2, num_blocks, block_size, heads, head_size))
        if seed is None:  # contents that do not matter (a benchmark's): fast to make
            self.caches = [torch.full(shape, float(i + 1), device=device, dtype=dtype)
                           for i in range(layers)]
        else:
            gen = torch.Generator(device=device).manual_seed(seed)
            self.caches = [torch.randn(shape, generator=gen, device=device).to(dtype)
                           for _ in range(layers)]
        self.device = torch.device(device)
        mem_type = "VRAM" if self.device.type == "cuda" else "DRAM"
        device_id = self.device.index or 0
        # As the AR's worker makes its agent: NIXL's progress thread serves reads over TCP.
        self.agent = KVAgent(f"{pipeline}.{stage}.tp{shard}.{uuid.uuid4().hex[:12]}",
                             progress_thread=True)
        self.agent.register([(c.data_ptr(), c.numel() * c.element_size(), device_id)
                             for c in self.caches], mem_type)
        planes = self.fmt.planes
        regions = []
        for c in self.caches:
            plane_bytes = c.numel() * c.element_size() // planes
            regions.extend(Region(c.data_ptr() + p * plane_bytes, plane_bytes, device_id)
                           for p in range(planes))
        compat = Compat(model=model, dtype=self.fmt.dtype, num_layers=layers,
                        num_kv_heads=heads * num_shards, head_size=head_size,
                        block_size=block_size, layout=self.fmt.digest())
        self.hello = Hello(agent=self.agent.name, conn=0, pipeline=pipeline, from_stage=stage,
                           to_stage="", shard=shard, num_shards=num_shards, mem_type=mem_type,
                           compat=compat, compat_hash=compat.hash(), block_format=self.fmt,
                           regions=tuple(regions), metadata=self.agent.metadata())
        self.entry_bytes = layers * 2 * heads * head_size * self.caches[0].element_size()

    def sender(self, endpoints: Mapping[str, str], **kwargs: Any) -> KVSender:
        return KVSender(endpoints, hello=self.hello, agent=self.agent, **kwargs)

    def offer(self, request_id: str, block_ids: Sequence[int], seq_len: int,
              attempt: int = 0) -> Offer:
        needed = -(-seq_len // self.fmt.block_size)
        return Offer(request_id=request_id, attempt=attempt, seq_len=seq_len,
                     runs=block_runs(block_ids[:needed]), nbytes=seq_len * self.entry_bytes)

    def expected(self, block_ids: Sequence[int], seq_len: int) -> np.ndarray:
        """The payload ``[layers, 2, H, seq_len, D]`` of these blocks, read from the tensors
        by plain indexing (independent of the receiver's assembly)."""
        B = self.fmt.block_size
        blocks = torch.as_tensor(list(block_ids), device=self.device)
        out = []
        for c in self.caches:
            if self.layout == "cpu":
                H, D = c.shape[1], c.shape[3] // 2
                sel = c[blocks]  # [n, H, B, 2D]: per head K^T [D, B] then V [B, D] in memory
                per_head = sel.reshape(len(blocks), H, 2 * D * B)
                k = per_head[..., : D * B].reshape(-1, H, D, B).permute(1, 0, 3, 2)
                v = per_head[..., D * B:].reshape(-1, H, B, D).permute(1, 0, 2, 3)
            else:
                k = c[0, blocks].permute(2, 0, 1, 3)  # [H, n, B, D]
                v = c[1, blocks].permute(2, 0, 1, 3)
            H, D = k.shape[0], k.shape[-1]
            out.append(torch.stack((k.reshape(H, -1, D)[:, :seq_len],
                                    v.reshape(H, -1, D)[:, :seq_len])))
        kv = torch.stack(out).cpu().contiguous()
        if kv.dtype == torch.bfloat16:
            return kv.view(torch.int16).numpy().view(np.uint16)
        return kv.numpy()

    def close(self) -> None:
        self.agent.close()
