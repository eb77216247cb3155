"""rollout.plan, the pure function behind every rollout step: the decisions one at a time."""
from __future__ import annotations

import copy

from omnip_support import pipeline_body
from omni_operator.pipeline.model import parse_pipeline
from omni_operator.controller.rollout import LEGACY, PodLoad, StagePod, Workload, plan, pod_of, workload_of

NOW = 1_800_000_000.0
OLD = "0000000old"


def pipeline(body: dict | None = None):
    body = copy.deepcopy(body or pipeline_body())
    body["metadata"]["uid"] = "u"
    return parse_pipeline(body)


def ready(revision: str, stage: str, n: int = 1, inputs: tuple[str, ...] = (), sends: bool = False,
          replicas: int | None = None, created: str = "2026-01-01T00:00:00Z") -> Workload:
    replicas = n if replicas is None else replicas
    return Workload(revision, stage, f"tiny-{stage}-{revision}", replicas=replicas, ready=n, pods=replicas,
                    inputs=inputs, sends=sends, created=created)


def old_pipeline_workloads(**over) -> list[Workload]:
    """The default pipeline's three stages, one ready pod each, at revision OLD."""
    ws = {"thinker": ready(OLD, "thinker", sends=True), "talker": ready(OLD, "talker", inputs=("thinker",), sends=True),
          "code2wav": ready(OLD, "code2wav", inputs=("talker",))}
    ws.update(over)
    return list(ws.values())


TARGETS = {"thinker": 1, "talker": 1, "code2wav": 1}


def draining(stage: str, name: str, started: float = NOW - 10, grace: float = 75) -> StagePod:
    return StagePod(name, OLD, stage, ready=False, drain_started=started, deadline=started + grace - 45)


def test_a_new_pipeline_starts_its_last_receiver_only():
    p = pipeline()
    step = plan(p, TARGETS, [], now=NOW)
    assert step.replicas == {(p.revision, "thinker"): 0, (p.revision, "talker"): 0, (p.revision, "code2wav"): 1}
    assert any("thinker waits for a ready pod of talker" in w for w in step.waiting)


def test_a_receiver_scaled_to_zero_holds_no_sender_back():
    p = pipeline()
    step = plan(p, {"thinker": 1, "talker": 1, "code2wav": 0}, [], now=NOW)
    assert step.replicas[(p.revision, "talker")] == 1 and step.replicas[(p.revision, "code2wav")] == 0


def test_an_old_receiver_waits_for_a_reading_taken_after_its_sender_began_draining():
    p = pipeline()
    mine = [ready(p.revision, s, inputs=i) for s, i in (("thinker", ()), ("talker", ("thinker",)), ("code2wav", ("talker",)))]
    gone_thinker = ready(OLD, "thinker", n=0, sends=True)
    ws = old_pipeline_workloads(thinker=gone_thinker) + mine
    pod = draining("thinker", "old-thinker-0")
    before = {"old-thinker-0": PodLoad(read_at=pod.drain_started - 1, transfers=0, requests=0)}
    after = {"old-thinker-0": PodLoad(read_at=pod.drain_started + 1, transfers=0, requests=0)}
    busy = {"old-thinker-0": PodLoad(read_at=pod.drain_started + 1, transfers=0, requests=1)}
    for loads in (before, busy, {}):
        assert plan(p, TARGETS, ws, [pod], loads, now=NOW).replicas[(OLD, "talker")] == 1
    assert plan(p, TARGETS, ws, [pod], after, now=NOW).replicas[(OLD, "talker")] == 0
    # Without transfer health nothing is read: the pod counts once gone, or past its deadline.
    assert plan(p, TARGETS, ws, [pod], after, now=NOW, read_loads=False).replicas[(OLD, "talker")] == 1
    assert plan(p, TARGETS, ws, [], {}, now=NOW, read_loads=False).replicas[(OLD, "talker")] == 0
    late = plan(p, TARGETS, ws, [pod], {"old-thinker-0": PodLoad(NOW, transfers=3)}, now=pod.deadline)
    assert late.replicas[(OLD, "talker")] == 0
    (event,) = late.events
    assert event.key == f"{OLD}.old-thinker-0" and "3 KV transfers in flight: 3 abandoned" in event.message


