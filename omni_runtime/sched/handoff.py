"""The contract between the omni scheduler and the omni KV connector, typed.

The scheduler decides *when* a transfer goes (the ledger); the connector decides *how*. Per
step, the scheduler hands the connector's scheduler half the transfers it handed off
(:class:`HandOff`), and withdraws the handed-off transfers it resolved itself (expiry, reset,
shutdown); the workers answer each transfer per attempt (:class:`Answer`). No vLLM here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from omni_runtime.transfers.ledger import Transfer


def _unix_time(monotonic_time: float) -> float:
    # The ledger's default clock is time.monotonic.
    return time.time() - (time.monotonic() - monotonic_time)


class Carried(NamedTuple):
    """What a hand-off carries besides the KV, fixed when its transfer is marked: the next
    stage's input (a downstream vLLM stage's request is made from it) and the pipeline
    request it belongs to."""

    #: The request's tokens at the trigger: its prompt (``prefill_finished``), the tokens
    #: before the sentinel (``special_token``), or every token it has, its last output
    #: included (``request_finished``). The KV covers the first ``seq_len`` of them.
    token_ids: tuple[int, ...] = ()
    #: How many of ``token_ids`` are the request's prompt (the rest it generated).
    prompt_len: int = 0
    #: The pipeline request's context (its id, the endpoint awaiting its output), from the
    #: request's ``kv_transfer_params["omni"]``; None for a request that came from no
    #: pipeline endpoint.
    origin: Mapping[str, str] | None = None


NOTHING_CARRIED = Carried()


class HandOff(NamedTuple):
    """One transfer handed to the connector in a step. Immutable (a named tuple: one is
    made per transfer on the scheduler's step, where a frozen dataclass's field-by-field
    set-up costs several times more)."""

    request_id: str
    #: Unique per ledger: what the answer names (a late answer to an earlier attempt of the
    #: same request resolves nothing).
    attempt: int
    seq_len: int
    #: The blocks holding tokens [0, seq_len), in order: ceil(seq_len / block_size) of them.
    block_ids: tuple[int, ...]
    #: Time left before the scheduler expires it: the connector gives up before that, so its
    #: failure (with a reason) arrives first.
    deadline_in_s: float
    #: The request's W3C trace headers, so the receiving stage's span joins its trace.
    trace_headers: Mapping[str, str] | None = None
    #: When its request had already finished (held: vLLM keeps all its KV blocks until the
    #: transfer resolves): (unix time it finished, the blocks kept), for the per-edge families
    #: the data path of a fan-out feeds; None while the request runs.
    held: tuple[float, int] | None = None
    #: What it carries besides the KV (:class:`Carried`).
    carried: Carried = NOTHING_CARRIED

    @classmethod
    def of(cls, transfer: Transfer, wall_time: Callable[[float], float] = _unix_time) -> HandOff:
        """``wall_time``: unix time of a ledger time (``TransferLedger.wall_time``)."""
        held_since = transfer.held_since
        headers = transfer.trace_headers
        left = transfer.deadline - transfer.handed_off_at
        # What the named tuple's own __new__ does (a Python frame per hand-off): the fields'
        # values, in their order, as a tuple of this class.
        return tuple.__new__(cls, (
            transfer.request_id,
            transfer.attempt,
            transfer.seq_len,
            tuple(transfer.block_ids),
            left if left > 0.0 else 0.0,
            dict(headers) if headers else None,
            None if held_since is None else (wall_time(held_since), transfer.held_blocks),
            transfer.carried or NOTHING_CARRIED,
        ))


class ChunkOut(NamedTuple):
    """One chunk of a streamed edge's stream handed to the connector in a step (the stream
    ledger cut it: omni_runtime/transfers/streams.py), or, with ``end`` set, the stream's
    early end (``producer_error``, ``aborted``, ``expired``) for the consumer."""

    request_id: str
    to_stage: str
    seq: int
    last: bool
    #: The chunk's output tokens; chunk 0 carries the request's prompt before them.
    token_ids: tuple[int, ...]
    #: How many of ``token_ids`` are the prompt (chunk 0 only).
    prompt_len: int
    #: Unix time the chunk was cut (the consumer's hop time starts there).
    produced_at: float
    #: Time the sender has for it: it gives up before the stream's own deadline would.
    deadline_in_s: float
    origin: Mapping[str, str] | None = None
    trace_headers: Mapping[str, str] | None = None
    end: str | None = None
    reason: str = ""


class ChunkAnswer(NamedTuple):
    """A worker's answer about one chunk: acked (``reason`` None) or why not; ``unanswered``:
    the sender gave up waiting for the consumer's answer (it may not know the stream ended)."""

    request_id: str
    to_stage: str
    seq: int
    reason: str | None
    unanswered: bool = False


@dataclass(frozen=True, slots=True)
class Answer:
    """A worker's answer about one attempt of a transfer: delivered (``reason`` None) or
    not, with the reason; ``expired`` when it is not because no answer came before the
    deadline (the sender gave up waiting, just before the ledger's deadline: an unreachable,
    hung or stopped receiver), else a failure; with the payload bytes delivered (every rank's
    together, once combined) and the seconds from the worker's offer to the answer (the
    slowest rank's)."""

    attempt: int
    reason: str | None = None
    nbytes: int = 0
    seconds: float = 0.0
    expired: bool = False

    @property
    def acked(self) -> bool:
        return self.reason is None

    @property
    def outcome(self) -> str:
        """acked, expired or failed: the ledger's outcome for it."""
        return "acked" if self.reason is None else "expired" if self.expired else "failed"
