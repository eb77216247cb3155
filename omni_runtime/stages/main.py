"""``omni-stage --config STAGE.yaml``: start one pipeline stage.

The stage config is the file the operator renders into the stage's ConfigMap (keys in
docs/operator.md; ``omni-pipeline up`` writes the same file for local runs). Two kinds:

* an AR stage (``role: ar``): vLLM's OpenAI server with :class:`OmniARScheduler`, the omni
  KV connector and the stage's ``omni_kv_config``; this process supervises it (see
  :mod:`omni_runtime.stages.ar`);
  with ``inputs``, its requests are made from the upstream stages' hand-offs, inside vLLM's
  server (:mod:`omni_runtime.stages.stage_input`);
* a receiving stage (any other role): a small HTTP server with ``/health``, ``/metrics`` and
  ``/v1/kv`` (what arrived), and the KV receiver with its inbox (see
  :mod:`omni_runtime.stages.receiver`);
* the pipeline's endpoint (``role: endpoint``): the one address a client sends its requests
  to and gets the last stage's output from (:mod:`omni_runtime.pipeline.endpoint`).

Ports: ``http`` (default 8000) and ``kv`` (default 9600), from the config's ``ports``.
SIGTERM drains: stop taking work, let in-flight requests and transfers finish within a grace
period, then exit.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from omni_runtime.stages.config import DEFAULT_GRACE_SECONDS, StageConfigError, load_stage_config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-stage", description="Start one omni pipeline stage.")
    parser.add_argument("--config", required=True, help="stage config file (from the stage's ConfigMap)")
    parser.add_argument("--host", default="0.0.0.0", help="address to serve on (default 0.0.0.0)")
    parser.add_argument(
        "--grace-seconds",
        type=_grace_seconds,
        default=None,
        help="on SIGTERM, how long in-flight requests, KV transfers and open streams get to "
        "finish before the stage exits (an AR stage passes it to vLLM as --shutdown-timeout; "
        "default: the stage's kvTransfer.timeoutSeconds, else 30, or its streamed edges' "
        "longest streamSeconds if longer)",
    )
    parser.add_argument("--print-command", action="store_true", help="print the vLLM command of an AR stage and exit")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_stage_config(args.config)
    except StageConfigError as exc:
        print(f"omni-stage: {exc}", file=sys.stderr)
        return 2
    grace = args.grace_seconds
    if grace is None:
        grace = default_grace_seconds(config)
    if config.is_endpoint:
        from omni_runtime.pipeline.endpoint import (
            EndpointConfigError,
            parse_endpoint_config,
            run,
        )

        try:
            endpoint = parse_endpoint_config(config.pipeline, config.model_name,
                                             config.endpoint)
        except EndpointConfigError as exc:
            print(f"omni-stage: {args.config}: {exc}", file=sys.stderr)
            return 2
        return run(endpoint, args.host, config.http_port)
    if config.takes_hand_offs:
        from omni_runtime.stages.inputs import InputHookError, load_hook

        try:  # here, before vLLM loads a model: the same import the stage's server does
            load_hook(config.input_hook)
        except InputHookError as exc:
            print(f"omni-stage: {args.config}: {exc}", file=sys.stderr)
            return 2
    if config.is_ar:
        from omni_runtime.stages.ar import ARStage, vllm_command

        try:
            # Built once here so that a config the stage cannot run stops it with its key
            # named (exit 2), whatever path found it, and never as a traceback.
            command = vllm_command(config, args.host, grace_seconds=grace)
        except StageConfigError as exc:
            print(f"omni-stage: {args.config}: {exc}", file=sys.stderr)
            return 2
        if args.print_command:
            print(" ".join(command))
            return 0
        return ARStage(config, host=args.host, grace_seconds=grace).run()
    # One process serves a receiving stage's /metrics: prometheus_client's single-process
    # mode is right, whatever the image's environment says (decided at its import, below).
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    from omni_runtime.stages.receiver import ReceiverStage

    return ReceiverStage(config, host=args.host, grace_seconds=grace).run()


def _grace_seconds(text: str) -> float:
    """--grace-seconds: a number of seconds above 0, at most a day (nan, inf and 1e400 ended
    in tracebacks; 0 and -1 silently became 1)."""
    from omni_contract.edges import MAX_DEADLINE_SECONDS

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= MAX_DEADLINE_SECONDS:  # nan fails both
        raise argparse.ArgumentTypeError(f"{text!r}: must be a number of seconds above 0, at most "
                                         f"{MAX_DEADLINE_SECONDS:g}")
    return value


def default_grace_seconds(config) -> float:
    """The stage's drain without ``--grace-seconds``: its KV transfers' deadline, or the
    longest whole-stream deadline of its streamed edges if longer (the contract's
    ``drain_seconds``, by which the operator sizes the pod's grace period)."""
    from omni_contract.edges import drain_seconds

    streams = [d.stream for d in config.downstream] + [e.stream for e in config.input_edges]
    return drain_seconds(config.kv_timeout_seconds or DEFAULT_GRACE_SECONDS, streams)


if __name__ == "__main__":
    sys.exit(main())
