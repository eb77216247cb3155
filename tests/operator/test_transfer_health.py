"""Reading the stages' metrics (omni_operator/health/reader.py) from the pods listed at the API
emulator, and what the reconcile makes of it: status, printer column, events, writes.

The pods' /metrics are `metrics_pages.PageServer`s (HTTP servers on 127.0.0.1 serving the text a
sending stage serves): these tests are about the operator's reading, timing and transitions;
tests/operator/test_transfer_health_e2e.py runs the same against real stage processes.
"""
from __future__ import annotations

import time

import pytest

from metrics_pages import PageServer, ar_page, create_pod
from omni_operator.health.reader import PodMetricsSource, TransferHealth
from omni_operator.pipeline.kinds import EVENT, NETWORKPOLICY
from omni_operator.pipeline.render import ClusterSettings
from omni_operator.controller.reconcile import Reconciler
from omni_operator.controller.resync import Resync
from omnip_support import NAMESPACE, complete_rollout, create_pipeline, make_kube, pipeline_body, status

SENDERS = ("thinker", "talker")


@pytest.fixture
def pages():
    servers: dict[str, PageServer] = {}

    def make(name: str, page: str = "", delay: float = 0.0) -> PageServer:
        servers[name] = PageServer(page, delay)
        return servers[name]

    yield make
    for server in servers.values():
        server.stop()


def events(kube, reason: str | None = None) -> list[dict]:
    items = kube.request("list", "Event", "GET", EVENT.collection_path(NAMESPACE))["items"]
    return [e for e in items if reason is None or e["reason"] == reason]


def condition(kube, ctype: str = "TransfersHealthy") -> dict:
    return next((c for c in status(kube).get("conditions", []) if c["type"] == ctype), {})


def setup_pipeline(kube, pages, stuck_seconds: int = 120) -> dict[str, PageServer]:
    """The default 3-stage pipeline with one pod per stage, each pod's /metrics a PageServer."""
    create_pipeline(kube, pipeline_body(observability={"alerts": {"stuckTransferSeconds": stuck_seconds}}))
    servers = {}
    for stage in (*SENDERS, "code2wav"):
        page = ar_page(stage) if stage in SENDERS else 'omni_kv_received_total{stage="code2wav",outcome="delivered"} 0.0\n'
        servers[stage] = pages(stage, page)
        create_pod(kube, "tiny", stage, f"tiny-{stage}-0", servers[stage].port)
    return servers


def test_a_slow_and_a_dead_pod_delay_no_other_pod(kube, emulator, pages):
    create_pipeline(kube, pipeline_body())
    fast = [pages(f"fast{i}", ar_page(active=i)) for i in range(6)]
    for i, server in enumerate(fast):
        create_pod(kube, "tiny", "thinker", f"tiny-thinker-{i}", server.port)
    slow = pages("slow", ar_page(), delay=30.0)
    create_pod(kube, "tiny", "talker", "tiny-talker-slow", slow.port)
    dead = pages("dead")
    dead.stop()  # nothing listens on its port any more
    create_pod(kube, "tiny", "talker", "tiny-talker-dead", dead.port)
    create_pod(kube, "tiny", "talker", "tiny-talker-pending", 1, phase="Pending")  # no IP yet: not read
    source = PodMetricsSource(make_kube(emulator.url), timeout=0.5, concurrency=4)
    try:
        started = time.monotonic()
        reading = source.read([(NAMESPACE, "tiny")])[(NAMESPACE, "tiny")]
        elapsed = time.monotonic() - started
    finally:
        source.close()
    # One timeout (0.5 s) for the slow pod, in parallel with everything else; not its 30 s.
    assert elapsed < 5.0, elapsed
    thinker = reading.stages["thinker"]
    assert sorted(p.pod for p in thinker.pods) == [f"tiny-thinker-{i}" for i in range(6)]
    assert sum(p.states["active"] for p in thinker.pods) == sum(range(6))
    talker = reading.stages["talker"]
    assert talker.pods == ()
    why = dict(talker.unreadable)
    assert set(why) == {"tiny-talker-slow", "tiny-talker-dead"}
    assert "timed out" in why["tiny-talker-slow"] and "refused" in why["tiny-talker-dead"]


