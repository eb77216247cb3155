#!/usr/bin/env python3
"""Coverage-guided fuzzing (atheris) of the KV receiver's control-message handler, with the
receiver alive: each input becomes one control message (hello, read, verdict, a stream's
chunk or raw frames), sent as the AR's sender sends it (a hello, or frames of several parts,
on a DEALER over TCP on 127.0.0.1; any other as a NIXL notification) to a real KVReceiver (a stage
that takes streams) that serves a synthetic AR
rank's registered KV cache (real NIXL). Reads it takes on are really read, get their verdict
and their final answer. Every hello and read must be answered, never ``internal_error``; the
receiver thread must stay alive, its inbox within its bound, no read left behind, and the
process's memory must not keep growing.

    python tests/fuzz/receiver_fuzz.py [libFuzzer flags] [CORPUS_DIR ...]
    python tests/fuzz/receiver_fuzz.py --write-seeds DIR    # valid messages as seeds

Input format (so mutations reach every field): byte 0 picks the mode.
* raw (bit 7 clear): ``n = byte0 % 5`` frames (0 means one empty frame), each but the last
  prefixed by a 2-byte big-endian length; the last frame takes the rest.
* field (bit 7 set): a valid message of kind ``byte0 & 3`` (hello, read, verdict, chunk) with
  field number ``byte1`` (of its body, its ``compat`` or ``block_format``) replaced by a JSON
  value built from the remaining bytes (an int, a float, a string, a list, an object of such,
  null or a boolean). Bit 6: a hello's metadata frame replaced by garbage, a read's second
  frame added. Bit 5: a read taken on gets ``commit: false``. Bit 4: no replacement (the
  valid message itself).
Run by tests/runtime/test_fuzz_receiver.py for a bounded time, longer by ``make fuzz``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import resource
import struct
import sys
import time
from pathlib import Path

import atheris

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("runtime", ".")]  # transport_fixtures, procs

with atheris.instrument_imports(include=["omni_runtime.kv.transport"]):
    import zmq

    from omni_runtime.kv.transport import REJECT_CODES, KVInbox, KVReceiver
    from omni_runtime.kv.transport.protocol import (WIRE_VERSION, StreamChunk, Verdict,
                                                    encode_chunk, encode_hello, encode_verdict)

from transport_fixtures import MODEL, RawDealer, SyntheticAR, read_body  # noqa: E402

STAGE = "talker"
INBOX_BYTES = 256 << 10
MAX_PAYLOAD = 64 << 10
REPLY_WAIT_S = 10.0
#: RSS the process may grow by after warm-up (libFuzzer's -rss_limit_mb bounds it too).
RSS_GROWTH_LIMIT_MB = 256
KINDS = ("hello", "read", "verdict", "chunk")


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
        return [[int(b), 1 + (rest[i + 1] if i + 1 < len(rest) else 0) % 4]
                for i, b in enumerate(rest[:6:2])]  # run-like lists
    return None


class Harness:
    def __init__(self) -> None:
        self.ar = SyntheticAR(layers=2, blocks=16, heads=2, block_size=4, head_size=8)
        self.receiver = KVReceiver(
            "tcp://127.0.0.1:0", KVInbox(max_bytes=INBOX_BYTES, ttl_s=30), stage=STAGE,
            pipeline="p", max_payload_bytes=MAX_PAYLOAD, slot_bytes=8192, slots=2,
            expect={"model": MODEL}, streams=self._stream)
        self.receiver.start()
        self.ctx = zmq.Context()
        # A hello on the handshake connection, the rest as the AR agent's notifications.
        self.dealer = RawDealer(self.ctx, self.receiver.endpoint, self.ar)
        self.hello = dataclasses.replace(self.ar.hello, to_stage=STAGE)
        self.count = 0
        self.tid = 1 << 20
        self.rss_base_kb: int | None = None
        self.send(encode_hello(self.hello))
        assert self.reply()["type"] == "hello_ok"

    def _stream(self, message, ticket) -> None:
        """The stage's stream consumer: every chunk taken at once (its answer, ``ok``, then
        travels as a consumer's does, after the receiver's loop sees it settled)."""
        if ticket is not None:
            self.receiver.settle(ticket)

    # ------------------------------------------------------------------ the peer
    def send(self, frames: list[bytes], channel: str | None = None) -> None:
        self.dealer.send(frames, channel)

    def reply(self, timeout: float = REPLY_WAIT_S) -> dict:
        """The next reply, by either way; the AR's agent is progressed meanwhile (UCX serves
        a read of its memory only then, as the AR's sender thread does)."""
        reply = self.dealer.reply(timeout)
        assert reply["type"] in ("hello_ok", "read_done", "ok", "rejected"), reply
        if reply["type"] == "rejected":
            assert reply["code"] in REJECT_CODES, reply
            if reply["code"] == "internal_error":
                raise AssertionError(f"internal_error (a receiver bug): {reply}")
        return reply

    # ------------------------------------------------------------------ one input
    def message(self, data: bytes) -> tuple[str, list[bytes], bool]:
        """(kind, frames, commit) of an input."""
        if not data:
            return "raw", [b""], True
        mode = data[0]
        if not mode & 0x80:
            n = mode % 5
            if n == 0:
                return "raw", [b""], True
            frames, rest = [], data[1:]
            for _ in range(n - 1):
                size = int.from_bytes(rest[:2], "big") if len(rest) >= 2 else 0
                frames.append(rest[2:2 + size])
                rest = rest[2 + size:]
            frames.append(rest)
            return "raw", frames, True
        kind = KINDS[mode & 3]
        self.tid += 1
        if kind == "hello":
            frames = encode_hello(self.hello)
        elif kind == "read":
            frames = [json.dumps(read_body(self.ar, self.tid, f"f{self.tid}", [3, 9, 4],
                                           10)).encode()]
        elif kind == "chunk":
            frames = encode_chunk(StreamChunk(
                self.tid, self.ar.name, self.hello.compat_hash, f"s{self.tid}", "", "p",
                self.hello.from_stage, STAGE, 0, True, (1, 2, 3), 1, 5.0, time.time(),
                time.time(), origin={"request_id": "pipe", "endpoint": "http://e"}))
        else:
            frames = encode_verdict(Verdict(self.ar.name, self.tid, True))
        body = json.loads(frames[0])
        if not mode & 0x10 and len(data) > 1:
            fields = [(None, k) for k in sorted(body)] + [(None, "extra")]
            for nested in ("compat", "block_format"):
                if isinstance(body.get(nested), dict):
                    fields += [(nested, k) for k in sorted(body[nested])]
            nested, key = fields[data[1] % len(fields)]
            (body[nested] if nested else body)[key] = json_value(data[2:])
        frames = [json.dumps(body, allow_nan=True).encode(), *frames[1:]]
        if mode & 0x40:
            frames = [frames[0], b"\x01garbage"] if kind == "hello" else frames + [b"x"]
        return kind, frames, not mode & 0x20

    def one(self, data: bytes) -> None:
        kind, frames, commit = self.message(data)
        channel = self.dealer.channel(frames)  # the marker goes the same way: answered after
        self.send(frames, channel)
        marker = f"marker-{self.count}"
        self.send([json.dumps({"v": WIRE_VERSION, "type": marker}).encode()], channel)
        replies = []
        while True:  # the message's own replies come before the marker's
            reply = self.reply()
            if reply["type"] == "rejected" and marker in reply["reason"]:
                break
            replies.append(reply)
        if kind in ("hello", "read", "chunk"):
            try:
                body = json.loads(frames[0])
            except ValueError:
                body = {}
            tid = body.get("transfer_id") if isinstance(body, dict) else None
            if kind in ("read", "chunk") and not replies and isinstance(tid, int) \
                    and not isinstance(tid, bool):
                replies.append(self.reply())  # taken on: answered once read, or settled
            assert replies, f"a {kind} went unanswered: {frames!r}"
            if replies[-1]["type"] == "read_done":
                self.send(encode_verdict(Verdict(body["agent"], tid, commit)))
                final = self.reply()
                assert final["transfer_id"] == tid, final
                assert final["type"] == ("ok" if commit else "rejected") or (
                    final["type"] == "rejected" and final["code"] in ("inbox_full",
                                                                      "shard_mismatch")), final
                self.receiver.inbox.get(f"f{tid}")  # consumed: the inbox stays free
        assert self.receiver.running, f"receiver thread died: {self.receiver.died}"
        assert self.receiver.inbox.bytes <= INBOX_BYTES
        deadline = time.monotonic() + REPLY_WAIT_S
        while self.receiver._reads:  # every read resolved (a short deadline: soon)
            assert time.monotonic() < deadline, "a read was left behind"
            try:
                self.reply(timeout=0.001)
            except AssertionError:
                pass  # nothing yet
        self.count += 1
        if self.count % 1000 == 0:
            rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            if self.rss_base_kb is None:
                self.rss_base_kb = rss_kb  # after warm-up
            growth_mb = (rss_kb - self.rss_base_kb) / 1024
            assert growth_mb < RSS_GROWTH_LIMIT_MB, f"RSS grew by {growth_mb:.0f} MiB"


def write_seeds(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for i, kind in enumerate(KINDS):
        (directory / f"valid-{kind}").write_bytes(bytes([0x90 | i, 0]))
        for field_no in range(40):
            (directory / f"{kind}-field-{field_no}").write_bytes(
                bytes([0x80 | i, field_no, 4]) + b"abcd")
    (directory / "read-abort").write_bytes(bytes([0xB1, 0]))
    (directory / "raw-json").write_bytes(bytes([1]) + b'{"v": %d, "type": "read"}' % WIRE_VERSION)


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
