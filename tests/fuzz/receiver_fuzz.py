#!/usr/bin/env python3
"""Coverage-guided fuzzing (atheris) of the KV receiver's whole handling path: each input is
turned into a ZeroMQ multipart message, sent from a DEALER to a real KVReceiver over TCP on
127.0.0.1, and must be answered; the receiver must stay alive and its inbox within its bound.

    python tests/fuzz/receiver_fuzz.py [libFuzzer flags] [CORPUS_DIR ...]
    python tests/fuzz/receiver_fuzz.py --write-seeds DIR    # valid transfers as seeds

Input format (so mutations reach every field): byte 0 picks the mode.
* raw (bit 7 clear): ``n = byte0 % 5`` frames (0 means one empty frame), each but the last
  prefixed by a 2-byte big-endian length; the last frame takes the rest.
* field (bit 7 set): a valid transfer whose header field number ``byte1`` is replaced by a
  JSON value built from the remaining bytes (an int, a float, a string, a list, an object of
  such, null or a boolean), optionally with a truncated or flipped data frame.
Run by tests/runtime/test_fuzz_receiver.py for a bounded time, longer by ``make fuzz``.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import struct
import sys
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["omni_runtime.kv.transport"]):
    import numpy as np
    import zmq

    from omni_runtime.kv.transport import KVInbox, KVPayload, KVReceiver
    from omni_runtime.kv.transport.wire import (
        HEADER_FIELDS,
        REJECT_CODES,
        checksum,
        data_view,
        encode_header,
    )

STAGE = "fuzzed"
INBOX_BYTES = 256 << 10
MAX_PAYLOAD = 64 << 10
REPLY_WAIT_MS = 10_000
FIELDS = sorted(HEADER_FIELDS) + ["external_request_id", "unknown_field"]
#: RSS the process may grow by after warm-up (libFuzzer's -rss_limit_mb bounds it too).
RSS_GROWTH_LIMIT_MB = 256


def valid_frames(rid: str = "seed", seq_len: int = 3, algo: str = "crc32") -> list[bytes]:
    kv = np.arange(2 * 2 * 1 * seq_len * 4, dtype=np.float32).reshape(2, 2, 1, seq_len, 4)
    payload = KVPayload(rid, seq_len, kv, pipeline="p", from_stage="ar",
                        trace_context={"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"})
    data = data_view(payload.kv)
    return [encode_header(payload, transfer_id=1, to_stage=STAGE,
                          digest=checksum(algo, data)), bytes(data)]


def json_value(data: bytes, depth: int = 0):
    if not data:
        return None
    kind, rest = data[0] % 8, data[1:]
    if kind == 0:
        return int.from_bytes(rest[:9], "big", signed=True) if rest else 0
    if kind == 1:
        return struct.unpack(">d", rest[:8].ljust(8, b"\0"))[0] if len(rest) >= 8 else -0.5
    if kind == 2:
        return rest.decode("utf-8", "replace")
    if kind == 3 and depth < 3:
        return [json_value(rest[i:i + 4], depth + 1) for i in range(0, min(len(rest), 24), 4)]
    if kind == 4 and depth < 3:
        return {rest[:4].decode("latin-1"): json_value(rest[4:], depth + 1),
                "traceparent": json_value(rest[4:8], depth + 1)}
    if kind == 5:
        return bool(rest and rest[0] & 1)
    if kind == 6:
        return [int(b) for b in rest[:6]]  # shape-like lists
    return None


def frames_from(data: bytes) -> list[bytes]:
    if not data:
        return [b""]
    mode = data[0]
    if mode & 0x80:
        frames = valid_frames(rid=f"f{len(data)}", seq_len=1 + (mode & 3))
        header = json.loads(frames[0])
        field = FIELDS[data[1] % len(FIELDS)] if len(data) > 1 else "v"
        header[field] = json_value(data[2:])
        raw = json.dumps(header, allow_nan=True).encode()
        body = frames[1]
        if mode & 0x40:
            body = body[: len(body) // 2]
        if mode & 0x20 and body:
            body = bytes([body[0] ^ 0xFF]) + body[1:]
        return [raw, body] if not (mode & 0x10) else [raw, body, b"extra"]
    n = mode % 5
    if n == 0:
        return [b""]
    frames, rest = [], data[1:]
    for _ in range(n - 1):
        size = int.from_bytes(rest[:2], "big") if len(rest) >= 2 else 0
        frames.append(rest[2:2 + size])
        rest = rest[2 + size:]
    frames.append(rest)
    return frames


class Harness:
    def __init__(self) -> None:
        self.receiver = KVReceiver("tcp://127.0.0.1:0", KVInbox(max_bytes=INBOX_BYTES, ttl_s=30),
                                   stage=STAGE, pipeline="p", max_payload_bytes=MAX_PAYLOAD)
        self.receiver.start()
        self.ctx = zmq.Context()
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(self.receiver.endpoint)
        self.count = 0
        self.rss_base_kb: int | None = None

    def one(self, data: bytes) -> None:
        frames = frames_from(data)
        self.dealer.send_multipart(frames)
        if not self.dealer.poll(REPLY_WAIT_MS):
            raise AssertionError(f"no answer to {len(frames)} frames {[f[:80] for f in frames]}")
        reply = json.loads(self.dealer.recv())
        assert reply["status"] in ("ok", "rejected"), reply
        assert reply["status"] == "ok" or reply["code"] in REJECT_CODES, reply
        if reply["code"] == "internal_error":
            raise AssertionError(f"internal_error (a receiver bug) for {frames!r}: {reply}")
        assert self.receiver.running, f"receiver thread died: {getattr(self.receiver, 'died', None)}"
        assert self.receiver.inbox.bytes <= INBOX_BYTES
        self.count += 1
        if self.count % 1000 == 0:
            rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            if self.rss_base_kb is None:
                self.rss_base_kb = rss_kb  # after warm-up
            growth_mb = (rss_kb - self.rss_base_kb) / 1024
            assert growth_mb < RSS_GROWTH_LIMIT_MB, f"RSS grew by {growth_mb:.0f} MiB"


def write_seeds(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for i, algo in enumerate(("crc32", "xxh3_64")):
        header, body = valid_frames(f"seed-{i}", algo=algo)
        (directory / f"valid-{algo}").write_bytes(bytes([2]) + len(header).to_bytes(2, "big")
                                                  + header + body)
    for field_no in range(len(FIELDS)):
        (directory / f"field-{field_no}").write_bytes(bytes([0x80, field_no, 4]) + b"abcd")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--write-seeds":
        write_seeds(Path(sys.argv[2]))
        return
    # Every rejection logs a warning; a fuzzer makes thousands a second. Errors still show.
    logging.basicConfig(level=logging.ERROR)
    harness = Harness()
    atheris.Setup(sys.argv, harness.one)
    print(f"fuzzing KVReceiver at {harness.receiver.endpoint} (pid {os.getpid()})", flush=True)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
