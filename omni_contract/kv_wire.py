"""The KV payload format version both sides agree on, known to the operator without the runtime.

The runtime's control protocol (``omni_runtime/kv/transport/protocol.py``) puts
``WIRE_VERSION`` in every hello and read, and its compatibility hash (``Compat``) covers it: a
receiver answers a message of another version ``unsupported_version`` and a mismatched hash
``incompatible``. The operator never imports the runtime, yet a pipeline's revision (the hash
of everything that must match across its stages) must change when the format does, so that a
new format rolls out as a new revision whose senders only ever reach receivers of their own
revision. This is that version, for the operator; a test keeps it equal to the runtime's.
"""

KV_WIRE_VERSION = 3
