"""vLLM's v1 scheduler extended for omni pipelines: decides when a request's KV goes to the
next stage, hands the blocks to the runner and holds them until the transfer resolves.

``--scheduler-cls omni_runtime.sched.OmniARScheduler`` is the public path (it picks the async
variant itself under async scheduling).
"""

from omni_runtime.sched.scheduler import OmniARAsyncScheduler, OmniARScheduler

__all__ = ["OmniARScheduler", "OmniARAsyncScheduler"]