def test_a_pod_not_ready_that_cannot_be_read_is_left_to_the_ready_condition(kube, emulator, pages):
    create_pipeline(kube, pipeline_body())
    dead = pages("dead")
    dead.stop()
    create_pod(kube, "tiny", "thinker", "tiny-thinker-0", dead.port, ready=False)
    source = PodMetricsSource(make_kube(emulator.url), timeout=0.5)
    try:
        reading = source.read([(NAMESPACE, "tiny")])[(NAMESPACE, "tiny")]
    finally:
        source.close()
    assert reading.stages["thinker"] == type(reading.stages["thinker"])((), ())


def test_stuck_then_recovered_status_column_and_one_event_each(kube, emulator, pages):
    servers = setup_pipeline(kube, pages, stuck_seconds=30)
    client = make_kube(emulator.url)
    health = TransferHealth(PodMetricsSource(client, timeout=2.0))
    reconciler = Reconciler(client, health=health)
    resync = Resync(reconciler, [NAMESPACE], interval=3600)
    try:
        resync.run_once()
        for stage in (*SENDERS, "code2wav"):
            complete_rollout(kube, stage)
        resync.run_once()
        assert status(kube)["transfersHealth"] == "ok"
        assert (condition(kube)["status"], condition(kube)["reason"]) == ("True", "TransfersFlowing")
        thinker = status(kube)["stages"][0]
        assert thinker["name"] == "thinker" and thinker["transfers"]["pods"] == 1 and thinker["transfers"]["active"] == 0

        # The talker's transfer has been active for 90 s: past the pipeline's 30 s threshold
        # (and its age, 60-120 s, reported as 60 for the rest of the test).
        servers["talker"].page = ar_page("talker", active=1, oldest_active=time.time() - 90)
        resync.run_once()
        assert status(kube)["transfersHealth"] == "stuck 1"
        cond = condition(kube)
        assert (cond["status"], cond["reason"]) == ("False", "TransferStuck") and "stage talker" in cond["message"]
        (warning,) = events(kube, "TransferStuck")
        assert warning["type"] == "Warning" and warning["involvedObject"]["name"] == "tiny"

        # Still stuck, a resync later: no new event, and nothing written at all.
        writes = client.writes
        outcome = reconciler.reconcile(NAMESPACE, "tiny")
        resync.run_once()
        assert client.writes == writes and outcome.writes == 0
        assert len(events(kube, "TransferStuck")) == 1

        # It resolves: one Normal event, the column says ok again.
        servers["talker"].page = ar_page("talker", resolved={"acked": 1})
        resync.run_once()
        assert status(kube)["transfersHealth"] == "ok"
        (recovered,) = events(kube, "TransfersRecovered")
        assert recovered["type"] == "Normal" and "was TransferStuck" in recovered["message"]
    finally:
        health.close()
        client.close()


def test_failing_transfers_and_unreadable_metrics(kube, emulator, pages):
    servers = setup_pipeline(kube, pages)
    client = make_kube(emulator.url)
    health = TransferHealth(PodMetricsSource(client, timeout=0.5), failing_ratio=0.1)
    reconciler = Reconciler(client, health=health)
    resync = Resync(reconciler, [NAMESPACE], interval=3600)
    try:
        servers["thinker"].page = ar_page(resolved={"acked": 100, "failed": 1})
        resync.run_once()
        servers["thinker"].page = ar_page(resolved={"acked": 108, "failed": 3})  # 2 of 10 in the interval
        resync.run_once()
        assert status(kube)["transfersHealth"] == "failing 20%"
        assert status(kube)["stages"][0]["transfers"]["failed"] == 2
        assert len(events(kube, "TransfersFailing")) == 1
        # Then the talker's pod stops answering: nothing is known to be wrong, nothing right.
        servers["thinker"].page = ar_page(resolved={"acked": 200, "failed": 3})
        servers["talker"].stop()
        resync.run_once()
        cond = condition(kube)
        assert (cond["status"], cond["reason"]) == ("Unknown", "MetricsUnavailable")
        assert "pod tiny-talker-0" in cond["message"] and status(kube)["transfersHealth"] == "unknown"
        assert status(kube)["stages"][1]["transfers"] == {"pods": 0, "unreadablePods": 1}
        assert events(kube, "TransfersRecovered") == []  # Unknown is no recovery
    finally:
        health.close()
        client.close()


