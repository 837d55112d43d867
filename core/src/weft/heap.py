"""The garbage collector around a running engine: start-up's objects frozen out of its view.

A full collection walks every tracked object of the process. After an engine's start-up that is
every imported module's objects and the model's Python objects (about 0.4 million on the CPU,
more with Triton and CUDA), and a collection of them stalled a running engine for about 0.2 s at a
time (two such gaps in an 8B run of 12.5 s on the H200). :func:`freeze_startup_objects` moves
what is alive after start-up to the collector's permanent generation (``gc.freeze``), which it
never walks; :func:`thaw` gives it back when an engine closes, so a closed engine's reference
cycles are collected, and the interpreter's exit does the same for an engine never closed.
"""

from __future__ import annotations

import atexit
import gc

_thaw_at_exit = False


def freeze_startup_objects() -> None:
    """Collect once, then freeze what is alive: called when an engine (or a worker process) is built."""
    global _thaw_at_exit
    gc.collect()
    gc.freeze()
    if not _thaw_at_exit:
        atexit.register(thaw)  # what is still frozen at exit is finalized like everything else
        _thaw_at_exit = True


def thaw() -> None:
    """Make the frozen objects collectable again (every engine's: freezing is process-wide)."""
    gc.unfreeze()
