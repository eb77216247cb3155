"""Reading a request's K and V out of vLLM's paged KV cache, whatever the block layout.

The payload layout (documented in docs/connector.md) is one array
``[num_layers, 2 (K, V), num_kv_heads, seq_len, head_size]``: per layer, Hugging Face's
``past_key_values`` order, so a receiver needs nothing of vLLM to use it.

vLLM 0.32 views each layer's cache as ``[num_blocks, num_kv_heads, block_size, content]``,
but how K and V fill a block's content is the attention backend's own affair, and varies
(the CPU kernels transpose keys for the vector ISA and pack them for AMX; GPU backends have
their own arrangements). Rather than hard-coding each variant, :class:`ProbedBlockLayout`
learns it from the backend itself: it writes probe values through the layer's own
``impl.do_kv_cache_update`` (what the forward pass uses) into a scratch block and records where
every (token, head, dim) element lands. Decoding is then one gather, exact by construction for
any layout that is a permutation (every non-quantized one). The tests check it against Hugging
Face transformers on the CPU backend; no GPU runs in this project's CI.
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


class ProbedBlockLayout(BlockLayout):
    """The block interior learned from the attention backend's own cache write.

    ``layer`` is one of the model's attention layers (its ``impl.do_kv_cache_update`` is what
    the forward pass uses to store K and V); ``cache`` one layer's cache tensor, a view
    ``[blocks, kv_heads, tokens, content]`` as vLLM 0.32 allocates it. The probe writes into
    a scratch block of the same strides and device, so what it learns holds for the real one.
    """

    def __init__(self, layer: torch.nn.Module, cache: torch.Tensor, num_kv_heads: int, head_size: int):
        self.num_kv_heads, self.head_size = num_kv_heads, head_size
        self.block_size = cache.shape[2]
        self.block_numel = cache[0].numel()
        self._k_index, self._v_index = self._probe(layer, cache)

    def _probe(self, layer: torch.nn.Module, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        H, B, D = self.num_kv_heads, self.block_size, self.head_size
        n = B * H * D
        device, dtype = cache.device, cache.dtype
        # Element ids 1..n (0 marks "not written"), written bit by bit as 0/1 values, which
        # every cache dtype (bf16 included) represents exactly.
        ids = torch.arange(1, n + 1, dtype=torch.int64, device=device).view(B, H, D)
        k_found = torch.zeros(cache[0].numel(), dtype=torch.int64, device=device)
        v_found = torch.zeros_like(k_found)
        slots = torch.arange(B, dtype=torch.int64, device=device)
        zeros = torch.zeros(B, H, D, dtype=dtype, device=device)
        for bit in range(n.bit_length()):
            plane = ((ids >> bit) & 1).to(dtype)
            for found, key, value in ((k_found, plane, zeros), (v_found, zeros, plane)):
                scratch = torch.zeros_like(cache[:1])  # same strides: same physical layout
                layer.impl.do_kv_cache_update(layer, key, value, scratch, slots)
                found |= (scratch[0].reshape(-1) != 0).to(torch.int64) << bit
        k_index = self._invert(k_found, n).view(B, H, D).permute(1, 0, 2)
        v_index = self._invert(v_found, n).view(B, H, D).permute(1, 0, 2)
        return k_index, v_index

    @staticmethod
    def _invert(found: torch.Tensor, n: int) -> torch.Tensor:
        """found[offset] = element id written there; returns the offset of each id 1..n."""
        where = torch.nonzero(found).view(-1)
        element = found[where]
        if element.numel() != n or torch.unique(element).numel() != n:
            raise UnsupportedKVCache(
                "the KV cache layout is not a permutation of its elements; extraction is "
                "not supported for this cache (quantized?)"
            )
        offsets = torch.empty(n, dtype=torch.int64, device=found.device)
        offsets[element - 1] = where
        return offsets

    def read(self, cache: torch.Tensor, block_ids: Sequence[int], seq_len: int) -> torch.Tensor:
        H, B, D = self.num_kv_heads, self.block_size, self.head_size
        index = torch.as_tensor(block_ids, dtype=torch.int64, device=cache.device)
        blocks = cache[index].reshape(len(block_ids), -1)  # each block in logical order
        n = blocks.shape[0]
        # [n, H, B, D] for K and V, then the tokens of consecutive blocks side by side.
        k = blocks[:, self._k_index].permute(1, 0, 2, 3).reshape(H, n * B, D)
        v = blocks[:, self._v_index].permute(1, 0, 2, 3).reshape(H, n * B, D)
        return torch.stack((k[:, :seq_len], v[:, :seq_len]))


def gather_index(layout: ProbedBlockLayout, block_ids: Sequence[int], seq_len: int,
                 device: torch.device | str = "cpu") -> torch.Tensor:
    """Flat offsets into one layer's cache (``cache.view(-1)``) of the elements of
    ``[2, H, seq_len, D]``, so that one ``index_select`` per layer gathers a transfer's K and V
    in the payload's order. Every layer's cache has the same shape (one KV cache group), so
    one index serves all layers."""
    B = layout.block_size
    if seq_len > len(block_ids) * B:
        raise ValueError(f"seq_len {seq_len} exceeds the {len(block_ids)} blocks of {B} tokens")
    H, D = layout.num_kv_heads, layout.head_size
    inner = torch.stack((layout._k_index, layout._v_index)).to(device)  # [2, H, B, D]
    block_numel = layout.block_numel
    tokens = torch.arange(seq_len, device=device)
    blocks = torch.as_tensor(list(block_ids), dtype=torch.int64, device=device)
    base = (blocks[tokens // B] * block_numel).view(1, 1, seq_len, 1)
    return (inner[:, :, tokens % B, :] + base).reshape(-1)


def gather_rows(index: torch.Tensor, head_size: int) -> tuple[torch.Tensor, int]:
    """``index`` (flat offsets, from :func:`gather_index`) as runs: the largest ``run``
    dividing ``head_size`` such that the offsets come in aligned runs of ``run`` consecutive
    elements, and the row of each run in ``cache.view(-1, run)``. Gathering rows of
    ``run`` elements is a memcpy per row instead of an indexed load per element (about 20x
    faster at run 128 than at run 1 on the CPU here)."""
    run = head_size
    while run > 1:
        if head_size % run == 0 and index.numel() % run == 0:
            rows = index.view(-1, run)
            first = rows[:, :1]
            if bool((first % run == 0).all()) and bool(
                (rows - first == torch.arange(run, device=index.device)).all()
            ):
                return (first.view(-1) // run).contiguous(), run
        run //= 2
    return index, 1


def extract(
    caches: Sequence[torch.Tensor], layout: BlockLayout, block_ids: Sequence[int], seq_len: int
) -> torch.Tensor:
    """The request's KV as one host tensor ``[L, 2, H, seq_len, D]`` (the reference the
    connector's per-layer gather is tested against)."""
    if seq_len > len(block_ids) * layout.block_size:
        raise ValueError(
            f"seq_len {seq_len} exceeds the {len(block_ids)} blocks of {layout.block_size} tokens"
        )
    if not block_ids:
        H, D = layout.num_kv_heads, layout.head_size
        return torch.empty(len(caches), 2, H, 0, D, dtype=caches[0].dtype)
    return torch.stack([layout.read(c, block_ids, seq_len) for c in caches]).cpu()


