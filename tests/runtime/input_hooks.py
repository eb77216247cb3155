"""Input hooks for the pipeline tests (stages/inputs.py), imported by a talker stage's
process from tests/runtime on its PYTHONPATH. The test chooses what a hook does by how the
prompt it sends the pipeline begins (prompts are token ids; no chat template begins so)."""

from omni_runtime.stages.inputs import StageRequest, Upstream, pass_tokens

#: A prompt beginning with one of these -> what the hook does.
RAISE = [499, 1]
TALK_LONG = [499, 2]
TALK_LONGEST = [499, 3]


def by_first_tokens(upstream: Upstream) -> StageRequest:
    begins = list(upstream.prompt_token_ids[:2])
    if begins == RAISE:
        raise RuntimeError("this hook refuses prompts that begin with [499, 1]")
    made = pass_tokens(upstream)
    if begins == TALK_LONG:  # a talker busy long enough to be aborted mid-way
        return StageRequest(made.prompt, sampling_params={"max_tokens": 180})
    if begins == TALK_LONGEST:  # busy for seconds, however fast the engine steps (at 600
        # tokens it once finished within the busy test's 1 s deadline)
        return StageRequest(made.prompt, sampling_params={"max_tokens": 1500})
    return made
