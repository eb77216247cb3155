"""The stage contract (omni_contract) is one piece of code, enforced by omni-stage and by the
operator alike: what `omni-pipeline validate` accepts, the stage runs; what the stage would
refuse, validate refuses first. omni-stage refuses a bad config with exit 2 and one line
naming the key, never a traceback."""
from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omni_contract.engine_args import RESERVED, SECRET_FLAGS, engine_args_problems, flag_name
from omni_operator.check.admission import admit, problems_of
from omni_runtime.stages.ar import vllm_command
from omni_runtime.stages.config import StageConfigError, load_stage_config, parse_stage_config

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = yaml.safe_load((ROOT / "examples" / "tiny-pipeline.yaml").read_text())
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _ar_index(body: dict) -> int:
    return next(i for i, s in enumerate(body["spec"]["stages"]) if s["role"] == "ar")


def with_engine_args(engine_args: dict) -> dict:
    body = copy.deepcopy(PIPELINE)
    body["spec"]["stages"][_ar_index(body)]["engineArgs"] = engine_args
    return body


def stage_config(engine_args: dict) -> dict:
    """The AR stage's config as the operator renders it, with these engineArgs (rendered
    from a valid pipeline, the engineArgs then put in: what omni-stage would read)."""
    admitted = admit(with_engine_args({}))
    stage = PIPELINE["spec"]["stages"][_ar_index(PIPELINE)]["name"]
    (configmap,) = [c for c in admitted.children
                    if c["kind"] == "ConfigMap" and c["metadata"]["labels"]["omnipipeline.dev/stage"] == stage]
    config = yaml.safe_load(configmap["data"]["stage.yaml"])
    config["engineArgs"] = engine_args
    return config


def spellings(flag: str) -> list[str]:
    words = flag.split("-")
    camel = words[0] + "".join(w.title() for w in words[1:])
    return [flag, flag.replace("-", "_"), camel, camel[0].upper() + camel[1:], flag.upper().replace("-", "_"),
            f"--{flag}"]


@pytest.mark.parametrize("key", [k for flag in RESERVED for k in spellings(flag)])
def test_every_spelling_of_a_reserved_flag_is_refused_by_both(key):
    assert flag_name(key) in RESERVED, key
    stage_message = None
    with pytest.raises(StageConfigError) as err:
        parse_stage_config(stage_config({key: "x"}))
    stage_message = str(err.value)
    assert stage_message.startswith(f"engineArgs.{key}: cannot be set"), stage_message
    problems = problems_of(with_engine_args({key: "x"}))
    assert [p.field for p in problems] == [f"spec.stages[{_ar_index(PIPELINE)}].engineArgs.{key}"]
    # One source: the same words on both sides.
    assert stage_message == f"engineArgs.{key}: {problems[0].message}"


@pytest.mark.parametrize("key", [k for flag in SECRET_FLAGS for k in spellings(flag)[:3]])
def test_a_credential_in_engine_args_is_refused_by_both_naming_the_secret_to_use(key):
    """engineArgs are written into the stage's ConfigMap: a token or key there would be
    readable by whoever reads ConfigMaps (an outside review found --hf-token taken and
    rendered in plain text)."""
    body = with_engine_args({key: "hf_SECRET_value"})
    problems = problems_of(body)
    assert [p.field for p in problems] == [f"spec.stages[{_ar_index(PIPELINE)}].engineArgs.{key}"]
    assert "ConfigMap" in problems[0].message and "Secret" in problems[0].message
    with pytest.raises(StageConfigError) as err:
        parse_stage_config(stage_config({key: "hf_SECRET_value"}))
    assert str(err.value) == f"engineArgs.{key}: {problems[0].message}"
    assert "hf_SECRET_value" not in str(err.value)


# engineArgs as users write them, good and bad: values the stage contract decides on.
_KEYS = st.sampled_from(["max-model-len", "max_model_len", "maxModelLen", "port", "PORT", "Model", "--model",
                         "served_model_name", "shutdownTimeout", "host", "additional-config", "additionalConfig",
                         "kv-transfer-config", "kv_transfer_config", "kvTransferConfig", "enforce-eager",
                         "a b", "", "gpu-memory-utilization", "x.y"])
_CONNECTORS = st.sampled_from([
    {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"},
    {"kv_connector": "LMCacheConnectorV1"},
    {"kv_connector": "OmniKVConnector", "kv_role": "kv_producer"},
    {"kv_connector": "MultiConnector", "kv_role": "kv_both"},
    {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"connectors": [
        {"kv_connector": "A", "kv_role": "kv_producer", "engine_id": "e"}]}},
    '{"kv_connector": "A", "kv_role": "kv_both"}', "{not json", ["A"], None,
])
_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-5, 5000), st.text(max_size=8),
                    st.just({"omni_kv_config": {}}), st.just({"x": 1}), _CONNECTORS)


