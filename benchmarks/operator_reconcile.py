"""How many API calls the operator makes, and how fast it reconciles and reads transfer health.

Counts, at the (emulated) API server, the requests made by reconciling a 3-stage pipeline:
its creation, a reconcile with nothing to change (target: no write), and a change to one
stage's engine arguments (a new revision: the first step of its rollout, which
benchmarks/operator_rollout.py follows to the end); then times reconciling --pipelines
pipelines from scratch, every other one with a streamed thinker -> talker edge, and
reconciling them again with nothing to change, both ways a reconcile reads the children:
from fresh lists (the resync timer's way: a LIST per child kind) and from the cache the
operator's watches keep (an event's way: the real operator, kopf and its watches, runs
beside the timed reconciler and feeds the cache it reads; `noop_pipelines_per_s`, target
150/s, is this one). Then --deployed-pipelines more created through the API as a user
creates them, the running operator reconciling them, until every status has observed its
pipeline (`deployed_pipelines_per_s`, with the CPU per pipeline of the benchmark's process,
where kopf, its handlers and the creating client run, and the emulator's): the rate a user
sees, kopf's own work per watch event included (no target: the sequential `pipelines_per_s`
is the one its target was set on). The server is the kmock-
based emulator of tests/operator (there is no Kubernetes API server here), in a process of
its own as an API server is (its CPU does not take the operator's interpreter lock), so the
wall time measures the operator's own work, the emulator's and local HTTP, not a real
cluster's latency.

Then transfer health: --health-pipelines pipelines of 3 stages x 2 pods (600 pods by default),
every pod's /metrics served by one fake endpoint (tests/operator/metrics_pages.py: a sending
stage's omni_kv_* families after 400 lines of vLLM's own, as a real page has them, and the
stream families of a streamed edge: every other pipeline streams thinker -> talker), and the
operator (the resync timer: list pipelines, read every pod's metrics, list each child kind
once for the namespace into the children's cache, reconcile every pipeline from it) in a
process of its own, so that its RSS is its own. Two rounds settle it (the
first creates the children and writes every status), then one resync is timed with nothing
changed: its wall time, its API writes (target: 0) and the operator's RSS. Target on this
machine: that resync within 10 s.

Prints one JSON object as its last line. Besides the rates it gives the CPU time per pipeline
(`*_cpu_ms`: the operator's and the emulator's processes together, the whole cost of a
reconcile here; `*_operator_cpu_ms`: the operator's alone) and the machine's load average at
the end, since on a shared machine the wall-time rates follow the load while the CPU figures
do not.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import multiprocessing
import os
import resource
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "tests", "operator"), os.path.join(REPO, "tests")]

from omnip_support import (NAMESPACE, OPERATOR_TOKEN, RunningOperator, create_pipeline, make_kube,  # noqa: E402
                           patch_pipeline, pipeline_body, wait_for)
from k8s_emulator import EmulatorThread  # noqa: E402
from metrics_pages import PageServer, ar_page, create_pod  # noqa: E402
from omni_operator.controller.reconcile import Reconciler  # noqa: E402

WRITE_METHODS = {"POST", "PATCH", "PUT", "DELETE"}


class EmulatorApart:
    """The emulator in a process of its own: its URL, the HTTP methods of the requests it has
    served, its CPU time."""

    def __init__(self) -> None:
        self._pipe, child = multiprocessing.get_context("spawn").Pipe()
        self._process = multiprocessing.get_context("spawn").Process(target=_serve_apart, args=(child,))

    def __enter__(self) -> "EmulatorApart":
        self._process.start()
        self.url = self._pipe.recv()
        return self

    def __exit__(self, *exc: object) -> None:
        self._pipe.send(None)
        self._process.join(30)
        if self._process.is_alive():
            self._process.kill()

    def methods(self) -> list[str]:
        self._pipe.send("methods")
        return self._pipe.recv()

    def cpu_s(self) -> float:
        self._pipe.send("cpu")
        return self._pipe.recv()


def _serve_apart(pipe) -> None:
    with EmulatorThread() as emu:
        pipe.send(emu.url)
        while (command := pipe.recv()) is not None:
            pipe.send([str(r.method.value) for r in emu.requests] if command == "methods" else time.process_time())


def server_calls(emu: EmulatorApart, since: int) -> tuple[int, int]:
    requests = emu.methods()[since:]
    return len(requests), sum(1 for method in requests if method in WRITE_METHODS)


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def operator_process(url: str, pipe) -> None:
    """The operator's side: the resync timer's round (list, read every pod, reconcile)."""
    from omni_operator.health.reader import PodMetricsSource, TransferHealth
    from omni_operator.controller.children import ChildCache
    from omni_operator.controller.resync import Resync

    kube = make_kube(url, OPERATOR_TOKEN)
    health = TransferHealth(PodMetricsSource(kube))
    # The children's cache as the running operator has it once kopf's watches have listed
    # every kind (ready); here nothing but the resync's own lists and the writes feed it.
    children = ChildCache()
    children.mark_ready()
    resync = Resync(Reconciler(kube, health=health, children=children), [NAMESPACE], interval=3600)
    try:
        while True:
            command = pipe.recv()
            if command == "stop":
                break
            started = time.perf_counter()
            resync.run_once()
            elapsed = time.perf_counter() - started
            reading = health.reading(NAMESPACE, "h000")
            pipe.send({"resync_s": elapsed, "read_s": health.last_round_seconds,
                       "pods_read_h000": sum(len(st.pods) for st in reading.stages.values()) if reading else 0,
                       "rss_mib": rss_mib(), "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
    finally:
        health.close()
        kube.close()


def health_benchmark(pipelines: int) -> dict:
    stages = [
        {"name": "thinker", "role": "ar", "replicas": 2, "gpus": 1, "kvTransfer": {"send": True}},
        {"name": "talker", "role": "ar", "replicas": 2, "inputs": ["thinker"], "kvTransfer": {"send": True}},
        {"name": "code2wav", "role": "generation", "replicas": 2, "gpus": 0, "inputs": ["talker"]},
    ]
    # A transfer in flight for 400 s (the 300-600 s age step: the age it reports stays put for
    # the whole run), under a threshold it does not reach: a steady, healthy pipeline.
    # Every other pipeline streams thinker -> talker: its pods' pages carry the stream families
    # too (a wait of 400 s under a threshold it does not reach, as for the transfers).
    page = ar_page(active=1, held=1, held_blocks=16, oldest_active=time.time() - 400, oldest_held=time.time() - 400,
                   resolved={"acked": 12345, "failed": 3}, vllm_lines=400,
                   streams={("thinker", "talker"): {"open": 3, "held": 1, "waiting": 2, "oldest_wait": time.time() - 400}})
    server = PageServer(page)
    context = multiprocessing.get_context("spawn")
    try:
        with EmulatorThread() as emu:
            user = make_kube(emu.url)
            user.request("create", "Namespace", "POST", "/api/v1/namespaces",
                         body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
            pods = 0
            for i in range(pipelines):
                name = f"h{i:03d}"
                body = pipeline_body(name=name, stages=copy.deepcopy(stages), observability={
                    "alerts": {"stuckTransferSeconds": 3600, "stalledStreamSeconds": 3600}})
                streamed(body, i)
                create_pipeline(user, body)
                for stage in stages:
                    for r in range(stage["replicas"]):
                        create_pod(user, name, stage["name"], f"{name}-{stage['name']}-{r}", server.port)
                        pods += 1
            parent, child = context.Pipe()
            proc = context.Process(target=operator_process, args=(emu.url, child))
            proc.start()
            try:
                rounds = []
                for _ in range(3):
                    mark = len(emu.calls(OPERATOR_TOKEN))
                    parent.send("round")
                    result = parent.recv()
                    calls = emu.calls(OPERATOR_TOKEN)[mark:]
                    result["writes"] = sum(1 for c in calls if c.verb in ("create", "patch", "update", "delete"))
                    result["pod_lists"] = sum(1 for c in calls if c.resource == "pods" and c.verb == "list")
                    result["lists"] = sum(1 for c in calls if c.verb == "list")
                    rounds.append(result)
                parent.send("stop")
            finally:
                proc.join(60)
            user.close()
            hits = server.hits
    finally:
        server.stop()
    timed = rounds[-1]
    return {
        "health_pipelines": pipelines,
        "health_pods": pods,
        "metrics_reads": hits,
        "resync_s": round(timed["resync_s"], 2),
        "resync_read_s": round(timed["read_s"], 2),
        "resync_writes": timed["writes"],
        "resync_pod_lists": timed["pod_lists"],
        "resync_lists": timed["lists"],
        "first_round_writes": rounds[0]["writes"],
        "operator_rss_mib": round(timed["rss_mib"], 1),
        "operator_max_rss_mib": round(timed["max_rss_mib"], 1),
    }


def streamed(body: dict, i: int) -> dict:
    """Every other pipeline of the mix streams its thinker -> talker edge."""
    if i % 2:
        body["spec"]["stages"][1]["streams"] = [{"stage": "thinker", "firstChunkTokens": 4, "chunkTokens": 16}]
    return body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipelines", type=int, default=100)
    parser.add_argument("--deployed-pipelines", type=int, default=50,
                        help="pipelines created through the running operator (kopf) at the end")
    parser.add_argument("--health-pipelines", type=int, default=100,
                        help="pipelines of 3 stages x 2 pods for the transfer-health resync (0: skip)")
    args = parser.parse_args()

    with EmulatorApart() as emu:
        user = make_kube(emu.url)
        user.request("create", "Namespace", "POST", "/api/v1/namespaces",
                     body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        create_pipeline(user, pipeline_body())
        operator_client = make_kube(emu.url)
        reconciler = Reconciler(operator_client)

        mark = len(emu.methods())
        reconciler.reconcile(NAMESPACE, "tiny")
        create_calls, create_writes = server_calls(emu, mark)

        mark = len(emu.methods())
        reconciler.reconcile(NAMESPACE, "tiny")
        noop_calls, noop_writes = server_calls(emu, mark)

        stages = pipeline_body()["spec"]["stages"]
        stages[1]["engineArgs"] = {"max-model-len": 2048}
        patch_pipeline(user, "tiny", {"spec": {"stages": stages}})
        mark = len(emu.methods())
        reconciler.reconcile(NAMESPACE, "tiny")
        update_calls, update_writes = server_calls(emu, mark)

        names = [f"p{i:03d}" for i in range(args.pipelines)]
        for i, name in enumerate(names):
            create_pipeline(user, streamed(pipeline_body(name=name), i))
        started, cpu, server_cpu = time.perf_counter(), time.process_time(), emu.cpu_s()
        for name in names:
            reconciler.reconcile(NAMESPACE, name)
        elapsed, create_cpu = time.perf_counter() - started, time.process_time() - cpu
        create_server_cpu = emu.cpu_s() - server_cpu

        # The operator as it runs: its watches fill the cache, then its resume handlers have
        # reconciled every pipeline (nothing to change). Then the timed reconciler (the one
        # that made them) reconciles each again from fresh lists, and again reading the cache.
        operator = RunningOperator(emu.url, [NAMESPACE])
        # Configured as the timed reconciler is (no transfer health), so that both write the
        # same status: a no-op is one for either.
        operator.options = dataclasses.replace(operator.options, transfer_health=False)
        operator.start()
        noop_total_writes = 0
        try:
            wait_for(lambda: operator.metrics.reconciles.labels("unchanged")._value.get() >= len(names) + 1,
                     timeout=120, what="the running operator's resume reconciles")
            children = sum(len(operator.children.children(NAMESPACE, name) or {}) for name in names)
            reconciler.children = operator.children
            # kopf's resume handlers annotated every pipeline: a new body to admit once.
            for name in names:
                noop_total_writes += reconciler.reconcile(NAMESPACE, name).writes
            started, cpu, server_cpu = time.perf_counter(), time.process_time(), emu.cpu_s()
            for name in names:
                noop_total_writes += reconciler.reconcile(NAMESPACE, name, fresh=True).writes
            listed_elapsed, listed_cpu = time.perf_counter() - started, time.process_time() - cpu
            listed_server_cpu = emu.cpu_s() - server_cpu
            mark = len(emu.methods())
            reconciler.reconcile(NAMESPACE, names[0])
            cached_calls, _ = server_calls(emu, mark)
            started, cpu, server_cpu = time.perf_counter(), time.process_time(), emu.cpu_s()
            for name in names:
                noop_total_writes += reconciler.reconcile(NAMESPACE, name).writes
            noop_elapsed, noop_cpu = time.perf_counter() - started, time.process_time() - cpu
            noop_server_cpu = emu.cpu_s() - server_cpu

            # Creates as a user makes them: through the API, the running operator (kopf: its
            # watch events, its handlers, its own records) reconciling each; until every one's
            # status has observed it.
            deployed = [f"d{i:03d}" for i in range(args.deployed_pipelines)]
            started, cpu, server_cpu = time.perf_counter(), time.process_time(), emu.cpu_s()
            for i, name in enumerate(deployed):
                create_pipeline(user, streamed(pipeline_body(name=name), i))
            wait_for(lambda: sum(1 for p in user.list_pipelines(NAMESPACE) if p["metadata"]["name"] in deployed
                                 and (p.get("status") or {}).get("observedGeneration") == 1) == len(deployed),
                     timeout=300, what="the running operator to create every pipeline")
            deployed_elapsed, deployed_cpu = time.perf_counter() - started, time.process_time() - cpu
            deployed_server_cpu = emu.cpu_s() - server_cpu
        finally:
            operator.stop()
            reconciler.close()
        user.close()
        operator_client.close()

    health = health_benchmark(args.health_pipelines) if args.health_pipelines else {}
    print(json.dumps({
        "create_calls": create_calls,
        "create_writes": create_writes,
        "noop_calls": noop_calls,
        "noop_cached_calls": cached_calls,
        "cached_children": children,
        "noop_writes": noop_writes,
        "update_calls": update_calls,
        "update_writes": update_writes,
        "pipelines": args.pipelines,
        "streamed_pipelines": args.pipelines // 2,
        "pipelines_per_s": round(args.pipelines / elapsed, 1),
        "noop_pipelines_per_s": round(args.pipelines / noop_elapsed, 1),
        "deployed_pipelines": args.deployed_pipelines,
        "deployed_pipelines_per_s": round(args.deployed_pipelines / deployed_elapsed, 1),
        "deployed_operator_cpu_ms": round(1000 * deployed_cpu / args.deployed_pipelines, 1),
        "deployed_emulator_cpu_ms": round(1000 * deployed_server_cpu / args.deployed_pipelines, 1),
        "noop_listing_pipelines_per_s": round(args.pipelines / listed_elapsed, 1),
        "noop_cache_ratio": round(listed_elapsed / noop_elapsed, 2),
        "noop_writes_100": noop_total_writes,
        "create_cpu_ms": round(1000 * (create_cpu + create_server_cpu) / args.pipelines, 1),
        "noop_cpu_ms": round(1000 * (noop_cpu + noop_server_cpu) / args.pipelines, 1),
        "noop_listing_cpu_ms": round(1000 * (listed_cpu + listed_server_cpu) / args.pipelines, 1),
        "create_operator_cpu_ms": round(1000 * create_cpu / args.pipelines, 1),
        "noop_operator_cpu_ms": round(1000 * noop_cpu / args.pipelines, 1),
        **health,
        "load_1m": round(os.getloadavg()[0], 2),
    }))


if __name__ == "__main__":
    main()
