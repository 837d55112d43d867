"""The CPU time one request's grammar mask may take in one step (``engine.structured_output_fill_budget``).

An ambiguous grammar's matcher takes longer to fill its mask with every token it accepted (xgrammar's Earley parser
over ``y ::= y y | y "a" | "a" y | "a"``, SmolLM2's vocabulary: 0.6 ms at the 25th token, 33 ms at the 100th, 1.9 s
at the 300th), and every step waits for every mask: one such request slowed every other request's tokens with it,
more with each token. :class:`FillBudget` finds the rows whose mask costs more than the budget, so their requests
fail (a 400 naming the setting) before the step time grows past it.

A step's rows are filled in one backend call (a backend may spread them over threads), timed in the filling
thread's CPU time and in wall time. Only when either is over its trigger (at first the budget) are the rows filled
again one by one (filling does not change a matcher), each timed in CPU time, so a loaded machine never counts
against a request. A check that finds no row over the budget (many rows, or a loaded machine) raises the trigger
that fired to twice what the call took, so it is not repeated on every step; one that finds a row sets both back to
the budget, and both go back to the budget after :data:`RAISED_FOR` fills (a large batch of cheap masks raised
them; it may be gone, and one costly mask alone must not go unchecked for the process's life). CPU time is the
trigger that matters on a loaded machine (wall time there runs several times
longer): it catches a row filled on this thread as soon as it is over; wall time catches rows filled on a
backend's own threads.

The engine core's fill thread uses it (:class:`~weft.engine.core.structured_output.ThreadFill`), and so does each fill
process (``engine.structured_output_fill = "process"``, :mod:`weft.engine.core.grammar_process`) over the rows it
fills, in its own CPU time: it names the matchers over the budget back to the core, whose requests fail alike.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from weft.contracts.structured_output import GrammarMatcher, StructuredOutputBackend


RAISED_FOR = 64
"""Fills after which a raised trigger goes back to the budget."""


class FillBudget:
    """Fills a step's bitmask rows (:meth:`fill`) and names those over ``seconds`` of CPU time (0: no budget)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._cpu_trigger = seconds
        self._wall_trigger = seconds
        """A step's fill taking longer than these (CPU time of this thread, wall time) is checked row by row."""
        self._raised_fills = 0
        """Fills since a trigger was raised above the budget (0: neither is)."""

    def fill(
        self, backend: StructuredOutputBackend, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor
    ) -> list[int]:
        """Fill row ``i`` of ``bitmask`` for ``matchers[i]``; the rows whose own fill took more than the budget."""
        if self._raised_fills:
            self._raised_fills += 1
            if self._raised_fills > RAISED_FOR:
                self._cpu_trigger = self._wall_trigger = self.seconds
                self._raised_fills = 0
        began, began_cpu = time.perf_counter(), time.thread_time()
        backend.fill_bitmasks(matchers, bitmask)
        wall, cpu = time.perf_counter() - began, time.thread_time() - began_cpu
        if not self.seconds or (cpu <= self._cpu_trigger and wall <= self._wall_trigger):
            return []
        over = []
        for row, matcher in enumerate(matchers):
            began_cpu = time.thread_time()
            matcher.fill_bitmask(bitmask, row)
            if time.thread_time() - began_cpu > self.seconds:
                over.append(row)
        if over:
            self._cpu_trigger = self._wall_trigger = self.seconds
            self._raised_fills = 0
        elif cpu > self._cpu_trigger:
            self._cpu_trigger = 2 * cpu
            self._raised_fills = 1
        else:
            self._wall_trigger = 2 * wall
            self._raised_fills = 1
        return over

    def message(self) -> str:
        """The error of a request whose mask took longer than the budget."""
        return (
            f"structured_outputs: filling this constraint's token mask took over engine.structured_output_fill_budget"
            f" = {self.seconds:g} s of CPU time in one step (an ambiguous grammar's cost grows with every token); "
            "send a less ambiguous grammar, or raise the budget"
        )