@SETTINGS
@given(engine_args=st.dictionaries(_KEYS, _VALUES, max_size=4))
def test_validate_accepts_exactly_what_the_stage_runs(engine_args):
    """For any engineArgs: the operator refuses the pipeline if and only if omni-stage
    refuses the stage config it would render; an accepted one builds its vLLM command."""
    operator_refuses = bool(problems_of(with_engine_args(engine_args)))
    try:
        config = parse_stage_config(stage_config(engine_args))
    except StageConfigError:
        stage_refuses = True
    else:
        stage_refuses = False
        vllm_command(config, "127.0.0.1")  # builds: no exception of any kind
    assert operator_refuses == stage_refuses, (engine_args, problems_of(with_engine_args(engine_args)))


_ANY = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=6)),
                    lambda inner: st.one_of(st.lists(inner, max_size=3),
                                            st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                    max_leaves=12)
_STAGE_KEYS = ["pipeline", "stage", "role", "model", "engineArgs", "kvTransfer", "downstream", "ports",
               "observability", "inputs"]


def test_an_engine_args_key_that_is_no_name_is_refused_on_one_line_named_quoted():
    """Found by the test below: a key holding a newline was named raw, splitting the line."""
    with pytest.raises(StageConfigError) as err:
        parse_stage_config(stage_config({"max\nmodel len": 1}))
    assert str(err.value).startswith('engineArgs["max\\nmodel len"]: is not a vLLM flag name')
    assert "\n" not in str(err.value)


@SETTINGS
@given(data=st.data())
def test_any_stage_config_is_run_or_refused_naming_a_key(data):
    """Whatever a stage config file holds, omni-stage parses it or raises StageConfigError:
    never another exception (which would be a traceback and exit 1)."""
    config = stage_config({})
    for _ in range(data.draw(st.integers(1, 3))):
        key = data.draw(st.sampled_from(_STAGE_KEYS))
        if data.draw(st.booleans()) and isinstance(config.get(key), dict) and config[key]:
            sub = data.draw(st.sampled_from(sorted(config[key])))
            config[key] = {**config[key], sub: data.draw(_ANY)}
        else:
            config[key] = data.draw(_ANY)
    try:
        parsed = parse_stage_config(config)
    except StageConfigError as exc:
        assert str(exc) and "\n" not in str(exc)
        return
    if parsed.is_ar:
        vllm_command(parsed, "127.0.0.1")


def run_stage(tmp_path: Path, text: str | bytes, *extra: str) -> subprocess.CompletedProcess:
    path = tmp_path / "stage.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return subprocess.run([sys.executable, "-m", "omni_runtime.stages.main", "--config", str(path), *extra],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("engine_args,key", [
    ({"PORT": 9000}, "engineArgs.PORT"),
    ({"served_model_name": "x"}, "engineArgs.served_model_name"),
    ({"kv-transfer-config": {"kv_connector": "LMCacheConnectorV1"}}, "engineArgs.kv-transfer-config"),
    ({"kvTransferConfig": "{oops"}, "engineArgs.kvTransferConfig"),
    ({"additional-config": ["x"]}, "engineArgs.additional-config"),
    ({"max-model-len": 1, "maxModelLen": 2}, "engineArgs.maxModelLen"),
])
def test_omni_stage_exits_2_with_one_line_naming_the_key(tmp_path, engine_args, key):
    proc = run_stage(tmp_path, yaml.safe_dump(stage_config(engine_args)), "--print-command")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{key}: " in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("text,words", [
    (b"pipeline: p\xff\n", "not UTF-8"),
    ("a: [" * 2000, "not valid YAML"),
    ("pipeline: p\nstage: s\nrole: ar\nmodel: {name: m}\nobservability: {tracing: [x]}\n", "observability.tracing"),
    ("pipeline: p\nstage: s\nrole: ar\nmodel: {name: m, cacheDir: 3}\n", "model.cacheDir"),
    ("pipeline: p\nstage: s\nrole: ar\nmodel: {name: m}\nports: {http: 70000}\n", "ports.http"),
    ("pipeline: p\nstage: s\nrole: generation\nmodel: {name: m}\nkvTransfer: {timeoutSeconds: -1}\n",
     "kvTransfer.timeoutSeconds"),
])
def test_omni_stage_refuses_malformed_files_without_a_traceback(tmp_path, text, words):
    proc = run_stage(tmp_path, text)
    assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_valid_rendered_config_prints_its_command(tmp_path):
    config = stage_config({"max_model_len": 512, "kv-transfer-config": {"kv_connector": "A", "kv_role": "kv_both"}})
    proc = run_stage(tmp_path, yaml.safe_dump(config), "--print-command")
    assert proc.returncode == 0, proc.stderr
    assert "--max-model-len 512" in proc.stdout and "MultiConnector" in proc.stdout


