"""The stage processes: ``omni-stage --config STAGE.yaml`` (:mod:`.main`) runs an AR stage
(:mod:`.ar`, vLLM's OpenAI server supervised) or a receiving stage (:mod:`.receiver`), both
from the stage config (:mod:`.config`)."""
