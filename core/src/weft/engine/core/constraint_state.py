"""A request's output constraint as the scheduler tracks it (:class:`ConstraintState`), and a matcher that lives in
a fill process (:class:`RemoteMatcher`). The :class:`~weft.engine.core.structured_output.StructuredOutputManager`
makes and drives them; a :class:`~weft.engine.core.request.Request` carries its state."""

from __future__ import annotations

import time
import weakref
from concurrent.futures import Future
from typing import TYPE_CHECKING

from weft.contracts.structured_output import GrammarMatcher, StructuredOutputsParams
from weft.engine.messages import GrammarStart

if TYPE_CHECKING:
    from weft.engine.core.grammar_compile import CompileJob
    from weft.engine.core.grammar_group import FillGroup


class ConstraintState:
    """One request's constraint: its compilation, then its matcher."""

    __slots__ = (
        "constraint",
        "compiled",
        "job",
        "since",
        "matcher",
        "starts_after",
        "opener",
        "active",
        "start",
        "failed",
        "terminated",
        "exceeded",
        "__weakref__",
    )

    def __init__(
        self,
        constraint: StructuredOutputsParams,
        compiled: Future,
        start: GrammarStart | None,
        job: CompileJob | None = None,
    ) -> None:
        self.constraint = constraint
        self.compiled = compiled
        self.job = job
        """The compile it waits for (None once compiled, or once the request ended)."""
        self.since = time.monotonic()
        """When it began waiting for its compile (``engine.structured_output_compile_timeout`` counts from here)."""
        self.matcher: GrammarMatcher | None = None
        self.starts_after = start.after if start is not None else ()
        self.opener = start.opener if start is not None else None
        """The token that may open the reasoning, allowed beside the grammar's tokens for the first output token
        (None once that token is sampled, or when the reasoning is open from the start)."""
        self.active = start is None or self.opener is not None
        """Whether output tokens are constrained now (after the reasoning, when there is one)."""
        self.start = 0 if self.active else None
        """The first output token its matcher takes (None: not active yet): a matcher made again after its fill
        process died catches up on the request's output from there."""
        self.failed = False
        """A sampled token the matcher refused (it then constrains nothing more)."""
        self.terminated = False
        """The matcher reached the end of its grammar (the scheduler reads it while the fill thread runs)."""
        self.exceeded: str | None = None
        """Why the request fails: its mask took longer than ``engine.structured_output_fill_budget`` in a step (set
        by the fill; the scheduler ends the request)."""

    @property
    def live(self) -> bool:
        """Whether the request's next sample may need a mask (its constraint neither failed nor ended)."""
        return not self.failed and not self.terminated and self.exceeded is None

    def compiled_now(self) -> None:
        """Its compile is done: it no longer waits for it."""
        job, self.job = self.job, None
        if job is not None:
            job.leave()

    def release(self) -> None:
        """The request ended: a compile no other request waits for is dropped if it has not started, a matcher in
        the fill process is dropped with the next step."""
        self.compiled_now()
        if isinstance(self.matcher, RemoteMatcher):
            self.matcher.release()

    def verifiable(self, output_token_ids: list[int], proposals: list[int], most: int) -> list[int]:
        """The speculative proposals (to follow ``output_token_ids``) the request may verify in one step: ``most`` at
        most (what its matcher can roll back), or, while it reasons, those before the end of the reasoning
        (:meth:`before_answer`); all of them once its constraint ended or failed."""
        if not self.live:
            return proposals
        if not self.active:
            return self.before_answer(output_token_ids, proposals)
        return proposals[:most]

    def before_answer(self, output_token_ids: list[int], proposals: list[int]) -> list[int]:
        """While the model reasons (not :attr:`active` yet): ``proposals`` (to follow ``output_token_ids``) cut before
        the one that would end the reasoning, whose next position would need the constraint's first mask (the step's
        own token may still end it: the next step is constrained)."""
        end = self.starts_after
        if not end:
            return proposals
        tokens = [*output_token_ids[-len(end) :], *proposals]
        before = len(tokens) - len(proposals)
        for index in range(len(proposals)):
            stop = before + index + 1  # the window of tokens ending with proposal ``index``
            if stop >= len(end) and tuple(tokens[stop - len(end) : stop]) == end:
                return proposals[:index]
        return proposals

    @property
    def masks(self) -> bool:
        """Whether the request's next sample is masked: its matcher exists, it is past any reasoning, not done."""
        return self.active and self.matcher is not None and self.live


class RemoteMatcher:
    """A matcher living in the fill process, by its handle; its request gone, the process drops it."""

    __slots__ = ("handle", "release", "__weakref__")

    def __init__(self, process: FillGroup) -> None:
        self.handle = process.new_handle()
        self.release = weakref.finalize(self, process.drop, self.handle)
        """Drop it now (once; its tokens still queued are then skipped)."""
