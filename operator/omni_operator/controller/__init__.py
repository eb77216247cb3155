"""The controller (`omni-operator`, run by kopf): reconciles each OmniPipeline into its
children, steps its rollouts, keeps its status and events, and reads its stages' transfer
health on the resync timer."""
