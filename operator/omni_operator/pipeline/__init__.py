"""The OmniPipeline as the operator reads it and what it renders from it: the typed model
(with the CRD's defaults), the children's names and kinds, the stage configs, the rendered
objects and the merge patch that makes a live child as rendered. No I/O beyond reading the
packaged CRD; every program of the operator builds on it."""
