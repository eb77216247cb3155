"""The edge contract (omni_contract/edges.py): the forms of an input, a stream's settings,
their bounds, and that what the writer writes the reader reads back."""

from __future__ import annotations

import math

import pytest

from omni_contract.edges import (DEFAULT_STREAM, STREAM, STREAM_KEYS, WHOLE, Edge, EdgeError,
                                 StreamSettings, parse_input, parse_inputs, parse_stream,
                                 stream_config)


def test_a_stage_name_is_a_whole_edge_and_writes_back_as_a_name():
    edge = parse_input("thinker", "inputs[0]")
    assert edge == Edge("thinker") and edge.mode == WHOLE and not edge.streamed
    assert edge.to_config() == "thinker"
    assert parse_input({"stage": "thinker"}, "inputs[0]") == edge
    assert parse_input({"stage": "thinker", "mode": "whole"}, "inputs[0]") == edge


def test_a_streamed_edge_takes_its_defaults_and_writes_every_setting():
    edge = parse_input({"stage": "thinker", "mode": "stream"}, "inputs[0]")
    assert edge.streamed and edge.stream == DEFAULT_STREAM
    written = edge.to_config()
    assert written["mode"] == STREAM and set(written["stream"]) == set(STREAM_KEYS)
    assert parse_input(written, "inputs[0]") == edge


def test_settings_round_trip_through_the_config():
    settings = StreamSettings(first_chunk_tokens=2, chunk_tokens=8, first_chunk_seconds=1.5,
                              gap_seconds=0.25, stream_seconds=60, chunks_in_flight=2,
                              max_open_streams=3)
    assert parse_stream(stream_config(settings), "s") == settings
    edge = Edge("thinker", STREAM, settings)
    assert parse_input(edge.to_config(), "x") == edge


@pytest.mark.parametrize("key", ["firstChunkSeconds", "gapSeconds", "streamSeconds"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0, 0.0, -1, -0.5, True, "10"])
def test_a_deadline_that_would_turn_it_off_is_refused_naming_the_key(key, value):
    with pytest.raises(EdgeError) as err:
        parse_input({"stage": "thinker", "mode": "stream", "stream": {key: value}},
                    "spec.stages[1].inputs[0]")
    assert f"spec.stages[1].inputs[0].stream.{key}" in str(err.value)


@pytest.mark.parametrize("key", ["firstChunkTokens", "chunkTokens", "chunksInFlight",
                                 "maxOpenStreams"])
@pytest.mark.parametrize("value", [0, -3, 1.5, True, "4", 10**9])
def test_a_count_out_of_bounds_is_refused_naming_the_key(key, value):
    with pytest.raises(EdgeError) as err:
        parse_stream({key: value}, "inputs[0].stream")
    assert f"inputs[0].stream.{key}" in str(err.value)


def test_a_first_chunk_or_gap_deadline_past_the_stream_deadline_is_refused():
    with pytest.raises(EdgeError, match="firstChunkSeconds .* exceeds .*streamSeconds"):
        parse_stream({"firstChunkSeconds": 30, "streamSeconds": 10}, "s")
    with pytest.raises(EdgeError, match="gapSeconds .* exceeds .*streamSeconds"):
        parse_stream({"firstChunkSeconds": 1, "gapSeconds": 30, "streamSeconds": 10}, "s")
    with pytest.raises(EdgeError, match="gapSeconds .* exceeds .*streamSeconds"):
        parse_stream({"firstChunkSeconds": 1, "streamSeconds": 5}, "s")  # the default gap (10 s) too


@pytest.mark.parametrize("raw, message", [
    ("", "cannot be empty"),
    (3, "must be a stage name or a mapping"),
    ({"mode": "stream"}, r"inputs\[0\].stage is required"),
    ({"stage": "a", "mode": "chunked"}, r"inputs\[0\].mode must be one of whole, stream"),
    ({"stage": "a", "stream": {}}, r"inputs\[0\].stream is set but inputs\[0\].mode is whole"),
    ({"stage": "a", "from": "b"}, r"inputs\[0\].from is not a key of an input"),
    ({"stage": "a", "mode": "stream", "stream": []}, r"inputs\[0\].stream must be a mapping"),
    ({"stage": "a", "mode": "stream", "stream": {"gap": 1}},
     r"inputs\[0\].stream.gap is not a stream setting"),
])
def test_a_malformed_input_is_refused_naming_the_key(raw, message):
    with pytest.raises(EdgeError, match=message):
        parse_input(raw, "inputs[0]")


def test_inputs_name_each_stage_once():
    assert parse_inputs(None) == ()
    assert [e.stage for e in parse_inputs(["a", {"stage": "b", "mode": "stream"}])] == ["a", "b"]
    with pytest.raises(EdgeError, match=r"inputs\[1\] names 'a' again"):
        parse_inputs(["a", {"stage": "a", "mode": "stream"}])
    with pytest.raises(EdgeError, match="inputs must be a list"):
        parse_inputs("a")
