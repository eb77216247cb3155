"""The OmniPipeline's status: a pure function of its stage Deployments and of the last
reading of its stages' transfer metrics (``transfers.py``).

Conditions follow the Kubernetes convention (type, status, reason, message,
lastTransitionTime); a condition keeps its lastTransitionTime while its status is unchanged.
"""
from __future__ import annotations

from typing import Any, Mapping

from typing import TYPE_CHECKING

from omni_operator.pipeline import naming
from omni_operator.pipeline.model import Pipeline
from omni_operator.health.transfers import FAILING, NOT_READ, TRANSFERS_HEALTHY, TransfersVerdict

if TYPE_CHECKING:
    from .rollout import Plan

READY, PROGRESSING, DEGRADED = "Ready", "Progressing", "Degraded"


def _deployment_condition(deployment: Mapping[str, Any], ctype: str) -> Mapping[str, Any]:
    for cond in (deployment.get("status") or {}).get("conditions") or []:
        if cond.get("type") == ctype:
            return cond
    return {}


def stage_state(desired_replicas: int, deployment: Mapping[str, Any] | None) -> tuple[dict[str, int], str, str]:
    """(counts, state, detail) of one stage; state is ready, progressing or failing."""
    if deployment is None:
        return {"replicas": desired_replicas, "readyReplicas": 0, "updatedReplicas": 0}, "progressing", "Deployment not created yet"
    st = deployment.get("status") or {}
    counts = {
        "replicas": desired_replicas,
        "readyReplicas": int(st.get("readyReplicas") or 0),
        "updatedReplicas": int(st.get("updatedReplicas") or 0),
    }
    progressing = _deployment_condition(deployment, "Progressing")
    failure = _deployment_condition(deployment, "ReplicaFailure")
    if progressing.get("reason") == "ProgressDeadlineExceeded":
        return counts, "failing", f"rollout exceeded its progress deadline: {progressing.get('message', '')}".rstrip(": ")
    if failure.get("status") == "True":
        return counts, "failing", f"cannot create pods: {failure.get('message', '')}".rstrip(": ")
    generation = int((deployment.get("metadata") or {}).get("generation") or 0)
    observed = int(st.get("observedGeneration") or 0)
    spec_replicas = int((deployment.get("spec") or {}).get("replicas", desired_replicas))
    if spec_replicas < desired_replicas:
        return counts, "progressing", f"{spec_replicas}/{desired_replicas} pods started (receivers first, within maxSurge)"
    if observed < generation or spec_replicas != desired_replicas:
        return counts, "progressing", "rollout not yet observed"
    if counts["updatedReplicas"] < desired_replicas or int(st.get("replicas") or 0) > desired_replicas:
        return counts, "progressing", f"{counts['updatedReplicas']}/{desired_replicas} replicas updated"
    if counts["readyReplicas"] < desired_replicas:
        return counts, "progressing", f"{counts['readyReplicas']}/{desired_replicas} replicas ready"
    return counts, "ready", ""


def _condition(ctype: str, ok: bool, reason: str, message: str, generation: int) -> dict[str, Any]:
    return {"type": ctype, "status": "True" if ok else "False", "reason": reason, "message": message,
            "observedGeneration": generation}


def with_transition_times(conditions: list[dict[str, Any]], previous: list[Mapping[str, Any]] | None, now: str) -> list[dict[str, Any]]:
    before = {c.get("type"): c for c in previous or []}
    out = []
    for cond in conditions:
        old = before.get(cond["type"])
        same = old is not None and old.get("status") == cond["status"] and old.get("lastTransitionTime")
        out.append({**cond, "lastTransitionTime": old["lastTransitionTime"] if same else now})
    return out


def _previous_condition(previous: Mapping[str, Any] | None, ctype: str) -> Mapping[str, Any] | None:
    return next((c for c in (previous or {}).get("conditions") or [] if c.get("type") == ctype), None)


def transfers_condition(verdict: TransfersVerdict | None, previous: Mapping[str, Any] | None,
                        generation: int) -> dict[str, Any]:
    """The TransfersHealthy condition: the verdict's, or without a new reading the previous one
    (status between two resyncs keeps what the last reading said), or "not read yet"."""
    if verdict is None:
        old = _previous_condition(previous, TRANSFERS_HEALTHY)
        if old is not None and old.get("status") in ("True", "False", "Unknown"):
            return {"type": TRANSFERS_HEALTHY, "status": old["status"], "reason": old.get("reason", ""),
                    "message": old.get("message", ""), "observedGeneration": generation}
        verdict = NOT_READ
    return {"type": TRANSFERS_HEALTHY, "status": verdict.status, "reason": verdict.reason,
            "message": verdict.message, "observedGeneration": generation}


