"""omni-pipeline validate and the pure parts of omni-pipeline up (the processes are started
by tests/runtime/test_local_up.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from omni_operator.local.run import (LocalStage, launch_order, local_stage_configs, local_stage_env, render_table,
                                 stage_counts)
from omni_operator.pipeline.model import parse_pipeline

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omni_operator.local.cli", *args],
                          capture_output=True, text=True, timeout=60)


def test_validate_accepts_every_example():
    proc = run_cli("validate", *map(str, EXAMPLES))
    assert proc.returncode == 0, proc.stdout
    assert proc.stdout.count(": valid (") == len(EXAMPLES)


def test_validate_names_each_bad_field(tmp_path):
    bad = yaml.safe_load((ROOT / "examples" / "tiny-pipeline.yaml").read_text())
    bad["spec"]["stages"][1]["role"] = "decoder"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    proc = run_cli("validate", str(path))
    assert proc.returncode == 1
    assert "spec.stages[1].role: 'decoder' is not one of" in proc.stdout


def test_validate_runs_the_crd_cel_rules(tmp_path):
    bad = yaml.safe_load((ROOT / "examples" / "tiny-pipeline.yaml").read_text())
    bad["spec"]["stages"][0]["kvTransfer"]["criteria"] = {"type": "special_token"}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    proc = run_cli("validate", str(path))
    assert proc.returncode == 1
    assert "tokenId" in proc.stdout and "spec.stages[0].kvTransfer" in proc.stdout


def test_validate_catches_a_cycle_the_schema_cannot(tmp_path):
    body = yaml.safe_load((ROOT / "examples" / "qwen-omni-thinker-talker.yaml").read_text())
    body["spec"]["stages"][0]["inputs"] = [body["spec"]["stages"][-1]["name"]]
    path = tmp_path / "cycle.yaml"
    path.write_text(yaml.safe_dump(body))
    proc = run_cli("validate", str(path))
    assert proc.returncode == 1 and "cycle" in proc.stdout.lower()


def test_validate_reports_unreadable_files(tmp_path):
    (tmp_path / "broken.yaml").write_text("spec: [unclosed")
    proc = run_cli("validate", str(tmp_path / "broken.yaml"), str(tmp_path / "missing.yaml"))
    assert proc.returncode == 1
    assert "not valid YAML" in proc.stdout and "cannot read it" in proc.stdout


def test_stages_launch_downstream_first():
    pipeline = parse_pipeline(yaml.safe_load((ROOT / "examples" / "qwen-omni-thinker-talker.yaml").read_text()))
    order = launch_order(pipeline)
    for stage in pipeline.stages:
        for upstream in stage.inputs:
            assert order.index(stage.name) < order.index(upstream)


def test_local_stages_run_with_vllms_cpu_binding_off_unless_the_user_set_one():
    # Every local stage shares the host: vLLM's auto binding would pin their workers to one
    # core (local_stage_env); test_local_rollout_e2e.py starts a second engine beside a busy one.
    env = local_stage_env({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    assert local_stage_env({"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3"})["VLLM_CPU_OMP_THREADS_BIND"] == "0-1|2-3"
    assert local_stage_env({"VLLM_CPU_OMP_THREADS_BIND": ""})["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_local_configs_point_every_stage_at_its_downstream_on_loopback():
    pipeline = parse_pipeline(yaml.safe_load((ROOT / "examples" / "qwen-omni-thinker-talker.yaml").read_text()))
    ports = {s.name: {"http": 10000 + i, "kv": 11000 + i} for i, s in enumerate(pipeline.stages)}
    configs = local_stage_configs(pipeline, ports)
    for stage in pipeline.stages:
        cfg = configs[stage.name]
        assert cfg["ports"] == ports[stage.name]
        assert [d["endpoint"] for d in cfg["downstream"]] == [
            f"127.0.0.1:{ports[d]['kv']}" for d in pipeline.downstream_of(stage.name)
        ]


def test_the_table_reads_the_stage_metrics():
    ar_page = "\n".join([
        "# TYPE omni_kv_transfers gauge",
        'omni_kv_transfers{model_name="m",stage="ar",state="pending"} 1.0',
        'omni_kv_transfers{model_name="m",stage="ar",state="active"} 2.0',
        'omni_kv_transfers{model_name="m",stage="ar",state="held"} 2.0',
        "# TYPE omni_kv_transfers_resolved_total counter",
        'omni_kv_transfers_resolved_total{model_name="m",outcome="acked",stage="ar"} 7.0',
        'omni_kv_transfers_resolved_total{model_name="m",outcome="expired",stage="ar"} 1.0',
        'omni_kv_transfers_resolved_total{model_name="m",outcome="failed",stage="ar"} 2.0',
    ])
    ar = LocalStage("ar", "ar", Path("x"), Path("y"), 8000, "127.0.0.1", ready=True, counts=stage_counts(ar_page))
    rx = LocalStage("rx", "generation", Path("x"), Path("y"), 8001, "127.0.0.1")
    table = render_table("p", [ar, rx])
    row = next(line for line in table.splitlines() if line.startswith("ar "))
    assert row.split()[:6] == ["ar", "ar", "yes", "1/2/2", "7", "3"]
    assert "waiting" in next(line for line in table.splitlines() if line.startswith("rx "))
    # The endpoint starts last: until then it is waiting, not "exited".
    endpoint = LocalStage("_endpoint", "endpoint", Path("x"), Path("y"), 8002, "127.0.0.1")
    assert render_table("p", [ar, endpoint]).splitlines()[-1].endswith("/v1 (waiting)")


def test_the_table_counts_a_streamed_edges_streams_as_its_transfers():
    """A streamed pipeline hands nothing off whole: its stages' streams are what the table
    counts (a stress run of the streamed example showed DELIVERED 0 and RECEIVED 0 after 120
    streams on every edge)."""
    def resolved(stage, from_stage, to_stage, outcome, value):
        return (f'omni_kv_streams_resolved_total{{from_stage="{from_stage}",model_name="m",'
                f'outcome="{outcome}",stage="{stage}",to_stage="{to_stage}"}} {value}')

    talker_page = "\n".join([
        "# TYPE omni_kv_streams_resolved_total counter",
        resolved("talker", "thinker", "talker", "finished", 9.0),     # taken from the thinker
        resolved("talker", "talker", "vocoder", "finished", 7.0),     # streamed on
        resolved("talker", "talker", "vocoder", "expired", 1.0),
        resolved("talker", "talker", "vocoder", "aborted", 1.0),      # a client went away
    ])
    vocoder_page = "\n".join([
        "# TYPE omni_kv_streams_resolved_total counter",
        resolved("vocoder", "talker", "vocoder", "finished", 7.0),
        resolved("vocoder", "talker", "vocoder", "producer_error", 2.0),
    ])
    talker = LocalStage("talker", "ar", Path("x"), Path("y"), 8000, "127.0.0.1", ready=True,
                        counts=stage_counts(talker_page))
    vocoder = LocalStage("vocoder", "generation", Path("x"), Path("y"), 8001, "127.0.0.1",
                         ready=True, counts=stage_counts(vocoder_page))
    rows = {line.split()[0]: line.split() for line in render_table("p", [talker, vocoder]).splitlines()[2:]}
    assert rows["talker"][:6] == ["talker", "ar", "yes", "0/0/0", "7", "1"]
    assert rows["vocoder"][3:7] == ["-", "-", "2", "7"]  # FAILED: what did not arrive whole


def test_the_front_forwards_to_the_current_revision_and_counts_what_is_in_flight():
    """The front of `up --watch`: requests reach the entry stage it points at (headers a
    stage reads carried on), a switch sends new ones to the new target, and waiting for the
    old target to be idle waits for the requests still there (real sockets; two small
    servers stand in for two revisions' entry stages)."""
    import threading
    import urllib.error
    import urllib.request
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from omni_operator.local.run import Front

    release = threading.Event()

    def server(name: str, hold: bool):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if hold:
                    release.wait(10)  # a request the old revision is still answering
                reply = f"{name}:{self.path}:{self.headers.get('X-Request-Id')}:{body.decode()}".encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"

    (old, old_url), (new, new_url) = server("old", True), server("new", False)
    front = Front("127.0.0.1")
    try:
        try:  # before any revision is ready: an answer that says so, not a dropped connection
            urllib.request.urlopen(front.url + "/health", timeout=5)
            raise AssertionError("answered 200 with no stage behind it")
        except urllib.error.HTTPError as exc:
            assert exc.code == 502 and b"still starting" in exc.read()
        front.switch(old_url)

        def post(rid: str) -> str:
            req = urllib.request.Request(front.url + "/v1/completions", data=b"{}", method="POST",
                                         headers={"X-Request-Id": rid, "Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=20) as resp:
                return resp.read().decode()

        answers: list[str] = []
        slow = threading.Thread(target=lambda: answers.append(post("r1")))
        slow.start()
        from omnip_support import wait_for

        wait_for(lambda: front.inflight[old_url] == 1, what="r1 in flight at the old target")
        assert not front.wait_idle(old_url, 0.2)
        assert front.switch(new_url) == old_url
        assert post("r2") == "new:/v1/completions:r2:{}"  # new requests go to the new target
        release.set()
        assert front.wait_idle(old_url, 10)
        slow.join(10)
        assert answers == ["old:/v1/completions:r1:{}"]
    finally:
        release.set()
        front.close()
        old.shutdown()
        new.shutdown()


def test_the_watcher_reports_a_changed_file_once(tmp_path):
    from omni_operator.local.run import file_watcher

    path = tmp_path / "p.yaml"
    path.write_text("a: 1\n")
    loads = []
    reload = file_watcher(path, lambda p: loads.append(p.read_text()) or p.read_text())
    assert reload() is None and loads == []
    path.write_text("a: 2\n")
    assert reload() == "a: 2\n" and reload() is None and loads == ["a: 2\n"]


def test_the_ports_up_picks_lie_below_the_kernels_ephemeral_range_and_are_free():
    """A stage binds its port a moment after the supervisor picked it: a port from the
    kernel's ephemeral range could be taken meanwhile by any connection's local end (a new
    revision's receiver failed to start so, "Address already in use"); below it, nothing
    takes a port by itself."""
    import socket

    from omni_operator.local.run import _ephemeral_ports, free_port

    first, _ = _ephemeral_ports()
    ports = {free_port("127.0.0.1") for _ in range(50)}
    assert all(1024 <= p < first for p in ports), sorted(ports)
    assert len(ports) > 1, "picked at random, not one port over and over"
    for port in list(ports)[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: the pick held nothing open


def test_a_port_is_never_handed_out_twice(monkeypatch):
    """Each pick is free when made and bound by its stage a moment later: the same pick twice
    gave a stage's HTTP server and its KV receiver one port, and `up` waited for an HTTP
    server that was a ZeroMQ socket (seen once under make test's load)."""
    import random

    from omni_operator.local import run

    first, _ = run._ephemeral_ports()
    draws = iter([first - 7, first - 7, first - 7, first - 9])
    monkeypatch.setattr(random, "randrange", lambda low, high: next(draws))
    monkeypatch.setattr(run, "_HANDED_OUT", type(run._HANDED_OUT)())
    assert [run.free_port("127.0.0.1"), run.free_port("127.0.0.1")] == [first - 7, first - 9]


def test_a_port_another_process_reserved_is_not_handed_out(monkeypatch, tmp_path):
    """Two `up`s (or an `up` and a test) pick ports at once: each port is free when picked and
    bound by its stage up to a minute later, so another process found it free meanwhile (two
    `up`s once shared an endpoint port, and one's client got the other pipeline's answer). A
    port a live process reserved is skipped; one whose process is gone is taken over, and
    this process's reservations go at its exit."""
    import random

    from omni_operator.local import run

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    ports = tmp_path / f"omni-pipeline-{os.getuid()}" / "ports"
    ports.mkdir(parents=True)
    first, _ = run._ephemeral_ports()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    (ports / str(first - 7)).write_text(str(os.getppid()))  # a live process's
    (ports / str(first - 9)).write_text(gone)  # a process that is gone
    draws = iter([first - 7, first - 9])
    monkeypatch.setattr(random, "randrange", lambda low, high: next(draws))
    monkeypatch.setattr(run, "_HANDED_OUT", type(run._HANDED_OUT)())
    monkeypatch.setattr(run, "_RESERVED", [])
    assert run.free_port("127.0.0.1") == first - 9
    assert (ports / str(first - 9)).read_text() == str(os.getpid())
    assert (ports / str(first - 7)).read_text() == str(os.getppid())
    run._release_reservations()
    assert sorted(p.name for p in ports.iterdir()) == [str(first - 7)]


# ---------------------------------------------------------------------------- up --streaming
# (the processes: tests/runtime/test_local_up.py, the streamed example's test)

def test_streaming_compares_with_the_same_pipeline_fed_whole():
    from omni_operator.check.admission import admit
    from omni_operator.local.run import whole_edges

    body = yaml.safe_load((ROOT / "examples" / "tiny-omni-streaming.yaml").read_text())
    streamed = admit(body).pipeline
    whole = admit(whole_edges(body)).pipeline
    assert [s.inputs for s in whole.stages] == [s.inputs for s in streamed.stages]
    assert len(streamed.streamed_edges()) == 2 and whole.streamed_edges() == []
    assert whole.revision != streamed.revision
    # Nothing else changed, and the file's own body is left as it was.
    assert [{k: v for k, v in s.items() if k != "streams"} for s in body["spec"]["stages"]] == \
        whole_edges(body)["spec"]["stages"]
    assert "streams" in body["spec"]["stages"][1]


def test_the_first_output_is_the_last_stage_taking_its_first_input():
    from omni_operator.local.run import first_output_seconds

    answer = {"omni": {"stages": {"thinker": {"sent_at": 100.0, "finished_at": 103.0},
                                  "talker": {"taken_at": 100.5},
                                  "vocoder": {"taken_at": 100.75, "stored_at": 104.0}}}}
    assert first_output_seconds(answer, "thinker", "vocoder") == 0.75
    assert first_output_seconds(answer, "thinker", "code2wav") is None
    assert first_output_seconds({"choices": []}, "thinker", "vocoder") is None


def test_the_comparison_prints_each_request_the_medians_and_how_much_sooner():
    from omni_operator.check.admission import admit
    from omni_operator.local.run import first_output_summary

    pipeline = admit(yaml.safe_load((ROOT / "examples" / "tiny-omni-streaming.yaml")
                                    .read_text())).pipeline
    text = first_output_summary(pipeline, [0.5, 0.4, None], [2.0, 2.4, 2.2])
    assert text.splitlines() == [
        "first output (the request at the endpoint until vocoder took its first input), "
        "3 requests each way:",
        "  streamed:        0.500 s, 0.400 s, - (median 0.500 s)",
        "  whole hand-offs: 2.000 s, 2.400 s, 2.200 s (median 2.200 s)",
        "  streamed, the first output came 4.4x sooner"]
    assert first_output_summary(pipeline, [3.0], [2.0]).endswith("came no sooner")


def test_up_streaming_refuses_what_it_cannot_compare(tmp_path):
    streaming = str(ROOT / "examples" / "tiny-omni-streaming.yaml")
    proc = run_cli("up", str(ROOT / "examples" / "tiny-chain.yaml"), "--demo", "1", "--streaming")
    assert proc.returncode == 2
    assert "has no streamed edge (spec.stages[].streams)" in proc.stdout
    assert "examples/tiny-omni-streaming.yaml" in proc.stdout
    proc = run_cli("up", streaming, "--streaming")
    assert proc.returncode == 2 and "give --demo N too" in proc.stdout
    proc = run_cli("up", streaming, "--demo", "1", "--streaming", "--watch")
    assert proc.returncode == 2 and "--streaming and --watch do not go together" in proc.stdout
    # Two last stages: no one endpoint, so no first output to time.
    body = yaml.safe_load(Path(streaming).read_text())
    body["spec"]["stages"].append({"name": "extra", "role": "generation", "gpus": 0,
                                   "inputs": ["thinker"]})
    path = tmp_path / "two-sinks.yaml"
    path.write_text(yaml.safe_dump(body))
    proc = run_cli("up", str(path), "--demo", "1", "--streaming")
    assert proc.returncode == 2 and "has no one endpoint" in proc.stdout, proc.stdout


def test_up_refuses_a_model_path_that_is_not_on_this_machine(tmp_path):
    """A fresh clone runs `omni-pipeline up examples/...` before `make demo` built the tiny
    model: refused before any stage starts, naming the field and the fix (vLLM would say
    "Repo id must use alphanumeric chars" from every stage)."""
    body = yaml.safe_load((ROOT / "examples" / "tiny-omni-streaming.yaml").read_text())
    for path in (str(tmp_path / "nowhere" / "tiny-qwen2"), "./.omni-no-such-cache/tiny-qwen2"):
        body["spec"]["model"]["path"] = path
        spec = tmp_path / "pipeline.yaml"
        spec.write_text(yaml.safe_dump(body))
        workdir = tmp_path / "work"
        proc = run_cli("up", str(spec), "--workdir", str(workdir))
        assert proc.returncode == 2, proc.stdout
        assert f"spec.model.path: {path} is not on this machine" in proc.stdout, proc.stdout
        assert f"python -m omni_runtime.devtools.tiny_model {path}" in proc.stdout
        assert not workdir.exists(), "nothing was started"


def test_a_model_hub_id_or_a_model_here_is_left_to_the_stages(tmp_path):
    from omni_operator.local.run import model_not_here
    from omni_operator.pipeline.model import parse_pipeline

    body = yaml.safe_load((ROOT / "examples" / "tiny-omni-streaming.yaml").read_text())
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    for path in ("Qwen/Qwen2.5-0.5B", "./models/tiny", str(tmp_path / "models" / "tiny")):
        body["spec"]["model"]["path"] = path
        assert model_not_here(parse_pipeline(body), cwd=tmp_path) is None, path
    body["spec"]["model"]["path"] = "./models/gone"
    assert "./models/gone is not on this machine" in model_not_here(parse_pipeline(body), cwd=tmp_path)


def _local_file(tmp_path: Path, name: str) -> Path:
    """examples/tiny-pipeline.yaml named ``name``, its model a directory that exists here (the
    checks below come before any stage would read it)."""
    body = yaml.safe_load((ROOT / "examples" / "tiny-pipeline.yaml").read_text())
    body["metadata"]["name"] = name
    (tmp_path / "model").mkdir(exist_ok=True)
    body["spec"]["model"]["path"] = str(tmp_path / "model")
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def test_up_says_in_one_line_what_it_cannot_begin_with(tmp_path):
    """A host that does not resolve, a port taken or out of range, a work directory under a
    file, --port without --watch, a negative count: one line each, exit 2, nothing left behind
    (an outside review as a new user: tracebacks, and the temporary directory left)."""
    import socket

    spec = str(_local_file(tmp_path, "door"))
    before = set(Path(tempfile.gettempdir()).glob("omni-door-*"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        cases = [(("--host", "no.such.host.invalid"), "cannot begin"),
                 (("--workdir", str(Path(spec) / "x")), "Not a directory"),
                 (("--watch", "--port", port), "Address already in use"),
                 (("--port", "5000"), "--port is the port of the front that --watch runs"),
                 (("--port", "70000"), "must be a port from 0 to 65535"),
                 (("--demo", "-1"), "must be a number of requests"),
                 (("--exit-after", "-3"), "must be a number of seconds")]
        for args, said in cases:
            proc = run_cli("up", spec, *args)
            text = proc.stdout + proc.stderr
            assert proc.returncode == 2, (args, text)
            assert said in text and "Traceback" not in text, (args, text)
    assert set(Path(tempfile.gettempdir()).glob("omni-door-*")) == before, "a temporary directory was left"


def test_a_pipeline_up_already_is_not_started_twice_and_a_stopped_one_is_not_running(tmp_path):
    """A second `up` of a pipeline that is up (by its name, or its --workdir) is refused: it
    overwrote the first's records and configs, and took over its pointer (an outside review);
    `status` of one whose `up` has exited says it is not running (exit 2), not "unknown"."""
    from omni_operator.local.status import pointer_path, record_endpoints

    spec = _local_file(tmp_path, "twice-up")
    pipeline = parse_pipeline(yaml.safe_load(spec.read_text()))
    workdir = tmp_path / "first"
    workdir.mkdir()
    pointer = record_endpoints(pipeline, workdir, {"ar": "http://127.0.0.1:9"})  # this process: alive
    try:
        for args in ((), ("--workdir", str(workdir))):
            proc = run_cli("up", str(spec), *args)
            assert proc.returncode == 2, proc.stdout + proc.stderr
            assert f"pipeline default/twice-up is up already (omni-pipeline up, pid {os.getpid()}" in proc.stdout
        assert pointer.exists() and pointer_path(pipeline) == pointer
        # The `up` that wrote the records is gone (a pid no process has).
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True)
        for path in (pointer, workdir / "endpoints.json"):
            record = json.loads(path.read_text())
            path.write_text(json.dumps({**record, "pid": int(gone.stdout)}))
        proc = run_cli("status", str(spec), "--workdir", str(workdir), "--interval", "0")
        assert proc.returncode == 2 and "the `up` that wrote it has exited" in proc.stdout, proc.stdout
    finally:
        pointer.unlink(missing_ok=True)


def test_a_stage_that_exits_while_a_later_one_starts_stops_the_start(tmp_path, monkeypatch):
    """The receiver up and ready, then gone while the AR stage above it is still starting:
    the start ends (the pipeline stops, exit 1) instead of waiting out the AR's start-up
    (an outside review: the table said `exited` for good, and Ctrl-C then exited 0). Stand-in
    processes (no engine): the receiver a sleeper that is killed, the AR one never ready."""
    import threading
    import time

    from omni_operator.local.run import LocalPipeline

    pipeline = parse_pipeline(yaml.safe_load(_local_file(tmp_path, "dies-early").read_text()))
    local = LocalPipeline(pipeline, tmp_path)

    def start(stage, env):
        stage.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])

    first, second = local.stages[local.order[0]], local.stages[local.order[1]]

    def poll(stage):
        stage.ready = stage is first  # the first one started (downstream) is ready
        if second.proc is not None and first.alive():  # the next is starting: the first dies
            first.proc.kill()
            first.proc.wait()

    monkeypatch.setattr(LocalStage, "start", start)
    monkeypatch.setattr(LocalStage, "poll", poll)
    began = time.monotonic()
    try:
        assert local.start({}, threading.Event()) is False
        assert time.monotonic() - began < 30
        assert not first.alive() and second.alive()
    finally:
        for stage in local.stages.values():
            if stage.proc is not None:
                stage.proc.kill()
                stage.proc.wait()


def test_validate_says_a_duplicate_stage_name_once_and_no_wrong_index(tmp_path):
    """A stage renamed to another's name (it lists that one in its inputs): the duplicate is
    the problem; the self-input rule said `spec.stages[0].inputs[0]` of a stage with no inputs
    (it found the stage by its name, the first of the two)."""
    body = yaml.safe_load((ROOT / "examples" / "tiny-pipeline.yaml").read_text())
    first = body["spec"]["stages"][0]["name"]
    body["spec"]["stages"][1]["name"] = first
    path = tmp_path / "duplicate.yaml"
    path.write_text(yaml.safe_dump(body))
    proc = run_cli("validate", str(path))
    assert proc.returncode == 1
    assert "must be unique" in proc.stdout and "cannot list itself" not in proc.stdout, proc.stdout


def test_the_demo_shows_the_streams_a_streamed_receiver_took(tmp_path):
    """`make demo DEMO_ARGS=--streaming`: the vocoder's inputs are streams, not KV payloads;
    it printed an empty `KV arrived` section (an outside review). A stand-in for the
    vocoder's HTTP API serves its /v1/streams."""
    import io
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from omni_operator.local.run import LocalPipeline, show_arrivals

    body = yaml.safe_load((ROOT / "examples" / "tiny-omni-streaming.yaml").read_text())
    local = LocalPipeline(parse_pipeline(body), tmp_path)
    [vocoder] = [s for s in local.table_order() if s.role == "generation"]
    streams = {"stage": vocoder.name, "streams": [
        {"request_id": "r-1", "from_stage": "talker", "token_ids": [1, 2, 3], "prompt_len": 0, "chunks": 2,
         "streamed": True, "outcome": "finished", "reason": None}]}

    class Vocoder(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            data = json.dumps(streams if self.path == "/v1/streams" else {"payloads": []}).encode()
            self.send_response(200 if self.path == "/v1/streams" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", vocoder.http_port), Vocoder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        out = io.StringIO()
        show_arrivals(local, 1, threading.Event(), out)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert out.getvalue().splitlines() == [
        f"streams taken at stage {vocoder.name} ({vocoder.url}/v1/streams):",
        "  r-1: 3 tokens in 2 chunks from talker, finished"]
