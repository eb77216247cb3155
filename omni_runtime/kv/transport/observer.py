"""What the receiver and its inbox report, as an interface: the transport imports no metrics
library and nothing else of omni_runtime. The receiving stage passes
:class:`omni_runtime.observability.receiver_metrics.ReceiverMetrics`, which implements it."""

from __future__ import annotations

from typing import Protocol


class ReceiverObserver(Protocol):
    """Called from the receiver thread and from consumer threads: implementations are
    thread-safe and never raise."""

    def delivered(self, nbytes: int, from_stage: str | None = None) -> None: ...

    def rejected(self, code: str, from_stage: str | None = None) -> None:
        """``from_stage``: the stage the sender says it is, when the message got that far."""

    def set_inbox(self, payloads: int, nbytes: int) -> None: ...

    def evicted(self, reason: str) -> None: ...

    def observe_wait(self, seconds: float, found: bool) -> None: ...

    def thread_up(self, up: bool) -> None:
        """The receiver thread started (True) or ended (False, also when it died)."""


class NullReceiverObserver:
    """Reports nothing (tools and tests that do not read receiver metrics)."""

    def delivered(self, nbytes: int, from_stage: str | None = None) -> None:
        pass

    def rejected(self, code: str, from_stage: str | None = None) -> None:
        pass

    def set_inbox(self, payloads: int, nbytes: int) -> None:
        pass

    def evicted(self, reason: str) -> None:
        pass

    def observe_wait(self, seconds: float, found: bool) -> None:
        pass

    def thread_up(self, up: bool) -> None:
        pass
