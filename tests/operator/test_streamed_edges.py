"""Streamed edges in the OmniPipeline (issue 49): the CRD's form (``inputs`` names the
upstream stages, ``streams`` says which are streamed and how), the schema's and CEL's
refusals, the operator's own check (a cadence an engine cannot hold), the typed view's
contract edges, and ``omni-pipeline validate`` refusing the same offline."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from omni_contract import edges as contract
from omni_operator.pipeline import crd
from omni_operator.check.admission import admit, problems_of
from omni_operator.check.validation import validate
from omnip_support import pipeline_body, validate_text


def body_with(streams: list[dict] | None = None, stage: int = 1, **changes) -> dict:
    """The thinker -> talker -> code2wav pipeline, stage ``stage`` with these ``streams``
    and the stages' fields in ``changes`` ({index: {field: value}})."""
    body = pipeline_body()
    if streams is not None:
        body["spec"]["stages"][stage]["streams"] = streams
    for index, fields in changes.items():
        body["spec"]["stages"][int(index.lstrip("s"))].update(fields)
    return body


def only_problem(body: dict):
    problems = problems_of(copy.deepcopy(body))
    assert len(problems) == 1, problems
    return problems[0]


# -- the form -------------------------------------------------------------------------------

def test_todays_inputs_stay_valid_and_whole():
    pipeline = admit(pipeline_body()).pipeline
    talker = pipeline.stage("talker")
    assert talker.inputs == ("thinker",) and talker.streams == ()
    assert talker.edges == (contract.Edge("thinker"),)
    assert not talker.edges[0].streamed


def test_a_streamed_input_is_the_contracts_edge_with_defaults_and_settings():
    body = body_with([{"stage": "thinker", "chunkTokens": 32, "gapSeconds": 2.5}])
    body["spec"]["stages"][2]["streams"] = [{"stage": "talker"}]
    pipeline = admit(body).pipeline
    (edge,) = pipeline.stage("talker").edges
    assert edge.streamed and edge.stage == "thinker"
    assert edge.stream == contract.StreamSettings(chunk_tokens=32, gap_seconds=2.5)
    assert pipeline.stage("code2wav").edge_from("talker").stream == contract.DEFAULT_STREAM
    assert [(p, c) for p, c, _ in pipeline.streamed_edges()] == [("thinker", "talker"), ("talker", "code2wav")]


def test_a_stream_change_is_a_new_revision_and_no_stream_keeps_the_old_one():
    whole = admit(pipeline_body()).pipeline.revision
    # Pinned before streamed edges existed (a5e9f43): an operator upgrade must not roll the
    # pods of every pipeline that streams nothing. A deliberate change of what a revision
    # covers (the KV wire version, a new stage field) changes it: update it then. (Updated
    # for KV wire version 4: the control on NIXL notifications, which old pods do not speak.)
    assert whole == "c041de47f1"
    streamed = admit(body_with([{"stage": "thinker"}])).pipeline.revision
    faster = admit(body_with([{"stage": "thinker", "firstChunkTokens": 2}])).pipeline.revision
    assert len({whole, streamed, faster}) == 3


def test_the_schema_bounds_are_the_contracts():
    """The CRD states each stream setting's bounds for kubectl apply; the contract
    (omni_contract/edges.py) is their one statement: at each bound the contract agrees."""
    item = crd.openapi_schema()["properties"]["spec"]["properties"]["stages"]["items"]["properties"]["streams"]["items"]
    settings = item["properties"]
    assert set(settings) - {"stage"} == set(contract.STREAM_KEYS)
    for key in contract.STREAM_KEYS:
        node = settings[key]
        low, high = node["minimum"], node["maximum"]
        assert "default" not in node, f"{key}: defaults live in the contract only"
        within = ("firstChunkSeconds", "gapSeconds")  # each at most streamSeconds
        contract.parse_stream({key: high, "streamSeconds": high} if key in within else {key: high}, "s")
        with pytest.raises(contract.EdgeError, match=key):
            contract.parse_stream({key: high + 1}, "s")
        if node.get("exclusiveMinimum"):
            assert node["type"] == "number" and low == 0
            with pytest.raises(contract.EdgeError, match=key):
                contract.parse_stream({key: low}, "s")
            contract.parse_stream({key: 0.001, **({"firstChunkSeconds": 0.001, "gapSeconds": 0.001}
                                                  if key == "streamSeconds" else {})}, "s")
        else:
            assert node["type"] == "integer"
            contract.parse_stream({key: low}, "s")
            with pytest.raises(contract.EdgeError, match=key):
                contract.parse_stream({key: low - 1}, "s")


