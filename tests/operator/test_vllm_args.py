"""The contract's table of vLLM's server arguments (omni_contract/vllm_args.json) and the check
of engineArgs against it (issue 44, class 1).

The table is generated from the installed vLLM's own parser: a test regenerates it and fails
when it drifts. Then the contract's verdict on an engineArgs value is compared with vLLM's own
parser and serve checks, run on the very argv ``omni-stage`` builds (``engine_args_to_cli``),
for every argument of the table and a spread of values: what the contract refuses, vLLM
refuses (no good pipeline is locked out), and what vLLM refuses, the contract refuses, except
where the table cannot know (a config object's fields, a custom action's format, the checks
the table lists as not modelled). Then the review's pipelines as users write them: each
refused by ``omni-pipeline validate`` naming the key and what vLLM accepts, and a pipeline for
another vLLM gets the spelling rules only, with a warning.
"""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import json
import re
import sys
from pathlib import Path

import pytest
import yaml

from omni_contract import vllm_args
from omni_contract.engine_args import RESERVED, SECRET_FLAGS, engine_args_problems, engine_args_report, flag_name
from omni_operator.local import cli
from omnip_support import validate_text
from omni_operator.check.admission import admit, problems_of, report_of
from omni_operator.check.documents import load_documents

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")


@pytest.fixture(scope="module")
def generator():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import generate_vllm_args
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return generate_vllm_args


@pytest.fixture(scope="module")
def vllm_parser(generator):
    return generator.server_parser()


def test_the_table_is_generated_from_the_installed_vllm(generator):
    """Regenerated from the installed vLLM's parser, the table is the one shipped: a new vLLM
    (or a changed generator) fails here until `python tools/generate_vllm_args.py` is run."""
    import vllm

    built = generator.build()
    assert built["vllm_version"] == vllm.__version__ == vllm_args.table().version
    assert generator.render(built) == (ROOT / "omni_contract" / "vllm_args.json").read_text(encoding="utf-8"), \
        "omni_contract/vllm_args.json is stale: run python tools/generate_vllm_args.py"


def test_the_table_is_package_data_read_with_the_standard_library():
    table = vllm_args.table()
    assert len(table.arguments) > 250
    assert table.options["max-model-len"][0].type == "human-int-or-auto"
    assert table.options["no-enable-prefix-caching"] == (table.options["enable-prefix-caching"][0], True)
    assert table.short["tp"].name == "tensor-parallel-size"
    assert {r["rule"] for r in table.rules} >= {"requires", "excludes", "minimum"}
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'omni_contract = \[[^\]]*"vllm_args\.json"', pyproject), "ship the table as package data"


# -- the contract against vLLM's own parser ----------------------------------------------------

SAMPLES = [True, False, None, 0, 1, -1, 7, 2.5, "0.85", "85%", "64Mi", "64M", "1.5K", "64k", "auto", "float32",
           "float33", "None", "", "x", "-x", "- x", " 3 ", "1_000", {"a": 1}, [1, 2], '{"a": 1}', "[1, 2]", "{oops",
           "Flashinfer-Cutlass", "yes"]


def _vllm_verdict(parser, argv: list[str]) -> str | None:
    """What vLLM's server says of these flags: None when it takes them, else why not."""
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = parser.parse_args(argv)
            validate_parsed_serve_args(args)
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "exit"
    except Exception as exc:  # noqa: BLE001 - vLLM's checks raise TypeError or ValueError
        return f"{type(exc).__name__}: {exc}"
    if args.model_tag is not None:  # a stray value became the positional model tag
        return f"a stray value taken as the model tag: {args.model_tag!r}"
    return _config_bounds_verdict(parser, args) or _attention_backend_verdict(args) or _model_config_verdict(args)


def _model_config_verdict(args) -> str | None:
    """What vLLM's ModelConfig says of --max-model-len on the tiny model when the engine's
    config is built (its validator, after the field's own range and the auto length). A
    length over the model's own is the model's rule, which the table does not state (it knows
    no model): not asked."""
    from vllm.config import ModelConfig

    from omni_runtime.devtools.tiny_model import ensure_tiny_model

    model = ensure_tiny_model()
    longest = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    if args.max_model_len is None or args.max_model_len > longest:
        return None
    try:
        ModelConfig(model=str(model), max_model_len=args.max_model_len)
    except Exception as exc:  # noqa: BLE001 - its validators' refusal
        return f"ModelConfig: {exc}"
    return None


