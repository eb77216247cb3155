"""``omni-pipeline``: check or run an ``OmniPipeline`` file without a cluster.

    omni-pipeline validate PATH...   each document of each file (a directory: its YAML files)
    omni-pipeline up FILE            every stage as a local process on 127.0.0.1
    omni-pipeline status FILE        the transfer health of a pipeline `up` runs
    omni-pipeline crd-check --crds DIR PATH...   objects (and what pipelines render) against CRDs

``validate`` runs the operator's own check (``admission.admit``: the CRD's schema and CEL
rules, the graph rules, Kubernetes' schemas for the pod fields and the rendered objects) and
prints one line per problem, ``FILE: document N (NAME): FIELD: MESSAGE``, or one line per
valid document, after a line ``FILE: document N (NAME): warning: FIELD: MESSAGE`` for each
thing its stages would run with but the user should know (a vLLM the stage contract's table
does not describe, an abbreviated flag: warnings never make a document invalid). Exit code 0 when every document is a valid OmniPipeline; 1 otherwise,
including an empty file, a file with no document, and a document of another kind. No input,
however malformed, ends in a traceback.

``up`` takes the same file ``kubectl apply`` takes and hands it to the local supervisor
(``run.py``); with ``--streaming`` (and ``--demo N``) also the same pipeline with every edge
fed whole, to time both modes' first output. ``status`` reads the stages of a pipeline ``up`` runs and prints the
per-stage and per-edge transfer table the operator's status is computed from
(``status.py``); exit code 0 healthy, 1 stuck or failing, 3 unknown, 2 not running.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, TextIO

from omni_operator.check.admission import admit, report_of
from omni_operator.check.documents import Document, DocumentError, iter_files, load_documents, read_text
from omni_operator.pipeline.errors import Problem, SpecError


def check_document(doc: Document) -> list[Problem]:
    """The problems of one document (empty: a valid OmniPipeline)."""
    return report_document(doc)[0]


def report_document(doc: Document) -> tuple[list[Problem], list[Problem]]:
    """(the problems, the warnings) of one document."""
    if doc.error is not None:
        return [Problem("<document>", doc.error)], []
    return report_of(doc.value)


def validate_file(path: Path, out: TextIO) -> bool:
    """Report every document of one file; True when all are valid OmniPipelines."""
    try:
        documents = load_documents(read_text(path))
    except DocumentError as exc:
        print(f"{path}: {exc}", file=out)
        return False
    documents = [d for d in documents if d.error is not None or d.value is not None]
    if not documents:
        print(f"{path}: holds no document; an OmniPipeline file needs apiVersion, kind, metadata and spec", file=out)
        return False
    ok = True
    for doc in documents:
        try:
            problems, warnings = report_document(doc)
        except Exception as exc:  # noqa: BLE001 - a bug must still not become a traceback for the user
            problems, warnings = [Problem("<document>", f"internal error while checking it ({type(exc).__name__}: "
                                                        f"{exc}); please report this with the file")], []
        for warning in warnings:
            print(f"{path}: {doc.label}: warning: {warning.field}: {_one_line(warning.message)}", file=out)
        if problems:
            ok = False
            for problem in problems:
                print(f"{path}: {doc.label}: {problem.field}: {_one_line(problem.message)}", file=out)
        else:
            stages = len(doc.value["spec"]["stages"])
            print(f"{path}: {doc.label}: valid ({stages} stage{'s' if stages != 1 else ''})", file=out)
    return ok


def cmd_validate(paths: list[Path], out: TextIO) -> int:
    results = [validate_file(path, out) for path in iter_files(paths)]
    return 0 if all(results) else 1


def cmd_up(args: argparse.Namespace, out: TextIO) -> int:
    from .run import UpOptions, file_watcher, model_not_here, run_pipeline

    pipeline = _load_one(args.file, out)
    if pipeline is None:
        return 2
    compare = None
    if args.streaming:
        compare = _whole_variant(args, pipeline, out)
        if compare is None:
            return 2
    if (problem := model_not_here(pipeline)) is not None:  # before any stage starts
        print(f"{args.file}: {problem}", file=out)
        return 2
    if args.port and not args.watch:
        print("omni-pipeline up: --port is the port of the front that --watch runs (the pipeline's one "
              "address across revisions); without --watch the endpoint's address is printed once it "
              "is up", file=out)
        return 2

    def reload(path: Path):
        changed = _load_one(path, out)
        if changed is not None and (problem := model_not_here(changed)) is not None:
            print(f"{path}: {problem}", file=out)
            changed = None
        if changed is None:
            print(f"{path}: not applied; the running revision stays", file=out, flush=True)
        return changed

    options = UpOptions(host=args.host, workdir=args.workdir, keep=args.keep, demo=args.demo, exit_after=args.exit_after,
                        reload=file_watcher(args.file, reload) if args.watch else None, port=args.port,
                        compare=compare)
    return run_pipeline(pipeline, options, out)


def _whole_variant(args: argparse.Namespace, pipeline, out: TextIO):
    """``up --streaming``: the file's pipeline with every edge fed whole, to compare with;
    None (reported) where the comparison cannot be made."""
    from .run import whole_edges

    problem = None
    if not pipeline.streamed_edges():
        problem = ("has no streamed edge (spec.stages[].streams) to compare with whole hand-offs; "
                   "run a file with one, e.g. examples/tiny-omni-streaming.yaml")
    elif pipeline.endpoint_stages is None:
        problem = ("has no one endpoint (one entry ar stage, one last stage), so no first output "
                   "to time; --streaming needs one")
    elif not args.demo:
        problem = "--streaming times the demo's requests: give --demo N too"
    elif args.watch:
        problem = "--streaming and --watch do not go together: compare first, then watch"
    if problem is not None:
        print(f"{args.file}: {problem}", file=out)
        return None
    [document] = [d for d in load_documents(read_text(args.file)) if d.value is not None]
    try:
        return admit(whole_edges(document.value)).pipeline
    except SpecError as exc:
        for found in exc.problems:
            print(f"{args.file}: with every edge whole (--streaming): {found}", file=out)
        return None


def _load_one(path: Path, out: TextIO):
    """The pipeline of a file holding exactly one valid OmniPipeline, else None (reported)."""
    try:
        documents = [d for d in load_documents(read_text(path)) if d.error is not None or d.value is not None]
    except DocumentError as exc:
        print(f"{path}: {exc}", file=out)
        return None
    if len(documents) != 1:
        print(f"{path}: expected one OmniPipeline, found {len(documents)} documents", file=out)
        return None
    document = documents[0]
    try:
        if document.error is not None:
            raise SpecError([Problem("<document>", document.error)])
        admitted = admit(document.value)
        for warning in admitted.warnings:
            print(f"{path}: warning: {warning.field}: {_one_line(warning.message)}", file=out)
        return admitted.pipeline
    except SpecError as exc:
        for problem in exc.problems:
            print(f"{path}: {problem}", file=out)
        return None


def cmd_status(args: argparse.Namespace, out: TextIO) -> int:
    from .status import NOT_RUNNING, show_status

    pipeline = _load_one(args.file, out)
    if pipeline is None:
        return NOT_RUNNING
    return show_status(pipeline, out, workdir=Path(args.workdir) if args.workdir else None,
                       interval=args.interval, failing_ratio=args.failing_ratio)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-pipeline", description=__doc__.splitlines()[0].replace("``", ""))
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("validate", help="check OmniPipeline files as the API server and the operator would")
    v.add_argument("paths", nargs="+", type=Path, metavar="PATH",
                   help="a YAML file (any number of documents), a directory, or - for the standard input")
    u = sub.add_parser("up", help="run an OmniPipeline's stages as local processes")
    u.add_argument("file", type=Path)
    u.add_argument("--host", default="127.0.0.1",
                   help="the address every stage, the endpoint and the front listen on (default: 127.0.0.1)")
    u.add_argument("--workdir", help="where stage configs and logs go (default: a temporary directory)")
    u.add_argument("--keep", action="store_true", help="keep the temporary directory (its configs and logs) at exit")
    u.add_argument("--demo", type=_count, default=0, metavar="N",
                   help="send N requests to the AR stage once all stages are ready")
    u.add_argument("--exit-after", type=_non_negative, metavar="SECONDS",
                   help="stop the pipeline after this long (unattended runs)")
    u.add_argument("--watch", action="store_true",
                   help="read the file again every second; a new revision rolls out (receivers first, the old one "
                        "drained by its transfers) behind one stable address, the pipeline's front")
    u.add_argument("--port", type=_port, default=0, help="the front's port with --watch (default: a free one)")
    u.add_argument("--streaming", action="store_true",
                   help="with --demo N: after the demo's requests (streamed, as the file's edges say), start the "
                        "same pipeline with every edge whole, send it the same requests, stop it, and print both "
                        "modes' first output's times")
    s = sub.add_parser("status", help="the transfer health of a pipeline that `omni-pipeline up` runs")
    s.add_argument("file", type=Path)
    s.add_argument("--workdir", help="the `up --workdir` of the pipeline (default: found by its name)")
    s.add_argument("--interval", type=_non_negative, default=5.0, metavar="SECONDS",
                   help="read twice, this far apart: failed and expired count over it (0: read once)")
    s.add_argument("--failing-ratio", type=_ratio, default=0.05, metavar="R",
                   help="share of the interval's transfers that may fail or expire (the operator's default)")
    from omni_operator.check.crd_check import add_parser as add_crd_check

    add_crd_check(sub)
    return parser


def _number(low: float, high: float, what: str, kind: Callable[[str], float] = float) -> Callable[[str], float]:
    """An argument type: a number (of ``kind``: float, or int for a whole one) within [low,
    high], or a usage error saying what it takes."""
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r}: must be {what}")
        return value
    return parse


_non_negative = _number(0, sys.float_info.max, "a number of seconds, at least 0")
_ratio = _number(0, 1, "a share between 0 and 1 (0.05: 5%)")
_count = _number(0, 10_000, "a number of requests from 0 to 10000", int)
_port = _number(0, 65535, "a port from 0 to 65535 (0: a free one)", int)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "validate":
        return cmd_validate(args.paths, sys.stdout)
    if args.command == "status":
        return cmd_status(args, sys.stdout)
    if args.command == "crd-check":
        from omni_operator.check.crd_check import run

        return run(args.crds, args.paths, sys.stdout)
    return cmd_up(args, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
