"""From blocks as the AR's cache holds them to the payload ``[layers, 2, H, seq_len, D]``.

The receiver reads a transfer's blocks as they are (NIXL moves bytes, it does not reorder
them): per layer and plane, the transfer's blocks one after another, into a device staging
slot a chunk at a time, or on the host into the payload's own memory, the whole transfer
(:class:`StagedKV`, assembled when a consumer takes it). This module turns staged layers
into their slice of the payload, with the block format the AR
announced in its hello (:class:`~.protocol.BlockFormat`): for an affine format (every layout
vLLM 0.32 writes) one strided copy per K and V per chunk (plus one for a partial last block),
else one gather through the element index. On the host the copy is numpy's, on the calling
thread (:func:`assemble_host`): torch's would fan a copy this size out to its OpenMP pool,
whose barrier waits for every thread of it, each a core another process may be busy on.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numpy.lib.stride_tricks import as_strided

from omni_runtime.kv.transport.payload import DTYPES
from omni_runtime.kv.transport.protocol import Affine, BlockFormat

#: Unsigned integers of each element size: the host copy moves bits, whatever the dtype
#: (numpy has no bfloat16).
_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def payload_view(kv: np.ndarray, dtype: str) -> torch.Tensor:
    """A torch view of a payload array (bfloat16 is carried as uint16 bits)."""
    t = torch.from_numpy(kv)
    return t.view(torch.bfloat16) if dtype == "bfloat16" else t


def assemble_chunk(staged: torch.Tensor, fmt: BlockFormat, num_layers: int, num_blocks: int,
                   tokens: int, out: torch.Tensor) -> None:
    """``staged``: bytes of ``num_layers`` layers x ``planes`` x ``num_blocks`` blocks, in
    that order (a uint8 tensor on the staging device); ``out``: the payload's slice for them,
    ``[num_layers, 2, H, tokens, D]`` (``tokens <= num_blocks * block_size``), any device."""
    dtype = TORCH_DTYPES[fmt.dtype]
    flat = staged[: num_layers * fmt.planes * num_blocks * fmt.block_bytes].view(dtype)
    target = out if out.device == flat.device else torch.empty(
        out.shape, dtype=out.dtype, device=flat.device)
    for kv, (affine, index) in enumerate(((fmt.k, fmt.k_index), (fmt.v, fmt.v_index))):
        dst = target[:, kv]
        if affine is not None:
            _copy_affine(flat, affine, fmt, num_layers, num_blocks, tokens, dst)
        else:
            _gather(flat, index, fmt, num_layers, num_blocks, tokens, dst)
    if target is not out:
        out.copy_(target, non_blocking=False)


def _copy_affine(flat: torch.Tensor, a: Affine, fmt: BlockFormat, layers: int, blocks: int,
                 tokens: int, dst: torch.Tensor) -> None:
    H, B, D, numel = fmt.num_kv_heads, fmt.block_size, fmt.head_size, fmt.block_numel
    plane_numel = blocks * numel
    layer_stride = fmt.planes * plane_numel
    # as_strided counts from the storage's start, not the view's.
    origin = flat.storage_offset() + a.plane * plane_numel + a.offset
    full, rest = divmod(tokens, B)
    if full:
        src = flat.as_strided((layers, H, full, B, D),
                              (layer_stride, a.head, numel, a.token, a.dim), origin)
        dst[:, :, : full * B].view(layers, H, full, B, D).copy_(src)
    if rest:
        src = flat.as_strided((layers, H, rest, D), (layer_stride, a.head, a.token, a.dim),
                              origin + full * numel)
        dst[:, :, full * B: tokens].copy_(src)


def _gather(flat: torch.Tensor, index: tuple[int, ...], fmt: BlockFormat, layers: int,
            blocks: int, tokens: int, dst: torch.Tensor) -> None:
    H, B, D, numel = fmt.num_kv_heads, fmt.block_size, fmt.head_size, fmt.block_numel
    index = torch.tensor(index, dtype=torch.int64, device=flat.device).view(H, B, D)
    plane, inner = index // numel, index % numel
    t = torch.arange(tokens, device=flat.device)
    offsets = (plane[:, t % B, :] * (blocks * numel) + inner[:, t % B, :]
               + (t // B).view(1, tokens, 1) * numel).reshape(-1)
    per_layer = flat.view(layers, fmt.planes * blocks * numel)
    dst.copy_(per_layer.index_select(1, offsets).view(layers, H, tokens, D))


def assemble_host(staged: np.ndarray, fmt: BlockFormat, num_layers: int, num_blocks: int,
                  tokens: int, out: np.ndarray) -> None:
    """:func:`assemble_chunk` for host memory, with numpy on the calling thread: ``staged``
    uint8, ``out`` any dtype of the format's element size (bfloat16 as uint16 bits)."""
    bits = _BITS[fmt.itemsize]
    flat = staged[: num_layers * fmt.planes * num_blocks * fmt.block_bytes].view(bits)
    target = out.view(bits)
    for kv, (affine, index) in enumerate(((fmt.k, fmt.k_index), (fmt.v, fmt.v_index))):
        dst = target[:, kv]
        if affine is not None:
            _copy_affine_host(flat, affine, fmt, num_layers, num_blocks, tokens, dst)
        else:
            _gather_host(flat, index, fmt, num_layers, num_blocks, tokens, dst)