def _attention_backend_verdict(args) -> str | None:
    """What vLLM's AttentionConfig says of --attention-backend when the engine's config is
    built (a closed registry: the table refuses what it refuses)."""
    from vllm.config.attention import AttentionConfig

    if args.attention_backend is None:
        return None
    try:
        AttentionConfig(backend=args.attention_backend)
    except Exception as exc:  # noqa: BLE001 - its validator's refusal
        return f"AttentionConfig.backend: {exc}"
    return None


def _config_bounds_verdict(parser, args) -> str | None:
    """What vLLM's config classes say of the parsed values when the engine's config is built
    (at the stage's start): each flag's field, in the class its argument group is titled
    with, validated by its own declared bounds (pydantic's Field(gt=, ge=, lt=, le=))."""
    from typing import Annotated

    import annotated_types
    import vllm.config
    from pydantic import TypeAdapter, ValidationError

    bound_types = (annotated_types.Gt, annotated_types.Ge, annotated_types.Lt, annotated_types.Le)
    for group in parser._action_groups:
        fields = getattr(getattr(vllm.config, group.title or "", None), "__pydantic_fields__", None) or {}
        for action in group._group_actions:
            info = fields.get(action.dest)
            value = getattr(args, action.dest, None)
            bounds = [m for m in (info.metadata if info is not None else ()) if isinstance(m, bound_types)]
            if not bounds or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            try:
                TypeAdapter(Annotated[float, *bounds]).validate_python(value)
            except ValidationError as exc:
                return f"{group.title}.{action.dest}: {exc.errors()[0]['msg']}"
    return None


def _stage_argv(monkeypatch, engine_args: dict) -> list[str]:
    """The flags omni-stage passes for these engineArgs (its own conversion, the contract's
    check skipped, so that what it would refuse can be put to vLLM)."""
    from omni_runtime.stages import ar

    monkeypatch.setattr(ar, "check_engine_args", lambda *a, **k: None)
    return ar.engine_args_to_cli(engine_args)[0]


def test_the_contract_converts_an_entry_as_omni_stage_does(monkeypatch):
    """argv_of (what the check reads) is omni-stage's own conversion, word for word."""
    from omni_contract.engine_args import argv_of

    for value in SAMPLES:
        assert _stage_argv(monkeypatch, {"max-model-len": value}) == argv_of("max-model-len", value), value


def _not_modelled_dests() -> set[str]:
    """The arguments vLLM's serve checks read in the checks the table does not model."""
    raw = json.loads((ROOT / "omni_contract" / "vllm_args.json").read_text(encoding="utf-8"))
    return {dest for check in raw["not_modelled"] for dest in check["reads"]}


def test_the_contract_and_vllms_parser_agree(vllm_parser, monkeypatch):
    table = vllm_args.table()
    owned = set(RESERVED) | set(SECRET_FLAGS) | {"additional-config", "kv-transfer-config"}
    unmodelled = _not_modelled_dests()
    refused_taken, taken_refused, compared = [], [], 0
    for name, argument in table.arguments.items():
        if name in owned or argument.takes == "exits":
            continue
        for value in SAMPLES:
            engine_args = {name: value}
            contract = engine_args_problems(engine_args, sends_kv=False)
            vllm = _vllm_verdict(vllm_parser, _stage_argv(monkeypatch, engine_args))
            compared += 1
            if contract and vllm is None:
                if argument.object:  # refused when the engine's config is built: the test below
                    continue
                refused_taken.append(f"{name}: {value!r}: {contract[0]}")
            elif not contract and vllm is not None:
                # What the table cannot know: a config object's fields (pydantic), a custom
                # action's own format, the serve checks it does not model.
                if (argument.type in ("config", "config-file") or argument.action not in (None, "append")
                        or argument.dest in unmodelled):
                    continue
                taken_refused.append(f"{name}: {value!r}: vLLM says {vllm}")
    assert compared > 5000
    assert refused_taken == [], "the contract refuses what vLLM takes:\n" + "\n".join(refused_taken[:40])
    assert taken_refused == [], "vLLM refuses what the contract takes:\n" + "\n".join(taken_refused[:40])


