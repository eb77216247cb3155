"""The KV wire's rules that the operator and the runtime both state: its version, and the
codes a receiver refuses a transfer with.

The runtime's control protocol (``omni_runtime/kv/transport/protocol.py``) puts
``KV_WIRE_VERSION`` in every hello and read, and its compatibility hash (``Compat``) covers it: a
receiver answers a message of another version ``unsupported_version`` and a mismatched hash
``incompatible``. The operator never imports the runtime, yet a pipeline's revision (the hash
of everything that must match across its stages) must change when the format does, so that a
new format rolls out as a new revision whose senders only ever reach receivers of their own
revision: both read the version here.

``REJECT_CODES`` is the receiver's answer to a transfer it refuses, and the ``reason`` label
of its metrics (``omni_kv_receiver_rejected_total``): a bounded enum, stated once.
"""

#: 3: the compatibility fields name the sender's pipeline revision (``Compat.revision``).
#: 4: after the hello (whose answer carries the receiver's NIXL metadata), every control message
#: travels as a NIXL notification.
KV_WIRE_VERSION = 4

#: Why a receiver refuses: a bounded enum, the ``reason`` metric label.
REJECT_CODES: tuple[str, ...] = (
    "bad_frames",           # not the frames a message of its type has
    "malformed",            # not JSON, not an object, a field missing, mistyped or out of range
    "unsupported_version",  # "v" is not KV_WIRE_VERSION
    "incompatible",         # compatibility fields or hash differ from what this stage expects
    "unknown_agent",        # a read from an agent that sent no accepted hello (re-handshake)
    "wrong_destination",    # to_stage / pipeline name another stage or pipeline
    "oversized",            # the payload would exceed the receiver's max_payload_bytes
    "inbox_full",           # storing it would exceed the inbox's memory bound
    "shard_mismatch",       # a shard that does not fit the other shards of its transfer
    "read_failed",          # NIXL could not read the blocks (peer gone, memory not registered)
    "deadline",             # the transfer's time ran out before the read or the verdict
    "input_refused",        # the stage that takes it as a request's input refused it (why)
    "stopping",             # the stage is stopping (its open streams drain): another replica may take it
    "internal_error",       # a bug on the receiver (logged with its traceback)
)
