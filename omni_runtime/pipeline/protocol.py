"""How a pipeline request is known to every stage that takes it, and how those stages report
to the pipeline's endpoint (endpoint.py).

A client's request enters at the endpoint, which gives it an id (the client's
``X-Request-Id``, else a new one) and sends it to the pipeline's first stage with its
**origin** in ``kv_transfer_params["omni"]``: ``{"request_id", "endpoint", "token"}``, the
endpoint being the URL of the endpoint replica awaiting its output, the token a secret of the
request's (only the stages it travels to know it). A stage's scheduler carries the
origin with each hand-off (sched/handoff.py's Carried), so each stage that takes the request
from a hand-off knows where it belongs, and passes it on with its own request.

Each stage that takes the request opens a **link** to the endpoint: a WebSocket at
:func:`link_path` on the origin's endpoint, presenting the origin's token
(:data:`LINK_TOKEN_HEADER`: the link's path is on the clients' port, and a request id can be
a client's own ``X-Request-Id``, so whoever knows one could otherwise report for a stage), carrying :data:`EVENTS` as JSON text frames, one
per message. The link is also the request's lifeline both ways: the endpoint aborts a stage's
request by sending ``{"event": "abort"}`` or closing the link; a stage whose link drops
before it said ``done``, ``handed_off`` or ``error`` is taken to have lost the request.

Standard library only: the endpoint, the stages and the scheduler share these names.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Callable
from urllib.parse import quote

#: The key of a request's ``kv_transfer_params`` that holds its origin.
KV_PARAMS_KEY = "omni"
#: The origin's keys: the pipeline request's id, and the endpoint replica's base URL.
ORIGIN_REQUEST_ID = "request_id"
ORIGIN_ENDPOINT = "endpoint"
ORIGIN_TOKEN = "token"
#: The header by which a stage's link presents its request's token.
LINK_TOKEN_HEADER = "X-Omni-Link-Token"
MAX_TOKEN_CHARS = 256

#: Stage -> endpoint:
#:   taken       the stage holds the request (its input accepted; its hand-off acked)
#:   output      new output of the pipeline's last stage: {"token_ids": [...], "text": "..."}
#:   payload     a last stage that is a receiving stage stored its payload: {"payload": {...}}
#:   handed_off  the stage's request finished and its hand-off goes on: {"to": [stages]}
#:   done        the last stage's request finished: {"finish_reason", "usage"}
#:   error       the stage failed the request: {"message"}
#: Endpoint -> stage:
#:   abort       stop the request (the client went away, or another stage failed it)
EVENTS = ("taken", "output", "payload", "handed_off", "done", "error", "abort")
#: The events after which a stage's link may close without the request being lost.
FINAL_EVENTS = frozenset({"handed_off", "done", "error"})
#: WebSocket close code of a link the endpoint has no request for (it ended or never was).
CLOSE_UNKNOWN_REQUEST = 4404
#: WebSocket close code of a link that did not present its request's token.
CLOSE_WRONG_TOKEN = 4403
#: A frame's size bound (an output event carries one step's tokens and text).
MAX_EVENT_BYTES = 1 << 20
#: WebSocket pings on a link, both ways: a peer that vanished is noticed within about twice
#: this.
HEARTBEAT_S = 5.0


class ProtocolError(ValueError):
    """A malformed origin or event, with the reason."""


class MalformedEvent(ProtocolError):
    """An event of a known kind whose fields are not what they must be (a stage's bug)."""


#: The longest request id a pipeline request carries from stage to stage (its origin).
MAX_REQUEST_ID_CHARS = 1024


#: The longest X-Request-Id a client may send: vLLM makes a stage's request id of it with up
#: to 20 characters more (``chatcmpl-ID-0-1a2b3c4d``; 4 more kept spare), and the KV wire
#: bounds a request id as the origin does.
MAX_CLIENT_REQUEST_ID_CHARS = MAX_REQUEST_ID_CHARS - 24


def request_id_problem(request_id: str) -> str | None:
    """Why a pipeline request cannot carry ``request_id`` (a client's X-Request-Id) to every
    stage; None when it can: ASCII text of 1 to MAX_CLIENT_REQUEST_ID_CHARS characters, not
    ``.`` or ``..`` (a path segment of the stages' links). ASCII: vLLM's server reads a
    header's bytes as Latin-1, so the first stage would know a non-ASCII id by another one
    (its UTF-8 bytes, one character each: longer than the wire carries past 1,008 bytes)."""
    if not request_id.isascii():
        at = next(i for i, c in enumerate(request_id) if not c.isascii())
        return (f"X-Request-Id must be ASCII text (a stage's vLLM server reads a header as Latin-1 "
                f"and would know the request by another id); character {at} is not")
    if not 0 < len(request_id) <= MAX_CLIENT_REQUEST_ID_CHARS:
        return (f"X-Request-Id must be 1 to {MAX_CLIENT_REQUEST_ID_CHARS} characters (a stage's request "
                f"id adds vLLM's prefix and suffix to it), got {len(request_id)}")
    if request_id in (".", ".."):
        return f"X-Request-Id may not be {request_id!r} (a path segment of the stages' links to the endpoint)"
    return None


def origin(request_id: str, endpoint: str, token: str | None = None) -> dict[str, str]:
    found = {ORIGIN_REQUEST_ID: request_id, ORIGIN_ENDPOINT: endpoint}
    if token:
        found[ORIGIN_TOKEN] = token
    return found


def origin_token(raw: Any) -> str | None:
    """The token of an origin (None: it has none); ProtocolError when it is malformed."""
    token = raw.get(ORIGIN_TOKEN) if isinstance(raw, Mapping) else None
    if token is None:
        return None
    if not (isinstance(token, str) and 0 < len(token) <= MAX_TOKEN_CHARS):
        raise ProtocolError(f"the origin's token must be a string of 1 to {MAX_TOKEN_CHARS} "
                            "characters")
    return token


def parse_origin(raw: Any) -> tuple[str, str] | None:
    """(request id, endpoint URL) of an origin, None when there is none; ProtocolError when
    it is malformed."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ProtocolError("the origin must be a mapping")
    request_id, endpoint = raw.get(ORIGIN_REQUEST_ID), raw.get(ORIGIN_ENDPOINT)
    if not (isinstance(request_id, str) and request_id and len(request_id) <= MAX_REQUEST_ID_CHARS):
        raise ProtocolError(f"the origin's request_id must be a string of 1 to {MAX_REQUEST_ID_CHARS} "
                            "characters")
    if not (isinstance(endpoint, str) and endpoint.startswith(("http://", "https://"))
            and len(endpoint) <= 2048):
        raise ProtocolError("the origin's endpoint must be an http(s) URL")
    return request_id, endpoint.rstrip("/")


def link_path(request_id: str, stage: str) -> str:
    """The path of a stage's link for a request, on the endpoint."""
    return f"/v1/omni/requests/{quote(request_id, safe='')}/stages/{quote(stage, safe='')}"


def link_url(endpoint: str, request_id: str, stage: str) -> str:
    """The WebSocket URL of a stage's link (``endpoint``: the origin's http(s) base URL)."""
    return "ws" + endpoint.rstrip("/")[4:] + link_path(request_id, stage)


def encode_event(event: str, **fields: Any) -> str:
    if event not in EVENTS:
        raise ProtocolError(f"unknown event {event!r}")
    return json.dumps({"event": event, **fields}, separators=(",", ":"))


def parse_event(text: str | bytes) -> dict[str, Any]:
    """An event frame as a dict with a known ``event``; ProtocolError otherwise."""
    if len(text) > MAX_EVENT_BYTES:
        raise ProtocolError(f"an event of {len(text)} bytes is over {MAX_EVENT_BYTES}")
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"an event must be JSON: {exc}") from None
    if not isinstance(body, dict) or body.get("event") not in EVENTS:
        raise ProtocolError(f"an event must be an object whose event is one of {EVENTS}")
    for key, (accepts, what) in _EVENT_FIELDS.items():
        if key in body and body[key] is not None and not accepts(body[key]):
            raise MalformedEvent(f"a {body['event']} event's {key} must be {what}, got {body[key]!r:.80}")
    return body


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


#: The fields an event may carry and what each must be (absent or null: not said): a stage's
#: bug must fail its request as a stage error, not break the endpoint's answer (a status of
#: "abc" was a 500, one of 1000 an HTTP status line the client could not read).
_EVENT_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "status": (lambda v: _whole(v) and 400 <= v <= 599, "an HTTP error status (400 to 599)"),
    "message": (lambda v: isinstance(v, str), "a string"),
    "param": (lambda v: isinstance(v, str), "a string"),
    # An error's stage at fault, where not the reporting one (a consumer whose producer stopped).
    "stage": (lambda v: isinstance(v, str), "a string"),
    "text": (lambda v: isinstance(v, str), "a string"),
    "token_ids": (lambda v: isinstance(v, list) and all(_whole(t) for t in v), "a list of integers"),
    "payload": (lambda v: isinstance(v, dict), "an object"),
    "finish_reason": (lambda v: isinstance(v, str), "a string"),
    "usage": (lambda v: isinstance(v, dict), "an object"),
    "offered_at": (_number, "a number"),
    "taken_at": (_number, "a number"),
}