@pytest.mark.parametrize("engine_args", [
    {"enable-auto-tool-choice": True},
    {"enable-auto-tool-choice": True, "tool-call-parser": "hermes"},
    {"enable-log-outputs": True},
    {"enable-log-outputs": True, "enable-log-requests": True},
    {"enable-per-request-metrics": True, "disable-log-stats": True},
    {"enable-per-request-metrics": True},
    {"sse-keep-alive-interval": -1},
    {"sse-keep-alive-interval": 0},
    {"enable-lora": True, "no-enable-lora": True},
    {"compilation-config.mode": 3},
    {"compilation_config.cudagraph_mode": "FULL_AND_PIECEWISE"},
    {"compilation-config.mode": True},
    {"max-model": 1024},
    {"enable-lo": True},
    {"tensorParallelSize": 2},
    {"max_model_len": "1k"},
    # The bounds of vLLM's config fields, enforced at the engine's start (an outside review:
    # each passed validate, the stage then failed to start).
    {"gpu-memory-utilization": 2.0}, {"gpu-memory-utilization": 1}, {"gpu-memory-utilization": -0.5},
    {"max-model-len": -5}, {"max-model-len": -1}, {"max-num-seqs": -4}, {"max-num-seqs": 1},
    # ModelConfig's own validator, after the field's range (an outside review's list: 0
    # passed the door, and the engine refused it at the start).
    {"max-model-len": 0}, {"max-model-len": "auto"}, {"max-model-len": 1}, {"max-model-len": "1k"},
    {"tensor-parallel-size": -1}, {"tensor-parallel-size": 0},
    # A config object's fields (an outside review: vLLM's parser refused the unknown key, the
    # stage then crash-looped on the cluster).
    {"compilation-config": {"bogus_key": 1}}, {"compilation-config.bogus": 1},
    {"compilation-config": '{"mode": 3, "cudagraph_modee": 1}'}, {"compilation-config": {"mode": 3}},
    {"structured-outputs-config": {"backend": "xgrammar"}}, {"attention-config": {"bakend": "x"}},
])
def test_the_contract_and_vllm_agree_on_combinations(vllm_parser, monkeypatch, engine_args):
    contract = engine_args_problems(engine_args, sends_kv=False)
    vllm = _vllm_verdict(vllm_parser, _stage_argv(monkeypatch, engine_args))
    if engine_args == {"enable-lora": True, "no-enable-lora": True}:
        assert vllm is None and contract  # vLLM keeps the last silently; the contract asks for one
        return
    assert bool(contract) == (vllm is not None), (contract, vllm)


@pytest.mark.parametrize("config", [
    {"kv_connector": "ExampleConnector", "kv_role": "kv_both", "bogus": 1},
    {"kv_connector": "ExampleConnector", "kv_role": "kv_bogus"},
    {"kv_connector": "ExampleConnector", "kv_role": "kv_both"},
    {"kv_connector": "ExampleConnector", "kv_role": "kv_consumer", "kv_buffer_device": "cpu"},
])
def test_a_connector_config_is_checked_as_vllm_parses_it(vllm_parser, config):
    """A stage that sends no KV passes the user's kv-transfer-config to vLLM as it is (an
    outside review: an unknown key or role passed the check, and the stage crash-looped)."""
    contract = engine_args_problems({"kv-transfer-config": config}, sends_kv=False)
    vllm = _vllm_verdict(vllm_parser, ["--kv-transfer-config", json.dumps(config)])
    assert bool(contract) == (vllm is not None), (contract, vllm)


# -- the review's pipelines, as users write them ---------------------------------------------

PIPELINE = """\
apiVersion: omnipipeline.dev/v1alpha1
kind: OmniPipeline
metadata:
  name: qwen-omni
spec:
  image: ghcr.io/omni-pipeline/omni-stage:0.1.0
  model:
    name: Qwen/Qwen2.5-Omni-7B
  stages:
    - name: thinker
      role: ar
      engineArgs:
        max-model-len: 8192
        gpu-memory-utilization: 0.9
      kvTransfer: {send: true}
    - name: talker
      role: generation
      inputs: [thinker]
"""


def with_engine_args(lines: str) -> str:
    return PIPELINE.replace("        max-model-len: 8192\n        gpu-memory-utilization: 0.9\n", lines)