# -- refused, naming the edge and the fix ---------------------------------------------------

@pytest.mark.parametrize("streams, changes, field, text", [
    ([{"stage": "code2wav"}], {}, "spec.stages[1].streams",
     "streams[0] is 'code2wav', not one of the stage's inputs (thinker)"),
    ([{"stage": "thinker"}], {"s0": {"kvTransfer": {"send": False}}, "s1": {"kvTransfer": {"send": False}}},
     "spec.stages", "spec.stages[1].streams[0] streams thinker -> talker, but thinker does not send KV"),
    ([{"stage": "thinker"}, {"stage": "thinker"}], {}, "spec.stages[1].streams[1]", "the same stage 'thinker'"),
    ([{"stage": "thinker", "gapSeconds": 0}], {}, "spec.stages[1].streams[0].gapSeconds", "must be greater than 0"),
    ([{"stage": "thinker", "streamSeconds": -1}], {}, "spec.stages[1].streams[0].streamSeconds", "greater than 0"),
    ([{"stage": "thinker", "firstChunkSeconds": 86401}], {}, "spec.stages[1].streams[0].firstChunkSeconds",
     "maximum of 86400"),
    ([{"stage": "thinker", "chunkTokens": 0}], {}, "spec.stages[1].streams[0].chunkTokens", "minimum of 1"),
    ([{"stage": "thinker", "chunksInFlight": 1.5}], {}, "spec.stages[1].streams[0].chunksInFlight",
     "must be an integer"),
    ([{"stage": "thinker", "gapSeconds": "nan"}], {}, "spec.stages[1].streams[0].gapSeconds", "must be a number"),
    ([{"stage": "thinker", "gap": 3}], {}, "spec.stages[1].streams[0]", "'gap' was unexpected"),
    ([{"chunkTokens": 3}], {}, "spec.stages[1].streams[0]", "'stage' is a required property"),
    # both given: CEL says it at kubectl apply ...
    ([{"stage": "thinker", "firstChunkSeconds": 70, "streamSeconds": 60}], {},
     "spec.stages[1].streams[0].firstChunkSeconds", "exceeds streamSeconds"),
    # ... and of the gap too (an outside review: a gap over the stream was taken)
    ([{"stage": "thinker", "gapSeconds": 70, "streamSeconds": 60}], {},
     "spec.stages[1].streams[0].gapSeconds", "exceeds streamSeconds"),
])
def test_the_crd_refuses_at_kubectl_apply(streams, changes, field, text):
    body = body_with(streams, **changes)
    assert any(field in e and text in e for e in validate(crd.openapi_schema(), copy.deepcopy(body))), \
        validate(crd.openapi_schema(), copy.deepcopy(body))
    problem = only_problem(body)
    assert problem.field == field and text in problem.message, problem


def test_a_producer_that_is_not_an_ar_stage_is_named():
    body = pipeline_body()
    body["spec"]["stages"][1].update(role="generation", kvTransfer={})
    body["spec"]["stages"][0]["kvTransfer"] = {"send": True}
    body["spec"]["stages"][2] = {"name": "code2wav", "role": "generation", "gpus": 0, "inputs": ["talker"],
                                 "streams": [{"stage": "talker"}]}
    problem = only_problem(body)
    assert problem.field == "spec.stages"
    assert "spec.stages[2].streams[0] streams talker -> code2wav, but talker is not an ar stage" in problem.message
    assert "set kvTransfer.send: true on the upstream" in problem.message