def test_load_stage_config_names_the_file(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(stage_config({"host": "x"})))
    with pytest.raises(StageConfigError, match=r"s\.yaml: engineArgs\.host: cannot be set"):
        load_stage_config(path)


def test_the_contract_is_what_the_operator_checks_not_a_copy():
    """The operator's model checks engineArgs with omni_contract's function itself."""
    from omni_operator.pipeline import model

    assert model.engine_args_problems is engine_args_problems


# ---------------------------------------------------------------------------- a pipeline past its first hop

CHAIN = yaml.safe_load((ROOT / "examples" / "tiny-chain.yaml").read_text())


def chain_configmaps() -> dict[str, dict]:
    admitted = admit(copy.deepcopy(CHAIN))
    return {c["metadata"]["labels"]["omnipipeline.dev/stage"]: c["data"]
            for c in admitted.children if c["kind"] == "ConfigMap"}


def test_a_stage_with_inputs_runs_vllm_with_the_stage_input_and_a_loading_connector():
    """What the operator renders for an ar stage with inputs, the runtime runs as a stage
    that makes requests of its hand-offs: vLLM's --middleware, its settings, and the omni
    connector loading prefixes as well as sending."""
    import json

    config = parse_stage_config(yaml.safe_load(chain_configmaps()["talker"]["stage.yaml"]))
    assert config.takes_hand_offs and config.input_sampling_params["max_tokens"] == 16
    argv = vllm_command(config, "0.0.0.0")
    assert argv[argv.index("--middleware") + 1] == "omni_runtime.stages.stage_input.StageInputMiddleware"
    settings = json.loads(argv[argv.index("--additional-config") + 1])["omni_stage_input"]
    assert settings["listen"] == "tcp://0.0.0.0:9600" and settings["inputs"] == ["thinker"]
    assert settings["downstream"] == ["vocoder"]
    connector = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert connector["kv_role"] == "kv_both" and connector["kv_connector_extra_config"]["loads"]
    thinker = parse_stage_config(yaml.safe_load(chain_configmaps()["thinker"]["stage.yaml"]))
    assert "--middleware" not in vllm_command(thinker, "0.0.0.0")


def test_the_rendered_endpoint_config_is_what_the_endpoint_runs(monkeypatch):
    from omni_runtime.pipeline.endpoint import parse_endpoint_config

    monkeypatch.setenv("POD_IP", "10.1.2.3")
    raw = yaml.safe_load(chain_configmaps()["thinker"]["endpoint.yaml"])
    config = parse_stage_config(raw)
    assert config.is_endpoint and config.http_port == 8080
    endpoint = parse_endpoint_config(config.pipeline, config.model_name, config.endpoint)
    assert (endpoint.entry_url, endpoint.advertise, endpoint.sink) == (
        "http://127.0.0.1:8000", "http://10.1.2.3:8080", "vocoder")
    assert [(e.source, e.target, e.timeout_s) for e in endpoint.edges] == [
        ("thinker", "talker", 10.0), ("talker", "vocoder", 10.0)]


def test_an_input_on_a_stage_that_makes_no_requests_of_hand_offs_is_refused_by_both():
    body = copy.deepcopy(CHAIN)
    body["spec"]["stages"][2]["input"] = {"samplingParams": {"max_tokens": 4}}
    problems = problems_of(body)
    assert any("spec.stages[2].input" in str(p) and "give the stage inputs and role ar" in str(p)
               for p in problems), problems
    config = yaml.safe_load(chain_configmaps()["vocoder"]["stage.yaml"])
    config["input"] = {"samplingParams": {"max_tokens": 4}}
    with pytest.raises(StageConfigError, match="only an ar stage with inputs makes requests"):
        parse_stage_config(config)


def test_an_input_hook_that_does_not_import_stops_the_stage_with_exit_2(tmp_path):
    config = yaml.safe_load(chain_configmaps()["talker"]["stage.yaml"])
    config["input"]["hook"] = "no_such_package.hooks:make"
    path = tmp_path / "talker.yaml"
    path.write_text(yaml.safe_dump(config))
    run = subprocess.run([sys.executable, "-m", "omni_runtime.stages.main", "--config", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "input.hook 'no_such_package.hooks:make' does not import" in run.stderr
    assert "Traceback" not in run.stderr
