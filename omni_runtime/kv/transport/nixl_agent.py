"""A NIXL agent, as the KV data plane uses it: register memory once, read remote blocks.

NIXL (PyPI ``nixl``; the CUDA-variant wheels ``nixl-cu12``/``nixl-cu13`` carry the binaries)
is the transfer engine vLLM's NixlConnector, Dynamo and llm-d move KV with, over UCX: NVLink
(``cuda_ipc``) within a node, RDMA across nodes, ``cma`` (one process reading another's
memory) or TCP on CPUs. This module is the only one that imports it.

Progress. The side that initiates a transfer progresses it by polling its state; the side
whose memory is read needs progress only on transports that emulate remote reads in
software (UCX's TCP). An agent made with ``progress_thread`` (the AR's) has NIXL's own
progress thread do it: the thread waits on UCX's event descriptor, so it runs when a peer's
request arrives and not otherwise. NIXL's Python wrapper fixes that thread's poll timeout at
0, which makes it spin (a whole core while idle), so the agent is made with a timeout of
:data:`PROGRESS_THREAD_TIMEOUT_US` instead (next to no CPU while idle: docs/connector.md,
"Figures behind the design").
An agent without it is progressed by whoever calls :meth:`KVAgent.progress`.

Destruction. Destroying an agent joins its progress thread; the thread waits on UCX's event
descriptors, and if one of them was closed behind UCX's back (a stray close elsewhere in the
process) and its number reused, the thread can block in a ``read`` for ever, and the join
with it, holding the interpreter's lock: the process hangs. :meth:`KVAgent.close` destroys the
agent at once (not whenever the garbage collector gets to it) after checking that the event
descriptors made with it are still its own; if not, it leaves the agent undestroyed (its
memory and thread, for the process's life) and logs the error, rather than hang.

Notifications. An agent that has loaded a peer's metadata can send it a message
(:meth:`KVAgent.notify`), and a READ may carry one that NIXL delivers to the peer whose memory
was read once the read has completed (``read(..., notify=)``). The peer collects them with
:meth:`KVAgent.notifications`; polling for them is also what progresses an agent, so
:meth:`KVAgent.progress` keeps what it collects for the next :meth:`KVAgent.notifications`:
one mechanism, nothing dropped. They work here between processes, over shared memory and over
UCX's TCP (``benchmarks/kv_control_rtt.py``; docs/connector.md, "The control plane and NIXL
notifications").
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

#: Transfer states as NIXL names them.
DONE, IN_PROGRESS, ERROR = "DONE", "PROC", "ERR"


#: The poll timeout of NIXL's progress thread, in microseconds: how long the thread sleeps when
#: UCX's event descriptor says nothing (a peer's request over TCP wakes it at once). Only
#: progress that raises no event waits for it: UCX's own timers, and a wake-up that UCX's
#: descriptor misses (NIXL's source keeps a timeout for that). Much shorter, and idle agents
#: take the CPU from busy ones where several stages share a host (docs/connector.md,
#: "Figures behind the design").
PROGRESS_THREAD_TIMEOUT_US = 100_000

#: Notifications collected and not taken that an agent keeps (beyond, the oldest are dropped,
#: logged): a bound on what an agent nobody asks for them can hold.
MAX_PENDING_NOTIFICATIONS = 1 << 16

# The wrapper's progress-thread timeout is replaced while an agent is made (below): one at a time.
_MAKING = threading.Lock()
# Guards each agent's one reader of notifications (KVAgent.claim).
_CLAIMS = threading.Lock()


class NixlUnavailable(RuntimeError):
    """NIXL cannot be loaded or set up here; the message says what to install or fix."""


#: UCX settings this data plane wants unless the deployment says otherwise (read by UCX when
#: the first agent is created):
#: * CUDA IPC reads: UCX serves a GET between two processes' GPU memory with CUDA IPC only
#:   when it detects NVLink; otherwise it bounces the bytes through host memory. The receiver
#:   pulls (GET), and bounced reads were three orders of magnitude slower on an H200
#:   (docs/connector.md, "Figures behind the design").
#:   (Set only where an NVIDIA driver is: UCX warns about a variable of a module it lacks.)
#: * the registration cache's unreleased-region limit vLLM sets too (a rare leak in UCX).
UCX_DEFAULTS = {"UCX_RCACHE_MAX_UNRELEASED": "1024"}
UCX_CUDA_DEFAULTS = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}


def _nixl_api() -> Any:
    defaults = dict(UCX_DEFAULTS)
    if os.path.exists("/proc/driver/nvidia/version"):
        defaults.update(UCX_CUDA_DEFAULTS)
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    try:
        from nixl import _api  # the meta package: picks nixl_cu13 / nixl_cu12 / nixl_rocm
    except ImportError as exc:
        raise NixlUnavailable(
            f"NIXL is not installed ({exc}): install the `nixl` package with the wheel for "
            "this machine's CUDA (`nixl-cu12` or `nixl-cu13`; on a CPU-only host "
            "`pip install --no-deps nixl nixl-cu12`, which keeps the CPU torch)"
        ) from None
    return _api


class KVAgent:
    """One NIXL agent with the UCX backend. ``name`` must be unique among the agents that
    talk to each other: a restarted process is a new agent (a stale name is never reused)."""

    def __init__(self, name: str, backends: Sequence[str] = ("UCX",), *,
                 progress_thread: bool = False) -> None:
        api = _nixl_api()
        try:
            def make() -> tuple[Any, bool]:
                return _make_agent(api, name, backends, progress_thread)

            # The event descriptors a progress thread waits on are watched (close()).
            (self._agent, progress_thread), watched = (_with_new_event_fds(make) if progress_thread
                                                       else (make(), {}))
        except Exception as exc:
            raise NixlUnavailable(f"cannot create the NIXL agent {name!r} with backends "
                                  f"{list(backends)}: {type(exc).__name__}: {exc}") from None
        if not self._agent.backends:
            raise NixlUnavailable(
                f"NIXL agent {name!r} has none of the backends {list(backends)} (plugins "
                f"found: {self._agent.get_plugin_list()}): is UCX's plugin in the wheel?")
        self.name = name
        #: Whether NIXL's thread progresses this agent (else :meth:`progress` must, where a
        #: peer reads its memory over a transport that needs the owner's progress).
        self.progresses_itself = progress_thread
        self._event_fds: dict[int, str] = watched if progress_thread else {}
        self._registrations: list[Any] = []
        # Notifications collected by progress() and not taken yet: (peer, message), oldest first.
        self._pending: list[tuple[str, bytes]] = []
        self._reader: object | None = None  # the one taker of notifications (claim())
        #: The peers whose metadata is loaded (add_remote, not yet remove_remote).
        self.remotes: set[str] = set()

    # ------------------------------------------------------------------ memory
    def register(self, regions: Sequence[tuple[int, int, int]], mem_type: str) -> Any:
        """Register ``(addr, length, device)`` regions of ``mem_type`` ("DRAM" or "VRAM")
        with every backend; raises NixlUnavailable naming the cause. Returns the
        registration, for :meth:`deregister` (close() deregisters what is left)."""
        try:
            descs = self._agent.get_reg_descs(
                np.array([[a, n, d] for a, n, d in regions], dtype=np.uint64), mem_type)
            self._agent.register_memory(descs)
        except Exception as exc:
            total = sum(n for _, n, _ in regions)
            raise NixlUnavailable(
                f"registering {len(regions)} {mem_type} regions ({total} bytes) with NIXL "
                f"failed: {type(exc).__name__}: {exc}") from None
        self._registrations.append(descs)
        return descs

    def deregister(self, registration: Any) -> None:
        """Deregister what one :meth:`register` registered (the memory may be freed then)."""
        self._registrations = [r for r in self._registrations if r is not registration]
        self._agent.deregister_memory(registration)

    def metadata(self) -> bytes:
        """What a peer needs to read this agent's registered memory (add_remote)."""
        return self._agent.get_agent_metadata()

    # ------------------------------------------------------------------ peers
    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata (again: NIXL takes it); its agent name."""
        name = self._agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else str(name)
        self.remotes.add(name)
        return name

    def remove_remote(self, name: str) -> None:
        self.remotes.discard(name)
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:  # already gone, or never loaded: nothing to free
            logger.debug("NIXL: removing remote agent %s: %s", name, exc)

    # ------------------------------------------------------------------ transfers
    def read(self, local: np.ndarray, local_mem: str, remote: np.ndarray, remote_mem: str,
             remote_agent: str, notify: bytes = b"") -> Any:
        """Post a READ of the ``remote`` descriptors (Nx3 ``[addr, length, device]``) of
        ``remote_agent`` into the ``local`` ones (same lengths, pairwise); ``notify``: a
        message NIXL delivers to ``remote_agent`` once the read has completed. Returns a handle
        for :meth:`state` / :meth:`release`; raises on a request NIXL refuses (memory not
        registered, peer disconnected)."""
        agent = self._agent
        handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, local_mem),
                                       agent.get_xfer_descs(remote, remote_mem), remote_agent,
                                       notify)
        try:
            if agent.transfer(handle) == ERROR:
                raise RuntimeError("NIXL refused to post the READ")
        except BaseException:
            self.release(handle)
            raise
        return handle

    def state(self, handle: Any) -> str:
        """DONE, PROC or ERR (polling also progresses the transfer)."""
        try:
            return self._agent.check_xfer_state(handle)
        except Exception as exc:  # a peer that disconnected mid-transfer
            logger.debug("NIXL: transfer state: %s", exc)
            return ERROR

    def release(self, handle: Any) -> bool:
        """Release a transfer handle; False when NIXL refuses (the memory it targets must
        then stay untouched: the backend may still write it)."""
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:
            logger.warning("NIXL: releasing a transfer handle failed: %s", exc)
            return False
        return True

    # ------------------------------------------------------------------ notifications
    def notify(self, peer: str, message: bytes) -> None:
        """Send ``message`` to ``peer`` (an agent whose metadata this one has loaded); raises
        when NIXL cannot (the peer unknown or gone)."""
        self._agent.send_notif(peer, message)

    def claim(self, reader: object) -> None:
        """Make ``reader`` the one taker of this agent's notifications (an answer goes to
        whoever takes it first: two takers would take each other's); raises when another
        holds them. :meth:`unclaim` gives them back."""
        with _CLAIMS:
            if self._reader is not None and self._reader is not reader:
                raise RuntimeError(f"NIXL agent {self.name}'s notifications are taken by "
                                   f"{self._reader!r} already: one sender per agent")
            self._reader = reader

    def unclaim(self, reader: object) -> None:
        with _CLAIMS:
            if self._reader is reader:
                self._reader = None

    def notifications(self) -> list[tuple[str, bytes]]:
        """The messages peers sent since the last call, (peer, message), in the order NIXL
        delivered them (this also progresses the agent)."""
        self.progress()
        taken, self._pending = self._pending, []
        return taken

    def progress(self) -> None:
        """Drive the backends once (UCX's TCP transport serves remote reads only when the
        owner of the memory makes progress); what it collects waits for :meth:`notifications`."""
        for peer, messages in self._agent.get_new_notifs().items():
            peer = peer.decode() if isinstance(peer, bytes) else str(peer)
            self._pending.extend((peer, bytes(m)) for m in messages)
            if len(self._pending) > MAX_PENDING_NOTIFICATIONS:
                dropped = len(self._pending) - MAX_PENDING_NOTIFICATIONS
                del self._pending[:dropped]
                logger.warning("NIXL agent %s: %d notifications nobody took dropped (the oldest)",
                               self.name, dropped)

    def close(self) -> None:
        """Deregister what is registered and destroy the agent (once; nothing may use it
        after). An agent with a progress thread whose event descriptors are no longer its own
        is left undestroyed, logged (module docstring, "Destruction")."""
        agent = self.__dict__.pop("_agent", None)
        if agent is None:
            return
        for descs in self._registrations:
            try:
                agent.deregister_memory(descs)
            except Exception as exc:
                logger.debug("NIXL: deregistering: %s", exc)
        self._registrations.clear()
        lost = [fd for fd, what in self._event_fds.items() if _event_fd(fd) != what]
        if lost:
            logger.error("NIXL agent %s: its UCX event descriptors %s were closed by something else in "
                         "this process; the agent is left undestroyed (destroying it could hang the "
                         "process, joining a progress thread blocked on a reused descriptor)",
                         self.name, lost)
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(agent))  # never deallocated
        del agent

    def __getattr__(self, name: str) -> Any:
        if name == "_agent":
            raise NixlUnavailable(f"NIXL agent {self.__dict__.get('name', '?')} is closed")
        raise AttributeError(name)


def _event_fd(fd: int) -> str | None:
    """What ``fd`` is, as far as telling one event descriptor from another goes: its kind,
    and an eventfd's id (None: not open)."""
    try:
        kind = os.readlink(f"/proc/self/fd/{fd}")
        if kind != "anon_inode:[eventfd]":
            return kind
        with open(f"/proc/self/fdinfo/{fd}") as info:
            return kind + next((line.split()[1] for line in info if line.startswith("eventfd-id:")), "")
    except OSError:
        return None


