"""The receiving stage's inbox: payloads stored by request id until consumed, with a memory
bound and a TTL.

Policy (docs/connector.md): when storing a payload would exceed ``max_bytes`` the NEW payload
is refused (the receiver answers ``inbox_full`` and the sender's transfer fails), never an old
one evicted: a payload in the inbox has been acked, so the AR stage has already freed its
blocks and nothing could resend it. Stored payloads leave only by being consumed
(:meth:`KVInbox.get`), by expiring ``ttl_s`` after they were stored, or by being replaced by a
newer payload of the same request id (a re-sent transfer after a preemption); expiries and
replacements are counted and logged, never silent.

Two ids find a payload: the request id it was sent under (vLLM's internal id,
``<id>-<8 random chars>``) and, when the sender named it, the client-facing
``external_request_id`` (an alias). Two requests may share an external id (vLLM allows
duplicate client ids): the alias names the newest; the older stays reachable by its own id.

Tensor parallelism: a payload that is one KV-head shard of a transfer (``num_shards`` > 1)
goes into that transfer's :class:`~.shards.ShardAssembly`; the assembled payload is stored
(and visible to consumers) only when every shard is in. An assembly reserves the whole
payload's bytes when its first shard arrives (``inbox_full`` refuses that shard when they do
not fit), and expires ``ttl_s`` after it started if a shard never comes. A newer attempt of
the same request (a re-sent snapshot) supersedes an unfinished older one. A shard the
receiver refused ends its attempt here (:meth:`KVInbox.abandon`): the attempt's assembly goes,
its bytes with it, and a shard of it that comes later is refused, so a payload is never
assembled from an attempt one of whose ranks failed or withdrew it (the ranks' reads commit
at different times: another rank may commit its shard after one was refused).

Invariants (under the lock): ``bytes == sum of stored payload sizes + sum of assemblies'
reserved sizes <= max_bytes``; entries (and assemblies) are in store (start) order, which is
expiry order (one TTL for all), so expiry is O(expired); every alias names a stored entry, so
aliases never outnumber entries (the memory bound holds).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np

from omni_runtime.kv.transport.observer import ReceiverObserver
from omni_runtime.kv.transport.shards import ShardAssembly, assembled_nbytes, assembly_key
from omni_runtime.kv.transport.payload import KVPayload
from omni_runtime.kv.transport.protocol import Rejected

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 4 << 30
DEFAULT_TTL_S = 300.0
#: Abandoned tensor-parallel attempts remembered (each for the TTL at most, oldest forgotten
#: first): a bound whatever a peer sends.
MAX_ABANDONED = 4096


@dataclass
class _Entry:
    payload: KVPayload
    nbytes: int
    stored_at: float  # the inbox clock (monotonic)


class InboxFull(Exception):
    """Storing the payload would exceed the inbox's memory bound."""


