"""omni_runtime's log lines where vLLM's go: vLLM configures only its own logger (``vllm``),
so inside a plain ``vllm serve`` (the connector, the scheduler, the stage input) ours had no
handler: INFO lines were lost and warnings came out bare, through Python's last resort."""

from __future__ import annotations

import logging

PACKAGE = "omni_runtime"


def log_like_vllm() -> None:
    """Give the ``omni_runtime`` logger vLLM's handlers (its format: the process, the level,
    the time, the file) and level, once, unless this process configured logging itself
    (``omni-stage``, a test: a handler on the root or on ours)."""
    package = logging.getLogger(PACKAGE)
    if package.handlers or logging.getLogger().handlers:
        return
    vllm = logging.getLogger("vllm")
    handlers = list(vllm.handlers)
    level = vllm.getEffectiveLevel()  # VLLM_LOGGING_LEVEL
    if not handlers:  # vLLM's logging configuration is off (VLLM_CONFIGURE_LOGGING=0)
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handlers, level = [handler], logging.INFO
    for handler in handlers:
        package.addHandler(handler)
    package.setLevel(level)
    package.propagate = False