def affine_strides(layout: ProbedBlockLayout) -> tuple[tuple[int, int, int, int], ...] | None:
    """For K and V, ``(offset, head_stride, token_stride, dim_stride)`` such that element
    (h, t, d) of a block sits at ``offset + h*head_stride + t*token_stride + d*dim_stride``
    inside the block, when the probed layout is that regular (every layout vLLM 0.32's
    attention backends write here: the CPU one keeps K transposed ``[D, B]`` and V ``[B, D]``
    per head); None otherwise. Then a run of consecutive blocks is one strided view of the
    cache, and :func:`copy_blocks` copies it with one ``copy_`` instead of an indexed load per
    element (the probed index of a transposed K has runs of one element: ~9x slower here)."""
    out = []
    for index in (layout._k_index, layout._v_index):  # [H, B, D]
        H, B, D = index.shape
        base = int(index[0, 0, 0])
        sh = int(index[1, 0, 0]) - base if H > 1 else 0
        st = int(index[0, 1, 0]) - base if B > 1 else 0
        sd = int(index[0, 0, 1]) - base if D > 1 else 0
        grid = (base + torch.arange(H).view(H, 1, 1) * sh + torch.arange(B).view(1, B, 1) * st
                + torch.arange(D).view(1, 1, D) * sd)
        if min(sh, st, sd) < 0 or not torch.equal(grid, index.cpu()):
            return None
        out.append((base, sh, st, sd))
    return tuple(out)


def block_runs(block_ids: Sequence[int], num_blocks: int) -> list[tuple[int, int, int]]:
    """The first ``num_blocks`` of ``block_ids`` as runs of consecutive ids:
    ``(first payload block, first cache block, length)``."""
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(block_ids[:num_blocks]):
        if runs and runs[-1][1] + runs[-1][2] == b:
            start, first, n = runs[-1]
            runs[-1] = (start, first, n + 1)
        else:
            runs.append((i, int(b), 1))
    return runs


def copy_blocks(cache: torch.Tensor, strides: tuple[tuple[int, int, int, int], ...],
                runs: list[tuple[int, int, int]], block_size: int, out: torch.Tensor) -> None:
    """One layer's K and V of a transfer into ``out`` ``[2, H, seq_len, D]``: per run of
    consecutive blocks and per K/V, one strided view of the cache copied with one
    ``copy_`` (a transposed K is transposed by the copy)."""
    flat = cache.view(-1)
    origin = flat.storage_offset()  # as_strided's offsets are the storage's, not the view's
    block_numel = cache[0].numel()
    _, H, seq_len, D = out.shape
    B = block_size
    for kv, (base, sh, st, sd) in enumerate(strides):
        dst = out[kv]
        for start, first, n in runs:
            t0 = start * B
            tokens = min(n * B, seq_len - t0)
            full, rest = divmod(tokens, B)
            offset = origin + first * block_numel + base
            if full:
                dst[:, t0:t0 + full * B].view(H, full, B, D).copy_(
                    flat.as_strided((H, full, B, D), (sh, block_numel, st, sd), offset))
            if rest:
                dst[:, t0 + full * B:t0 + tokens].copy_(
                    flat.as_strided((H, rest, D), (sh, st, sd), offset + full * block_numel))
