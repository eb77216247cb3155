"""The fields omni_runtime adds to vLLM's scheduler and model-runner outputs.

Names follow vllm-omni's model runners, so their runners understand our scheduler:
  * ``SchedulerOutput.finished_requests_needing_kv_transfer``:
    ``{request_id: {"seq_len": int, "block_ids": list[int]}}``: transfers handed to the runner
    in this step (the blocks of KV cache group 0, cut to ceil(seq_len / block_size));
  * ``ModelRunnerOutput.kv_extracted_req_ids``: requests whose transfer was delivered;
  * ``ModelRunnerOutput.kv_extraction_failures``: ``{request_id: reason}`` for transfers the
    runner or the receiver failed (our addition; vllm-omni's runners never fail one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

TRANSFERS_FIELD = "finished_requests_needing_kv_transfer"
ACKS_FIELD = "kv_extracted_req_ids"
FAILURES_FIELD = "kv_extraction_failures"


@dataclass
class OmniSchedulerOutput(SchedulerOutput):
    finished_requests_needing_kv_transfer: dict[str, dict[str, Any]] = field(
        default_factory=dict
    )


@dataclass
class OmniNewRequestData(NewRequestData):
    """A new request with vllm-omni's request-level payload (``prompt_embeds`` is already a
    field of vLLM's own NewRequestData)."""

    additional_information: Any = None
