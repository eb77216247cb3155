"""What a downstream vLLM stage makes of an upstream stage's hand-off: the input hook.

A stage with ``inputs`` turns each hand-off that arrives into a request in its engine
(stage_input.py). The hook decides that request's input: a function ``hook(upstream) ->
StageRequest`` named in the stage config (``input.hook: "package.module:function"``, as
vllm-omni's ``custom_process_next_stage_input_func``). It gets an :class:`Upstream` (the
upstream request's tokens, how many were its prompt, its KV payload) and returns a
:class:`StageRequest`: vLLM's prompt (``{"prompt_token_ids": [...]}``, or
``{"prompt_embeds": tensor}`` or ``multi_modal_data`` where the engine accepts them), the
sampling parameters it changes from the stage's, and whether the upstream's KV may be the
request's prefix. The default, :func:`pass_tokens`, passes every upstream token on: the
request continues the upstream's sequence, so where the two stages run the same model the
upstream's KV is its prefix (loaded, not recomputed: kv/load.py).

A hook that does not import stops the stage at start-up (``omni-stage`` exits 2 naming
``input.hook``); one that raises, or returns something else, fails that request alone, its
hand-off refused with the error (``input_refused``), never the engine.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


class InputHookError(ValueError):
    """An input hook that cannot be used (it does not import, or is not callable)."""


@dataclass(frozen=True)
class Upstream:
    """A hand-off as the hook sees it."""

    #: The pipeline request's id (the same at every stage).
    request_id: str
    from_stage: str
    #: The upstream request's tokens at its trigger: its prompt, then what it generated.
    token_ids: tuple[int, ...]
    prompt_len: int
    #: How many of ``token_ids`` the KV payload covers.
    seq_len: int
    #: The KV payload (``payload.materialize()``: ``[layers, 2, kv_heads, seq_len,
    #: head_size]``), for hooks that derive features from it.
    payload: Any = field(default=None, repr=False)

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        return self.token_ids[:self.prompt_len]

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return self.token_ids[self.prompt_len:]


@dataclass(frozen=True)
class StageRequest:
    """The request a hand-off becomes."""

    #: vLLM's prompt: ``{"prompt_token_ids": [...]}`` (optionally with
    #: ``multi_modal_data``), or ``{"prompt_embeds": tensor}``.
    prompt: Mapping[str, Any]
    #: Sampling parameters changed from the stage's ``input.samplingParams``.
    sampling_params: Mapping[str, Any] = field(default_factory=dict)
    #: Whether the upstream's KV may be loaded as the request's prefix (it is where the two
    #: stages' models agree and the prompt begins with the tokens the KV covers).
    reuse_kv: bool = True


def pass_tokens(upstream: Upstream) -> StageRequest:
    """The default hook: the request continues the upstream's sequence (every token)."""
    return StageRequest({"prompt_token_ids": list(upstream.token_ids)})


def output_tokens(upstream: Upstream) -> StageRequest:
    """A hook for a stage that starts afresh from what the upstream generated (its prompt
    left out, so no KV is reused)."""
    return StageRequest({"prompt_token_ids": list(upstream.output_token_ids)},
                        reuse_kv=False)


def load_hook(path: str | None) -> Callable[[Upstream], StageRequest]:
    """The hook named by ``path`` ("package.module:function"; None: :func:`pass_tokens`);
    InputHookError naming what is wrong."""
    if path is None:
        return pass_tokens
    module_name, sep, name = path.partition(":")
    if not sep or not module_name or not name:
        raise InputHookError(f"input.hook must be 'package.module:function', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise InputHookError(f"input.hook {path!r} does not import: "
                             f"{type(exc).__name__}: {exc}") from None
    hook = getattr(module, name, None)
    if not callable(hook):
        raise InputHookError(f"input.hook {path!r}: module {module_name} has no function "
                             f"{name!r}")
    return hook


def request_of(hook: Callable[[Upstream], Any], upstream: Upstream) -> StageRequest:
    """The hook's request for ``upstream``; ValueError with the hook's own error when it
    raises or answers something else."""
    try:
        made = hook(upstream)
    except Exception as exc:
        raise ValueError(f"the input hook raised {type(exc).__name__}: {exc}") from None
    if isinstance(made, Mapping):
        made = StageRequest(made)
    if not isinstance(made, StageRequest) or not isinstance(made.prompt, Mapping):
        raise ValueError(f"the input hook must return a StageRequest, got {type(made).__name__}")
    return made
