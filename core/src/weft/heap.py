"""The garbage collector in a process that runs one engine: start-up's objects frozen out of its view.

A full collection walks every tracked object of the process. After an engine's start-up that is
every imported module's objects and the model's Python objects (about 0.4 million with Triton
and CUDA), and one such collection stalled a running 8B engine for 0.3 s on the H200.
:func:`freeze_startup_objects` moves what is alive after start-up into the collector's permanent
generation (``gc.freeze``), which it never walks. It is called where a process exists for one
engine until it exits, as vLLM's engine core does: the engine-core process of ``weft serve`` and
each ``mp`` worker process. Not for an in-process ``LLM``: there the caller's objects would be
frozen too, and an engine dropped without ``close`` would keep its KV cache in cycles the
collector no longer sees until the process ends.
"""

from __future__ import annotations

import atexit
import gc

_thaw_at_exit = False


def freeze_startup_objects() -> None:
    """Collect once, then freeze what is alive (and make it collectable again at exit)."""
    global _thaw_at_exit
    gc.collect()
    gc.freeze()
    if not _thaw_at_exit:
        atexit.register(gc.unfreeze)  # what is still frozen at exit is finalized like everything else
        _thaw_at_exit = True
