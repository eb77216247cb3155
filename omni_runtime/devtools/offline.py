"""Running the omni AR scheduler in an offline vLLM ``LLM`` (tests, the demo, notebooks).

Offline, ``LLM.generate`` returns once every request's output is complete, but transfers may
still be in flight: the engine core must go on stepping until they resolve, so that held
blocks are freed. With the in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
:func:`drain_transfers` does that.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

SCHEDULER_CLS = "omni_runtime.sched.OmniARScheduler"


def omni_llm(
    model: str,
    omni_kv_config: Mapping[str, Any] | None = None,
    *,
    endpoints: Mapping[str, str] | None = None,
    pipeline: str = "",
    compose_with: Mapping[str, Any] | None = None,
    io_cpus: str | list[int] | None = None,
    loads: bool = False,
    **engine_args: Any,
):
    """An ``LLM`` whose scheduler is :class:`~omni_runtime.sched.OmniARScheduler`; with
    transfers on, the omni KV connector ships to ``endpoints`` ({stage: address}; the
    connector refuses a set-up that sends with none, unless it ``loads``), composed through vLLM's MultiConnector with the
    connector config ``compose_with`` when given (as ``omni-stage`` does with one in
    ``engineArgs``); ``io_cpus``: the transport threads' CPUs (the connector's ``io_cpus``
    setting); ``loads``: the connector also loads the KV prefixes the requests name in
    ``kv_transfer_params["omni_load"]`` (a downstream stage's, kv/load.py)."""
    from vllm import LLM

    from omni_runtime.kv.connector_config import composed_kv_transfer_config, kv_transfer_config

    additional = dict(engine_args.pop("additional_config", None) or {})
    if omni_kv_config is not None:
        additional["omni_kv_config"] = dict(omni_kv_config)
        if omni_kv_config.get("need_send_cache") or loads:
            connector = kv_transfer_config(endpoints or {}, pipeline, io_cpus, loads=loads)
            if compose_with is not None:
                connector = composed_kv_transfer_config(connector, compose_with)
            engine_args["kv_transfer_config"] = connector
    return LLM(model=model, scheduler_cls=SCHEDULER_CLS, additional_config=additional, **engine_args)


def engine_core_of(llm: Any):
    """The in-process EngineCore of an ``LLM`` (None with a multi-process engine core)."""
    client = llm.llm_engine.engine_core
    return getattr(client, "engine_core", None)


def drain_transfers(llm: Any, timeout_s: float) -> None:
    """Step the engine until its scheduler has nothing left, transfers included.

    Raises TimeoutError after ``timeout_s`` (a transfer deadline longer than that, say)."""
    core = engine_core_of(llm)
    if core is None:
        raise RuntimeError(
            "drain_transfers needs the in-process engine core: set "
            "VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating the LLM"
        )
    deadline = time.monotonic() + timeout_s
    while core.scheduler.has_requests():
        if time.monotonic() > deadline:
            raise TimeoutError(f"transfers still unresolved after {timeout_s:g}s")
        outputs, executed = core.step()
        if not executed:
            # Nothing to run: wait for an ack or a deadline without spinning the CPU, as
            # EngineCore's own loop does in the same situation.
            time.sleep(0.001)
