"""How many API calls the operator makes, and how fast it reconciles.

Counts, at the (emulated) API server, the requests made by reconciling a 3-stage pipeline:
its creation, a reconcile with nothing to change (target: no write), and a change to one
stage; then times reconciling --pipelines pipelines from scratch. The server is the kmock-
based emulator of tests/operator (there is no Kubernetes API server here), so the wall time
measures the operator's own work plus local HTTP, not a real cluster's latency.

Prints one JSON object as its last line. Besides the rates it gives the process's CPU time per
pipeline (the operator's and the emulator's thread together: the whole cost of a reconcile
here) and the machine's load average at the end, since on a shared machine the wall-time rates
follow the load while the CPU figures do not.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "operator"))

from omnip_support import NAMESPACE, create_pipeline, make_kube, patch_pipeline, pipeline_body  # noqa: E402
from k8s_emulator import EmulatorThread  # noqa: E402
from omni_operator.reconcile import Reconciler  # noqa: E402

WRITE_METHODS = {"POST", "PATCH", "PUT", "DELETE"}


def server_calls(emu: EmulatorThread, since: int) -> tuple[int, int]:
    requests = emu.requests[since:]
    return len(requests), sum(1 for r in requests if str(r.method.value) in WRITE_METHODS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipelines", type=int, default=100)
    args = parser.parse_args()

    with EmulatorThread() as emu:
        user = make_kube(emu.url)
        user.request("create", "Namespace", "POST", "/api/v1/namespaces",
                     body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        create_pipeline(user, pipeline_body())
        operator_client = make_kube(emu.url)
        reconciler = Reconciler(operator_client)

        mark = len(emu.requests)
        reconciler.reconcile(NAMESPACE, "tiny")
        create_calls, create_writes = server_calls(emu, mark)

        mark = len(emu.requests)
        reconciler.reconcile(NAMESPACE, "tiny")
        noop_calls, noop_writes = server_calls(emu, mark)

        stages = pipeline_body()["spec"]["stages"]
        stages[1]["engineArgs"] = {"max-model-len": 2048}
        patch_pipeline(user, "tiny", {"spec": {"stages": stages}})
        mark = len(emu.requests)
        reconciler.reconcile(NAMESPACE, "tiny")
        update_calls, update_writes = server_calls(emu, mark)

        names = [f"p{i:03d}" for i in range(args.pipelines)]
        for name in names:
            create_pipeline(user, pipeline_body(name=name))
        started, cpu = time.perf_counter(), time.process_time()
        for name in names:
            reconciler.reconcile(NAMESPACE, name)
        elapsed, create_cpu = time.perf_counter() - started, time.process_time() - cpu
        started, cpu = time.perf_counter(), time.process_time()
        noop_total_writes = 0
        for name in names:
            noop_total_writes += reconciler.reconcile(NAMESPACE, name).writes
        noop_elapsed, noop_cpu = time.perf_counter() - started, time.process_time() - cpu
        user.close()
        operator_client.close()

    print(json.dumps({
        "create_calls": create_calls,
        "create_writes": create_writes,
        "noop_calls": noop_calls,
        "noop_writes": noop_writes,
        "update_calls": update_calls,
        "update_writes": update_writes,
        "pipelines": args.pipelines,
        "pipelines_per_s": round(args.pipelines / elapsed, 1),
        "noop_pipelines_per_s": round(args.pipelines / noop_elapsed, 1),
        "noop_writes_100": noop_total_writes,
        "create_cpu_ms": round(1000 * create_cpu / args.pipelines, 1),
        "noop_cpu_ms": round(1000 * noop_cpu / args.pipelines, 1),
        "load_1m": round(os.getloadavg()[0], 2),
    }))


if __name__ == "__main__":
    main()