def test_duplicate_stage_names_are_said_without_a_stream_refusal_about_another_stage():
    """Two stages named talker, the second streaming from "talker": the stream rule found the
    second stage as the first talker's producer and said ``spec.stages[1].streams[0] streams
    talker -> talker, but talker does not send KV``, of a stage that streams from thinker and
    sends (an outside review). The duplicate is the problem; the rule waits for names to be
    unique, as the self-input rule does."""
    body = pipeline_body()
    body["spec"]["stages"][1]["streams"] = [{"stage": "thinker"}]
    body["spec"]["stages"][2] = {"name": "talker", "role": "generation", "gpus": 0, "inputs": ["talker"],
                                 "streams": [{"stage": "talker"}]}
    said = validate(crd.openapi_schema(), copy.deepcopy(body))
    assert any("spec.stages[].name must be unique" in e for e in said), said
    assert not any("streams talker -> talker" in e or "does not send KV" in e for e in said), said


def test_a_streamed_consumer_cannot_scale_to_zero():
    body = body_with([{"stage": "talker"}], stage=2)
    body["spec"]["stages"][2]["autoscaling"] = {"minReplicas": 0, "maxReplicas": 4,
                                                "metrics": [{"signal": "incomingTransfers", "target": 2}]}
    problem = only_problem(body)
    assert problem.field == "spec.stages[2].autoscaling.minReplicas"
    assert "cannot scale to zero" in problem.message and "set minReplicas to 1" in problem.message
    body["spec"]["stages"][2]["autoscaling"]["minReplicas"] = 1
    assert problems_of(body) == []


def test_the_operator_refuses_a_first_chunk_deadline_beyond_the_default_stream_deadline():
    # Only one of the two given: the other's default is the contract's, which no schema holds.
    body = body_with([{"stage": "thinker", "firstChunkSeconds": 700}])
    assert validate(crd.openapi_schema(), copy.deepcopy(body)) == []
    problem = only_problem(body)
    assert problem.field == "spec.stages[1].streams[0].firstChunkSeconds"
    assert "(700) exceeds spec.stages[1].streams[0].streamSeconds (600)" in problem.message
    assert "raise streamSeconds" in problem.message


@pytest.mark.parametrize("engine_args, stage, stream, key, end", [
    ({"max-model-len": 16}, 0, {}, "chunkTokens", "producer thinker runs with max-model-len 16"),
    ({"max_model_len": "2k"}, 0, {"chunkTokens": 4096}, "chunkTokens", "producer thinker runs with max-model-len 2000"),
    ({"maxModelLen": 4}, 0, {"chunkTokens": 2}, "firstChunkTokens", "producer thinker runs with max-model-len 4"),
    ({"max-model-len": 8}, 1, {}, "chunkTokens", "consumer talker runs with max-model-len 8"),
])
def test_a_cadence_the_max_model_len_cannot_hold_is_refused(engine_args, stage, stream, key, end):
    body = body_with([{"stage": "thinker", **stream}])
    body["spec"]["stages"][stage]["engineArgs"] = engine_args
    assert validate(crd.openapi_schema(), copy.deepcopy(body)) == []
    problem = only_problem(body)
    assert problem.field == f"spec.stages[1].streams[0].{key}"
    assert f"streamed edge thinker -> talker, but the {end}" in problem.message
    assert f"set {key} below" in problem.message


@pytest.mark.parametrize("engine_args", [{"max-model-len": 17}, {"max-model-len": "auto"}, {"max-model-len": -1}, {}])
def test_a_cadence_that_fits_or_an_unknown_length_is_accepted(engine_args):
    body = body_with([{"stage": "thinker"}])
    body["spec"]["stages"][0]["engineArgs"] = engine_args
    assert problems_of(body) == []