def _standing_failure(verdict: TransfersVerdict | None, previous: Mapping[str, Any] | None) -> bool:
    """A first reading (the reader just started: failures not counted yet) that finds nothing
    else wrong does not clear a TransfersFailing the previous status reported: no recovery and
    relapse around an operator restart; the next reading judges it."""
    if verdict is None or verdict.judged_failing or verdict.status != "True":
        return False
    old = _previous_condition(previous, TRANSFERS_HEALTHY) or {}
    return old.get("status") == "False" and old.get("reason") == FAILING


INTERVAL_COUNTS = ("failed", "expired", "rejected")


def _with_previous_counts(new: Mapping[str, Any], old: Mapping[str, Any] | None) -> dict[str, Any]:
    """A first reading's figures with the counts over the last interval (which it could not
    take) as the previous status had them."""
    out = dict(new)
    old = old or {}
    for key in INTERVAL_COUNTS:
        if key in old:
            out[key] = old[key]
        elif key == "rejected":
            out.pop(key, None)
    if "edges" in out:
        before = {e.get("toStage"): e for e in old.get("edges") or []}
        out["edges"] = [{**e, **{k: before[e["toStage"]][k] for k in ("failed", "expired")
                                 if k in before.get(e["toStage"], {})}} for e in out["edges"]]
    return out


def compute_status(pipeline: Pipeline, deployments: Mapping[str, Mapping[str, Any]],
                   previous: Mapping[str, Any] | None, now: str,
                   transfers: TransfersVerdict | None = None, *, transfer_health: bool = True,
                   targets: Mapping[str, int] | None = None, rollout: "Plan | None" = None,
                   autoscalers: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Status from the current revision's stage Deployments (keyed by stage name), the
    rollout's step (``rollout``: the revisions and what it waits for) and the verdict of the
    last reading of the stages' transfer metrics (None: no new reading; the previous status's
    transfer fields stay as they are). ``transfer_health=False``: the operator does not read
    them (no TransfersHealthy condition, ``transfersHealth: off``). ``targets``: each stage's
    replicas (the spec's, or its autoscaler's, named in ``autoscalers``)."""
    old_stages = {st.get("name"): st for st in (previous or {}).get("stages") or []}
    targets = targets or {}
    autoscalers = autoscalers or {}
    draining = {entry["name"] for r in (rollout.revisions if rollout else []) if not r.current
                for entry in r.stages}
    stages, waiting, failing = [], [], []
    for stage in pipeline.stages:
        counts, state, detail = stage_state(targets.get(stage.name, stage.replicas), deployments.get(stage.name))
        if state == "ready" and stage.name in draining:
            state, detail = "progressing", "an old revision is draining"
        entry: dict[str, Any] = {"name": stage.name, **counts}
        if stage.name in autoscalers:
            entry["autoscaler"] = autoscalers[stage.name]
        before = (old_stages.get(stage.name) or {}).get("transfers")
        figures = (None if not transfer_health else transfers.stages.get(stage.name) if transfers is not None
                   else before)
        if figures and transfers is not None and not transfers.judged_failing:
            figures = _with_previous_counts(figures, before)
        if figures:
            entry["transfers"] = figures
        stages.append(entry)
        if state == "failing":
            failing.append(f"{stage.name}: {detail}")
        elif state == "progressing":
            waiting.append(f"{stage.name}: {detail}")
    ready_count = len(pipeline.stages) - len(waiting) - len(failing)
    all_ready = not waiting and not failing
    gen = pipeline.generation
    rolling = rollout is not None and rollout.rolling
    progress = list(waiting)
    if rolling:  # the step: what the rollout to the current revision waits for
        progress = [f"revision {pipeline.revision}: " + "; ".join(rollout.waiting or waiting or ["finishing"])]
    conditions = [
        _condition(READY, all_ready, "AllStagesReady" if all_ready else "StagesNotReady",
                   "all stages are ready" if all_ready else "; ".join(failing + waiting), gen),
        _condition(PROGRESSING, bool(waiting) or rolling,
                   "RevisionRollingOut" if rolling else "RollingOut" if waiting else "Complete",
                   "; ".join(progress) if progress else "no rollout in progress", gen),
        _condition(DEGRADED, bool(failing), "StageFailing" if failing else "AsExpected",
                   "; ".join(failing) if failing else "no stage is failing", gen),
    ]
    standing = _standing_failure(transfers, previous)
    if transfer_health:
        conditions.append(transfers_condition(None if standing else transfers, previous, gen))
    phase = "Degraded" if failing else "Ready" if all_ready else "Progressing"
    summary = ("off" if not transfer_health else transfers.summary if transfers is not None and not standing
               else (previous or {}).get("transfersHealth") or NOT_READ.summary)
    status = {
        "observedGeneration": gen,
        "phase": phase,
        "stagesReady": f"{ready_count}/{len(pipeline.stages)}",
        "transfersHealth": summary,
        "stages": stages,
        "conditions": with_transition_times(conditions, (previous or {}).get("conditions"), now),
    }
    if pipeline.revision:
        status["revision"] = pipeline.revision
    shape = pipeline.endpoint_stages
    if shape is not None:  # the one address a client uses for the whole pipeline (the ENDPOINT column)
        status["endpoint"] = naming.pipeline_endpoint(pipeline.name, shape[0].name, pipeline.namespace)
    if rollout is not None:
        status["revisions"] = [{"revision": r.revision, "current": r.current, "draining": r.draining,
                                "stages": r.stages} for r in rollout.revisions]
    return status


NOT_PROGRESSING = {
    "ChildRejected": "this generation is not applied again; fix what the API server refused, then change the spec "
                     "(or restart the operator) to retry",
    "ChildConflict": "the stage's children cannot be applied until the conflicting objects are deleted or renamed",
}


def refused_status(status: Mapping[str, Any], generation: int, reason: str, message: str,
                   previous: Mapping[str, Any] | None, now: str) -> dict[str, Any]:
    """``status`` (the stages as the last admitted spec runs them) of a resource whose current
    spec (``generation``) is refused: Ready=False and Degraded with the reason; Progressing as
    the kept spec's rollout goes on."""
    kept = [dict(c) for c in status.get("conditions") or [] if c["type"] not in (READY, DEGRADED)]
    conditions = [_condition(READY, False, reason, message, generation),
                  _condition(DEGRADED, True, reason, message, generation), *kept]
    return {**status, "observedGeneration": generation, "phase": "Failed",
            "conditions": with_transition_times(conditions, (previous or {}).get("conditions"), now)}


