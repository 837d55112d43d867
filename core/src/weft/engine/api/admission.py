"""Which requests :class:`~weft.engine.api.async_engine.AsyncEngine` admits, through a drain and its end.

Every request is admitted until a drain begins; then only those that arrived before it began (their API request
was already being read), until the drain is over. Once it is over, the engine stopped or its core died, none is.
"""

from __future__ import annotations

import time


class Admission:
    """The engine's admission state (module docstring)."""

    def __init__(self) -> None:
        self.open = True
        """False once a drain is over, or the engine stops or its core died: nothing is admitted."""
        self.drain_began: float | None = None
        """``time.monotonic()`` when a drain began: requests that arrive later are refused."""
        self.drain_deadline: float | None = None
        """``time.monotonic()`` when the drain in progress gives up on the requests still running."""

    def refusal(self, arrival: float, dead: bool) -> str | None:
        """Why a request that arrived at ``arrival`` (``time.monotonic()``) may not be submitted now, or None
        (``dead``: the core died)."""
        if dead:
            return "the engine core process died"
        if not self.open or (self.drain_began is not None and arrival >= self.drain_began):
            return "the server is shutting down"
        return None

    def begin_drain(self, timeout: float) -> None:
        """Refuse requests that arrive from now on (a drain begun already keeps its start); give up ``timeout``
        seconds from now."""
        if self.drain_began is None:
            self.drain_began = time.monotonic()
        self.drain_deadline = time.monotonic() + timeout

    def draining(self) -> bool:
        """Whether the drain in progress still waits for the requests running."""
        return self.drain_deadline is not None and time.monotonic() < self.drain_deadline

    def hurry(self) -> None:
        """End a drain in progress now."""
        self.drain_deadline = time.monotonic()

    def close(self) -> None:
        """Admit nothing from now on."""
        self.open = False
