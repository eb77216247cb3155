"""The KV data plane's transport, on NIXL: what NIXL itself does not do.

NIXL moves the bytes (nixl_agent.py: the receiving stage reads the blocks straight out of the
AR's registered KV cache) and, as notifications, the control messages. What is here: the
control protocol (protocol.py: the hello over one ZeroMQ connection per peer, then the read
descriptor, the fence's verdict and the ack as NIXL notifications), the AR rank's control side
(:class:`KVSender`), the receiving side (:class:`KVReceiver`: NIXL reads into registered
staging slots, assembly of the payload from the AR's block format, the fence) and its inbox
(:class:`KVInbox`, shards.py for tensor-parallel shards).

No vLLM import here, and nothing else of omni_runtime: the omni KV connector's worker half
uses :class:`KVSender`; a receiving stage runs :class:`KVReceiver` into a :class:`KVInbox`.
"""

from omni_runtime.kv.transport.inbox import InboxFull, KVInbox
from omni_runtime.kv.transport.observer import NullReceiverObserver, ReceiverObserver
from omni_runtime.kv.transport.payload import KVPayload
from omni_runtime.kv.transport.protocol import REJECT_CODES, WIRE_VERSION
from omni_runtime.kv.transport.receiver import KVReceiver
from omni_runtime.kv.transport.sender import KVSender, Offer

__all__ = ["KVPayload", "KVSender", "Offer", "KVReceiver", "KVInbox", "InboxFull",
           "ReceiverObserver", "NullReceiverObserver", "REJECT_CODES", "WIRE_VERSION"]