def test_surge_counts_terminating_pods_and_old_pods_not_yet_gone():
    """A GPU stage (maxSurge 0) of one pod: its new pod waits until the old one is gone, not
    just told to go."""
    p = pipeline()
    mine = [ready(p.revision, "talker", inputs=("thinker",)), ready(p.revision, "code2wav", inputs=("talker",))]
    told = Workload(OLD, "thinker", "x", replicas=0, ready=1, pods=1, sends=True)
    ws = old_pipeline_workloads(thinker=told) + mine
    assert plan(p, TARGETS, ws, [], now=NOW).replicas[(p.revision, "thinker")] == 0
    terminating = plan(p, TARGETS, old_pipeline_workloads(thinker=ready(OLD, "thinker", n=0, sends=True)) + mine,
                       [draining("thinker", "old-thinker-0")], now=NOW)
    assert terminating.replicas[(p.revision, "thinker")] == 0
    gone = plan(p, TARGETS, old_pipeline_workloads(thinker=ready(OLD, "thinker", n=0, sends=True)) + mine, [], now=NOW)
    assert gone.replicas[(p.revision, "thinker")] == 1
    assert (OLD, "thinker") in gone.delete


def test_workloads_made_before_revisions_are_the_legacy_revision_with_the_spec_s_graph():
    p = pipeline()
    legacy = {"metadata": {"name": "tiny-talker", "labels": {"omnipipeline.dev/pipeline": "tiny",
                                                           "omnipipeline.dev/stage": "talker"}},
              "spec": {"replicas": 1}, "status": {"readyReplicas": 1, "replicas": 1}}
    w = workload_of(legacy, p)
    assert (w.revision, w.inputs, w.sends) == (LEGACY, ("thinker",), True)
    pod = pod_of({"metadata": {"name": "x", "labels": {"omnipipeline.dev/stage": "talker"},
                               "deletionTimestamp": "2027-01-15T08:00:00Z", "deletionGracePeriodSeconds": 75}})
    assert pod.revision == LEGACY and pod.deadline == pod.drain_started + 30


def test_a_settled_rollout_no_step_moves_drains_the_old_senders_and_says_so():
    """A CPU thinker (no maxUnavailable: it keeps its pod until a new one is ready) before
    GPU receivers of one pod each (no surge): the new code2wav needs the old one's GPU, which
    stays while the old talker sends, which stays while the old thinker sends, which waits
    for a new thinker, which waits for new receivers. Nothing moves: the thinker drains."""
    body = pipeline_body()
    for s, gpus in zip(body["spec"]["stages"], (0, 1, 1)):
        s.update(gpus=gpus, replicas=1)
    p = pipeline(body)
    ws = [ready(OLD, "thinker", 1, sends=True), ready(OLD, "talker", 1, ("thinker",), True),
          ready(OLD, "code2wav", 1, ("talker",)), ready(p.revision, "thinker", 0), ready(p.revision, "talker", 0),
          ready(p.revision, "code2wav", 0)]
    step = plan(p, TARGETS, ws, [], now=NOW)
    assert step.replicas[(OLD, "thinker")] == 0
    assert any("thinker drains below its floor" in w for w in step.waiting)
    # Not while anything still moves (a pod terminating).
    moving = plan(p, TARGETS, ws, [draining("thinker", "t")], now=NOW)
    assert moving.replicas[(OLD, "thinker")] == 1


