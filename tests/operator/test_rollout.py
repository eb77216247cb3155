"""Revisioned rollouts against the API emulator, step by step, with the invariants checked
after every step of the cluster (cluster_sim: the controllers and kubelets, which cannot run
here) and of the operator (its real reconcile, resync and metrics reader):

I1  every live sending revision has ready receivers of its own revision: a ready sending pod
    of revision R has, for each stage it sends to, a ready pod of R;
I2  no stage under its availability floor (target - maxUnavailable ready pods, all revisions
    together) or over its surge (target + maxSurge pods, terminating ones included), once
    the pipeline was ready before the change; where the rollout says it must drain a sender
    below its floor (receivers without surge), that is the only exception;
I3  an old revision's receiving pods go only once the senders of that revision upstream of
    them have no transfer in flight, or are past their drain deadline (their transfers
    abandoned, and a Warning event says so); no transfer is ever in flight toward a stage
    that has no pod left to receive it.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import pytest

from cluster_sim import Clock, SimCluster
from omnip_support import (NAMESPACE, create_pipeline, make_kube, patch_pipeline, pipeline_body, revision, status,
                           wait_for)
from omni_operator.pipeline import naming
from omni_operator.health.reader import PodMetricsSource, TransferHealth
from omni_operator.pipeline.kinds import CONFIGMAP, DEPLOYMENT, SERVICE
from omni_operator.controller.reconcile import Reconciler
from omni_operator.controller.resync import Resync

STAGES = ("thinker", "talker", "code2wav")


def three_stages(gpus: tuple[int, int, int] = (1, 0, 0), replicas: int = 2) -> list[dict]:
    return [
        {"name": "thinker", "role": "ar", "gpus": gpus[0], "replicas": replicas, "kvTransfer": {"send": True}},
        {"name": "talker", "role": "ar", "gpus": gpus[1], "replicas": replicas, "inputs": ["thinker"],
         "kvTransfer": {"send": True}},
        {"name": "code2wav", "role": "generation", "gpus": gpus[2], "replicas": replicas, "inputs": ["talker"]},
    ]


@dataclass
class Operator:
    """The operator's parts a resync round runs: the reconciler, the metrics reader on the
    test's clock, the resync timer's round (driven by hand)."""
    client: object
    health: TransferHealth
    reconciler: Reconciler
    resync: Resync

    def close(self) -> None:
        self.health.close()
        self.client.close()


@dataclass
class Rig:
    kube: object
    url: str
    clock: Clock
    sim: SimCluster
    operators: list[Operator] = field(default_factory=list)

    def start_operator(self) -> Operator:
        """A fresh operator process: nothing remembered but what the cluster holds."""
        client = make_kube(self.url)
        health = TransferHealth(PodMetricsSource(client, timeout=2.0, clock=self.clock))
        reconciler = Reconciler(client, health=health, now=self.clock)
        op = Operator(client, health, reconciler, Resync(reconciler, [NAMESPACE], interval=3600))
        self.operators.append(op)
        return op


@pytest.fixture
def rig(emulator, kube):
    clock = Clock(1_800_000_000)
    sim = SimCluster(kube, NAMESPACE, clock)
    r = Rig(kube, emulator.url, clock, sim)
    yield r
    sim.close()
    for op in r.operators:
        op.close()


class Invariants:
    def __init__(self, rig: Rig):
        self.rig = rig
        self.graphs: dict[str, dict[str, tuple[str, ...]]] = {}
        self.floors: dict[str, tuple[int, int, int]] | None = None  # stage -> (target, surge, unavailable)
        self.checks = 0
        self.floor_breaks: list[str] = []
        self.announced: set[str] = set()  # stages the rollout said it drains below their floor

    def baseline(self, stages: list[dict]) -> None:
        """The pipeline is ready: from now on the floors hold (with these stages' limits)."""
        self.floors = {}
        for s in stages:
            gpu = s.get("gpus", 1) > 0
            rollout = s.get("rollout") or {}
            self.floors[s["name"]] = (s.get("replicas", 1), rollout.get("maxSurge", 0 if gpu else 1),
                                      rollout.get("maxUnavailable", 1 if gpu else 0))

    def check(self, when: str) -> None:
        self.checks += 1
        sim, now = self.rig.sim, self.rig.clock()
        for dep in self.rig.kube.list(DEPLOYMENT, NAMESPACE, naming.PIPELINE_LABEL):
            labels, notes = dep["metadata"]["labels"], dep["metadata"].get("annotations") or {}
            graph = self.graphs.setdefault(labels[naming.REVISION_LABEL], {})
            graph[labels[naming.STAGE_LABEL]] = tuple(i for i in notes[naming.INPUTS_ANNOTATION].split(",") if i)
        pods = list(sim.pods.values())
        # I1
        for pod in pods:
            if not (pod.sends and pod.ready):
                continue
            graph = self.graphs[pod.revision]
            for downstream in (s for s, inputs in graph.items() if pod.stage in inputs):
                assert any(p.ready for p in sim.of(pod.revision, downstream)), \
                    f"{when}: {pod.name} (revision {pod.revision}) sends, no ready {downstream} of its revision"
        # I2
        if self.floors is not None:
            message = _progressing(self.rig.kube)
            for stage, (target, surge, unavailable) in self.floors.items():
                if f"{stage} drains below its floor" in message:
                    self.announced.add(stage)
                ready = sum(1 for p in pods if p.stage == stage and p.ready)
                every = sum(1 for p in pods if p.stage == stage)
                assert every <= target + surge, f"{when}: {stage} has {every} pods, over {target} + maxSurge {surge}"
                if ready < target - unavailable:
                    # Only where the rollout said so (and until the stage is back at its floor).
                    assert stage in self.announced, \
                        f"{when}: {stage} has {ready} ready pods, under {target} - maxUnavailable {unavailable}"
                    self.floor_breaks.append(stage)
                else:
                    self.announced.discard(stage)
        # I3
        for revision_, graph in self.graphs.items():
            for stage, inputs in graph.items():
                if not inputs:
                    continue
                live = sum(1 for p in sim.of(revision_, stage) if not p.terminating)
                senders = [p for u in inputs for p in sim.of(revision_, u)]
                # A receiver pod may go while its senders send if another stays: a stopping
                # replica refuses new hand-offs and its senders offer them to the others
                # (docs/operator.md, "Which replica a transfer or a stream goes to"); never the last one.
                if live == 0:
                    for p in senders:
                        assert p.in_flight == 0 or now >= p.drain_deadline, \
                            f"{when}: {p.name} has {p.in_flight} transfers in flight toward {stage}, which has no pod"


def _progressing(kube) -> str:
    return next((c.get("message", "") for c in status(kube).get("conditions", []) if c["type"] == "Progressing"), "")


def step(rig: Rig, op: Operator, inv: Invariants, n: int) -> None:
    """One step of the cluster, then one resync round of the operator (read the pods'
    metrics, reconcile), the invariants checked after each; then a second passes."""
    rig.sim.tick()
    inv.check(f"step {n}, after the cluster")
    op.resync.run_once()
    inv.check(f"step {n}, after the operator")
    rig.clock.advance(1)


def settled(rig: Rig, body: dict) -> bool:
    """Only the body's revision is left, every stage has all its pods ready, none terminating."""
    rev = revision(body)
    deployments = rig.kube.list(DEPLOYMENT, NAMESPACE, naming.PIPELINE_LABEL)
    if {d["metadata"]["labels"][naming.REVISION_LABEL] for d in deployments} != {rev}:
        return False
    if any(p.terminating or not p.ready for p in rig.sim.pods.values()):
        return False
    targets = {s["name"]: s.get("replicas", 1) for s in body["spec"]["stages"]}
    return all(len(rig.sim.of(rev, stage)) == target for stage, target in targets.items())


def run(rig: Rig, op: Operator, inv: Invariants, body: dict, max_steps: int = 200, start: int = 0) -> int:
    """Steps until the body's revision is all there is; how many it took."""
    for n in range(start, start + max_steps):
        if settled(rig, body):
            return n - start
        step(rig, op, inv, n)
    raise AssertionError(f"not settled after {max_steps} steps: {_progressing(rig.kube)}")


def bring_up(rig: Rig, op: Operator, inv: Invariants, body: dict) -> None:
    create_pipeline(rig.kube, body)
    steps = run(rig, op, inv, body)
    assert steps > 0 and status(rig.kube)["phase"] == "Ready"
    inv.baseline(body["spec"]["stages"])


def with_engine_args(body: dict, stage: int, args: dict) -> dict:
    changed = copy.deepcopy(body)
    changed["spec"]["stages"][stage]["engineArgs"] = args
    return changed


def events(kube, reason: str) -> list[dict]:
    return [e for e in kube.request("list", "Event", "GET", f"/api/v1/namespaces/{NAMESPACE}/events")["items"]
            if e["reason"] == reason]


# ------------------------------------------------------------------------------------------
def test_first_start_is_receivers_first(rig):
    """A new pipeline: each sending stage gets pods only once the stages it sends to have a
    ready pod of the same revision (I1 checked at every step)."""
    op, inv = rig.start_operator(), Invariants(rig)
    body = pipeline_body(stages=three_stages())
    create_pipeline(rig.kube, body)
    started: list[str] = []
    for n in range(30):
        if settled(rig, body):
            break
        step(rig, op, inv, n)
        for stage in STAGES:
            if stage not in started and rig.sim.of(revision(body), stage):
                started.append(stage)
    assert settled(rig, body) and started == ["code2wav", "talker", "thinker"]
    assert status(rig.kube)["phase"] == "Ready" and status(rig.kube)["revision"] == revision(body)


def test_a_rollout_keeps_every_invariant_at_every_step(rig):
    """Three stages x 2 pods (a GPU thinker: no surge; CPU talker and code2wav: surge 1),
    talker's engine arguments change: the new revision comes up receivers first, the old one
    drains by its transfers, oldest pods and senders first; nothing is abandoned."""
    op, inv = rig.start_operator(), Invariants(rig)
    body = pipeline_body(stages=three_stages())
    bring_up(rig, op, inv, body)
    old = revision(body)
    new_body = with_engine_args(body, 1, {"max-model-len": 2048})
    patch_pipeline(rig.kube, "tiny", {"spec": {"stages": new_body["spec"]["stages"]}})
    steps = run(rig, op, inv, new_body)
    st = status(rig.kube)
    assert st["revision"] == revision(new_body) != old and st["phase"] == "Ready"
    assert [r["revision"] for r in st["revisions"]] == [revision(new_body)]
    assert inv.floor_breaks == [] and rig.sim.abandoned == [] and events(rig.kube, "DrainDeadlinePassed") == []
    # The old revision's every object is gone: Deployments, ConfigMaps, KV Services.
    for kind in (DEPLOYMENT, CONFIGMAP, SERVICE):
        assert not [o for o in rig.kube.list(kind, NAMESPACE, f"{naming.REVISION_LABEL}={old}")]
    # Old senders drained before old receivers went: every old pod of a sending stage was
    # gone before the last old pod of the stage it sends to began terminating.
    gone = {p.name: p for p in rig.sim.gone}
    for sender, receiver in (("thinker", "talker"), ("talker", "code2wav")):
        senders = [p for p in gone.values() if p.revision == old and p.stage == sender]
        receivers = [p for p in gone.values() if p.revision == old and p.stage == receiver]
        assert senders and receivers
        assert max(p.started_terminating for p in senders) <= max(p.started_terminating for p in receivers)
    assert 5 < steps < 60, steps
    assert inv.checks > 2 * steps


def test_an_operator_restart_mid_rollout_resumes_it(rig):
    """The operator is replaced (nothing remembered) at every few steps of a rollout: each new
    one resumes from the objects; the invariants hold throughout; no write is repeated."""
    op, inv = rig.start_operator(), Invariants(rig)
    body = pipeline_body(stages=three_stages())
    bring_up(rig, op, inv, body)
    new_body = with_engine_args(body, 1, {"max-model-len": 2048})
    patch_pipeline(rig.kube, "tiny", {"spec": {"stages": new_body["spec"]["stages"]}})
    restarts = 0
    for n in range(200):
        if settled(rig, new_body):
            break
        if n % 3 == 0:
            op = rig.start_operator()  # the old one is never called again
            restarts += 1
        step(rig, op, inv, n)
    assert settled(rig, new_body) and restarts > 3
    assert [r["revision"] for r in status(rig.kube)["revisions"]] == [revision(new_body)]
    assert rig.sim.abandoned == []


def test_a_change_during_a_rollout_starts_the_next_from_where_it_stands(rig):
    op, inv = rig.start_operator(), Invariants(rig)
    body = pipeline_body(stages=three_stages())
    bring_up(rig, op, inv, body)
    second = with_engine_args(body, 1, {"max-model-len": 2048})
    patch_pipeline(rig.kube, "tiny", {"spec": {"stages": second["spec"]["stages"]}})
    for n in range(6):
        step(rig, op, inv, n)
    assert len(status(rig.kube)["revisions"]) == 2  # mid-rollout
    third = with_engine_args(body, 1, {"max-model-len": 1024})
    patch_pipeline(rig.kube, "tiny", {"spec": {"stages": third["spec"]["stages"]}})
    step(rig, op, inv, 6)
    assert {r["revision"] for r in status(rig.kube)["revisions"]} >= {revision(third), revision(body)}
    run(rig, op, inv, third, start=7)
    assert [r["revision"] for r in status(rig.kube)["revisions"]] == [revision(third)]
    assert rig.sim.abandoned == []
    # Two old revisions' receivers fill code2wav's surge (1): the old senders had to drain
    # below their floor, which the rollout announced (I2 checked that it did).
    assert set(inv.floor_breaks) <= {"thinker", "talker"}


def test_receivers_without_surge_keep_every_floor(rig):
    """Every stage on GPUs (no surge, one pod unavailable at most), two pods each: an old
    receiver whose senders still send keeps one ready pod for them, not both, so each new
    stage gets a GPU from its old one at once, receivers first, and no stage is ever under
    its floor (the whole pipeline stayed down for most of such a rollout before: every old
    receiver held all its pods until the old senders had drained below their floor);
    nothing is lost."""
    op, inv = rig.start_operator(), Invariants(rig)
    body = pipeline_body(stages=three_stages(gpus=(1, 1, 1)))
    bring_up(rig, op, inv, body)
    new_body = with_engine_args(body, 1, {"max-model-len": 2048})
    patch_pipeline(rig.kube, "tiny", {"spec": {"stages": new_body["spec"]["stages"]}})
    run(rig, op, inv, new_body)
    assert inv.floor_breaks == []
    assert rig.sim.abandoned == [] and events(rig.kube, "DrainDeadlinePassed") == []


def test_a_new_revision_that_never_becomes_ready_leaves_the_old_one_serving(rig):
    """Every stage on GPUs, and the new revision's pods never ready (a bad image): the old
    revision keeps every stage at its floor, however long (it tore the old thinker and talker
    down to nothing before: rule 4 drained them to make room the new pods never used)."""
    op, inv = rig.start_operator(), Invariants(rig)
    body = pipeline_body(stages=three_stages(gpus=(1, 1, 1)))
    bring_up(rig, op, inv, body)
    new_body = with_engine_args(body, 1, {"max-model-len": 2048})
    new = revision(new_body)
    write = rig.sim._write_pod_status

    def never_ready(pod):
        if pod.revision == new:
            pod.ready = False
        write(pod)

    rig.sim._write_pod_status = never_ready
    patch_pipeline(rig.kube, "tiny", {"spec": {"stages": new_body["spec"]["stages"]}})
    for n in range(40):
        step(rig, op, inv, n)
    assert inv.floor_breaks == []
    old = revision(body)
    for stage in ("thinker", "talker", "code2wav"):
        assert sum(1 for p in rig.sim.of(old, stage) if p.ready and not p.terminating) >= 1, stage


def test_a_sender_stuck_past_its_drain_deadline_lets_its_receivers_go_with_one_event(rig):
    """An old thinker pod whose transfers never resolve: its receivers keep a pod for it until
    its drain deadline (its transfer timeout after it began terminating, 45 s before the kubelet
    kills it), then go (the others go as new ones are ready); one Warning event names the transfers abandoned, however many
    reconciles and operator restarts see it."""
    op, inv = rig.start_operator(), Invariants(rig)
    stages = three_stages()
    stages[0]["replicas"] = 1  # a GPU stage of one pod: it drains at once (maxUnavailable 1)
    stages[0]["kvTransfer"]["timeoutSeconds"] = 20
    body = pipeline_body(stages=stages)
    bring_up(rig, op, inv, body)
    old = revision(body)
    (stuck,) = [p.name for p in rig.sim.of(old, "thinker")]
    rig.sim.pods[stuck].stuck = True
    new_body = with_engine_args(body, 1, {"max-model-len": 2048})
    patch_pipeline(rig.kube, "tiny", {"spec": {"stages": new_body["spec"]["stages"]}})
    deadline = kill = None
    for n in range(200):
        if settled(rig, new_body):
            break
        if n % 7 == 6:
            op = rig.start_operator()
        step(rig, op, inv, n)
        pod = rig.sim.pods.get(stuck)
        if pod is not None and pod.terminating:
            deadline, kill = pod.drain_deadline, pod.kill_at
    assert settled(rig, new_body) and deadline is not None
    old_talkers = [p for p in rig.sim.gone if p.revision == old and p.stage == "talker"]
    last_gone = max(p.started_terminating for p in old_talkers)
    assert deadline <= last_gone < kill  # at the drain deadline, not before, nor at the SIGKILL
    assert rig.sim.abandoned == [(stuck, 2)]  # the kubelet killed it with its 2 transfers
    (event,) = events(rig.kube, "DrainDeadlinePassed")
    assert event["type"] == "Warning" and f"pod {stuck} (stage thinker)" in event["message"]
    assert "with 2 KV transfers in flight: 2 abandoned" in event["message"] and f"revision {old}" in event["message"]


def test_the_running_operator_restarted_mid_rollout_finishes_it(rig, start_operator):
    """The whole operator (kopf's handlers and watches, the resync timer every 0.2 s reading
    the pods' metrics) against the simulated cluster, which steps whenever polled; stopped in
    the middle of a rollout and started again (kopf resumes the pipeline), it finishes it; the
    invariants hold at every step of the cluster."""
    inv = Invariants(rig)
    rig.clock.t = float(int(time.time()))  # the running operator reads the real clock

    def tick() -> None:
        rig.clock.t = max(rig.clock.t, float(int(time.time())))
        rig.sim.tick()
        inv.check("a cluster step")

    op = start_operator(resync_seconds=0.2)
    body = pipeline_body(stages=three_stages())
    create_pipeline(rig.kube, body)
    wait_for(lambda: tick() or settled(rig, body), timeout=60, what="the pipeline up")
    wait_for(lambda: status(rig.kube).get("phase") == "Ready", what="phase Ready")
    inv.baseline(body["spec"]["stages"])
    new_body = with_engine_args(body, 1, {"max-model-len": 2048})
    patch_pipeline(rig.kube, "tiny", {"spec": {"stages": new_body["spec"]["stages"]}})
    old = revision(body)

    def midway() -> bool:
        tick()
        return any(p.revision == old and p.terminating for p in rig.sim.pods.values()) and \
            any(p.revision == revision(new_body) and p.ready for p in rig.sim.pods.values())

    wait_for(midway, timeout=60, what="the rollout midway")
    op.stop()
    for _ in range(3):  # the cluster moves on while no operator runs
        tick()
    start_operator(resync_seconds=0.2)
    wait_for(lambda: tick() or settled(rig, new_body), timeout=90, what="the rollout finished by the new operator")
    wait_for(lambda: [r["revision"] for r in status(rig.kube).get("revisions", [])] == [revision(new_body)],
             what="the status to show one revision")
    assert rig.sim.abandoned == []