def test_a_generation_consumers_stream_has_no_length_to_hold():
    body = body_with([{"stage": "talker", "chunkTokens": 4096}], stage=2)
    body["spec"]["stages"][2]["engineArgs"] = {"max-model-len": 16}  # not an engine: no vLLM reads it
    assert [p for p in problems_of(body) if "streams" in p.field] == []


# -- omni-pipeline validate, offline --------------------------------------------------------

def test_validate_refuses_the_same_offline(tmp_path: Path):
    body = body_with([{"stage": "thinker", "chunkTokens": 64}])
    body["spec"]["stages"][0]["engineArgs"] = {"max-model-len": 64}
    code, lines = validate_text(tmp_path, yaml.safe_dump(body))
    assert code == 1
    (line,) = lines
    assert ": spec.stages[1].streams[0].chunkTokens: is 64 tokens on the streamed edge thinker -> talker" in line


def test_validate_refuses_a_nan_deadline_naming_it(tmp_path: Path):
    # JSON has no NaN: kubectl cannot send one, and the reader refuses it where it stands.
    text = yaml.safe_dump(body_with([{"stage": "thinker"}])).replace("- stage: thinker", "- stage: thinker\n    gapSeconds: .nan")
    assert "gapSeconds: .nan" in text
    code, lines = validate_text(tmp_path, text)
    assert code == 1
    assert any("gapSeconds" in line and ".nan is not a JSON number" in line for line in lines), lines


def test_validate_accepts_a_streamed_pipeline(tmp_path: Path):
    code, lines = validate_text(tmp_path, yaml.safe_dump(body_with([{"stage": "thinker"}])))
    assert code == 0 and lines[0].endswith("valid (3 stages)"), lines


# -- rendered into both ends' stage configs -------------------------------------------------

def _configs(body: dict) -> dict[str, dict]:
    """Each stage's stage.yaml (by stage name) and the endpoint's, as admit renders them."""
    out = {}
    for child in admit(body).children:
        if child["kind"] == "ConfigMap":
            stage = child["metadata"]["labels"]["omnipipeline.dev/stage"]
            out[stage] = yaml.safe_load(child["data"]["stage.yaml"])
            if "endpoint.yaml" in child["data"]:
                out["endpoint"] = yaml.safe_load(child["data"]["endpoint.yaml"])
    return out


def test_a_pipeline_without_streams_renders_byte_identical():
    """Config hashes pinned before streamed edges existed (a5e9f43): the stage configs of a
    pipeline that streams nothing are byte for byte what they were, so an operator upgrade
    rolls no pod. (A deliberate change of the stage config changes them: update them then.
    Updated once since, for KV wire version 4, which every revision covers.)"""
    from omni_operator.pipeline.stage_config import config_hash, dump_stage_config, render_stage_config

    repo = Path(__file__).resolve().parents[2]
    chain = yaml.safe_load((repo / "examples" / "tiny-chain.yaml").read_text())
    for body, revision, hashes in [
        (pipeline_body(), "c041de47f1",
         {"thinker": "bce3068bffa8afef", "talker": "b2c21488f20b0cf9", "code2wav": "c5056313ca915c2b"}),
        (chain, "468fd4377b",
         {"thinker": "7d09d42c011337b0", "talker": "7e72e1781d8a535e", "vocoder": "fa4617e6806e49c3"}),
    ]:
        pipeline = admit(body).pipeline
        assert pipeline.revision == revision
        assert {s.name: config_hash(dump_stage_config(render_stage_config(pipeline, s.name)))
                for s in pipeline.stages} == hashes
    configs = _configs(pipeline_body())
    assert configs["talker"]["inputs"] == ["thinker"]
    assert all(set(d) == {"stage", "endpoint"} for c in configs.values() for d in c.get("downstream", ()))


