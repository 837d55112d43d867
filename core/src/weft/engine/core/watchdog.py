"""What watches the engine-core process's main loop from beside it: the API process's life, and a stuck step.

The core's main thread runs one step at a time (:mod:`weft.engine.core.core_process`); while a step runs it
checks nothing else. :class:`CoreWatchdog` is a thread of the core process that does, five times a second:

- The API process (the core's parent) is gone: the core exits at once, mid-step (a prefill instance whose API
  process was killed must not finish its prefill and push the KV to a decode instance nobody asked). Its
  workers watch the core and follow it.
- A step has run longer than ``engine.step_timeout``: the watchdog logs the phase the main thread is in (its
  innermost Weft frame, and the whole stack), fails every request the core holds with an error naming the
  phase and the limit, and tells the API side the core is stuck (``StepOutputs.stuck``: ``/health`` answers
  503 until a step ends). When the step ends at last, the core drops the requests the watchdog failed.

The watchdog sends on ZMQ sockets of its own (sockets are not thread-safe); the API side's PULL socket takes both.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

from weft.engine.messages import CoreStats, StepOutputs

if TYPE_CHECKING:
    from types import FrameType

    from weft.engine.core.api_clients import ApiClients

logger = logging.getLogger("weft.engine")

HEARTBEAT_SECONDS = 1.0
"""While a step runs longer than this, the watchdog says so to the API side this often (``StepOutputs.heartbeat``)."""
POLL_SECONDS = 0.2
"""How often the watchdog looks: the API process's death is noticed within this (and the exit's time)."""


def stuck_phase(frame: FrameType | None) -> str:
    """Where a thread is, as ``module.function`` of its innermost frame in Weft's code (else its innermost
    frame): what a stuck step was doing (``weft.engine.core.structured_output.grammar_output``)."""
    innermost = None
    while frame is not None:
        module = frame.f_globals.get("__name__", "?")
        if innermost is None:
            innermost = f"{module}.{frame.f_code.co_name}"
        if module.startswith("weft"):
            return f"{module}.{frame.f_code.co_name}"
        frame = frame.f_back
    return innermost or "unknown"


class CoreWatchdog:
    """The watching thread (:meth:`start`); the main loop calls :meth:`step_began` and :meth:`step_ended` around
    each step, and keeps :attr:`last_stats` current."""

    def __init__(self, parent_pid: int, step_timeout: float, held_request_ids: Any, clients: ApiClients) -> None:
        """``held_request_ids()``: the requests the core holds (read while the main thread is stuck); ``clients``:
        the main loop's API processes (the watchdog sends on sockets of its own, :meth:`ApiClients.sibling`)."""
        self.parent_pid = parent_pid
        self.step_timeout = step_timeout
        self._held_request_ids = held_request_ids
        self._clients = clients
        self._sockets: ApiClients | None = None
        self.last_stats = CoreStats()
        """The gauges the main loop last sent: a watchdog's message carries them (counters must not go back)."""
        self._step_began: float | None = None
        self._fired = False
        """Whether the watchdog failed the current step's requests."""
        self._last_beat = 0.0
        """When the watchdog last told the API side that a long step is still running."""
        self._failed: list[str] = []
        """Requests failed while the current step ran (the main loop drops them when it ends)."""
        self._lock = threading.Lock()
        self._main = threading.main_thread().ident
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weft-core-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop watching and close the socket (before the core terminates its ZMQ context, which waits for it)."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self._sockets is not None:
            self._sockets.close(linger=1000)

    def step_began(self) -> None:
        self._step_began = time.monotonic()

    def step_ended(self) -> list[str]:
        """The step is over; returns the requests the watchdog failed while it ran (abort them in the core)."""
        with self._lock:
            self._step_began = None
            self._fired = False
            failed, self._failed = self._failed, []
        return failed

    def _run(self) -> None:
        while not self._stopped.wait(POLL_SECONDS):
            if os.getppid() != self.parent_pid:
                logger.error("the API process (pid %d) is gone; the engine core exits now", self.parent_pid)
                logging.shutdown()
                os._exit(1)
            began = self._step_began
            if began is not None and time.monotonic() - began > self.step_timeout:
                self._fail_stuck_step(time.monotonic() - began)
            elif began is not None and time.monotonic() - max(began, self._last_beat) >= HEARTBEAT_SECONDS:
                # A long step (a prefill of thousands of tokens on a CPU) is progress: the API side's /health must
                # not take its silence for a stalled core. A stopped process sends nothing, its watchdog included.
                self._last_beat = time.monotonic()
                with self._lock:
                    if not self._fired:
                        self._send(StepOutputs([], self.last_stats, heartbeat=True))

    def _fail_stuck_step(self, seconds: float) -> None:
        with self._lock:
            if self._step_began is None or self._fired:
                return  # ended meanwhile, or already failed
            frame = sys._current_frames().get(self._main)
            phase = stuck_phase(frame)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
            for _ in range(3):  # the main thread may move on while the ids are copied
                try:
                    held = list(self._held_request_ids())
                    break
                except RuntimeError:
                    continue
            else:
                held = []
            reason = (
                f"the engine step ran {seconds:.0f} s, past engine.step_timeout ({self.step_timeout:g} s), stuck in "
                f"{phase}; its requests were failed (raise engine.step_timeout if steps this long are expected)"
            )
            logger.error("%s; %d requests failed. The engine core's main thread:\n%s", reason, len(held), stack)
            self._fired, self._failed = True, held
            self._send(StepOutputs([], self.last_stats, {}, dict.fromkeys(held, reason), stuck=phase))

    def _send(self, message: StepOutputs) -> None:
        if self._sockets is None:
            self._sockets = self._clients.sibling()
        self._sockets.send(message)