def test_nothing_changed_means_no_write_with_health_reading_on(kube, emulator, pages):
    servers = setup_pipeline(kube, pages)
    # Ages of 400 s: reported as 300 (the 300-600 s step) for the rest of the test.
    servers["thinker"].page = ar_page(active=2, oldest_active=time.time() - 400, held=1, held_blocks=4,
                                      oldest_held=time.time() - 400)
    client = make_kube(emulator.url)
    health = TransferHealth(PodMetricsSource(client))
    resync = Resync(Reconciler(client, health=health), [NAMESPACE], interval=3600)
    try:
        resync.run_once()
        resync.run_once()
        before = client.writes
        for _ in range(3):
            resync.run_once()
        assert client.writes == before
        assert status(kube)["stages"][0]["transfers"]["heldBlocks"] == 4
    finally:
        health.close()
        client.close()


def test_only_the_pods_of_the_pipelines_asked_for_are_read(kube, emulator, pages):
    create_pipeline(kube, pipeline_body())
    mine, other = pages("mine", ar_page()), pages("other", ar_page())
    create_pod(kube, "tiny", "thinker", "tiny-thinker-0", mine.port)
    create_pod(kube, "other", "thinker", "other-thinker-0", other.port)
    source = PodMetricsSource(make_kube(emulator.url))
    try:
        readings = source.read([(NAMESPACE, "tiny")])
    finally:
        source.close()
    assert list(readings) == [(NAMESPACE, "tiny")] and mine.hits == 1 and other.hits == 0


def test_the_network_policy_lets_the_operator_reach_the_http_port_only(kube, emulator):
    create_pipeline(kube, pipeline_body())
    peer = {"namespace": "omni-system", "labels": {"app.kubernetes.io/name": "omni-pipeline",
                                                   "app.kubernetes.io/component": "operator"}}
    client = make_kube(emulator.url)
    try:
        Reconciler(client, cluster=ClusterSettings(operator_namespace=peer["namespace"],
                                                    operator_pod_labels=tuple(peer["labels"].items()))
                   ).reconcile(NAMESPACE, "tiny")
    finally:
        client.close()
    rules = kube.get(NETWORKPOLICY, NAMESPACE, "tiny")["spec"]["ingress"]
    operator_rules = [r for r in rules if any("namespaceSelector" in f for f in r.get("from", []))]
    assert operator_rules == [{
        "from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "omni-system"}},
                  "podSelector": {"matchLabels": peer["labels"]}}],
        "ports": [{"protocol": "TCP", "port": 8000}],
    }]
    # The kv port is still only the pipeline's own pods'.
    kv = [r for r in rules if r["ports"] == [{"protocol": "TCP", "port": 9600}]]
    assert kv == [{"from": [{"podSelector": {"matchLabels": {"omnipipeline.dev/pipeline": "tiny"}}}],
                   "ports": [{"protocol": "TCP", "port": 9600}]}]


