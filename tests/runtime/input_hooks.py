"""Input hooks for the pipeline tests (stages/inputs.py), imported by a talker stage's
process from tests/runtime on its PYTHONPATH. The test chooses what a hook does by the first
token of the prompt it sends the pipeline (prompts are token ids)."""

from omni_runtime.stages.inputs import StageRequest, Upstream, pass_tokens

#: First prompt token -> what the hook does.
RAISE = 1
TALK_LONG = 2


def by_first_token(upstream: Upstream) -> StageRequest:
    first = upstream.prompt_token_ids[0] if upstream.prompt_token_ids else None
    if first == RAISE:
        raise RuntimeError("this hook refuses prompts that begin with token 1")
    made = pass_tokens(upstream)
    if first == TALK_LONG:  # a talker busy long enough to be aborted mid-way
        return StageRequest(made.prompt, sampling_params={"max_tokens": 180})
    return made
