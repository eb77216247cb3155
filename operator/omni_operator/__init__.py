"""omni_operator: a kopf operator reconciling OmniPipeline resources into stage Deployments.

Nothing here imports vLLM or omni_runtime: the operator image carries neither.
"""

GROUP = "omnipipeline.dev"
VERSION = "v1alpha1"
PLURAL = "omnipipelines"
KIND = "OmniPipeline"
API_VERSION = f"{GROUP}/{VERSION}"
