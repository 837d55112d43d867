"""``WEFT_TRACE_PLUGINS=1``: log every plugin load and every hook call to stderr."""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("weft.plugins")


def tracing_enabled() -> bool:
    return os.environ.get("WEFT_TRACE_PLUGINS", "").strip().lower() in ("1", "true", "yes", "on")


def trace(message: str, *args: object) -> None:
    """Log a plugin event at INFO when tracing, DEBUG otherwise."""
    if tracing_enabled():
        _ensure_stderr_handler()
        logger.info(message, *args)
    else:
        logger.debug(message, *args)


def _ensure_stderr_handler() -> None:
    if any(getattr(handler, "_weft_trace", False) for handler in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[weft.plugins] %(message)s"))
    handler._weft_trace = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
