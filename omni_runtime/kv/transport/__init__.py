"""The KV transport: ships a request's KV cache from an AR stage to the next stages over
ZeroMQ, with delivery acks (wire format and semantics: docs/connector.md).

No vLLM import here: the omni KV connector's worker side builds :class:`KVPayload` host arrays and
calls :class:`KVSender`; a receiving stage runs :class:`KVReceiver` into a :class:`KVInbox`.
"""

from omni_runtime.kv.transport.inbox import InboxFull, KVInbox
from omni_runtime.kv.transport.observer import NullReceiverObserver, ReceiverObserver
from omni_runtime.kv.transport.receiver import KVReceiver
from omni_runtime.kv.transport.sender import KVSender
from omni_runtime.kv.transport.wire import REJECT_CODES, WIRE_VERSION, KVPayload

__all__ = ["KVPayload", "KVSender", "KVReceiver", "KVInbox", "InboxFull", "ReceiverObserver",
           "NullReceiverObserver",
           "REJECT_CODES", "WIRE_VERSION"]