def _with_new_event_fds(make: Any) -> tuple[Any, dict[int, str]]:
    """``make()``, and the event descriptors (eventfd, epoll) that appeared meanwhile: UCX's,
    as far as another thread made none at the same time (which could only make
    :meth:`KVAgent.close` keep an agent it could have destroyed)."""
    def event_fds() -> dict[int, str]:
        try:
            fds = os.listdir("/proc/self/fd")
        except OSError:  # no /proc: nothing is watched
            return {}
        found = {}
        for fd in map(int, fds):
            what = _event_fd(fd)
            if what is not None and what.startswith(("anon_inode:[eventfd]", "anon_inode:[eventpoll]")):
                found[fd] = what
        return found

    before = event_fds()
    made = make()
    return made, {fd: what for fd, what in event_fds().items() if before.get(fd) != what}


def _make_agent(api: Any, name: str, backends: Sequence[str], progress_thread: bool) -> tuple[Any, bool]:
    """A ``nixl_agent``, and whether NIXL's progress thread runs it: with ``progress_thread``,
    polling with a timeout of :data:`PROGRESS_THREAD_TIMEOUT_US` rather than the wrapper's 0
    (the wrapper sets the native config's ``pthrDelay`` itself and takes no value for it: the
    native constructor it calls is wrapped while the agent is made). A NIXL whose wrapper
    has no such constructor, or whose config has no such field, gets no progress thread (it
    would spin): its owner progresses it (:meth:`KVAgent.progress`)."""
    bindings = getattr(api, "nixlBind", None)
    native = getattr(bindings, "nixlAgent", None)
    if progress_thread and (native is None or not hasattr(getattr(bindings, "nixlAgentConfig", None),
                                                          "pthrDelay")):
        logger.warning("NIXL %s: no way to set its progress thread's poll timeout here; the agent "
                       "is progressed by its owner instead", getattr(api, "__name__", "?"))
        progress_thread = False
    config = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=list(backends))
    if not progress_thread:
        return api.nixl_agent(name, config), False
    timed: list[str] = []

    def with_timeout(agent_name: str, native_config: Any) -> Any:
        # Only this agent's: another thread may make an agent of its own meanwhile (vLLM's
        # NIXL connector beside ours), which keeps the wrapper's settings.
        if agent_name == name and getattr(native_config, "useProgThread", True):
            native_config.pthrDelay = PROGRESS_THREAD_TIMEOUT_US
            timed.append(agent_name)
        return native(agent_name, native_config)

    with _MAKING:
        bindings.nixlAgent = with_timeout
        try:
            agent = api.nixl_agent(name, config)
        finally:
            bindings.nixlAgent = native
    if timed:
        return agent, True
    # The wrapper did not make it through the constructor wrapped here: its thread may spin.
    del agent
    logger.warning("NIXL %s made its agent without the constructor this module sets the "
                   "progress thread's timeout through; the agent is progressed by its owner "
                   "instead", getattr(api, "__name__", "?"))
    return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False,
                                                      backends=list(backends))), False