def test_the_prometheus_reader_against_a_real_prometheus(tmp_path, pages):
    """The Prometheus-backed reader: gauges, increase() over its window and up == 0, from a real
    Prometheus scraping two stage pages labelled as the operator's PodMonitor labels them."""
    import json

    from omni_operator.health.reader import PrometheusSource
    from omni_operator.pipeline.model import parse_pipeline
    from procs import PrometheusServer, wait_until

    thinker = pages("thinker", ar_page(resolved={"acked": 100}))
    talker = pages("talker", ar_page("talker"))
    targets = [{"targets": [f"127.0.0.1:{server.port}"],
                "labels": {"namespace": NAMESPACE, "pipeline": "tiny", "stage": stage, "pod": f"tiny-{stage}-0"}}
               for stage, server in (("thinker", thinker), ("talker", talker))]
    config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
              "scrape_configs": [{"job_name": "stages", "honor_labels": True, "static_configs": targets}]}
    prometheus = PrometheusServer(tmp_path, json.dumps(config))
    body = pipeline_body()
    body["metadata"].update(uid="u", generation=1)
    pipeline = parse_pipeline(body)
    # A short window, so that the failures below leave it within seconds.
    health = TransferHealth(PrometheusSource(prometheus.url, window_seconds=5))

    def verdict():
        health.refresh([body])
        return health.verdict(pipeline)

    try:
        wait_until(lambda: verdict().summary == "ok", 30, "both stages scraped")
        began = time.time() - 500
        thinker.page = ar_page(active=1, oldest_active=began, resolved={"acked": 100}, held=1, held_blocks=4,
                               oldest_held=began, edges={"talker": {"active": 1, "oldest": began, "held": 1,
                                                                    "held_blocks": 4, "oldest_held": began}})
        stuck = wait_until(lambda: (lambda v: v if v.summary == "stuck 1" else None)(verdict()), 30, "stuck")
        assert stuck.stages["thinker"]["oldestActiveSeconds"] == 300 and "stage thinker" in stuck.message
        assert stuck.stages["thinker"]["edges"] == [{
            "toStage": "talker", "active": 1, "held": 1, "heldBlocks": 4, "oldestActiveSeconds": 300,
            "oldestHeldSeconds": 300, "failed": 0, "expired": 0}]
        thinker.page = ar_page(resolved={"acked": 110, "failed": 10})
        failing = wait_until(lambda: (lambda v: v if v.reason == "TransfersFailing" else None)(verdict()), 30,
                             "failing")
        assert failing.stages["thinker"]["failed"] >= 10  # increase() over the window, extrapolated
        talker.stop()
        thinker.page = ar_page(resolved={"acked": 110, "failed": 10})
        unknown = wait_until(lambda: (lambda v: v if v.status == "Unknown" else None)(verdict()), 30,
                             "the talker unscrapable (and the failures out of the window)", interval=0.5)
        assert "pod tiny-talker-0: Prometheus cannot scrape it (up == 0)" in unknown.message
    finally:
        prometheus.stop()
    # Prometheus gone: the reading says why, nothing is claimed either way.
    gone = verdict()
    assert gone.status == "Unknown" and "querying Prometheus at" in gone.message


def test_omni_pipeline_status_finds_a_running_pipeline_by_its_pointer_and_says_when_none_runs(
        pages, tmp_path, monkeypatch, capsys):
    """`omni-pipeline status FILE` without --workdir: `up`'s pointer under the runtime directory
    leads to the stages (exit 0 healthy, 1 stuck, with the table); once `up` has stopped (the
    pointer removed) it says the pipeline is not running, and how to start it (exit 2)."""
    import json

    from omni_operator.local import cli
    from omni_operator.local.status import forget_endpoints, record_endpoints
    from omni_operator.pipeline.model import parse_pipeline

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    body = pipeline_body()
    pipeline_file = tmp_path / "pipeline.yaml"
    pipeline_file.write_text(json.dumps(body))
    servers = {s: pages(s, ar_page(s, edges={nxt: {}} if nxt else None))
               for s, nxt in (("thinker", "talker"), ("talker", "code2wav"), ("code2wav", None))}
    workdir = tmp_path / "up"
    workdir.mkdir()
    pipeline = parse_pipeline(body)
    record_endpoints(pipeline, workdir, {s: f"http://127.0.0.1:{srv.port}" for s, srv in servers.items()})

    def status_cli() -> tuple[int, str]:
        capsys.readouterr()
        rc = cli.main(["status", str(pipeline_file), "--interval", "0"])
        return rc, capsys.readouterr().out

    rc, out = status_cli()
    assert rc == 0 and "pipeline tiny: transfers ok" in out and "-> talker" in out, out
    servers["talker"].page = ar_page("talker", active=1, oldest_active=time.time() - 3600,
                                     edges={"code2wav": {"active": 1, "oldest": time.time() - 3600}})
    rc, out = status_cli()
    assert rc == 1 and "transfers stuck 1" in out and "toward code2wav" in out, out
    forget_endpoints(pipeline, workdir)
    rc, out = status_cli()
    assert rc == 2 and "is not running here" in out and "omni-pipeline up FILE" in out, out