class KVInbox:
    """Thread-safe store of received payloads, read by request id with a timeout.

    ``clock`` is monotonic seconds (injectable for tests); ``received_at`` in summaries is
    unix time.
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, ttl_s: float = DEFAULT_TTL_S, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_bytes <= 0 or ttl_s <= 0:
            raise ValueError("max_bytes and ttl_s must be > 0")
        self.max_bytes = int(max_bytes)
        self.ttl_s = float(ttl_s)
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._aliases: dict[str, str] = {}  # external request id -> stored request id
        #: Tensor-parallel transfers with shards still to come, oldest first.
        self._assemblies: OrderedDict[tuple[str, int, int], ShardAssembly] = OrderedDict()
        #: Attempts a refused shard ended (see abandon()), oldest first: key -> (why, when).
        self._abandoned: OrderedDict[tuple[str, int, int], tuple[str, float]] = OrderedDict()
        self._bytes = 0
        self._cond = threading.Condition(threading.Lock())
        self._metrics: ReceiverObserver | None = None
        self._allocate = np.empty  # payloads' arrays, assembled (the receiver binds its pool)

    def bind_metrics(self, metrics: ReceiverObserver | None) -> None:
        """Report size gauges, evictions and get() wait times to ``metrics`` (the receiver
        does this with its own metrics)."""
        with self._cond:
            self._metrics = metrics
            self._update_gauges()

    def bind_allocator(self, allocate) -> None:
        """Where the arrays of payloads assembled in get() come from:
        ``allocate(shape, dtype)``."""
        self._allocate = allocate

    # ------------------------------------------------------------------ producer side
    def put(self, payload: KVPayload) -> KVPayload | None:
        """Store ``payload`` (replacing one of the same request id) or raise InboxFull.
        Wakes every get() waiting for it. A shard (``num_shards`` > 1) is stored into its
        transfer's assembly instead (:meth:`_put_shard`). The whole payload now stored (the
        assembled one for the last shard), or None: a shard kept until the others come."""
        if payload.num_shards > 1:
            return self._put_shard(payload)
        with self._cond:
            self._expire_locked(self._clock())
            self._store_locked(payload)
        return payload

    def discard(self, request_id: str) -> bool:
        """Drop the stored payload of ``request_id`` (either id), unconsumed and uncounted
        (its consumer refused it); whether there was one."""
        with self._cond:
            key = self._key_locked(request_id)
            if key is None:
                return False
            self._remove_locked(key, None)
            return True

    def _store_locked(self, payload: KVPayload) -> None:
        """Store a whole payload (the caller holds the lock)."""
        nbytes = payload.nbytes
        old = self._entries.get(payload.request_id)
        freed = old.nbytes if old is not None else 0
        if self._bytes - freed + nbytes > self.max_bytes:
            raise InboxFull(f"{nbytes} bytes do not fit: {self._bytes} of {self.max_bytes} "
                            f"bytes used by {len(self._entries)} payloads")
        if old is not None:
            self._remove_locked(payload.request_id, "replaced")
        if payload.received_at is None:
            payload.received_at = time.time()
        self._entries[payload.request_id] = _Entry(payload, nbytes, self._clock())
        alias = payload.external_request_id
        if alias and alias != payload.request_id:
            self._aliases[alias] = payload.request_id
        self._bytes += nbytes
        self._update_gauges()
        self._cond.notify_all()

    def _put_shard(self, shard: KVPayload) -> KVPayload | None:
        """Store one KV-head shard of a tensor-parallel transfer; the last one stores the
        assembled payload. Raises InboxFull (the first shard's reservation does not fit) or
        Rejected ``shard_mismatch``."""
        with self._cond:
            now = self._clock()
            self._expire_locked(now)
            key = assembly_key(shard)
            if (abandoned := self._abandoned.get(key)) is not None:
                raise Rejected("shard_mismatch", _abandoned_reason(shard.shard, key,
                                                                   abandoned[0]))
            assembly = self._assemblies.get(key)
            if assembly is None:
                # Attempts supersede each other (as the sender's do): an older attempt's
                # unfinished assembly goes, a shard of an older attempt is refused.
                for other in [k for k in self._assemblies if k[0] == key[0]]:
                    if other[1] > key[1]:
                        raise Rejected("shard_mismatch", f"shard of attempt {key[1]} of "
                                       f"request {key[0]}: attempt {other[1]} supersedes it")
                    self._drop_assembly_locked(other, "replaced")
                nbytes = assembled_nbytes(shard)
                if self._bytes + nbytes > self.max_bytes:
                    raise InboxFull(
                        f"{nbytes} bytes (shard {shard.shard} of {shard.num_shards}) do not "
                        f"fit: {self._bytes} of {self.max_bytes} bytes used")
                assembly = self._assemblies[key] = ShardAssembly(shard, now)
                self._bytes += assembly.nbytes
            elif (problem := assembly.mismatch(shard)) is not None:
                raise Rejected("shard_mismatch", problem)
            assembly.add(shard)
            if not assembly.complete:
                self._update_gauges()
                return None
            # Every shard is in: its reservation becomes the stored payload (which fits, as
            # the reservation did).
            del self._assemblies[key]
            self._bytes -= assembly.nbytes
            whole = assembly.payload()
            self._store_locked(whole)
            return whole

    def _drop_assembly_locked(self, key: tuple[str, int, int], eviction: str) -> None:
        assembly = self._assemblies.pop(key)
        self._bytes -= assembly.nbytes
        logger.warning("KV inbox: dropped %d of %d shards of request %s (attempt %d): %s",
                       len(assembly.received), assembly.num_shards, key[0], key[1], eviction)
        if self._metrics is not None:
            self._metrics.evicted(eviction)
        self._update_gauges()

    def abandon(self, request_id: str, attempt: int, num_shards: int, why: str) -> None:
        """A shard of this tensor-parallel attempt was refused (``why``): its assembly, if
        one started, goes now, and its other shards are refused from now on (see the module
        docstring)."""
        if num_shards <= 1:
            return
        key = (request_id, attempt, num_shards)
        with self._cond:
            self._abandoned[key] = (why, self._clock())
            self._abandoned.move_to_end(key)
            while len(self._abandoned) > MAX_ABANDONED:
                self._abandoned.popitem(last=False)
            if key in self._assemblies:
                self._drop_assembly_locked(key, "abandoned")

    def abandoned(self, request_id: str, attempt: int, num_shards: int, shard: int
                  ) -> str | None:
        """Why a shard of this attempt would be refused (another shard of it was), or None."""
        key = (request_id, attempt, num_shards)
        with self._cond:
            self._expire_locked(self._clock())
            abandoned = self._abandoned.get(key)
        return None if abandoned is None else _abandoned_reason(shard, key, abandoned[0])

    def has_room(self, request_id: str, attempt: int, num_shards: int, nbytes: int) -> bool:
        """Whether a payload of ``nbytes`` (one shard's, when ``num_shards`` > 1) would fit
        now, as put() decides: a shard of a transfer whose assembly started fits in the room
        that assembly reserved; a whole payload may use the bytes of the stored payload of
        the same request it would replace. The receiver asks before it reads (put() stays
        the authority: it refuses with InboxFull)."""
        with self._cond:
            if num_shards > 1:
                if (request_id, attempt, num_shards) in self._assemblies:
                    return True
                return self._bytes + nbytes * num_shards <= self.max_bytes
            old = self._entries.get(request_id)
            freed = old.nbytes if old is not None else 0
            return self._bytes - freed + nbytes <= self.max_bytes

    def expire(self) -> int:
        """Evict payloads older than the TTL now; the number evicted."""
        with self._cond:
            return self._expire_locked(self._clock())

    def next_expiry_in(self) -> float | None:
        """Seconds until the oldest payload expires (None when empty), for the receiver's
        wake-up timer."""
        with self._cond:
            starts = [e.stored_at for e in itertools.islice(self._entries.values(), 1)]
            starts += [a.started_at for a in itertools.islice(self._assemblies.values(), 1)]
            if not starts:
                return None
            return max(0.0, min(starts) + self.ttl_s - self._clock())

    # ------------------------------------------------------------------ consumer side
    def get(self, request_id: str, timeout_s: float = 0.0, *, remove: bool = True,
            assemble: bool = True) -> KVPayload | None:
        """The payload of ``request_id`` (the id it was sent under, or its external request
        id), waiting up to ``timeout_s`` for it to arrive; None on timeout. ``remove``
        (default) consumes it, freeing its bytes. The payload comes assembled (``kv`` set):
        one stored as read is assembled here, on the caller's thread, outside the lock;
        ``assemble=False`` leaves that to the caller (``payload.materialize``, into memory of
        its choice)."""
        start = time.monotonic()
        deadline = start + max(0.0, timeout_s)
        with self._cond:
            while True:
                self._expire_locked(self._clock())
                key = self._key_locked(request_id)
                entry = self._entries.get(key) if key is not None else None
                if entry is not None:
                    if remove:
                        self._remove_locked(key, None)
                    self._observe_wait(time.monotonic() - start, True)
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    self._observe_wait(time.monotonic() - start, False)
                    return None
                # Woken by put(); the loop re-checks (spurious wake-ups, other request ids).
                self._cond.wait(left)
        if assemble:
            entry.payload.materialize(self._allocate)
        return entry.payload

    def list(self) -> list[dict]:
        """Summaries of the stored payloads, oldest first (for the stage's HTTP endpoint)."""
        with self._cond:
            self._expire_locked(self._clock())
            return [e.payload.summary() for e in self._entries.values()]

    def __len__(self) -> int:
        with self._cond:
            return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        with self._cond:
            return self._key_locked(request_id) is not None

    @property
    def bytes(self) -> int:
        with self._cond:
            return self._bytes

    # ------------------------------------------------------------------ internals
    def _key_locked(self, request_id: str) -> str | None:
        """The stored entry's key for an id or an external id, or None."""
        if request_id in self._entries:
            return request_id
        return self._aliases.get(request_id)

    def _expire_locked(self, now: float) -> int:
        evicted = 0
        while self._entries:
            rid, entry = next(iter(self._entries.items()))
            if now - entry.stored_at < self.ttl_s:
                break  # store order is expiry order
            self._remove_locked(rid, "expired")
            evicted += 1
        while self._assemblies:
            key, assembly = next(iter(self._assemblies.items()))
            if now - assembly.started_at < self.ttl_s:
                break  # start order is expiry order
            self._drop_assembly_locked(key, "expired")
            evicted += 1
        while self._abandoned:
            if now - next(iter(self._abandoned.values()))[1] < self.ttl_s:
                break  # abandon order is expiry order
            self._abandoned.popitem(last=False)
        return evicted

    def _remove_locked(self, request_id: str, eviction: str | None) -> None:
        entry = self._entries.pop(request_id)
        alias = entry.payload.external_request_id
        if alias and self._aliases.get(alias) == request_id:
            del self._aliases[alias]
        self._bytes -= entry.nbytes
        if eviction is not None:
            logger.warning("KV inbox: evicted payload of request %s (%d bytes): %s",
                           request_id, entry.nbytes, eviction)
            if self._metrics is not None:
                self._metrics.evicted(eviction)
        self._update_gauges()

    def _update_gauges(self) -> None:
        if self._metrics is not None:
            self._metrics.set_inbox(len(self._entries), self._bytes)

    def _observe_wait(self, seconds: float, found: bool) -> None:
        if self._metrics is not None:
            self._metrics.observe_wait(seconds, found)


def _abandoned_reason(shard: int, key: tuple[str, int, int], why: str) -> str:
    return (f"shard {shard} of {key[2]} of request {key[0]} (attempt {key[1]}): another shard "
            f"of this attempt was refused ({why}), so it cannot be assembled")