# (id, the engineArgs lines, the key named, words of the message: what vLLM accepts)
REFUSED = [
    ("unknown-flag", "        max-model-length: 8192\n", "max-model-length", ["not a flag of vLLM 0.32.0",
                                                                              "did you mean max-model-len?"]),
    ("value-outside-choices", "        dtype: float33\n", "dtype", ["'float33' is not one of", "float16",
                                                                     "did you mean float32?"]),
    ("binary-suffix-with-i", "        kv-cache-memory-bytes: 64Mi\n", "kv-cache-memory-bytes",
     ["'64Mi' is not an integer", "did you mean 64M"]),
    ("percent-for-a-float", "        gpu-memory-utilization: 85%\n", "gpu-memory-utilization",
     ["'85%' is not a number", "e.g. 0.85"]),
    ("needs-a-companion", "        enable-auto-tool-choice: true\n", "enable-auto-tool-choice",
     ["needs tool-call-parser too", "--enable-auto-tool-choice requires --tool-call-parser"]),
    ("vllm-omni-only-flag", "        model-stage: thinker\n", "model-stage", ["not a flag of vLLM 0.32.0"]),
    ("short-option", "        tp: 2\n", "tp", ["short option -tp", "write tensor-parallel-size"]),
    ("value-for-a-bare-flag", "        enforce-eager: 'yes'\n", "enforce-eager", ["takes no value", "write true"]),
    ("no-value-for-a-flag", "        max-num-seqs: true\n", "max-num-seqs", ["needs a value", "an integer"]),
    ("ambiguous-abbreviation", "        enable-lo: true\n", "enable-lo", ["ambiguous", "--enable-lora"]),
    ("abbreviation-of-an-owned-flag", "        served-model: qwen\n", "served-model",
     ["abbreviation of --served-model-name", "spec.model.name"]),
    ("field-of-the-stages-config", "        additional-config.foo: 1\n", "additional-config.foo",
     ["write it inside additional-config"]),
    ("negative-keep-alive", "        sse-keep-alive-interval: -1\n", "sse-keep-alive-interval", ["is below 0"]),
]


@pytest.mark.parametrize("case_id,lines,key,words", REFUSED, ids=[c[0] for c in REFUSED])
def test_what_vllm_refuses_is_refused_naming_the_key(tmp_path, case_id, lines, key, words):
    code, out = validate_text(tmp_path, with_engine_args(lines))
    assert code == 1, out
    (line,) = out
    assert f": spec.stages[0].engineArgs.{key}: " in line, line
    for word in words:
        assert word in line, (word, line)


def test_a_good_set_of_flags_is_valid(tmp_path):
    code, out = validate_text(tmp_path, with_engine_args(
        "        max-model-len: 32k\n        gpu-memory-utilization: 0.9\n        dtype: bfloat16\n"
        "        enable-auto-tool-choice: true\n        tool-call-parser: hermes\n        enforce-eager: true\n"
        "        enable-prefix-caching: false\n        compilation-config: {mode: 3}\n"
        "        kv-cache-memory-bytes: 64M\n        tensorParallelSize: 2\n        no-enable-log-requests: true\n"
    ).replace("      role: ar\n", "      role: ar\n      gpus: 2\n"))  # a GPU per tensor-parallel rank
    assert code == 0, out


def test_warnings_do_not_refuse(tmp_path):
    code, out = validate_text(tmp_path, with_engine_args("        max-model: 8192\n        enable-prefix-caching: false\n"))
    assert code == 0, out
    warnings = [line for line in out if ": warning: " in line]
    assert any("spec.stages[0].engineArgs.max-model: is an abbreviation of --max-model-len" in w for w in warnings)
    assert any("write no-enable-prefix-caching: true" in w for w in warnings)
    assert out[-1].endswith("valid (2 stages)")


# -- another vLLM: the spelling rules only, with a warning -----------------------------------

@pytest.mark.parametrize("image,annotation,version", [
    ("ghcr.io/example/omni-stage:0.2.0-vllm0.33.1", None, "0.33.1"),
    ("registry.example.com:5000/omni-stage:vllm-v0.40.0", None, "0.40.0"),
    ("vllm/vllm-openai:v0.33.0", None, "0.33.0"),
    ("ghcr.io/example/omni-stage:0.2.0", "0.33.1", "0.33.1"),
    ("vllm/vllm-openai:latest", None, "unknown"),
])
def test_a_stage_for_another_vllm_gets_the_spelling_rules_only(tmp_path, image, annotation, version):
    text = with_engine_args("        model-stage: thinker\n        max-model-length: 8192\n").replace(
        "  image: ghcr.io/omni-pipeline/omni-stage:0.1.0", f"  image: {image}")
    if annotation:
        text = text.replace("  name: qwen-omni\n", f"  name: qwen-omni\n  annotations:\n    "
                                                   f"omnipipeline.dev/vllm-version: \"{annotation}\"\n")
    code, out = validate_text(tmp_path, text)
    assert code == 0, out
    (warning,) = [line for line in out if ": warning: " in line]
    assert ": warning: spec.stages[0].engineArgs: the stage runs " in warning
    assert (f"vLLM {version}," if version != "unknown" else "whose version its image does not tell") in warning
    assert "only the spelling rules are checked" in warning
    # The spelling rules still hold for it: a flag the stage owns is refused.
    code, out = validate_text(tmp_path, text.replace("        model-stage: thinker\n", "        port: 9000\n"))
    assert code == 1 and any("engineArgs.port: cannot be set" in line for line in out), out


