"""`omni-pipeline crd-check` given what it cannot use: each problem named with its file, exit
1, never a traceback (an outside review found a non-UTF-8 file, a YAML syntax error and a CRD
without a spec each ending it with a Python traceback, and a missing directory reported as one
"holding no CustomResourceDefinition")."""
from __future__ import annotations

import io
from pathlib import Path

from omni_operator.check import crd_check

REPO = Path(__file__).resolve().parents[2]
OURS = REPO / "operator" / "omni_operator" / "crd"
EXAMPLE = REPO / "examples" / "tiny-chain.yaml"


def run(crds: Path, *paths: Path) -> tuple[int, list[str]]:
    out = io.StringIO()
    code = crd_check.run(crds, list(paths), out)
    return code, out.getvalue().splitlines()


def test_unreadable_crd_files_are_named_and_the_rest_is_used(tmp_path):
    crds = tmp_path / "crds"
    crds.mkdir()
    (crds / "latin1.yaml").write_bytes(b"\xff\xfe kind: x")
    (crds / "broken.yaml").write_text("a: [\n")
    (crds / "nospec.yaml").write_text("apiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition\n"
                                      "metadata: {name: x}\n")
    (crds / "ours.yaml").write_text((OURS / "omnipipelines.omnipipeline.dev.yaml").read_text())
    code, lines = run(crds, EXAMPLE)
    assert code == 1, lines
    assert any(line.startswith(f"{crds / 'latin1.yaml'}: is not UTF-8") for line in lines), lines
    assert any(line.startswith(f"{crds / 'broken.yaml'}: document 1: not valid YAML") for line in lines), lines
    assert any(line.endswith("a CustomResourceDefinition without spec") for line in lines), lines


def test_a_missing_location_and_one_crd_file(tmp_path):
    code, lines = run(tmp_path / "nowhere", EXAMPLE)
    assert code == 1 and lines == [f"{tmp_path / 'nowhere'}: no such file or directory: name the directory of "
                                   "the CRDs (or one file)"]
    # One file serves as well as its directory.
    code, lines = run(OURS / "omnipipelines.omnipipeline.dev.yaml", EXAMPLE)
    assert code == 0 and lines[-1].startswith("not checked (no CRD in"), lines


def test_nothing_to_check_is_said(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    code, lines = run(OURS, empty)
    assert code == 1 and lines == [f"nothing to check: {empty} hold(s) no object"]
    # A pipeline refused is said as such, not as no object (an outside review), and a valid
    # one is said to be valid before its rendered objects are checked.
    bad = tmp_path / "bad.yaml"
    bad.write_text(EXAMPLE.read_text().replace("role: ar", "role: nope", 1))
    code, lines = run(OURS, bad)
    assert code == 1 and len(lines) == 1 and "not a valid OmniPipeline: spec.stages[0].role" in lines[0], lines
    code, lines = run(OURS, EXAMPLE)
    assert code == 0 and "a valid OmniPipeline; the" in lines[0], lines


def test_the_cli_says_what_an_argument_takes(capsys):
    """Bad arguments are usage errors naming the argument and what it takes (an outside review
    saw "invalid _non_negative value", and --failing-ratio 5 taken)."""
    import pytest

    from omni_operator.local import cli

    for argv, words in ((["status", "x.yaml", "--interval", "abc"], "--interval: 'abc' is not a number of seconds"),
                        (["status", "x.yaml", "--interval", "-1"], "at least 0"),
                        (["status", "x.yaml", "--failing-ratio", "5"], "between 0 and 1")):
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 2 and words in capsys.readouterr().err
    assert cli.build_parser().description == "omni-pipeline: check or run an OmniPipeline file without a cluster."


def test_every_example_the_docs_name_exists():
    import re

    docs = [REPO / "README.md", REPO / "charts" / "omni-pipeline" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    named = {m for doc in docs for m in re.findall(r"examples/[A-Za-z0-9_.-]+\.ya?ml", doc.read_text())}
    assert named and not [n for n in sorted(named) if not (REPO / n).is_file()]


def test_validate_reads_the_standard_input_as_dash(monkeypatch, capsys):
    """`omni-pipeline validate -` reads the standard input, as `kubectl apply -f -` does (it
    said "cannot read it: No such file")."""
    import io as _io
    import sys as _sys

    from omni_operator.local import cli

    class Stdin:
        buffer = _io.BytesIO(EXAMPLE.read_bytes())

    monkeypatch.setattr(_sys, "stdin", Stdin)
    assert cli.main(["validate", "-"]) == 0
    assert capsys.readouterr().out.startswith("-: document 1 (tiny-chain): valid (3 stages)")
    Stdin.buffer = _io.BytesIO(b"\x00binary")
    assert cli.main(["validate", "-"]) == 1
    assert "-: is not a YAML file" in capsys.readouterr().out
