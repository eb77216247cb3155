"""An edge of the stage graph: how a stage's output feeds the next one, whole or streamed.

A stage's ``inputs`` name its upstream stages. An input is fed **whole** (the default: the
upstream hands each request off once, at its trigger) or **streamed** (vllm-omni's
``async_chunk``: the upstream sends chunks of its committed output while it decodes, and the
downstream request grows as they come). This module is the one statement of an edge's form,
its settings, their defaults and their bounds: the operator reads a pipeline's edges with
:func:`parse_input` (and ``omni-pipeline validate`` with it), renders them into both ends'
stage configs with :meth:`Edge.to_config`, and the stage reads them back with
:func:`parse_input` again, so the writer and the reader cannot drift.

The forms, in a pipeline's ``stages[].inputs`` and a stage config's ``inputs``::

    inputs: [thinker]                          # whole (today's form)
    inputs:
      - stage: thinker                         # the same, spelled out
      - stage: thinker
        mode: stream                           # streamed, every setting at its default
        stream: {firstChunkTokens: 4, chunkTokens: 16, firstChunkSeconds: 30,
                 gapSeconds: 10, streamSeconds: 600, chunksInFlight: 4, maxOpenStreams: 64}

A stream's deadlines are always on: a value that is not a finite positive number (``nan``,
``.inf``, ``0``, ``-1``) is refused naming its key, never read as "off" (vllm-omni's deadline
knob silently turned off on ``nan`` or a negative value).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

WHOLE = "whole"
STREAM = "stream"
MODES = (WHOLE, STREAM)

#: Largest chunk size in tokens and largest credit counts a stream may ask for: beyond these a
#: chunk is a whole hand-off in all but name, and a cap that large bounds nothing.
MAX_CHUNK_TOKENS = 65536
MAX_CHUNKS_IN_FLIGHT = 1024
MAX_OPEN_STREAMS = 65536
#: Longest deadline, in seconds (a day): a stream open longer is stuck by any measure.
MAX_DEADLINE_SECONDS = 86400.0


class EdgeError(ValueError):
    """A bad edge; the message names the key (``inputs[0].stream.gapSeconds``) and the fix."""


@dataclass(frozen=True, slots=True)
class StreamSettings:
    """A streamed edge's cadence, deadlines and credits (the config's camelCase in
    :data:`_KEYS`)."""

    #: Output tokens in the first chunk: small, so the consumer starts early.
    first_chunk_tokens: int = 4
    #: Output tokens in each later chunk (the last one may be shorter).
    chunk_tokens: int = 16
    #: From the request's start on the producer to its first chunk acked by the consumer.
    first_chunk_seconds: float = 30.0
    #: Between two chunks of one stream, either side: the consumer waiting for the next one,
    #: the producer waiting for a chunk's ack.
    gap_seconds: float = 10.0
    #: The whole stream, first chunk to the last one's ack.
    stream_seconds: float = 600.0
    #: Chunks of one stream sent and not yet acked: the producer holds beyond it.
    chunks_in_flight: int = 4
    #: Streams on this edge open at once on one producer replica: a new one waits beyond it.
    max_open_streams: int = 64


#: The config's key for each field, with its kind and its bounds (inclusive, or exclusive
#: below for seconds): the one statement of the settings' form.
_KEYS: dict[str, tuple[str, type, float, float]] = {
    "firstChunkTokens": ("first_chunk_tokens", int, 1, MAX_CHUNK_TOKENS),
    "chunkTokens": ("chunk_tokens", int, 1, MAX_CHUNK_TOKENS),
    "firstChunkSeconds": ("first_chunk_seconds", float, 0.0, MAX_DEADLINE_SECONDS),
    "gapSeconds": ("gap_seconds", float, 0.0, MAX_DEADLINE_SECONDS),
    "streamSeconds": ("stream_seconds", float, 0.0, MAX_DEADLINE_SECONDS),
    "chunksInFlight": ("chunks_in_flight", int, 1, MAX_CHUNKS_IN_FLIGHT),
    "maxOpenStreams": ("max_open_streams", int, 1, MAX_OPEN_STREAMS),
}
STREAM_KEYS: tuple[str, ...] = tuple(_KEYS)
DEFAULT_STREAM = StreamSettings()
assert {f.name for f in fields(StreamSettings)} == {v[0] for v in _KEYS.values()}


@dataclass(frozen=True, slots=True)
class Edge:
    """One input of a stage: the upstream ``stage`` and how it is fed."""

    stage: str
    mode: str = WHOLE
    #: The stream's settings; None for a whole edge.
    stream: StreamSettings | None = None

    @property
    def streamed(self) -> bool:
        return self.mode == STREAM

    def to_config(self) -> str | dict[str, Any]:
        """The edge as a config writes it: a whole edge as its stage's name alone (so a
        pipeline without streams renders exactly as before), a streamed one as a mapping
        with every setting spelled out (the stage never falls back on a default of its own)."""
        if not self.streamed:
            return self.stage
        return {"stage": self.stage, "mode": STREAM, "stream": stream_config(self.stream)}


def drain_seconds(transfer_timeout_s: float, streams: Iterable[StreamSettings | None]) -> float:
    """How long a stopping stage may drain: its KV transfers' deadline, or, at either end of
    streamed edges (``streams``: their settings, None for a whole edge), the longest
    whole-stream deadline if longer: a stream open when SIGTERM comes (a rollout's drain, a
    scale-in's pick) may run that long, and the stage lets it end rather than cut it. The
    operator sizes a pod's grace period by it (render.drain_seconds); ``omni-stage`` drains
    that long by default."""
    longest = max((s.stream_seconds for s in streams if s is not None), default=0.0)
    return max(float(transfer_timeout_s), longest)


def stream_config(settings: StreamSettings | None) -> dict[str, Any]:
    """Every setting of a stream, keyed as the config keys them."""
    settings = settings or DEFAULT_STREAM
    return {key: getattr(settings, spec[0]) for key, spec in _KEYS.items()}


def parse_input(raw: Any, where: str) -> Edge:
    """One entry of ``inputs`` (a stage's name, or a mapping with ``stage``, ``mode`` and
    ``stream``), checked; ``where`` is its path (``inputs[0]``, ``spec.stages[1].inputs[0]``)
    for the message. EdgeError naming the key for anything else, never another exception."""
    if isinstance(raw, str):
        if not raw:
            raise EdgeError(f"{where}: a stage name cannot be empty")
        return Edge(raw)
    if not isinstance(raw, Mapping):
        raise EdgeError(f"{where} must be a stage name or a mapping with stage (and mode, "
                        f"stream), got {type(raw).__name__}")
    unknown = sorted(str(k) for k in raw if k not in ("stage", "mode", "stream"))
    if unknown:
        raise EdgeError(f"{where}.{unknown[0]} is not a key of an input (stage, mode, stream)")
    stage = raw.get("stage")
    if not isinstance(stage, str) or not stage:
        raise EdgeError(f"{where}.stage is required: the name of the stage at the edge's other end")
    mode = raw.get("mode")
    if mode is None:
        mode = WHOLE
    if mode not in MODES:
        raise EdgeError(f"{where}.mode must be one of {', '.join(MODES)}, got {mode!r}")
    settings = raw.get("stream")
    if mode == WHOLE:
        if settings is not None:
            raise EdgeError(f"{where}.stream is set but {where}.mode is {WHOLE}: set mode: "
                            f"{STREAM}, or remove stream")
        return Edge(stage)
    return Edge(stage, STREAM, parse_stream(settings, f"{where}.stream"))


def parse_stream(raw: Any, where: str) -> StreamSettings:
    """A stream's settings (absent keys at their defaults), each checked against its kind and
    bounds; EdgeError naming the key."""
    if raw is None:
        return DEFAULT_STREAM
    if not isinstance(raw, Mapping):
        raise EdgeError(f"{where} must be a mapping of {', '.join(STREAM_KEYS)}")
    unknown = sorted(str(k) for k in raw if k not in _KEYS)
    if unknown:
        raise EdgeError(f"{where}.{unknown[0]} is not a stream setting (one of "
                        f"{', '.join(STREAM_KEYS)})")
    values: dict[str, Any] = {}
    for key, (name, kind, low, high) in _KEYS.items():
        value = raw.get(key)
        if value is None:
            continue
        values[name] = (_seconds if kind is float else _count)(value, f"{where}.{key}", low, high)
    settings = StreamSettings(**values)
    for key, seconds, what in (("firstChunkSeconds", settings.first_chunk_seconds, "the first chunk"),
                               ("gapSeconds", settings.gap_seconds, "a wait between chunks")):
        if seconds > settings.stream_seconds:
            raise EdgeError(f"{where}.{key} ({seconds:g}) exceeds {where}.streamSeconds "
                            f"({settings.stream_seconds:g}): {what} is part of the stream; lower "
                            f"{key}, or raise streamSeconds")
    return settings


def _count(value: Any, key: str, low: float, high: float) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise EdgeError(f"{key} must be a whole number from {low:g} to {high:g}, got {value!r}")
    if not low <= value <= high:
        raise EdgeError(f"{key} must be from {low:g} to {high:g}, got {value}")
    return value


def _seconds(value: Any, key: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise EdgeError(f"{key} must be a number of seconds, got {value!r}")
    if not (math.isfinite(value) and low < value <= high):
        raise EdgeError(f"{key} must be a finite number of seconds above 0 and at most "
                        f"{high:g} (a stream's deadlines cannot be turned off), got {value!r}")
    return float(value)


def parse_inputs(raw: Any, where: str = "inputs") -> tuple[Edge, ...]:
    """A stage's ``inputs`` (absent: none); each stage at most once."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise EdgeError(f"{where} must be a list of stage names or inputs, got "
                        f"{type(raw).__name__}")
    edges = tuple(parse_input(item, f"{where}[{i}]") for i, item in enumerate(raw))
    seen: set[str] = set()
    for i, edge in enumerate(edges):
        if edge.stage in seen:
            raise EdgeError(f"{where}[{i}] names {edge.stage!r} again: a stage is one input "
                            "of another at most once")
        seen.add(edge.stage)
    return edges