def _copy_affine_host(flat: np.ndarray, a: Affine, fmt: BlockFormat, layers: int, blocks: int,
                      tokens: int, dst: np.ndarray) -> None:
    H, B, D, numel = fmt.num_kv_heads, fmt.block_size, fmt.head_size, fmt.block_numel
    item = flat.itemsize
    layer_stride = fmt.planes * blocks * numel * item
    origin = a.plane * blocks * numel + a.offset
    full, rest = divmod(tokens, B)
    if full:
        src = as_strided(flat[origin:], (layers, H, full, B, D),
                         (layer_stride, a.head * item, numel * item, a.token * item,
                          a.dim * item))
        s0, s1, s2, s3 = dst.strides
        # The token axis split into (block, token in block): a view, written in place.
        as_strided(dst, (layers, H, full, B, D), (s0, s1, B * s2, s2, s3))[...] = src
    if rest:
        dst[:, :, full * B: tokens] = as_strided(
            flat[origin + full * numel:], (layers, H, rest, D),
            (layer_stride, a.head * item, a.token * item, a.dim * item))


def _gather_host(flat: np.ndarray, index: tuple[int, ...], fmt: BlockFormat, layers: int,
                 blocks: int, tokens: int, dst: np.ndarray) -> None:
    H, B, D, numel = fmt.num_kv_heads, fmt.block_size, fmt.head_size, fmt.block_numel
    index = np.asarray(index, dtype=np.int64).reshape(H, B, D)
    plane, inner = index // numel, index % numel
    t = np.arange(tokens)
    offsets = (plane[:, t % B, :] * (blocks * numel) + inner[:, t % B, :]
               + (t // B).reshape(1, tokens, 1) * numel).reshape(-1)
    per_layer = flat.reshape(layers, fmt.planes * blocks * numel)
    dst[...] = per_layer[:, offsets].reshape(layers, H, tokens, D)


@dataclass(eq=False)
class StagedKV:
    """A transfer's KV as a host receiver read it, not yet assembled: ``raw`` holds
    ``num_layers`` x ``planes`` x ``num_blocks`` blocks in that order (the staged order
    above, the whole transfer at once), in the AR's block format ``fmt``. The payload's
    ``[layers, 2, H, seq_len, D]`` array is made from it on first use (:meth:`into`)."""

    raw: np.ndarray  # uint8, on registered landing memory (landing.py)
    fmt: BlockFormat
    num_layers: int
    num_blocks: int
    seq_len: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.fmt.num_kv_heads, self.seq_len, self.fmt.head_size)

    @property
    def dtype(self) -> np.dtype:
        return DTYPES[self.fmt.dtype]

    def into(self, out: np.ndarray) -> None:
        """Assemble into ``out`` (this shape and dtype; any strides a slice gives)."""
        assemble_host(self.raw, self.fmt, self.num_layers, self.num_blocks, self.seq_len, out)
