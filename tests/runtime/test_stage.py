"""omni-stage's config parsing and the vLLM command it builds (pure), and its CLI errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from omni_runtime.stages.ar import (
    SCHEDULER_CLS,
    engine_args_to_cli,
    in_flight_transfers,
    vllm_command,
)
from omni_runtime.transfers.config import parse_omni_kv_config
from omni_runtime.stages.config import StageConfigError, parse_stage_config

BASE = {
    "pipeline": "p",
    "stage": "thinker",
    "role": "ar",
    "model": {"name": "Qwen/Qwen2.5-Omni-7B", "path": "/models/qwen"},
    "engineArgs": {"max-model-len": 4096, "enforce_eager": True, "gpuMemoryUtilization": 0.9, "trust-remote-code": False},
    "kvTransfer": {"send": True, "criteria": {"type": "special_token", "tokenId": 151667}, "timeoutSeconds": 45},
    "downstream": [{"stage": "talker", "endpoint": "p-talker.ns.svc:9600"}],
    "ports": {"http": 8000, "kv": 9600},
    "observability": {"metrics": True, "tracing": {"otlpEndpoint": "http://otel:4317"}},
}


def test_the_vllm_command_carries_the_scheduler_connector_and_kv_config():
    cfg = parse_stage_config(BASE)
    argv = vllm_command(cfg, "0.0.0.0", python="python")
    assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == "/models/qwen"
    assert argv[argv.index("--served-model-name") + 1] == "Qwen/Qwen2.5-Omni-7B"
    assert argv[argv.index("--scheduler-cls") + 1] == SCHEDULER_CLS
    assert "--worker-cls" not in argv, "vLLM's own worker runs the omni KV connector"
    assert argv[argv.index("--otlp-traces-endpoint") + 1] == "http://otel:4317"
    assert argv[argv.index("--max-model-len") + 1] == "4096"
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.9"
    assert "--enforce-eager" in argv and "--trust-remote-code" not in argv
    additional = json.loads(argv[argv.index("--additional-config") + 1])
    connector = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert connector == {
        "kv_connector": "OmniKVConnector",
        "kv_connector_module_path": "omni_runtime.kv.connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"pipeline": "p", "endpoints": {"talker": "tcp://p-talker.ns.svc:9600"}},
    }
    kv = parse_omni_kv_config(additional["omni_kv_config"], vocab_size=152064)
    assert (kv.need_send_cache, kv.criteria.value, kv.token_id, kv.timeout_seconds, kv.stage_name) == (
        True, "special_token", 151667, 45.0, "thinker")


def test_user_additional_config_is_merged_and_reserved_args_are_refused():
    flags, additional = engine_args_to_cli({"additional-config": {"x": 1}, "max_num_seqs": 8})
    assert flags == ["--max-num-seqs", "8"] and additional == {"x": 1}
    for key in ("port", "schedulerCls", "model"):
        with pytest.raises(StageConfigError, match=f"engineArgs.{key}"):
            engine_args_to_cli({key: "x"})
    with pytest.raises(StageConfigError, match="additional-config.omni_kv_config"):
        parse_stage_config({**BASE, "engineArgs": {"additional-config": {"omni_kv_config": {}}}})


OMNI_CONNECTOR = {
    "kv_connector": "OmniKVConnector",
    "kv_connector_module_path": "omni_runtime.kv.connector",
    "kv_role": "kv_producer",
    "kv_connector_extra_config": {"pipeline": "p", "endpoints": {"talker": "tcp://p-talker.ns.svc:9600"}},
}


@pytest.mark.parametrize("as_json", [False, True])
def test_another_kv_connector_in_engine_args_is_composed_with_ours(as_json):
    other = {"kv_connector": "ExampleConnector", "kv_role": "kv_both", "engine_id": "e1",
             "kv_connector_extra_config": {"shared_storage_path": "/kv"}}
    value = json.dumps(other) if as_json else other
    cfg = parse_stage_config({**BASE, "engineArgs": {"kvTransferConfig": value}})
    argv = vllm_command(cfg, "0.0.0.0")
    assert argv.count("--kv-transfer-config") == 1
    composed = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    child = {k: v for k, v in other.items() if k != "engine_id"}
    assert composed == {
        "kv_connector": "MultiConnector", "kv_role": "kv_both", "engine_id": "e1",
        "kv_connector_extra_config": {"connectors": [child, OMNI_CONNECTOR]},
    }


def test_a_multi_connector_in_engine_args_gets_ours_as_one_more_child():
    children = [{"kv_connector": "ExampleConnector", "kv_role": "kv_producer"},
                {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_producer"}]
    other = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"connectors": children}}
    cfg = parse_stage_config({**BASE, "engineArgs": {"kv-transfer-config": other}})
    argv = vllm_command(cfg, "0.0.0.0")
    composed = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert composed["kv_connector"] == "MultiConnector"
    assert composed["kv_role"] == "kv_producer", "every child only produces"
    assert composed["kv_connector_extra_config"]["connectors"] == [*children, OMNI_CONNECTOR]


@pytest.mark.parametrize(
    "value, message",
    [
        ("not json", "engineArgs.kvTransferConfig: is not valid JSON"),
        (["ExampleConnector"], "engineArgs.kvTransferConfig: must be a mapping"),
        ({"kv_role": "kv_both"}, "engineArgs.kvTransferConfig: connector 0 .* naming kv_connector"),
        ({"kv_connector": "ExampleConnector"}, "engineArgs.kvTransferConfig: .*needs a kv_role"),
        ({"kv_connector": "OmniKVConnector", "kv_role": "kv_producer"},
         "engineArgs.kvTransferConfig: .*the omni KV connector is added by the stage"),
        ({"kv_connector": "MultiConnector", "kv_role": "kv_both"},
         "engineArgs.kvTransferConfig: .*connectors must be a non-empty list"),
    ],
)
def test_a_kv_connector_that_cannot_be_composed_is_refused_naming_the_key(value, message):
    """Refused when the config is read (the stage contract's check, the one the operator
    runs too), before any command is built."""
    with pytest.raises(StageConfigError, match=message):
        parse_stage_config({**BASE, "engineArgs": {"kvTransferConfig": value}})


def test_without_transfers_a_users_connector_is_passed_through_as_it_is():
    other = {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}
    cfg = parse_stage_config({**BASE, "kvTransfer": {"send": False},
                              "engineArgs": {"kv_transfer_config": other}})
    argv = vllm_command(cfg, "0.0.0.0")
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1]) == other
    assert argv.count("--kv-transfer-config") == 1


def test_without_transfers_no_connector_is_loaded():
    cfg = parse_stage_config({**BASE, "kvTransfer": {"send": False}})
    assert "--kv-transfer-config" not in vllm_command(cfg, "0.0.0.0")


@pytest.mark.parametrize(
    "change, key",
    [
        ({"stage": None}, "stage is required"),
        ({"model": {}}, "model.name or model.path"),
        ({"ports": {"http": "8000"}}, "ports.http must be a int"),
        ({"downstream": [{"stage": "talker"}]}, r"downstream\[0\].endpoint is required"),
        ({"kvTransfer": {"send": "yes"}}, "kvTransfer.send must be a bool"),
        ({"kvTransfer": {"timeoutSeconds": "soon"}}, "kvTransfer.timeoutSeconds"),
        ({"inputs": ["a", ""]}, r"inputs\[1\]: a stage name cannot be empty"),
        ({"downstream": [{"stage": "talker", "endpoint": "x:1", "mode": "stream",
                          "stream": {"gapSeconds": float("nan")}}]},
         r"downstream\[0\].stream.gapSeconds must be a finite number"),
        ({"downstream": [{"stage": "talker", "endpoint": "x:1", "stream": {}}]},
         r"downstream\[0\].stream is set but downstream\[0\].mode is whole"),
    ],
)
def test_bad_stage_configs_name_the_key(change, key):
    with pytest.raises(StageConfigError, match=key):
        parse_stage_config({**BASE, **change})


def test_both_ends_of_a_streamed_edge_read_it_from_their_configs():
    from omni_contract.edges import Edge, StreamSettings
    settings = StreamSettings(first_chunk_tokens=2, gap_seconds=3.0)
    edge = Edge("talker", "stream", settings).to_config()
    producer = parse_stage_config({**BASE, "downstream": [
        {**edge, "endpoint": "p-talker.ns.svc:9600"},
        {"stage": "code2wav", "endpoint": "p-code2wav.ns.svc:9600"}]})
    assert [(d.stage, d.stream) for d in producer.downstream] == [
        ("talker", settings), ("code2wav", None)]
    consumer = parse_stage_config({**BASE, "stage": "talker", "downstream": [],
                                   "kvTransfer": {"send": False},
                                   "inputs": [{**edge, "stage": "thinker"}, "vision"]})
    assert consumer.inputs == ("thinker", "vision")
    assert consumer.input_edges == (Edge("thinker", "stream", settings), Edge("vision"))


def test_in_flight_transfers_are_read_from_the_metrics_page():
    page = "\n".join([
        '# TYPE omni_kv_transfers gauge',
        'omni_kv_transfers{model_name="m",stage="s",state="pending"} 2.0',
        'omni_kv_transfers{model_name="m",stage="s",state="active"} 3.0',
        'omni_kv_transfers{model_name="m",stage="s",state="held"} 7.0',
    ])
    assert in_flight_transfers(page) == 5


def test_omni_stage_refuses_a_bad_config_with_the_key(tmp_path):
    bad = tmp_path / "stage.yaml"
    bad.write_text("pipeline: p\nstage: s\nrole: ar\nmodel: {}\n")
    proc = subprocess.run([sys.executable, "-m", "omni_runtime.stages.main", "--config", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "model.name or model.path is required" in proc.stderr


@pytest.mark.parametrize(
    "kv, key",
    [
        ({"send": True, "criteria": {"type": "sometimes"}}, "kvTransfer.criteria.type"),
        ({"send": True, "criteria": {"type": "special_token"}}, "kvTransfer.criteria.tokenId"),
        ({"send": True, "timeoutSeconds": -5}, "kvTransfer.timeoutSeconds"),
    ],
)
def test_an_ar_stage_config_with_bad_transfer_settings_fails_before_vllm_starts(kv, key):
    with pytest.raises(StageConfigError, match=key.replace(".", r"\.")):
        parse_stage_config({**BASE, "kvTransfer": kv})


def test_the_crds_request_finished_criteria_is_the_schedulers_default_trigger():
    cfg = parse_stage_config({**BASE, "kvTransfer": {"send": True, "criteria": {"type": "request_finished"}}})
    kv = parse_omni_kv_config(cfg.omni_kv_config())
    assert kv.need_send_cache and kv.criteria is None


# -- kvTransfer.ioCpus: the KV transport threads' CPUs ------------------------------------------

def _connector_extra(argv: list[str]) -> dict:
    """The omni connector's kv_connector_extra_config in a built command (alone or composed)."""
    connector = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    if connector["kv_connector"] == "MultiConnector":
        (connector,) = [c for c in connector["kv_connector_extra_config"]["connectors"]
                        if c["kv_connector"] == "OmniKVConnector"]
    return connector["kv_connector_extra_config"]