def test_both_ends_carry_the_streamed_edge_as_the_stage_reads_it():
    """The consumer's inputs entry and the producer's downstream entry, read by omni-stage's
    own parser (omni_runtime.stages.config, no engine started), give the same edge."""
    from omni_runtime.stages.config import parse_stage_config

    body = body_with([{"stage": "thinker", "firstChunkTokens": 2, "chunkTokens": 8, "gapSeconds": 1.5}])
    configs = _configs(body)
    talker, thinker, code2wav = (parse_stage_config(configs[s]) for s in ("talker", "thinker", "code2wav"))
    settings = contract.StreamSettings(first_chunk_tokens=2, chunk_tokens=8, gap_seconds=1.5)
    assert talker.input_edges == (contract.Edge("thinker", contract.STREAM, settings),)
    (down,) = thinker.downstream
    assert (down.stage, down.stream) == ("talker", settings)
    assert down.endpoint.startswith("tiny-talker-")
    # The talker -> code2wav edge stays whole at both ends.
    assert code2wav.input_edges == (contract.Edge("talker"),)
    assert [d.stream for d in talker.downstream] == [None]
    # Every setting is spelled out at both ends: neither falls back on a default of its own.
    raw = configs["thinker"]["downstream"][0]
    assert raw["mode"] == "stream" and set(raw["stream"]) == set(contract.STREAM_KEYS)
    assert configs["talker"]["inputs"] == [{"stage": "thinker", "mode": "stream", "stream": raw["stream"]}]


def test_the_endpoint_config_names_the_streamed_edge_with_its_deadlines():
    configs = _configs(body_with([{"stage": "thinker", "streamSeconds": 120}]))
    edges = {(e["from"], e["to"]): e for e in configs["endpoint"]["endpoint"]["edges"]}
    assert edges[("thinker", "talker")]["mode"] == "stream"
    assert edges[("thinker", "talker")]["stream"]["streamSeconds"] == 120
    assert set(edges[("talker", "code2wav")]) == {"from", "to", "timeoutSeconds"}


def test_a_stream_change_rolls_both_ends_and_nothing_else_changes_in_their_pods():
    from test_render import children

    whole = children(pipeline_body())
    streamed = children(body_with([{"stage": "thinker"}]))
    for stage in ("thinker", "talker"):
        a = yaml.safe_load(whole[("ConfigMap", f"tiny-{stage}")]["data"]["stage.yaml"])
        b = yaml.safe_load(streamed[("ConfigMap", f"tiny-{stage}")]["data"]["stage.yaml"])
        for config in (a, b):  # a new revision: its KV Services' names change with it
            for entry in config["downstream"]:
                entry.pop("endpoint")
        changed = {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
        assert changed == {"revision", "downstream" if stage == "thinker" else "inputs"}, changed
    # The KV Services, the NetworkPolicy and the rollout's graph treat a streamed edge as a whole one.
    assert whole[("NetworkPolicy", "tiny")]["spec"] == streamed[("NetworkPolicy", "tiny")]["spec"]
    assert set(whole) == set(streamed)
    assert (whole[("Deployment", "tiny-talker")]["metadata"]["annotations"]
            == streamed[("Deployment", "tiny-talker")]["metadata"]["annotations"])


def test_the_local_runner_writes_the_same_edge_with_local_addresses():
    from omni_operator.local.run import local_stage_configs

    pipeline = admit(body_with([{"stage": "thinker"}])).pipeline
    configs = local_stage_configs(pipeline, {s.name: {"http": 18000 + i, "kv": 19600 + i}
                                             for i, s in enumerate(pipeline.stages)})
    (down,) = configs["thinker"]["downstream"]
    assert down["endpoint"] == "127.0.0.1:19601" and down["mode"] == "stream"
    assert configs["talker"]["inputs"][0]["mode"] == "stream"


# -- autoscaling on open streams ------------------------------------------------------------

def _autoscaled_on_streams(**autoscaling) -> dict:
    body = body_with([{"stage": "thinker"}])
    body["spec"]["stages"][1]["autoscaling"] = {"maxReplicas": 4, "metrics": [{"signal": "openStreams", "target": 16}],
                                                **autoscaling}
    return body


def test_open_streams_scales_a_streamed_consumer_on_its_producers_open_streams():
    from test_render import children

    kids = children(_autoscaled_on_streams())
    (trigger,) = kids[("ScaledObject", "tiny-talker")]["spec"]["triggers"]
    assert trigger["name"] == "open-streams" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["threshold"] == "16"
    # The producer's own series (stage thinker) toward this stage: each stream counted once.
    assert trigger["metadata"]["query"] == (
        'sum(omni_kv_streams{namespace="team-a",pipeline="tiny",to_stage="talker",stage=~"thinker",state="open"})')
    (metric,) = kids[("HorizontalPodAutoscaler", "tiny-talker")]["spec"]["metrics"]
    assert metric["external"]["metric"]["name"] == "omni_stage_open_streams"
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "16"}


