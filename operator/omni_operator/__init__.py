"""omni_operator: a kopf operator reconciling OmniPipeline resources into stage Deployments,
and the tools around it. Three programs, each a package, on two shared ones; arrows one way:

    controller (omni-operator) ─┐
                                ├─> check ─> pipeline
    local (omni-pipeline)  ─────┘      health ─> pipeline

``pipeline``: the custom resource's model and what is rendered from it; ``health``: what the
stages' metrics say; ``check``: the API server's admission, emulated (the offline check);
``controller`` and ``local`` use all three and never each other (tests/test_layout.py).

Nothing here imports vLLM or omni_runtime: the operator image carries neither.
"""

GROUP = "omnipipeline.dev"
VERSION = "v1alpha1"
PLURAL = "omnipipelines"
KIND = "OmniPipeline"
API_VERSION = f"{GROUP}/{VERSION}"