def invalid_status(generation: int, message: str, previous: Mapping[str, Any] | None, now: str,
                   reason: str = "InvalidSpec",
                   deployments: Mapping[str, Mapping[str, Any] | None] | None = None) -> dict[str, Any]:
    """Status of a resource that cannot be applied: Ready=False with the reason; nothing
    changed. The stages that run (the previous status's, at its revision) are as observed:
    ``deployments``, their Deployments by stage name (None: not read, kept as they were)."""
    previous = previous or {}
    stages = [dict(entry) for entry in previous.get("stages") or []]
    ready = previous.get("stagesReady", "0/0")
    if deployments is not None and stages:
        for entry in stages:
            desired = int(entry.get("replicas") or 0)
            counts, _, _ = stage_state(desired, deployments.get(entry.get("name")))
            entry.update(counts)
        ready = f"{sum(1 for e in stages if e['readyReplicas'] >= e['replicas'])}/{len(stages)}"
    conditions = [
        _condition(READY, False, reason, message, generation),
        _condition(PROGRESSING, False, reason, NOT_PROGRESSING.get(reason, "nothing is applied until the spec is fixed"),
                   generation),
        _condition(DEGRADED, True, reason, message, generation),
    ]
    # Transfer health is about the stages that run, whatever the spec now says: kept as read.
    transfers = _previous_condition(previous, TRANSFERS_HEALTHY)
    if transfers is not None:
        conditions.append(dict(transfers))
    status = {
        "observedGeneration": generation,
        "phase": "Failed",
        "stagesReady": ready,
        "stages": stages,
        "conditions": with_transition_times(conditions, previous.get("conditions"), now),
    }
    if "transfersHealth" in previous:
        status["transfersHealth"] = previous["transfersHealth"]
    return status


def status_patch(current: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of status to write: empty when nothing changed (no write)."""
    current = current or {}
    return {k: v for k, v in desired.items() if current.get(k) != v}