def test_open_streams_on_a_stage_fed_whole_is_refused():
    body = _autoscaled_on_streams()
    del body["spec"]["stages"][1]["streams"]
    problem = only_problem(body)
    assert problem.field == "spec.stages[1].autoscaling.metrics"
    assert "openStreams counts the streams" in problem.message and "use incomingTransfers" in problem.message


def test_open_streams_and_every_other_signal_fit_in_one_stage():
    body = _autoscaled_on_streams(metrics=[{"signal": s, "target": 4} for s in (
        "queuedRequests", "kvCacheUsage", "pendingTransfers", "heldTransfers", "oldestPendingTransferSeconds",
        "incomingTransfers", "openStreams")])
    assert problems_of(body) == []


# -- the examples run in the shape they show ------------------------------------------------

@pytest.mark.parametrize("name, streamed", [
    ("qwen-omni-thinker-talker.yaml", [("thinker", "talker"), ("talker", "code2wav")]),
    ("tiny-omni-streaming.yaml", [("thinker", "talker"), ("talker", "vocoder")]),
])
def test_the_streaming_examples_stream_every_edge_and_render_both_ends(name, streamed):
    from omni_runtime.stages.config import parse_stage_config

    repo = Path(__file__).resolve().parents[2]
    body = yaml.safe_load((repo / "examples" / name).read_text())
    admitted = admit({**body, "metadata": {**body["metadata"], "namespace": "default"}})
    assert [(p, c) for p, c, _ in admitted.pipeline.streamed_edges()] == streamed
    configs = {}
    for child in admitted.children:
        if child["kind"] == "ConfigMap":
            configs[child["metadata"]["labels"]["omnipipeline.dev/stage"]] = parse_stage_config(
                yaml.safe_load(child["data"]["stage.yaml"]))
    for producer, consumer in streamed:
        edge = admitted.pipeline.stage(consumer).edge_from(producer)
        assert configs[consumer].input_edges == (edge,)
        assert [d.stream for d in configs[producer].downstream if d.stage == consumer] == [edge.stream]


def test_a_stream_producers_pods_may_drain_for_its_longest_stream():
    from test_render import children

    body = body_with([{"stage": "thinker", "streamSeconds": 900}])
    body["spec"]["stages"][2]["streams"] = [{"stage": "talker", "firstChunkSeconds": 10, "streamSeconds": 20}]
    kids = children(body)
    grace = {s: kids[("Deployment", f"tiny-{s}")]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
             for s in ("thinker", "talker", "code2wav")}
    # The 900 s stream over the 30 s transfer deadline at both its ends (a consumer scaled in
    # finishes the streams it takes); the 20 s stream is shorter than the transfer deadline
    # (30 s), which stays.
    assert grace == {"thinker": 900 + 45, "talker": 900 + 45, "code2wav": 30 + 45}
    plain = children(pipeline_body())
    assert plain[("Deployment", "tiny-thinker")]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 75