def test_the_tables_own_version_in_any_spelling_checks_everything(tmp_path):
    for image in ("vllm/vllm-openai:v0.32.0", "ghcr.io/example/omni-stage:0.1.0-vllm0.32", "x/y:vllm-0.32.0"):
        code, out = validate_text(tmp_path, with_engine_args("        model-stage: thinker\n").replace(
            "  image: ghcr.io/omni-pipeline/omni-stage:0.1.0", f"  image: {image}"))
        assert code == 1 and "not a flag of vLLM 0.32.0" in out[0], (image, out)


def test_a_stage_image_overrides_the_pipelines(tmp_path):
    text = with_engine_args("        model-stage: thinker\n").replace(
        "      role: ar\n", "      role: ar\n      image: ghcr.io/example/omni-stage:0.2.0-vllm0.33.1\n", 1)
    code, out = validate_text(tmp_path, text)
    assert code == 0, out


def test_a_version_annotation_that_is_no_version_is_refused(tmp_path):
    text = PIPELINE.replace("  name: qwen-omni\n", "  name: qwen-omni\n  annotations:\n    "
                                                   "omnipipeline.dev/vllm-version: latest\n")
    code, out = validate_text(tmp_path, text)
    assert code == 1, out
    assert "metadata.annotations['omnipipeline.dev/vllm-version']: 'latest' is not a vLLM version" in out[0]


def test_the_version_annotation_is_not_part_of_the_revision():
    (doc,) = load_documents(PIPELINE)
    a = copy.deepcopy(doc.value)
    b = copy.deepcopy(doc.value)
    b["metadata"]["annotations"] = {"omnipipeline.dev/vllm-version": "0.32.0"}
    for body in (a, b):
        body["metadata"]["namespace"] = "ml"
    assert admit(a).pipeline.revision == admit(b).pipeline.revision


# -- omni-stage checks against the vLLM it runs ----------------------------------------------

def test_omni_stage_checks_against_the_installed_vllm(monkeypatch, caplog):
    assert engine_args_problems({"model-stage": "ar"}, sends_kv=False)  # vLLM 0.32.0 installed here
    monkeypatch.setattr(vllm_args, "installed_vllm_version", lambda: "0.40.0")
    with caplog.at_level("WARNING"):
        assert engine_args_problems({"model-stage": "ar"}, sends_kv=False) == []
        assert engine_args_problems({"port": 1}, sends_kv=False)  # the spelling rules hold
    assert "vLLM 0.40.0 is installed" in caplog.text


def test_a_stage_config_with_a_flag_vllm_refuses_stops_omni_stage():
    from omni_runtime.stages.config import StageConfigError, parse_stage_config

    raw = {"pipeline": "p", "stage": "ar", "role": "ar", "model": {"name": "m"},
           "engineArgs": {"dtype": "float33"}}
    with pytest.raises(StageConfigError, match=r"engineArgs.dtype: 'float33' is not one of"):
        parse_stage_config(raw)


def test_flag_name_keeps_a_json_fields_name():
    assert flag_name("compilationConfig.cudagraph_mode") == "compilation-config.cudagraph_mode"
    assert flag_name("max_model_len") == "max-model-len"


