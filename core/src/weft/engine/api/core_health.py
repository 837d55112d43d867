"""What ``/health`` says of the engine core, as the API process sees it (:class:`CoreHealth`).

The core sends a message every step while it has work, and its watchdog (:mod:`weft.engine.core.watchdog`) names
the phase a step past ``engine.step_timeout`` is stuck in. Silence while requests are in flight (a stopped or hung
process) or a stuck step makes the core unhealthy.
"""

from __future__ import annotations

import time


class CoreHealth:
    """When the core was last heard from, and the phase its watchdog found a step stuck in."""

    def __init__(self, stall_timeout: float) -> None:
        self.stall_timeout = stall_timeout
        """``server.health_stall_timeout``."""
        self.stuck: str | None = None
        """The phase the core's watchdog found a step stuck in (None once a step ended)."""
        self.last_heard = time.monotonic()
        """When the core last sent anything, or (if later) when requests came in after none was in flight."""

    def submitted(self, now: float, idle: bool) -> None:
        """Requests came in at ``now``; ``idle``: none was in flight, so the core's silence starts counting now."""
        if idle:
            self.last_heard = now

    def heard(self) -> None:
        self.last_heard = time.monotonic()

    def problem(self, dead: bool, in_flight: int) -> str | None:
        """Why ``/health`` answers 503 for the core (None: it is well): it died, a step is stuck past
        ``engine.step_timeout``, or it sent nothing for ``server.health_stall_timeout`` while ``in_flight``
        requests wait on it."""
        if dead:
            return "engine core is gone"
        if self.stuck is not None:
            return f"engine core is stuck in {self.stuck} (past engine.step_timeout)"
        silent = time.monotonic() - self.last_heard
        if in_flight and silent > self.stall_timeout:
            return (
                f"engine core sent nothing for {silent:.0f} s while {in_flight} requests are in flight "
                f"(server.health_stall_timeout: {self.stall_timeout:g} s)"
            )
        return None
