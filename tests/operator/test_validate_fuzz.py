"""Fuzzing `omni-pipeline validate`: random YAML documents, random bytes, and mutations of the
examples never end in an exception; every line names its file and document, and the exit
code says whether every document was a valid OmniPipeline.

The check under the CLI (`cli.check_document`, the operator's own admission check) is called
without the CLI's last-resort handler, so a bug anywhere in it fails the test."""
from __future__ import annotations

import copy
import io
import os
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omni_operator.local import cli
from omni_operator.check.documents import Document, load_documents

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = [yaml.safe_load(p.read_text()) for p in sorted((ROOT / "examples").glob("*.yaml"))]
# OMNI_FUZZ_EXAMPLES raises the count for a longer hunt (the default keeps the suite quick).
SETTINGS = settings(max_examples=int(os.environ.get("OMNI_FUZZ_EXAMPLES", "150")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

# Values a user (or a broken editor) might put anywhere.
scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.sampled_from(["", " ", "2Gi", "-1", "1e999999999", "2024-01-01", "Exists", "ar", "generation", "special_token",
                     "nvidia.com/gpu", "OMNI_X", "thinker", "talker", "0x10", "~", "null", "yes", "1.5Gi ", "Ki"]),
)
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.text(max_size=12), children, max_size=4)),
    max_leaves=25,
)


def check_all(text: str) -> list[str]:
    """What the CLI prints for a file's text; asserts the check itself never raises."""
    docs = load_documents(text)
    for doc in docs:
        if doc.value is not None or doc.error is not None:
            problems = cli.check_document(doc)  # no safety net here: an exception fails the test
            for p in problems:
                assert p.field and p.message and "\n" not in p.field
    return [d.label for d in docs]


def run_cli(tmp_path: Path, data: bytes) -> tuple[int, list[str]]:
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(data)
    out = io.StringIO()
    code = cli.cmd_validate([path], out)
    lines = out.getvalue().splitlines()
    assert code in (0, 1)
    assert lines, "every file gets at least one line"
    for line in lines:
        assert line.startswith(f"{path}: "), line
        assert "internal error" not in line and "Traceback" not in line, line
    if code == 0:
        assert all(line.endswith(")") and ": valid (" in line for line in lines), lines
    return code, lines


@SETTINGS
@given(value=json_values)
def test_random_yaml_documents(tmp_path_factory, value):
    text = yaml.safe_dump(value)
    check_all(text)
    run_cli(tmp_path_factory.mktemp("fuzz"), text.encode())


@SETTINGS
@given(data=st.binary(max_size=300))
def test_random_bytes(tmp_path_factory, data):
    run_cli(tmp_path_factory.mktemp("fuzz"), data)


@SETTINGS
@given(text=st.text(alphabet=st.sampled_from(list("{}[]:,-?&*!|>'\"#%@` \n\tab01.~")), max_size=200))
def test_random_yaml_syntax(tmp_path_factory, text):
    check_all(text)
    run_cli(tmp_path_factory.mktemp("fuzz"), text.encode())


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def _set(root, path, value):
    node = root
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value


def _delete(root, path):
    node = root
    for part in path[:-1]:
        node = node[part]
    del node[path[-1]]


@SETTINGS
@given(data=st.data())
def test_mutated_examples(tmp_path_factory, data):
    body = copy.deepcopy(data.draw(st.sampled_from(EXAMPLES)))
    for _ in range(data.draw(st.integers(min_value=1, max_value=4))):
        paths = [p for p in _paths(body) if p]
        if not paths:
            break
        path = data.draw(st.sampled_from(paths))
        action = data.draw(st.sampled_from(["replace", "delete", "wrap", "duplicate"]))
        node = body
        for part in path[:-1]:
            node = node[part]
        if action == "replace":
            _set(body, path, data.draw(json_values))
        elif action == "delete":
            _delete(body, path)
        elif action == "wrap":
            _set(body, path, [node[path[-1]]])
        elif isinstance(node, list):
            node.append(copy.deepcopy(node[path[-1]]))
    text = yaml.safe_dump(body)
    check_all(text)
    run_cli(tmp_path_factory.mktemp("fuzz"), text.encode())


@pytest.mark.parametrize("example", EXAMPLES, ids=[e["metadata"]["name"] for e in EXAMPLES])
def test_unmutated_examples_are_valid(tmp_path, example):
    code, lines = run_cli(tmp_path, yaml.safe_dump(example).encode())
    assert code == 0, lines


def test_a_document_label_survives_any_name():
    assert Document(0, {"metadata": {"name": "a\nb" * 100}}).label.startswith("document 1 (a b")
    assert Document(2, {"metadata": "x"}).label == "document 3"


def test_an_engine_args_key_with_a_newline_stays_on_one_line(tmp_path):
    """Found by test_mutated_examples: a key that is no flag name is named quoted, so the
    problem is one line whose field holds no newline."""
    body = copy.deepcopy(EXAMPLES[0])
    body["spec"]["stages"][0]["engineArgs"] = {"max\nmodel len": 1}
    code, lines = run_cli(tmp_path, yaml.safe_dump(body).encode())
    assert code == 1
    assert any('engineArgs["max\\nmodel len"]: is not a vLLM flag name' in line for line in lines), lines