@pytest.mark.parametrize("stage, warned", [
    ({"resources": {"limits": {"memory": "1Gi"}}}, True),  # the default shmSize, 2Gi
    ({"shmSize": "512Mi", "resources": {"limits": {"memory": "1Gi"}}}, False),
    ({"shmSize": "1Gi", "resources": {"limits": {"memory": "1Gi"}}}, False),
    ({"shmSize": "4Gi"}, False),  # no limit
])
def test_a_shm_size_over_the_memory_limit_is_a_warning(stage, warned):
    """/dev/shm counts against the container's memory limit (an outside review: a size over
    it was taken without a word); the stage would run, so a warning, naming both."""
    body = yaml.safe_load(PIPELINE)
    body["spec"]["stages"][0].update(stage)
    problems, warnings = report_of(body)
    assert problems == []
    found = [w for w in warnings if w.field == "spec.stages[0].shmSize"]
    assert bool(found) == warned, warnings
    if warned:
        assert "over the container's memory limit 1Gi" in found[0].message


def test_reports_are_pure_and_warnings_separate():
    problems, warnings = engine_args_report({"max-model": 1}, sends_kv=False)
    assert problems == [] and len(warnings) == 1


# -- the shipped examples run on the image they name -----------------------------------------

@pytest.mark.parametrize("name", ["tiny-pipeline.yaml", "bagel-ar-diffusion.yaml", "qwen-omni-thinker-talker.yaml"])
def test_the_examples_pass_with_the_image_they_name(tmp_path, name):
    out = io.StringIO()
    assert cli.cmd_validate([EXAMPLES / name], out) == 0, out.getvalue()
    assert ": warning: " not in out.getvalue()
    (doc,) = load_documents((EXAMPLES / name).read_text())
    assert problems_of(copy.deepcopy(doc.value)) == []
    assert yaml.safe_load((EXAMPLES / name).read_text())["spec"]["image"].startswith("ghcr.io/omni-pipeline/omni-stage:")


