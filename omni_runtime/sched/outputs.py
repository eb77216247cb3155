"""What omni_runtime adds to vLLM's scheduler output: vllm-omni's request-level payload.

The KV transfers themselves travel in the step's KV connector metadata (``kv/connector.py``),
not in fields of our own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.v1.core.sched.output import NewRequestData


@dataclass
class OmniNewRequestData(NewRequestData):
    """A new request with vllm-omni's request-level payload (``prompt_embeds`` is already a
    field of vLLM's own NewRequestData)."""

    additional_information: Any = None
