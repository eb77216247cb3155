"""Which replica a scale-in removes: the pods with open streams last.

A Deployment scaled in (its autoscaler, a rollout's step down of an old revision, a user)
has its ReplicaSet pick the pods to delete; among pods alike it removes those of the lowest
``controller.kubernetes.io/pod-deletion-cost`` first. The operator sets that annotation on
each stage pod from the streams open at the pod, at either end of its streamed edges, as its
last reading of the pods' metrics says (``transfers.PipelineReading``, on the resync timer), so
idle replicas go before ones that would have to drain a stream. A replica picked anyway drains
its open streams on SIGTERM, within a grace period that covers its edges' longest
``streamSeconds`` (``omni_contract.edges.drain_seconds``): this only makes that rarer.

The cost is the count of open streams rounded down to a step (``STEPS``), so a busy pod's
annotation changes when its load crosses a step, not at every resync; a pod with no open
stream has no annotation (the default cost, 0). Written only where it changes, and only where
the pods were listed (the pod reader; with ``--prometheus-url`` the operator lists no pods
and sets no cost).
"""
from __future__ import annotations

from typing import Any, Mapping

from omni_operator.pipeline.naming import POD_DELETION_COST
from omni_operator.health.transfers import PipelineReading, PodReading

#: The counts of open streams a cost is rounded down to.
STEPS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


def cost(open_streams: float) -> int:
    """The deletion cost of a pod with ``open_streams`` streams open: 0 for none, else the
    largest step not above it."""
    return max((step for step in STEPS if step <= open_streams), default=0)


def open_streams(pod: PodReading) -> float:
    """The streams open at a pod, either end of any of its edges."""
    return sum(sample.open for sample in pod.streams.values())


def desired(reading: PipelineReading) -> dict[str, int]:
    """Each running pod's cost, by name (a pod read as unreadable counts as none open)."""
    costs = {pod: 0 for pod in reading.deletion_costs or {}}
    for stage in reading.stages.values():
        for pod in stage.pods:
            costs[pod.pod] = cost(open_streams(pod))
    return costs


def patches(reading: PipelineReading) -> dict[str, dict[str, Any]]:
    """The merge patch of each pod whose annotation differs from its cost (none where the
    reading listed no pods)."""
    current: Mapping[str, str | None] | None = reading.deletion_costs
    if current is None:
        return {}
    out = {}
    for pod, want in desired(reading).items():
        have = current.get(pod)
        value = str(want) if want else None
        if have != value:
            out[pod] = {"metadata": {"annotations": {POD_DELETION_COST: value}}}
    return out
