"""omni_contract: the stage contract that the operator and the stage runtime both enforce.

``omni-stage`` (omni_runtime) refuses a stage config that breaks the contract, and the
operator and ``omni-pipeline validate`` (omni_operator) refuse an OmniPipeline that would
render one, with this same code, so a pipeline that passes ``validate`` is one whose stages
start. The operator imports neither vLLM nor omni_runtime, and omni_runtime never imports
the operator: both import this package, which imports only the standard library.

* :mod:`omni_contract.engine_args`: the ``engineArgs`` a stage passes to vLLM as flags, the
  flags the stage owns, and the one spelling rule (``max-model-len``, ``max_model_len`` and
  ``maxModelLen`` are one flag);
* :mod:`omni_contract.vllm_args`: what vLLM's server takes (its flags, their values, the rules
  between them), read from ``vllm_args.json``, a table generated from the pinned vLLM's own
  parser (``tools/generate_vllm_args.py``), and the version it describes;
* :mod:`omni_contract.kv_transfer`: which user ``kv-transfer-config`` the stage can compose
  with the omni KV connector through vLLM's ``MultiConnector``, and the composition itself;
* :mod:`omni_contract.kv_wire`: the KV wire's version (which the operator puts in a
  pipeline's revision hash) and a receiver's refusal codes (its metrics' ``reason`` label);
* :mod:`omni_contract.cpu_list`: a Linux CPU list (a stage's ``kvTransfer.ioCpus``), its
  ranges' order and its ids' bound;
* :mod:`omni_contract.metrics`: the metric contract's families (names, types, labels, help),
  which the runtime registers and the operator and the monitoring mixin read;
* :mod:`omni_contract.edges`: an edge of the stage graph, fed whole or streamed: its form in
  ``inputs``, a stream's cadence, deadlines and credits, their defaults and bounds;
* :mod:`omni_contract.ports`: a stage's ``http`` and ``kv`` ports and the pipeline endpoint's.
"""