@pytest.mark.parametrize("io_cpus, passed", [
    ("3", "3"), ("2-3,6", "2-3,6"), (" 0-1 ", "0-1"), ([2, 3], [2, 3]), ([0], [0]),
])
def test_io_cpus_reach_the_connectors_extra_config(io_cpus, passed):
    cfg = parse_stage_config({**BASE, "kvTransfer": {**BASE["kvTransfer"], "ioCpus": io_cpus}})
    extra = _connector_extra(vllm_command(cfg, "0.0.0.0"))
    assert extra["io_cpus"] == passed
    # What the connector makes of it at start-up (its own parser), with those CPUs allowed.
    from omni_runtime.kv.cpu_affinity import parse_cpu_list, transport_cpus

    wanted = parse_cpu_list(passed) if isinstance(passed, str) else set(passed)
    assert transport_cpus(extra["io_cpus"], environ={}, available=range(8)) == wanted


@pytest.mark.parametrize("kv", [{}, {"ioCpus": "auto"}, {"ioCpus": None}])
def test_io_cpus_auto_or_absent_leaves_the_connector_on_auto(kv):
    cfg = parse_stage_config({**BASE, "kvTransfer": {**BASE["kvTransfer"], **kv}})
    assert cfg.kv_io_cpus is None
    assert "io_cpus" not in _connector_extra(vllm_command(cfg, "0.0.0.0"))


