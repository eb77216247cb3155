"""Reading a request's K and V out of vLLM's paged KV cache, whatever the block layout.

The payload layout (documented in docs/connector.md) is one array
``[num_layers, 2 (K, V), num_kv_heads, seq_len, head_size]``: per layer, Hugging Face's
``past_key_values`` order, so a receiver needs nothing of vLLM to use it.

vLLM's CPU attention stores each layer as ``[num_blocks, num_kv_heads, block_size,
2 * head_size]`` but the interior of a (block, head) depends on the kernel's ISA (keys
transposed for the vector ISA, VNNI-packed for AMX, ...). Rather than hard-coding each
variant, :class:`CpuBlockLayout` learns the permutation from the kernel itself: it writes
probe values with vLLM's own ``cpu_attn_reshape_and_cache`` into a scratch block and records
where every (token, head, dim) element lands. Decoding is then one gather, exact by
construction for any layout that is a permutation (every non-quantized one).

GPU backends arrange a block's content their own way too; none is decoded yet (their probe
would use the backend's own cache-write op, and no GPU runs here to check it against).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class UnsupportedKVCache(RuntimeError):
    """The KV cache cannot be extracted (quantized, unknown backend layout, ...)."""


class BlockLayout:
    """Decodes blocks of one layer's cache tensor into ``[2, H, n * block_size, D]``."""

    num_kv_heads: int
    block_size: int
    head_size: int

    def read(self, cache: torch.Tensor, block_ids: Sequence[int], seq_len: int) -> torch.Tensor:
        raise NotImplementedError


class CpuBlockLayout(BlockLayout):
    def __init__(self, num_kv_heads: int, block_size: int, head_size: int, isa: str, dtype: torch.dtype):
        self.num_kv_heads, self.block_size, self.head_size = num_kv_heads, block_size, head_size
        self.isa = isa
        self.dtype = dtype
        self._k_index, self._v_index = self._probe()

    def _probe(self) -> tuple[torch.Tensor, torch.Tensor]:
        from vllm import _custom_ops as ops

        H, B, D = self.num_kv_heads, self.block_size, self.head_size
        n = B * H * D
        # Element ids 1..n (0 marks "not written"); written bit by bit as 0/1 values, which
        # every cache dtype (bf16 included) represents exactly.
        ids = torch.arange(1, n + 1, dtype=torch.int64).view(B, H, D)
        k_found = torch.zeros(H * B * 2 * D, dtype=torch.int64)
        v_found = torch.zeros_like(k_found)
        slots = torch.arange(B, dtype=torch.int64)
        zeros = torch.zeros(B, H, D, dtype=self.dtype)
        for bit in range(n.bit_length()):
            plane = ((ids >> bit) & 1).to(self.dtype)
            for probe, found, is_key in ((plane, k_found, True), (plane, v_found, False)):
                scratch = torch.zeros(1, H, B, 2 * D, dtype=self.dtype)
                key_cache, value_cache = scratch.view(1, H, 2 * B, D).chunk(2, dim=2)
                key, value = (probe, zeros) if is_key else (zeros, probe)
                ops.cpu_attn_reshape_and_cache(
                    key.contiguous(), value.contiguous(), key_cache, value_cache, slots, self.isa
                )
                found |= (scratch.view(-1) != 0).to(torch.int64) << bit
        k_index = self._invert(k_found, n)
        v_index = self._invert(v_found, n)
        return k_index.view(B, H, D).permute(1, 0, 2), v_index.view(B, H, D).permute(1, 0, 2)

    @staticmethod
    def _invert(found: torch.Tensor, n: int) -> torch.Tensor:
        """found[offset] = element id written there; returns offset of each id 1..n."""
        where = torch.nonzero(found).view(-1)
        element = found[where]
        if element.numel() != n or torch.unique(element).numel() != n:
            raise UnsupportedKVCache(
                "the CPU KV cache layout is not a permutation of its elements; extraction "
                "is not supported for this cache (quantized?)"
            )
        offsets = torch.empty(n, dtype=torch.int64)
        offsets[element - 1] = where
        return offsets

    def read(self, cache: torch.Tensor, block_ids: Sequence[int], seq_len: int) -> torch.Tensor:
        H, B, D = self.num_kv_heads, self.block_size, self.head_size
        blocks = cache.view(cache.shape[0], -1)[torch.as_tensor(block_ids, dtype=torch.int64)]
        n = blocks.shape[0]
        # [n, H, B, D] for K and V, then tokens of consecutive blocks side by side.
        k = blocks[:, self._k_index].permute(1, 0, 2, 3).reshape(H, n * B, D)
        v = blocks[:, self._v_index].permute(1, 0, 2, 3).reshape(H, n * B, D)
        return torch.stack((k[:, :seq_len], v[:, :seq_len]))


def extract(
    caches: Sequence[torch.Tensor], layout: BlockLayout, block_ids: Sequence[int], seq_len: int
) -> torch.Tensor:
    """The request's KV as one host tensor ``[L, 2, H, seq_len, D]``."""
    if seq_len > len(block_ids) * layout.block_size:
        raise ValueError(
            f"seq_len {seq_len} exceeds the {len(block_ids)} blocks of {layout.block_size} tokens"
        )
    if not block_ids:
        H, D = layout.num_kv_heads, layout.head_size
        return torch.empty(len(caches), 2, H, 0, D, dtype=caches[0].dtype)
    return torch.stack([layout.read(c, block_ids, seq_len) for c in caches]).cpu()
