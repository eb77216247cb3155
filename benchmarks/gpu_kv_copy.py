"""The GPU half of the KV data path, measured with PyTorch and the connector's copier: does copying a
7B-shaped transfer's KV to host on a side CUDA stream stall the engine's stream?

A synthetic paged KV cache in the FlashAttention layout (per layer
``[2, num_blocks, block_size, kv_heads, head_size]``) lives on ``cuda``. A simulated engine
step is a chain of matmuls per layer (standing in for the forward) that writes the layer's
cache. The transfer is copied by the omni KV connector's own ``SideStreamCopier``
(``omni_runtime/kv/device_copy.py``), as the connector's worker side drives it: at the start
of the step an event is recorded on the engine's stream; a side stream waits on it, gathers
each transfer's blocks of every layer (one ``index_select`` per layer into a device staging
buffer) and copies them to a pinned host buffer (``non_blocking``); at the end of the step the
engine's stream waits on the device for the gathers only, and a thread ships each transfer
once its host copy is done. The blocks copied are ones the step does not write, as in the
engine (a transfer covers tokens that earlier steps wrote).

Prints the mean step time without a transfer, with the transfer copied on the side stream,
and with the copy done synchronously in the step (the old design), and as its last line one
JSON object: ``step_ratio_side_stream`` (target <= 1.03), ``step_ratio_sync`` and the copy
bandwidth. Run: ``python benchmarks/gpu_kv_copy.py`` (seconds on one GPU). Without CUDA it
exits with status 2 and says so: it is not runnable on this project's CPU-only machines.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omni_runtime.kv.device_copy import SideStreamCopier  # noqa: E402

LAYERS, KV_HEADS, HEAD_SIZE, HIDDEN = 28, 4, 128, 3584  # the 7B KV shape
BLOCK_SIZE = 16


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--transfers", type=int, default=4, help="concurrent transfers")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-tokens", type=int, default=2048, help="tokens per simulated step")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_kv_copy.py needs a CUDA device (torch.cuda.is_available() is False); "
              "it does not run on CPU-only machines", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    blocks_per_transfer = -(-args.seq_len // BLOCK_SIZE)
    num_blocks = blocks_per_transfer * args.transfers * 2 + 64
    caches = [torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, device=dev, dtype=dtype)
              for _ in range(LAYERS)]
    weights = [torch.randn(HIDDEN, HIDDEN, device=dev, dtype=dtype) / HIDDEN ** 0.5
               for _ in range(LAYERS)]
    x0 = torch.randn(args.batch_tokens, HIDDEN, device=dev, dtype=dtype)
    # The step writes slots past the transferred blocks (as a forward writes new tokens).
    first_free = blocks_per_transfer * args.transfers * BLOCK_SIZE
    write_slots = first_free + torch.arange(args.batch_tokens, device=dev) % (
        num_blocks * BLOCK_SIZE - first_free)
    ids = [torch.arange(i * blocks_per_transfer, (i + 1) * blocks_per_transfer, device=dev)
           for i in range(args.transfers)]
    dev_bufs = [torch.empty(LAYERS, 2, blocks_per_transfer, BLOCK_SIZE, KV_HEADS, HEAD_SIZE,
                            device=dev, dtype=dtype) for _ in range(args.transfers)]
    host_bufs = [torch.empty(b.shape, dtype=dtype, pin_memory=True) for b in dev_bufs]
    shipped = threading.Semaphore(0)
    failures: list[str] = []

    def ship(job, error):
        if error is not None:
            failures.append(error)
        shipped.release()

    copier = SideStreamCopier(dev, ship)
    jobs = list(range(args.transfers))

    def gather(i, layer):
        torch.index_select(caches[layer], 1, ids[i], out=dev_bufs[i][layer])
    nbytes = sum(b.numel() * b.element_size() for b in host_bufs)

    def step(mode: str) -> float:
        main_stream = torch.cuda.current_stream()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        x = x0
        if mode == "side":
            copier.start(jobs, gather, LAYERS, staging=lambda i: dev_bufs[i],
                         host=lambda i: host_bufs[i])
        for layer in range(LAYERS):
            x = torch.tanh(x @ weights[layer])
            flat = caches[layer].view(2, -1, KV_HEADS, HEAD_SIZE)
            kv = x[:, : KV_HEADS * HEAD_SIZE].reshape(-1, KV_HEADS, HEAD_SIZE)
            flat[0].index_copy_(0, write_slots, kv)
            if mode == "sync":
                for i in range(args.transfers):
                    torch.index_select(caches[layer], 1, ids[i], out=dev_bufs[i][layer])
                    host_bufs[i][layer].copy_(dev_bufs[i][layer], non_blocking=False)
        if mode == "side":
            copier.end_step()
        main_stream.synchronize()  # the step ends when the engine's stream is done
        elapsed = time.perf_counter() - t0
        if mode == "side":  # (outside the step) every transfer reaches its host buffer
            for _ in jobs:
                if not shipped.acquire(timeout=30):
                    raise RuntimeError("a side-stream copy was not shipped within 30 s")
            if failures:
                raise RuntimeError(f"side-stream copies failed: {failures}")
        return elapsed

    for mode in ("off", "side", "sync"):
        step(mode)  # warm-up
    times: dict[str, list[float]] = {"off": [], "side": [], "sync": []}
    for _ in range(args.steps):
        for mode in ("off", "side", "sync"):  # interleaved
            times[mode].append(step(mode))
    t0 = time.perf_counter()
    step("sync")
    copy_s = time.perf_counter() - t0 - sum(times["off"]) / len(times["off"])
    copier.close()
    # The copier's host buffers hold exactly the blocks (checked once, outside the timing).
    for i in jobs:
        for layer in (0, LAYERS - 1):
            expected = caches[layer].index_select(1, ids[i]).cpu()
            if not torch.equal(host_bufs[i][layer], expected):
                raise RuntimeError(f"transfer {i} layer {layer}: host copy differs from the cache")
    mean = {k: sum(v) / len(v) for k, v in times.items()}
    for k, v in mean.items():
        print(f"{k:>5}: mean step {v * 1e3:.2f} ms")
    print(json.dumps({
        "step_ratio_side_stream": round(mean["side"] / mean["off"], 4),
        "step_ratio_sync": round(mean["sync"] / mean["off"], 4),
        "transfer_bytes": nbytes,
        "sync_copy_gbps": round(nbytes / max(copy_s, 1e-9) / 1e9, 2),
        "target_step_ratio_side_stream": 1.03,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
