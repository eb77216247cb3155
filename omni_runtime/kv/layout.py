"""Where K and V sit in vLLM's paged KV cache, learned from the attention backend itself.

The receiving stage reads a transfer's blocks as they are (NIXL moves bytes) and assembles
the payload ``[num_layers, 2 (K, V), num_kv_heads, seq_len, head_size]`` from them, so it
needs the block format: how a layer's cache splits into blocks, and where each (head, token,
dim) element of K and V lands in a block. That is the attention backend's own affair and
varies (the CPU kernels keep K transposed ``[head_size, block_size]`` per head and V as
``[block_size, head_size]``, inside one block; FlashAttention keeps K and V in two planes
``[2, num_blocks, block_size, heads, head_size]``). Rather than hard-coding each variant,
:func:`probe_block_format` writes probe values through the layer's own
``impl.do_kv_cache_update`` (what the forward pass uses) into a scratch cache of one block and
records where every element lands: exact by construction for any layout that is a
permutation (every non-quantized one). The result is described as a
:class:`~omni_runtime.kv.transport.protocol.BlockFormat`, affine when it is one.
"""

from __future__ import annotations

import math

import torch

from omni_runtime.kv.transport.protocol import Affine, BlockFormat

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class UnsupportedKVCache(RuntimeError):
    """The KV cache cannot be read for a transfer (quantized, unknown layout, ...)."""


def block_dim(cache: torch.Tensor, num_blocks: int) -> int:
    """The dimension of a layer's cache that indexes blocks: the first of size
    ``num_blocks`` (vLLM allocates exactly the configured number of blocks)."""
    for d, size in enumerate(cache.shape):
        if size == num_blocks:
            return d
    raise UnsupportedKVCache(f"no dimension of the KV cache view {tuple(cache.shape)} has the "
                             f"{num_blocks} blocks vLLM allocated")


def probe_block_format(layer: torch.nn.Module, cache: torch.Tensor, num_blocks: int,
                       block_size: int, num_kv_heads: int, head_size: int) -> BlockFormat:
    """The block format of ``cache`` (one layer's, as vLLM allocated it), probed through
    ``layer``'s own cache write. Planes: the dimensions before the block dimension (one
    plane when K and V share a block, two when they are split)."""
    if cache.dtype not in DTYPE_NAMES:
        raise UnsupportedKVCache(f"KV cache dtype {cache.dtype} cannot be read for a transfer "
                                 "(quantized caches are not supported)")
    if not cache.is_contiguous():
        raise UnsupportedKVCache(f"the KV cache view {tuple(cache.shape)} is not contiguous")
    d = block_dim(cache, num_blocks)
    planes = math.prod(cache.shape[:d])
    block_numel = math.prod(cache.shape[d + 1:])
    H, B, D = num_kv_heads, block_size, head_size
    n = H * B * D
    if 2 * n > planes * block_numel:
        raise UnsupportedKVCache(f"a block of {planes} x {block_numel} elements cannot hold K "
                                 f"and V of {H} heads x {B} tokens x {D}")
    shape = list(cache.shape)
    shape[d] = 1
    device, dtype = cache.device, cache.dtype
    # Element ids 1..n (0 marks "not written"), written bit by bit as 0/1 values, which every
    # cache dtype (bf16 included) represents exactly.
    ids = torch.arange(1, n + 1, dtype=torch.int64, device=device).view(B, H, D)
    k_found = torch.zeros(planes * block_numel, dtype=torch.int64, device=device)
    v_found = torch.zeros_like(k_found)
    slots = torch.arange(B, dtype=torch.int64, device=device)
    zeros = torch.zeros(B, H, D, dtype=dtype, device=device)
    for bit in range(n.bit_length()):
        plane = ((ids >> bit) & 1).to(dtype)
        for found, key, value in ((k_found, plane, zeros), (v_found, zeros, plane)):
            scratch = torch.zeros(shape, dtype=dtype, device=device)
            layer.impl.do_kv_cache_update(layer, key, value, scratch, slots)
            found |= (scratch.reshape(-1) != 0).to(torch.int64) << bit
    # Offsets into [planes, block_numel] (one block of each plane), per (h, t, d).
    k_index = _invert(k_found, n).view(B, H, D).permute(1, 0, 2).reshape(-1)
    v_index = _invert(v_found, n).view(B, H, D).permute(1, 0, 2).reshape(-1)
    dtype_name = DTYPE_NAMES[dtype]
    k, v = _affine(k_index, H, B, D, block_numel), _affine(v_index, H, B, D, block_numel)
    return BlockFormat(
        block_size=B, num_kv_heads=H, head_size=D, dtype=dtype_name, block_numel=block_numel,
        planes=planes, k=k, v=v,
        k_index=None if k is not None else tuple(k_index.tolist()),
        v_index=None if v is not None else tuple(v_index.tolist()),
    )


def _invert(found: torch.Tensor, n: int) -> torch.Tensor:
    """found[offset] = element id written there; returns the offset of each id 1..n."""
    where = torch.nonzero(found).view(-1)
    element = found[where]
    if element.numel() != n or torch.unique(element).numel() != n:
        raise UnsupportedKVCache(
            "the KV cache layout is not a permutation of its elements; it cannot be read for "
            "a transfer (quantized?)"
        )
    offsets = torch.empty(n, dtype=torch.int64, device=found.device)
    offsets[element - 1] = where
    return offsets.cpu()


def _affine(index: torch.Tensor, H: int, B: int, D: int, block_numel: int) -> Affine | None:
    """``index`` (offsets into [planes, block_numel] per (h, t, d)) as an affine map inside
    one plane, when it is one."""
    grid = index.view(H, B, D)
    base = int(grid[0, 0, 0])
    sh = int(grid[1, 0, 0]) - base if H > 1 else 0
    st = int(grid[0, 1, 0]) - base if B > 1 else 0
    sd = int(grid[0, 0, 1]) - base if D > 1 else 0
    plane, offset = divmod(base, block_numel)
    expect = (base + torch.arange(H).view(H, 1, 1) * sh + torch.arange(B).view(1, B, 1) * st
              + torch.arange(D).view(1, 1, D) * sd)
    if min(sh, st, sd) < 0 or not torch.equal(expect, grid):
        return None
    last = offset + (H - 1) * sh + (B - 1) * st + (D - 1) * sd
    if last >= block_numel:
        return None  # spans planes: not one strided view
    return Affine(offset=offset, head=sh, token=st, dim=sd, plane=plane)
