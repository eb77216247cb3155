"""A fault for the AR supervisor's end-to-end test (tests/runtime/test_stage_health.py): with
``OMNI_TEST_SENDER_DIES`` set, the KV sender's I/O thread dies at its first offer (the first
time it has a transfer to offer to a receiver), as a bug in it would. A mock of a fault,
because nothing deterministic kills the real thread inside a running vLLM engine; the engine,
the connector, the gauge and the supervisor are real. test_connector_faults.py checks that
this fault does what it says to the real KVSender.

Python imports ``sitecustomize`` at start-up from the path: the test puts this directory on
the PYTHONPATH of the stage it starts, so every process of it (the supervisor, vLLM's API
server, its engine core) gets the fault.
"""

import os

if os.environ.get("OMNI_TEST_SENDER_DIES"):
    from omni_runtime.kv.transport import sender as _sender

    _pump = _sender.KVSender._pump

    def _dying_pump(self, ep):
        # _pump offers an endpoint's queued transfers (once the receiver accepted this
        # rank's hello); it runs on the I/O thread, whose loop lets the exception end it.
        if ep.queue:
            raise RuntimeError("injected fault: the KV sender's I/O thread dies")
        return _pump(self, ep)

    _sender.KVSender._pump = _dying_pump
