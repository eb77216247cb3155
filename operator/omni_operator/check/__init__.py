"""The offline check (`omni-pipeline validate`, and the controller's admission of each
pipeline before it writes): what the API server would say of the OmniPipeline and of every
object rendered from it (its OpenAPI schema, CEL rules, object metadata and pod rules),
emulated here so that a refused child is refused before anything is created."""