def test_io_cpus_reach_our_connector_when_composed_with_the_users():
    other = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"shared_storage_path": "/kv"}}
    cfg = parse_stage_config({**BASE, "kvTransfer": {**BASE["kvTransfer"], "ioCpus": "2-3"},
                              "engineArgs": {"kv-transfer-config": other}})
    argv = vllm_command(cfg, "0.0.0.0")
    composed = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    user_child, ours = composed["kv_connector_extra_config"]["connectors"]
    assert user_child == other, "the user's connector is left as it is"
    assert ours == {**OMNI_CONNECTOR, "kv_connector_extra_config": {
        **OMNI_CONNECTOR["kv_connector_extra_config"], "io_cpus": "2-3"}}


def test_io_cpus_for_our_connector_cannot_come_from_engine_args():
    """Our connector's settings come from kvTransfer alone: a user config that names it (to
    set its io_cpus, say) is refused, pointing at kvTransfer.ioCpus, never merged."""
    mine = {"kv_connector": "OmniKVConnector", "kv_role": "kv_producer",
            "kv_connector_extra_config": {"io_cpus": "1"}}
    with pytest.raises(StageConfigError, match=r"engineArgs\.kv-transfer-config: .*kvTransfer\.ioCpus"):
        parse_stage_config({**BASE, "kvTransfer": {**BASE["kvTransfer"], "ioCpus": "2"},
                            "engineArgs": {"kv-transfer-config": mine}})