def test_an_old_receiver_whose_senders_still_send_keeps_one_ready_pod_and_its_floor_not_all():
    """Every stage on GPUs, two pods each (no surge, one unavailable): the old code2wav, whose
    talker still sends, gives one of its two GPUs to the new code2wav at once (a stopping
    replica refuses new hand-offs and its senders offer them to the other), instead of
    holding both until the old senders drain below their floor; and never its last pod."""
    body = pipeline_body()
    for s in body["spec"]["stages"]:
        s.update(gpus=1, replicas=2)
    p = pipeline(body)
    targets = {"thinker": 2, "talker": 2, "code2wav": 2}
    ws = [ready(OLD, "thinker", 2, sends=True), ready(OLD, "talker", 2, ("thinker",), True),
          ready(OLD, "code2wav", 2, ("talker",))]
    step = plan(p, targets, ws, [], now=NOW)
    assert step.replicas[(OLD, "code2wav")] == 1 and step.replicas[(OLD, "talker")] == 1
    assert step.replicas[(OLD, "thinker")] == 1  # its floor: no new thinker is ready yet
    assert not any("below its floor" in w for w in step.waiting)
    # The new code2wav ready: the old one keeps its last pod while its senders send.
    ws = [ready(OLD, "thinker", 1, sends=True), ready(OLD, "talker", 1, ("thinker",), True),
          ready(OLD, "code2wav", 1, ("talker",)), ready(p.revision, "code2wav", 1, ("talker",), replicas=2)]
    step = plan(p, targets, ws, [], now=NOW)
    assert step.replicas[(OLD, "code2wav")] == 1 and step.replicas[(OLD, "talker")] == 1
    # Not ready pods are not counted on: an old receiver none of whose pods is ready keeps them.
    ws = [ready(OLD, "thinker", 2, sends=True), ready(OLD, "talker", 2, ("thinker",), True),
          Workload(OLD, "code2wav", "x", replicas=2, ready=0, pods=2, inputs=("talker",))]
    assert plan(p, targets, ws, [], now=NOW).replicas[(OLD, "code2wav")] == 2


def test_an_old_stream_producer_drains_its_open_streams_too_and_names_those_it_abandons():
    """A draining sender with no transfer and no request left but streams still open (or
    held, out of credit) keeps its revision's receivers; past its deadline the streams are
    abandoned, and the event says how many of each."""
    p = pipeline()
    mine = [ready(p.revision, s, inputs=i) for s, i in (("thinker", ()), ("talker", ("thinker",)), ("code2wav", ("talker",)))]
    ws = old_pipeline_workloads(thinker=ready(OLD, "thinker", n=0, sends=True)) + mine
    pod = draining("thinker", "old-thinker-0")
    streaming = {"old-thinker-0": PodLoad(read_at=pod.drain_started + 1, transfers=0, requests=0, streams=2)}
    assert plan(p, TARGETS, ws, [pod], streaming, now=NOW).replicas[(OLD, "talker")] == 1
    done = {"old-thinker-0": PodLoad(read_at=pod.drain_started + 1, transfers=0, requests=0, streams=0)}
    assert plan(p, TARGETS, ws, [pod], done, now=NOW).replicas[(OLD, "talker")] == 0
    late = plan(p, TARGETS, ws, [pod], {"old-thinker-0": PodLoad(NOW, transfers=1, streams=2)}, now=pod.deadline)
    assert late.replicas[(OLD, "talker")] == 0
    (event,) = late.events
    assert "with 1 KV transfer and 2 streams in flight: 3 abandoned" in event.message


def test_pod_loads_count_the_streams_a_pod_sends_not_those_it_takes():
    """A talker that takes thinker's stream and streams on to code2wav: only the second is
    its to drain (the first is the thinker's)."""
    from metrics_pages import ar_page
    from omni_operator.controller.reconcile import pod_loads
    from omni_operator.health.transfers import PipelineReading, StageReading, parse_metrics, pod_reading

    page = ar_page("talker", streams={("thinker", "talker"): {"open": 5, "waiting": 1},
                                      ("talker", "code2wav"): {"open": 2, "held": 1}})
    reading = PipelineReading(NOW, stages={"talker": StageReading((pod_reading("talker-0", None, parse_metrics(page)),))})
    assert pod_loads(reading)["talker-0"].streams == 3
