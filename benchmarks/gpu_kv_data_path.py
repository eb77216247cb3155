"""The KV data plane on a GPU: VRAM registered with NIXL, read device to device between two
processes on one GPU, against a bare torch device copy and a bare NIXL READ of the same bytes.

Needs a CUDA device (``make bench-gpu``); no vLLM. The AR side is a synthetic rank
(omni_runtime/devtools/synthetic_ar.py) whose paged cache has FlashAttention's layout
(``[2, blocks, block_size, heads, head_size]`` per layer: K and V in two planes) at the 7B
shape (28 layers, 4 KV heads, head size 128), in a process of its own; the receiver
(:class:`~omni_runtime.kv.transport.KVReceiver` with its staging slots in VRAM) in this one.

    python benchmarks/gpu_kv_data_path.py [--requests 4] [--prompt-tokens 1024] [--dtype float32]

Last line, one JSON object (without a CUDA device: ``not_measured``, the figures below, and
the exit status 1; otherwise times in seconds for ``--requests`` transfers of
``--prompt-tokens`` tokens, best of ``--repeats``):
  * ``torch_copy_s``: one ``copy_`` per transfer of the same bytes, device to device, one
    process (the floor);
  * ``nixl_read_s``: a bare NIXL READ per transfer from the other process's VRAM into this
    one's (UCX's cuda_ipc inside a node);
  * ``data_plane_s``: the data plane, offer to ack: the receiver reads the blocks (NIXL, VRAM
    to VRAM), assembles the payload on the device, copies it to the host payload the inbox
    stores (pinned host memory), gets the AR's commit, acks; ``data_plane_assemble_s``: the
    receiver's time assembling and copying to the host, which is most of it;
  * ratios: ``nixl_read_vs_torch_copy``, ``data_plane_vs_nixl_read`` (each: the first's
    throughput over the second's), ``data_plane_vs_host_copy``: against a bare device-to-host
    copy of the same bytes into pinned memory (what storing a host payload costs at least).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPE_7B = dict(layers=28, heads=4, head_size=128)
#: The figures of the last line (times, ratios and rates; see above).
FIGURES = ("torch_copy_s", "nixl_read_s", "data_plane_s", "data_plane_assemble_s", "host_copy_s",
           "nixl_read_vs_torch_copy", "data_plane_vs_host_copy", "data_plane_vs_nixl_read",
           "nixl_read_gb_s", "data_plane_gb_s")
BLOCK = 16


def _ar(conn, args) -> None:
    """The AR rank: a VRAM cache registered with NIXL, and a bare region for the reference."""
    import torch

    from omni_runtime.devtools.synthetic_ar import SyntheticAR
    from omni_runtime.kv.transport.nixl_agent import KVAgent

    dtype = getattr(torch, args.dtype)
    blocks = args.prompt_tokens // BLOCK
    ar = SyntheticAR(**SHAPE_7B, block_size=BLOCK, num_blocks=blocks * args.requests + 1,
                     dtype=dtype, device="cuda:0", layout="flash", pipeline="bench",
                     stage="ar")
    nbytes = args.requests * args.prompt_tokens * ar.entry_bytes
    bare_src = torch.randn(nbytes // 4, device="cuda:0")
    bare = KVAgent(f"bare-src-{os.getpid()}")
    bare.register([(bare_src.data_ptr(), nbytes, 0)], "VRAM")
    endpoint = conn.recv()
    # The bare reference reads this process's memory: its agent makes progress meanwhile (as
    # the data plane's sender does for its own while reads are in flight).
    import threading

    stop = threading.Event()

    def progress_bare() -> None:
        while not stop.wait(0.001):
            bare.progress()

    progress = threading.Thread(target=progress_bare, daemon=True)
    progress.start()
    conn.send((bare.metadata(), bare_src.data_ptr(), nbytes))
    sender = ar.sender({"next": endpoint})
    times = []
    while (cmd := conn.recv()) != "stop":
        t0 = time.perf_counter()
        for i in range(args.requests):
            sender.submit(ar.offer(f"{cmd}-{i}", range(i * blocks, (i + 1) * blocks),
                                   args.prompt_tokens), timeout_s=60)
        answers: dict = {}
        while len(answers) < args.requests:
            if not sender.wait(60):
                raise RuntimeError("transfers not answered within 60 s")
            answers.update(sender.poll())
        failed = {k: v for k, v in answers.items() if v[1] is not None}
        if failed:
            raise RuntimeError(f"transfers failed: {failed}")
        times.append(time.perf_counter() - t0)
        conn.send(times[-1])
    stop.set()
    progress.join()
    sender.close()
    ar.close()
    bare.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    import numpy as np
    import torch

    if not torch.cuda.is_available():
        # The last line is still the one JSON object: what was not measured, and why.
        print(json.dumps({"not_measured": list(FIGURES), "reason": "needs a CUDA device; none here"}))
        sys.exit(1)
    from omni_runtime.kv.transport import KVInbox, KVReceiver
    from omni_runtime.kv.transport.nixl_agent import DONE, ERROR, KVAgent

    started = time.monotonic()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_ar, args=(child, args), daemon=True)
    proc.start()
    inbox = KVInbox(max_bytes=8 << 30)
    # Staging in VRAM, a slot per transfer, each the size of one transfer.
    dtype = getattr(torch, args.dtype)
    per_transfer = (SHAPE_7B["layers"] * 2 * SHAPE_7B["heads"] * SHAPE_7B["head_size"]
                    * args.prompt_tokens * torch.empty((), dtype=dtype).element_size())
    rx = KVReceiver("tcp://127.0.0.1:0", inbox, pipeline="bench", stage="next",
                    max_payload_bytes=4 << 30, staging_device="cuda:0",
                    slot_bytes=per_transfer + (1 << 20), slots=args.requests).start()
    try:
        parent.send(rx.endpoint)
        metadata, src_addr, nbytes = parent.recv()
        size = nbytes // args.requests

        # 1. The floor: a device copy of the same bytes, in one process.
        src = torch.randn(nbytes // 4, device="cuda:0")
        dst = torch.empty_like(src)
        copies = []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(args.requests):
                n = size // 4
                dst[i * n:(i + 1) * n].copy_(src[i * n:(i + 1) * n])
            torch.cuda.synchronize()
            copies.append(time.perf_counter() - t0)
        # The floor of storing a host payload: a device-to-host copy into pinned memory.
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        d2h = []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            host.copy_(src.view(torch.uint8))
            d2h.append(time.perf_counter() - t0)
        del src, dst, host

        # 2. A bare NIXL READ per transfer, VRAM to VRAM, from the AR's process.
        reader = KVAgent(f"bare-reader-{os.getpid()}")
        landing = torch.empty(size, dtype=torch.uint8, device="cuda:0")
        reader.register([(landing.data_ptr(), size, 0)], "VRAM")
        name = reader.add_remote(metadata)
        local = np.array([[landing.data_ptr(), size, 0]], dtype=np.uint64)
        reads = []
        for _ in range(args.repeats + 1):  # the first read wires the connection up
            t0 = time.perf_counter()
            for i in range(args.requests):
                remote = np.array([[src_addr + i * size, size, 0]], dtype=np.uint64)
                handle = reader.read(local, "VRAM", remote, "VRAM", name)
                while (state := reader.state(handle)) != DONE:
                    if state == ERROR:
                        raise RuntimeError("bare NIXL READ failed")
                reader.release(handle)
            reads.append(time.perf_counter() - t0)
        reads = reads[1:]

        # 3. The data plane, offer to ack (a warm-up round first: hello and wire-up).
        ours, assemble_s = [], []
        parent.send("warm")
        parent.recv()
        for rep in range(args.repeats):
            for entry in inbox.list():
                inbox.get(entry["request_id"])
            a0 = rx.assemble_seconds
            parent.send(f"round{rep}")
            ours.append(parent.recv())
            assemble_s.append(rx.assemble_seconds - a0)
        parent.send("stop")
        # The payloads are right: the last round's first one against the AR's blocks is
        # checked in tests on CPU; here its size and finiteness.
        payload = inbox.get(f"round{args.repeats - 1}-0")
        assert payload is not None and payload.seq_len == args.prompt_tokens
        assert np.isfinite(payload.as_float32()).all()
    finally:
        rx.close()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    best = min
    result = {
        "bytes_per_round": nbytes,
        "dtype": args.dtype,
        "device": torch.cuda.get_device_name(0),
        "torch_copy_s": round(best(copies), 6),
        "nixl_read_s": round(best(reads), 6),
        "data_plane_s": round(best(ours), 6),
        "data_plane_assemble_s": round(best(assemble_s), 6),
        "host_copy_s": round(best(d2h), 6),
        "nixl_read_vs_torch_copy": round(best(copies) / best(reads), 4),
        "data_plane_vs_host_copy": round(best(d2h) / best(ours), 4),
        "data_plane_vs_nixl_read": round(best(reads) / best(ours), 4),
        "nixl_read_gb_s": round(nbytes / best(reads) / 1e9, 2),
        "data_plane_gb_s": round(nbytes / best(ours) / 1e9, 2),
        "seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