@pytest.mark.parametrize("io_cpus, words", [
    ("", "is empty"),
    ([], "is empty"),
    ("3-1", "descending CPU range"),
    ("two", "not a CPU list item"),
    ("1;2", "not a CPU list item"),
    ("-1", "not a CPU list item"),
    ("0-99999999999", "CPU id above 65535"),
    ([1, -2], "a list of CPU ids"),
    ([1, "2"], "a list of CPU ids"),
    ([True], "a list of CPU ids"),
    (3, "a list of CPU ids"),
    ({"cpus": "3"}, "a list of CPU ids"),
])
def test_a_malformed_io_cpus_is_refused_naming_the_key_and_the_fix(io_cpus, words):
    with pytest.raises(StageConfigError) as err:
        parse_stage_config({**BASE, "kvTransfer": {**BASE["kvTransfer"], "ioCpus": io_cpus}})
    message = str(err.value)
    assert message.startswith("kvTransfer.ioCpus") and words in message, message
    assert "auto" in message, "the message names the fix"


@pytest.mark.parametrize("role", ["ar", "generation"])
def test_io_cpus_on_a_stage_that_does_not_send_is_refused(role):
    with pytest.raises(StageConfigError, match=r"kvTransfer\.ioCpus is set but kvTransfer\.send is false"):
        parse_stage_config({**BASE, "role": role, "kvTransfer": {"ioCpus": "2"}})
    # "auto" is the default and asks for nothing: allowed anywhere.
    assert parse_stage_config({**BASE, "role": role, "kvTransfer": {"ioCpus": "auto"}}).kv_io_cpus is None


