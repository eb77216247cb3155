"""The pipeline request's protocol and the endpoint's config, alone: every bad input refused
naming its key, never another exception."""

from __future__ import annotations

import pytest

from omni_runtime.pipeline.endpoint import EndpointConfigError, parse_endpoint_config
from omni_runtime.pipeline.protocol import (
    MAX_EVENT_BYTES,
    ProtocolError,
    encode_event,
    link_url,
    origin,
    parse_event,
    parse_origin,
)

GOOD = {"entry": {"stage": "thinker", "url": "http://127.0.0.1:8000"}, "sink": "talker",
        "advertise": "http://127.0.0.1:8080",
        "edges": [{"from": "thinker", "to": "talker", "timeoutSeconds": 30}]}


def test_an_origin_round_trips_and_a_malformed_one_is_refused():
    assert parse_origin(origin("p-1", "http://e:8080/")) == ("p-1", "http://e:8080")
    assert parse_origin(None) is None
    for bad in ("http://e", {"request_id": "", "endpoint": "http://e"},
                {"request_id": "x", "endpoint": "ftp://e"}, {"request_id": 3, "endpoint": "http://e"}):
        with pytest.raises(ProtocolError):
            parse_origin(bad)


def test_a_links_url_quotes_the_request_and_the_stage():
    assert link_url("https://e:8080", "a/b c", "talker") == \
        "wss://e:8080/v1/omni/requests/a%2Fb%20c/stages/talker"
    assert link_url("http://e:8080/", "r", "s") == "ws://e:8080/v1/omni/requests/r/stages/s"


def test_events_round_trip_and_anything_else_is_refused():
    assert parse_event(encode_event("output", token_ids=[1, 2], text="hi")) == {
        "event": "output", "token_ids": [1, 2], "text": "hi"}
    with pytest.raises(ProtocolError):
        encode_event("nonsense")
    for bad in ("", "[]", '{"event": "nonsense"}', "{", '{"no": "event"}',
                '"' + "x" * MAX_EVENT_BYTES + '"'):
        with pytest.raises(ProtocolError):
            parse_event(bad)


def test_the_endpoint_config_parses_and_expands_the_pods_address(monkeypatch):
    monkeypatch.setenv("POD_IP", "10.0.0.7")
    config = parse_endpoint_config("p", "m", {**GOOD, "advertise": "http://${POD_IP}:8080/"})
    assert config.advertise == "http://10.0.0.7:8080" and config.entry_url == "http://127.0.0.1:8000"
    assert [e.target for e in config.downstream("thinker")] == ["talker"]
    assert config.request_timeout_s == 600.0


@pytest.mark.parametrize("change, words", [
    ({"entry": None}, "endpoint.entry must be a mapping"),
    ({"entry": {"stage": "thinker", "url": "tcp://x"}}, "endpoint.entry.url must be an http(s) URL"),
    ({"advertise": "http://${NO_SUCH_VARIABLE_HERE}:1"}, "names ${NO_SUCH_VARIABLE_HERE}"),
    ({"sink": "vocoder"}, "endpoint.sink 'vocoder' is not a stage"),
    ({"edges": [{"from": "thinker", "to": "talker", "timeoutSeconds": 0}]},
     "endpoint.edges[0].timeoutSeconds must be a positive number of seconds"),
    ({"edges": [{"from": "thinker", "to": "talker", "timeoutSeconds": float("nan")}]},
     "endpoint.edges[0].timeoutSeconds must be a positive number"),
    ({"edges": ["thinker->talker"]}, "endpoint.edges[0] must be a mapping"),
    ({"requestTimeoutSeconds": -1}, "endpoint.requestTimeoutSeconds must be a positive"),
    ({"sink": ""}, "endpoint.sink must be a non-empty string"),
])
def test_a_bad_endpoint_config_is_refused_naming_the_key(change, words):
    with pytest.raises(EndpointConfigError) as err:
        parse_endpoint_config("p", "m", {**GOOD, **change})
    assert words in str(err.value)
