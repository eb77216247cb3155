"""Check objects against the CustomResourceDefinitions of a directory: their openAPIV3Schema and
CEL rules, as the API server would (``validation.problems``, the very check the OmniPipeline
CRD gets).

``omni-pipeline crd-check --crds DIR PATH...``: every document of every file (a directory: its
YAML files) whose apiVersion and kind one of DIR's CRDs serves is checked against that CRD's
version; an OmniPipeline is rendered first (``admission.admit``: all its children, a
PodMonitor, a KEDA ScaledObject and a HorizontalPodAutoscaler included) and its children are
checked the same way. Point DIR at the CRDs installed in a cluster (the Prometheus Operator's,
KEDA's) to learn whether they accept what the operator and the chart render. Exit code 0 when
everything matched is accepted, 1 otherwise; kinds no CRD of DIR serves are listed, not checked.

The project's tests run it against the upstream CRDs kept as reference data (not copied into
the project): tests/operator/test_third_party_crds.py.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TextIO

from omni_operator import API_VERSION, KIND
from .documents import DocumentError, iter_files, load_documents, read_text
from omni_operator.pipeline.errors import SpecError
from .gopattern import SchemaValidator
from .validation import problems, to_jsonschema


class CRDSet:
    """The CRDs of a directory (its YAML and JSON files) or of one file, by (group/version,
    kind) of every served version; ``errors``: what could not be read, each naming its file."""

    def __init__(self, location: Path):
        self.schemas: dict[tuple[str, str], dict[str, Any]] = {}
        self.files: dict[tuple[str, str], str] = {}
        self.errors: list[str] = []
        self._validators: dict[tuple[str, str], Any] = {}
        if not location.exists():
            self.errors.append(f"{location}: no such file or directory: name the directory of the CRDs (or one file)")
            return
        for path, doc in documents_of([location], self.errors.append):
            if isinstance(doc.value, dict) and doc.value.get("kind") == "CustomResourceDefinition":
                missing = self._add(path, doc.value)
                if missing:
                    self.errors.append(f"{path}: {doc.label}: a CustomResourceDefinition without {missing}")

    def _add(self, path: Path, crd: dict[str, Any]) -> str | None:
        """The CRD's served versions with a schema; what it lacks to be read, if anything."""
        spec = crd.get("spec")
        if not isinstance(spec, dict):
            return "spec"
        names = spec.get("names")
        if not isinstance(spec.get("group"), str) or not isinstance(names, dict) or not isinstance(names.get("kind"), str):
            return "spec.group and spec.names.kind"
        if not isinstance(spec.get("versions"), list):
            return "spec.versions"
        for version in spec["versions"]:
            schema = ((version.get("schema") or {}).get("openAPIV3Schema")) if isinstance(version, dict) else None
            if isinstance(schema, dict) and version.get("served", True) and isinstance(version.get("name"), str):
                key = (f"{spec['group']}/{version['name']}", names["kind"])
                self.schemas[key] = schema
                self.files[key] = path.name
        return None

    def schema_for(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        return self.schemas.get((str(obj.get("apiVersion")), str(obj.get("kind"))))

    def check(self, obj: dict[str, Any]) -> list[str] | None:
        """The problems the CRD finds (empty: accepted); None when no CRD here serves it."""
        key = (str(obj.get("apiVersion")), str(obj.get("kind")))
        schema = self.schemas.get(key)
        if schema is None:
            return None
        if key not in self._validators:
            self._validators[key] = SchemaValidator(to_jsonschema(schema, root=True))
        return [f"{field}: {message}" for field, message in problems(schema, obj, self._validators[key])]


def rendered_children(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Every child an OmniPipeline renders (all optional kinds included)."""
    from .admission import admit

    body = dict(body)
    meta = dict(body.get("metadata") or {})
    meta.setdefault("namespace", "default")
    meta.setdefault("uid", "00000000-0000-4000-8000-000000000000")
    body["metadata"] = meta
    return list(admit(body).children)


def documents_of(paths: Iterable[Path], report: Callable[[str], Any]) -> Iterator[tuple[Path, Any]]:
    """(file, document) of every document that could be read from ``paths`` (a directory: its
    YAML and JSON files); each file or document that could not is ``report``-ed, named."""
    for path in iter_files(list(paths)):
        try:
            documents = load_documents(read_text(path))
        except DocumentError as exc:
            report(f"{path}: {exc}")
            continue
        for doc in documents:
            if doc.error is not None:
                report(f"{path}: {doc.label}: {doc.error}")
            else:
                yield path, doc


def objects_of(paths: Iterable[Path], out: TextIO) -> tuple[list[tuple[str, dict[str, Any]]], bool]:
    """(where, object) of every document, OmniPipelines replaced by their children; whether
    every file could be read and every pipeline rendered."""
    found, failed = [], []

    def report(line: str) -> None:
        print(line, file=out)
        failed.append(line)

    for path, doc in documents_of(paths, report):
        value = doc.value
        if not isinstance(value, dict):
            continue
        if value.get("apiVersion") == API_VERSION and value.get("kind") == KIND:
            try:
                children = rendered_children(value)
            except SpecError as exc:
                report(f"{path}: {doc.label}: not a valid OmniPipeline: {exc}")
                continue
            print(f"{path}: {doc.label}: a valid OmniPipeline; the {len(children)} objects it renders are "
                  "checked below where the CRDs hold their kinds", file=out)
            found += [(f"{path}: {doc.label}: renders {c['kind']} {c['metadata']['name']}", c) for c in children]
        else:
            found.append((f"{path}: {doc.label}", value))
    return found, not failed


def run(crds: Path, paths: list[Path], out: TextIO) -> int:
    crd_set = CRDSet(crds)
    for error in crd_set.errors:
        print(error, file=out)
    if not crd_set.schemas:
        if crds.exists():
            print(f"{crds}: holds no CustomResourceDefinition with a schema", file=out)
        return 1
    objects, ok = objects_of(paths, out)
    ok = ok and not crd_set.errors
    if not objects:
        if ok:  # (a file that could not be read, a pipeline refused: said above)
            print(f"nothing to check: {', '.join(map(str, paths))} hold(s) no object", file=out)
        return 1
    unmatched: set[str] = set()
    for where, obj in objects:
        result = crd_set.check(obj)
        if result is None:
            unmatched.add(f"{obj.get('apiVersion')} {obj.get('kind')}")
            continue
        file = crd_set.files[(str(obj["apiVersion"]), str(obj["kind"]))]
        if result:
            ok = False
            for problem in result:
                print(f"{where}: refused by {file}: {problem}", file=out)
        else:
            print(f"{where}: accepted by {file}", file=out)
    if unmatched:
        print(f"not checked (no CRD in {crds}): {', '.join(sorted(unmatched))}", file=out)
    return 0 if ok else 1


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("crd-check", help="check objects, and what OmniPipelines render, against a directory of CRDs")
    parser.add_argument("--crds", type=Path, required=True, help="a directory of CustomResourceDefinition YAML files (or one file)")
    parser.add_argument("paths", nargs="+", type=Path, help="YAML files or directories")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_operator.check.crd_check", description=__doc__.splitlines()[0])
    parser.add_argument("--crds", type=Path, required=True)
    parser.add_argument("paths", nargs="+", type=Path)
    args = parser.parse_args(argv)
    return run(args.crds, args.paths, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