def test_omni_stage_refuses_a_malformed_io_cpus_before_vllm_starts(tmp_path):
    bad = tmp_path / "stage.yaml"
    bad.write_text("pipeline: p\nstage: s\nrole: ar\nmodel: {name: m}\n"
                   "kvTransfer: {send: true, ioCpus: '2-x'}\n")
    proc = subprocess.run([sys.executable, "-m", "omni_runtime.stages.main", "--config", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "kvTransfer.ioCpus: not a CPU list item: '2-x'" in proc.stderr


def test_the_pipeline_revision_reaches_the_senders_hello_and_the_receivers_expectation():
    """The operator's stage config names the pipeline revision: the AR stage's connector puts
    it in its hello's compatibility fields, a receiving stage of that config refuses senders
    of another revision (test_connector.py: the refusal itself). A config without one (written
    by hand) checks nothing."""
    from procs import free_port

    from omni_runtime.stages.receiver import ReceiverStage

    cfg = parse_stage_config({**BASE, "revision": "5c0ffee"})
    argv = vllm_command(cfg, "0.0.0.0", python="python")
    extra = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
    assert extra["revision"] == "5c0ffee"
    assert "revision" not in json.loads(vllm_command(parse_stage_config(BASE), "0.0.0.0", python="python")[
        argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]

    for revision, expected in (("5c0ffee", "5c0ffee"), (None, None)):
        raw = {**BASE, "role": "generation", "kvTransfer": {"send": False},
               "ports": {"http": free_port(), "kv": free_port()}}
        if revision:
            raw["revision"] = revision
        stage = ReceiverStage(parse_stage_config(raw), host="127.0.0.1")
        try:
            assert stage.receiver.expect == {"model": "Qwen/Qwen2.5-Omni-7B", "revision": expected}
        finally:
            stage._http.server_close()
            stage.receiver.close()


def test_an_ar_stage_leaves_no_metrics_directory_behind(tmp_path, monkeypatch):
    """Each run of an AR stage has prometheus_client's multiprocess directory of its own; it
    goes when the run ends (an outside review: one per run piled up in /tmp, hundreds). The
    stand-in for vLLM (no engine) exits at once, which ends the run."""
    import signal
    import sys

    from omni_runtime.stages import ar

    monkeypatch.setattr(ar, "vllm_command", lambda *a, **k: [sys.executable, "-c", "pass"])
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # the test process keeps its handlers
    base = tmp_path / "multiproc"
    base.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(base))
    stage = ar.ARStage(parse_stage_config(BASE), host="127.0.0.1", grace_seconds=1)
    stage.run()
    assert list(base.iterdir()) == []
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
    made = []
    real_mkdtemp = ar.tempfile.mkdtemp
    monkeypatch.setattr(ar.tempfile, "mkdtemp", lambda **k: made.append(real_mkdtemp(dir=tmp_path, **k)) or made[-1])
    ar.ARStage(parse_stage_config(BASE), host="127.0.0.1", grace_seconds=1).run()
    assert made and not any(Path(m).exists() for m in made)


def test_a_request_id_never_breaks_a_response_header():
    """A receiving stage answers GET /v1/kv/<id> with the payload's request id in a header:
    an id a client chose with a line break split the response (a header injected), one
    outside Latin-1 crashed the handler (an outside review). Such a value is percent-encoded."""
    from omni_runtime.stages.receiver import header_value

    assert header_value("cmpl-abc-0") == "cmpl-abc-0"
    assert header_value("inj\r\nX-Injected: yes") == "inj%0D%0AX-Injected: yes"
    assert header_value("日本語") == "%E6%97%A5%E6%9C%AC%E8%AA%9E"
    for value in ("a\nb", "é", "\x00", "x\ty"):
        assert header_value(value).isascii() and header_value(value).isprintable()


@pytest.mark.parametrize("args, said", [
    (["--grace-seconds", "nan"], "must be a number of seconds above 0"),
    (["--grace-seconds", "1e400"], "must be a number of seconds above 0"),
    (["--grace-seconds", "0"], "must be a number of seconds above 0"),
])
def test_omni_stage_refuses_a_grace_period_it_cannot_keep(tmp_path, args, said):
    """nan, inf and 1e400 ended in tracebacks; 0 and -1 silently became 1 (an outside review)."""
    proc = subprocess.run([sys.executable, "-m", "omni_runtime.stages.main", "--config", str(tmp_path / "x.yaml"),
                           *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_omni_stage_says_a_number_yaml_cannot_convert_in_one_line(tmp_path):
    """A YAML integer of over 4,300 digits (Python's conversion limit) ended in a traceback."""
    bad = tmp_path / "huge.yaml"
    bad.write_text("ports: {http: " + "1" * 5001 + "}\n")
    proc = subprocess.run([sys.executable, "-m", "omni_runtime.stages.main", "--config", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "is not valid YAML" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_transfer_deadline_the_kv_wire_cannot_carry_is_refused():
    """kvTransfer.timeoutSeconds 1e30 was taken, and every transfer then failed as malformed
    at the receiver (the wire bounds a deadline at a day); refused at the stage's start now,
    and in omni_kv_config too."""
    from omni_runtime.transfers.config import OmniKVConfigError, parse_omni_kv_config

    for timeout in (1e30, 86401):
        with pytest.raises(StageConfigError, match="at most 86400"):
            parse_stage_config({**BASE, "kvTransfer": {**BASE["kvTransfer"], "timeoutSeconds": timeout}})
        with pytest.raises(OmniKVConfigError, match="at most 86400"):
            parse_omni_kv_config({"need_send_cache": True, "timeout_seconds": timeout})
    assert parse_stage_config({**BASE, "kvTransfer": {**BASE["kvTransfer"], "timeoutSeconds": 86400}})


@pytest.mark.parametrize("outcome, named", [("expired", "talker"), ("producer_error", "talker"),
                                            ("consumer_error", None), ("aborted", None)])
def test_a_receiving_stage_names_its_producer_where_a_stream_ended_by_its_doing(outcome, named):
    """A receiving stage reports a stream that did not finish to the request's endpoint; where
    the producer stopped sending or failed, the report names the producer as the stage at
    fault (the endpoint then names it to the client: a stalled talker was reported as the
    vocoder's fault, an outside review)."""
    from procs import free_port

    from omni_runtime.pipeline.protocol import origin
    from omni_runtime.stages.receiver import ReceiverStage
    from omni_runtime.stages.stream_inbox import StreamRecord

    raw = {**BASE, "stage": "vocoder", "role": "generation", "kvTransfer": {"send": False},
           "ports": {"http": free_port(), "kv": free_port()}}
    stage = ReceiverStage(parse_stage_config(raw), host="127.0.0.1")
    reports = []
    stage._links.report = lambda endpoint, request_id, events, token=None, **where: reports.append(events)
    try:
        stage._stream_ended(StreamRecord("r1", "talker", origin("p-1", "http://127.0.0.1:1", "t"),
                                         outcome=outcome, reason="waited over its 5 s gap deadline"))
    finally:
        stage._http.server_close()
        stage.receiver.close()
    [[(kind, fields)]] = reports
    assert kind == "error" and fields.get("stage") == named, fields
    assert ("its stream to stage vocoder" in fields["message"]) == (named is not None), fields