def test_the_operator_posts_the_warnings_once_per_generation():
    from k8s_emulator import EmulatorThread
    from omnip_support import NAMESPACE, create_pipeline, make_kube, patch_pipeline
    from omni_operator.controller.reconcile import Reconciler

    with EmulatorThread() as emu:
        kube = make_kube(emu.url)
        kube.request("create", "Namespace", "POST", "/api/v1/namespaces",
                     body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        (doc,) = load_documents(with_engine_args("        max-model: 8192\n"))
        body = doc.value
        body["metadata"]["namespace"] = NAMESPACE
        create_pipeline(kube, body)
        reconciler = Reconciler(make_kube(emu.url))

        def warnings() -> list[dict]:
            items = kube.request("list", "Event", "GET", f"/api/v1/namespaces/{NAMESPACE}/events")["items"]
            return [e for e in items if e["reason"] == "SpecWarning"]

        reconciler.reconcile(NAMESPACE, "qwen-omni")
        reconciler.reconcile(NAMESPACE, "qwen-omni")
        (event,) = warnings()
        assert event["type"] == "Warning"
        assert "spec.stages[0].engineArgs.max-model: is an abbreviation of --max-model-len" in event["message"]
        # A new generation that still warns: one more event (and none again for it).
        patch_pipeline(kube, "qwen-omni", {"spec": {"stages": [
            {**body["spec"]["stages"][0], "engineArgs": {"max-model": 4096}}, body["spec"]["stages"][1]]}})
        reconciler.reconcile(NAMESPACE, "qwen-omni")
        reconciler.reconcile(NAMESPACE, "qwen-omni")
        assert len(warnings()) == 2
        reconciler.kube.close()
        kube.close()


def test_one_flags_value_is_read_in_any_spelling_as_vllm_converts_it():
    from omni_contract.engine_args import engine_arg_value

    assert engine_arg_value({"maxModelLen": "32k"}, "max_model_len") == 32000
    assert engine_arg_value({"max_model_len": 256}, "max_model_len") == 256
    assert engine_arg_value({"max-model-len": "auto"}, "max_model_len") == -1
    assert engine_arg_value({"max-model-len": "lots"}, "max_model_len") is None  # refused
    assert engine_arg_value({"max-model-len": True}, "max_model_len") is None
    assert engine_arg_value({"dtype": "float32"}, "max_model_len") is None
    assert engine_arg_value({"dtype": "float32"}, "no_such_argument") is None


SAMPLING_VALUES = [None, True, 0, 1, -1, 2, 3, 0.5, 1.5, 2.5, -0.5, -2, -3, float("nan"), float("inf"), "x", [1],
                   ["x"], [1, "x"], [], {"a": 1}]


def test_the_contract_and_vllms_sampling_params_agree():
    """Every SamplingParams field the table types, with each value: the contract refuses all
    that vLLM's SamplingParams(**{field: value}) refuses (the checks the table lists as not
    modelled aside), and beyond that only a value of a kind the field's annotation does not
    take (vLLM's struct does not check kinds in its constructor: ignore_eos: 3 is taken)."""
    from vllm import SamplingParams

    table = vllm_args.table()
    raw = json.loads((ROOT / "omni_contract" / "vllm_args.json").read_text(encoding="utf-8"))
    unmodelled = {name for check in raw["sampling_params"]["not_modelled"] for name in table.sampling_fields
                  if f"self.{name}" in check}
    disagree, compared = [], 0
    for name, kinds in table.sampling_fields.items():
        if kinds is None or name in unmodelled:
            continue
        for value in SAMPLING_VALUES:
            contract = vllm_args.sampling_params_problems({name: value})
            try:
                SamplingParams(**{name: value})
                vllm = None
            except Exception as exc:  # noqa: BLE001 - vLLM's validation error, or a TypeError on a wrong type
                vllm = f"{type(exc).__name__}: {exc}"
            compared += 1
            if bool(contract) != (vllm is not None):
                if contract and vllm is None and contract[0].message.startswith("must be "):
                    continue  # a kind the annotation does not take
                disagree.append(f"{name}={value!r}: contract {contract[0].message if contract else 'takes it'}; "
                                f"vLLM {vllm or 'takes it'}")
    assert compared > 300
    assert disagree == [], "\n".join(disagree[:40])
    assert [f.key for f in vllm_args.sampling_params_problems({"bogus_param": 1, "max_tokens": 8})] == ["bogus_param"]
    # A list's items (an outside review: stop: [1, 2] was taken, and the stage stopped at its start).
    (stop,) = vllm_args.sampling_params_problems({"stop": [1, 2], "stop_token_ids": [7], "bad_words": ["x"]})
    assert (stop.key, stop.message) == ("stop", "must be a list of strings, got 1 in it")
    (ids,) = vllm_args.sampling_params_problems({"stop_token_ids": [1, "a"]})
    assert ids.message == "must be a list of integers, got 'a' in it"
    with pytest.raises(TypeError):
        SamplingParams(bogus_param=1)


@pytest.mark.parametrize("engine_args, warned", [
    ({"quantization": "fp9"}, "did you mean fp8?"), ({"quantization": "fp8"}, None), ({"quantization": "FP8"}, None),
    ({"load-format": "bogus"}, "unless a plugin in the stage's image registers it"), ({"load-format": "safetensors"}, None),
    ({"enable-auto-tool-choice": True, "tool-call-parser": "hermez"}, "did you mean hermes?"),
    ({"enable-auto-tool-choice": True, "tool-call-parser": "hermes"}, None),
    ({"reasoning-parser": "deepseek_r2"}, "did you mean deepseek_r1?"), ({"reasoning-parser": "deepseek_r1"}, None),
])
def test_a_value_no_registry_of_vllm_holds_is_a_warning(engine_args, warned):
    """vLLM looks a quantization method or a load format up in a registry when it builds the
    engine, a tool-call or reasoning parser when its server starts (an outside review:
    `quantization: fp9` passed, the stage crash-looped); a plugin may register more, so it is a
    warning that names the registry's values."""
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    problems, warnings = engine_args_report(engine_args, sends_kv=False)
    assert problems == []
    if warned is None:
        assert warnings == []
    else:
        (warning,) = warnings
        assert warned in warning.message and "is not one of vLLM 0.32.0's" in warning.message
    flag, value = list(engine_args.items())[-1]
    registry = {"quantization": QUANTIZATION_METHODS, "load-format": _LOAD_FORMAT_TO_MODEL_LOADER,
                "tool-call-parser": ToolParserManager.list_registered(),
                "reasoning-parser": ReasoningParserManager.list_registered()}[flag]
    assert (value.lower() in registry if flag == "quantization" else value in registry) == (warned is None)


@pytest.mark.parametrize("engine_args, refused", [
    ({"max-num-batched-tokens": 1, "max-num-seqs": 4}, "is below max-num-seqs (4)"),
    ({"max-num-batched-tokens": 4, "max-num-seqs": 4}, None),
    ({"no-enable-chunked-prefill": True, "max-num-batched-tokens": 100, "max-model-len": 256},
     "is below max-model-len (256) while enable-chunked-prefill is off"),
    ({"max-num-batched-tokens": 100, "max-model-len": 256}, None),  # chunked prefill on (vLLM's default)
    ({"no-enable-chunked-prefill": True, "max-num-batched-tokens": "1k", "max-model-len": 256}, None),
    ({"max-num-batched-tokens": 1}, None),  # vLLM's max-num-seqs default depends on the platform
])
def test_the_schedulers_pair_rules_are_the_contracts(engine_args, refused):
    """vLLM's SchedulerConfig refuses max-num-batched-tokens below max-num-seqs, or below
    max-model-len without chunked prefill, when it builds the engine (an outside review: the
    check passed, the stage crash-looped); the contract says so where engineArgs sets both."""
    from vllm.config import SchedulerConfig

    problems = engine_args_problems(engine_args, sends_kv=False)
    if refused is None:
        assert problems == []
    else:
        (problem,) = problems
        assert problem.key == "max-num-batched-tokens" and refused in problem.message
    named = {"max_num_batched_tokens", "max_num_seqs", "max_model_len"}
    given = {k.replace("-", "_"): v for k, v in engine_args.items() if k.replace("-", "_") in named}
    if len(given) == 2:  # vLLM's own verdict, on both values set
        values = {"max_model_len": 256, "max_num_seqs": 4, "is_encoder_decoder": False,
                  "enable_chunked_prefill": "no-enable-chunked-prefill" not in engine_args,
                  **{k: (1000 if v == "1k" else v) for k, v in given.items()}}
        try:
            SchedulerConfig(**values)
            taken = True
        except Exception:  # noqa: BLE001 - vLLM's refusal
            taken = False
        assert taken == (refused is None), values


@pytest.mark.parametrize("value", ["BOGUS", "flash_attn", "FLASH_ATTN", "auto", "cpu_attn", "flash-attn"])
def test_an_attention_backend_is_one_of_vllms_as_its_config_reads_it(value):
    """vLLM's AttentionConfig takes "auto" or a backend's name in any case, and refuses any
    other when it builds the engine (an outside review: `attention-backend: BOGUS` passed, the
    stage crash-looped). Its registry is closed (an enum): a refusal, not a warning."""
    from vllm.config.attention import AttentionConfig

    try:
        AttentionConfig(backend=value)
        taken = True
    except Exception:  # noqa: BLE001 - vLLM's refusal
        taken = False
    problems, warnings = engine_args_report({"attention-backend": value}, sends_kv=False)
    assert warnings == []
    assert (problems == []) == taken, (value, problems)
    if not taken:
        assert "is not one of vLLM 0.32.0's --attention-backend values" in problems[0].message


def test_a_json_flag_vllm_takes_as_a_map_is_refused_as_anything_else_as_its_engine_refuses_it(vllm_parser):
    """vLLM's parser takes any JSON for these flags, and refuses all but a map when it builds
    the engine's config and its model loader at the stage's start (an outside review:
    `speculative-config: [1, 2]` passed, the stage crash-looped on an AttributeError). Each
    flag the table marks, with a list, a string, a number and a map, against vLLM's own config
    building on the tiny model."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.model_executor.model_loader import get_model_loader

    from omni_contract.vllm_args import argv_of
    from omni_runtime.devtools.tiny_model import ensure_tiny_model

    parser, model = vllm_parser, str(ensure_tiny_model())
    marked = [name for name, a in vllm_args.table().arguments.items() if a.object and name != "additional-config"]
    assert {"speculative-config", "override-generation-config", "hf-overrides", "limit-mm-per-prompt"} <= set(marked)
    disagree = []
    for name in marked:
        for value in ([1, 2], "x", 7, {}):
            contract = engine_args_problems({name: value}, sends_kv=False)
            argv = ["--model", model, "--dtype", "float32", "--max-model-len", "256", *argv_of(name, value)]
            try:
                with contextlib.redirect_stderr(io.StringIO()):
                    config = AsyncEngineArgs.from_cli_args(parser.parse_args(argv)).create_engine_config()
                    get_model_loader(config.load_config)  # what the worker makes first at the start
                vllm = None
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - any refusal
                vllm = f"{type(exc).__name__}: {exc}"
            if value == {} and vllm is not None:
                continue  # a map's own fields (what a config needs in it) are vLLM's to check
            if bool(contract) != (vllm is not None):
                disagree.append(f"{name}: {value!r}: contract {contract[:1]}, vLLM {vllm!r:.120}")
    assert disagree == [], "\n".join(disagree)
