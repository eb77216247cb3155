"""What a revisioned rollout costs the operator: N pipelines x 3 stages rolled at once.

Against the kmock-based API emulator of tests/operator (there is no Kubernetes API server
here), with tests/operator/cluster_sim.py standing in for the Deployment controller and the
kubelets (pods created and made ready one step later, terminated ones drained of their KV
transfers one per step, each pod's /metrics served on 127.0.0.1). --pipelines pipelines of
three stages x 2 pods (a GPU thinker: no surge; a CPU talker and vocoder: surge 1) are
brought up, then all of them get a new talker engine argument (a new revision) at once, and
the operator's resync round (read every pod's metrics, reconcile every pipeline), as the
resync timer runs it, alternates with a step of the cluster until every pipeline runs only
its new revision. The invariants of tests/operator/test_rollout.py are not checked here
(the tests do); the benchmark counts:

- rounds: resync rounds from the change to the last pipeline settled (each reconciles every
  pipeline once: the reconcile passes per rollout);
- writes_per_rollout: the operator's API writes (create, patch, delete; status and events
  included) during the rollout, per pipeline;
- calls_per_round: the operator's API calls per round, all pipelines;
- wall_s: the rollout's wall time, cluster steps included; operator_s: the part spent in the
  operator's rounds; cpu_s: the process's CPU time over the rollout (operator, emulator and
  simulated cluster together).

Prints one JSON object as its last line.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "tests", "operator"), os.path.join(REPO, "tests")]

from cluster_sim import Clock, SimCluster  # noqa: E402
from k8s_emulator import EmulatorThread  # noqa: E402
from omnip_support import (NAMESPACE, OPERATOR_TOKEN, create_pipeline, make_kube, patch_pipeline,  # noqa: E402
                           pipeline_body, revision)
from omni_operator.pipeline import naming  # noqa: E402
from omni_operator.health.reader import PodMetricsSource, TransferHealth  # noqa: E402
from omni_operator.pipeline.kinds import DEPLOYMENT  # noqa: E402
from omni_operator.controller.reconcile import Reconciler  # noqa: E402
from omni_operator.controller.resync import Resync  # noqa: E402

WRITES = ("create", "patch", "update", "delete")


def stages() -> list[dict]:
    return [
        {"name": "thinker", "role": "ar", "gpus": 1, "replicas": 2, "kvTransfer": {"send": True}},
        {"name": "talker", "role": "ar", "gpus": 0, "replicas": 2, "inputs": ["thinker"], "kvTransfer": {"send": True}},
        {"name": "code2wav", "role": "generation", "gpus": 0, "replicas": 2, "inputs": ["talker"]},
    ]


def settled(kube, sim: SimCluster, bodies: list[dict]) -> bool:
    want = {(b["metadata"]["name"], revision(b)) for b in bodies}
    deployments = kube.list(DEPLOYMENT, NAMESPACE, naming.PIPELINE_LABEL)
    have = {(d["metadata"]["labels"][naming.PIPELINE_LABEL], d["metadata"]["labels"][naming.REVISION_LABEL])
            for d in deployments}
    if have != want or any(p.terminating or not p.ready for p in sim.pods.values()):
        return False
    return len(sim.pods) == sum(s["replicas"] for b in bodies for s in b["spec"]["stages"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipelines", type=int, default=20)
    parser.add_argument("--max-rounds", type=int, default=200)
    args = parser.parse_args()

    with EmulatorThread() as emu:
        user = make_kube(emu.url)
        user.request("create", "Namespace", "POST", "/api/v1/namespaces",
                     body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        clock = Clock(time.time())
        sim = SimCluster(user, NAMESPACE, clock)
        client = make_kube(emu.url, OPERATOR_TOKEN)
        health = TransferHealth(PodMetricsSource(client, clock=clock))
        resync = Resync(Reconciler(client, health=health, now=clock), [NAMESPACE], interval=3600)
        try:
            bodies = [pipeline_body(name=f"r{i:02d}", stages=stages()) for i in range(args.pipelines)]
            for body in bodies:
                create_pipeline(user, body)
            for _ in range(args.max_rounds):
                if settled(user, sim, bodies):
                    break
                sim.tick()
                resync.run_once()
                clock.advance(1)
            assert settled(user, sim, bodies), "the pipelines did not come up"

            new_bodies = []
            for body in bodies:
                changed = copy.deepcopy(body)
                changed["spec"]["stages"][1]["engineArgs"] = {"max-model-len": 2048}
                new_bodies.append(changed)
            mark = len(emu.calls(OPERATOR_TOKEN))
            started, cpu = time.perf_counter(), time.process_time()
            for body in new_bodies:
                patch_pipeline(user, body["metadata"]["name"], {"spec": {"stages": body["spec"]["stages"]}})
            rounds, operator_s = 0, 0.0
            while not settled(user, sim, new_bodies):
                if rounds >= args.max_rounds:
                    raise SystemExit(f"not rolled out after {rounds} rounds")
                sim.tick()
                t = time.perf_counter()
                resync.run_once()
                operator_s += time.perf_counter() - t
                clock.advance(1)
                rounds += 1
            wall, cpu = time.perf_counter() - started, time.process_time() - cpu
            calls = emu.calls(OPERATOR_TOKEN)[mark:]
            writes = sum(1 for c in calls if c.verb in WRITES)
            abandoned = len(sim.abandoned)
        finally:
            health.close()
            client.close()
            sim.close()
            user.close()
    print(json.dumps({
        "pipelines": args.pipelines,
        "stages": 3,
        "pods_per_stage": 2,
        "rounds": rounds,
        "writes_per_rollout": round(writes / args.pipelines, 1),
        "calls_per_round": round(len(calls) / max(rounds, 1), 1),
        "wall_s": round(wall, 2),
        "operator_s": round(operator_s, 2),
        "cpu_s": round(cpu, 2),
        "abandoned_transfers": abandoned,
        "load_1m": round(os.getloadavg()[0], 2),
    }))


if __name__ == "__main__":
    main()
