"""Several fill processes seen by the engine core as one (:class:`FillGroup`), and what a step's answer holds.

:mod:`weft.engine.core.grammar_process` has the fill process itself
(:class:`~weft.engine.core.grammar_process.FillProcess`, the core's end of one child, and the child's loop) and the
protocol they share; this module splits a step's work across children (``engine.structured_output_fill_processes``).
"""

from __future__ import annotations

import itertools
from multiprocessing import shared_memory
from typing import TYPE_CHECKING, Any

import numpy

from weft.engine.core.grammar_process import ENDED, FillProcess, StepSegment

if TYPE_CHECKING:
    from weft.contracts.structured_output import StructuredOutputBackend, Vocabulary


class FillFailed(RuntimeError):
    """A fill child failed a step (its error as the message); ``reply`` has what the others reported."""

    def __init__(self, message: str, reply: StepReply) -> None:
        super().__init__(message)
        self.reply = reply


class StepReply:
    """What the children did with one step."""

    __slots__ = ("filled", "ended", "refused", "over")

    def __init__(self, filled: list[int], ended: list[int], refused: list[tuple[int, int]], over: list[int]) -> None:
        self.filled = filled
        """Handles whose bitmask rows were filled, in the order of the rows (one per position each verifies)."""
        self.ended = ended
        """Handles whose matcher terminated on a token of this step."""
        self.refused = refused
        """``(handle, token)`` of tokens a matcher refused (it takes no more tokens, as a failed constraint)."""
        self.over = over
        """Handles whose fill took longer than the fill budget (their rows were filled; their child dropped them)."""


class FillGroup:
    """Several :class:`FillProcess` children sharing the matchers, seen by the core as one (the same methods): each
    matcher lives in one child (a new one in the child holding the fewest), a step's data goes once into the shared
    segment with the rows to fill ordered child after child, and the filled rows come back in child order. Used
    from one thread at a time (the engine core's), except :meth:`new_handle`, :meth:`drop` and :meth:`close`."""

    def __init__(
        self,
        backend_class: type[StructuredOutputBackend],
        options: Any,
        vocabulary: Vocabulary,
        words: int,
        processes: int = 1,
        spin: float | None = None,
        budget: float = 0.0,
    ) -> None:
        """``budget``: the CPU seconds one matcher's fill may take in a step (``engine.structured_output_fill_budget``;
        0: none); those over it are reported (:attr:`StepReply.over`)."""
        if processes < 1:
            raise ValueError(f"a fill group needs at least one process, not {processes}")
        self.children: list[FillProcess] = []
        self.words = words
        self._handles = itertools.count()
        self._owner: dict[int, int] = {}
        """Each live matcher's child."""
        self._load = [0] * processes
        """Live matchers per child."""
        self._segment: StepSegment | None = None
        """The children's shared step data, one segment it owns and unlinks: child ``i`` fills from
        ``self._offsets[i]``."""
        self._offsets: list[int] = [0] * processes
        """Each child's first row of the last step."""
        self._asked: list[int] = [0] * processes
        """Handles the last step asked each child to fill."""
        self._asked_rows: list[int] = [0] * processes
        """Rows those handles fill (one per position each verifies)."""
        self._filled: list[int] = []
        """Rows the last step filled, per child (:meth:`rows` reads them in child order)."""
        self._order: list[int] = []
        """The last step's handles to fill, child after child."""
        self._widths: dict[int, int] = {}
        """The proposals each handle of the last step verifies (absent: none)."""
        self._tokens = 0
        """Tokens the last step sent."""
        try:
            for index in range(processes):  # all start, then each is waited for
                self.children.append(
                    FillProcess(
                        backend_class,
                        options,
                        vocabulary,
                        words,
                        spin,
                        name=f"weft-grammar-fill-{index}",
                        wait=False,
                        budget=budget,
                    )
                )
            for child in self.children:
                child.wait_started()
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int | None]:
        return [child.pid for child in self.children]

    @property
    def alive(self) -> bool:
        """Whether every child runs (one that exited took its matchers with it)."""
        return all(child.alive for child in self.children)

    @property
    def exit_codes(self) -> list[int | None]:
        return [child.exitcode for child in self.children]

    def new_handle(self) -> int:
        handle = next(self._handles)
        child = min(range(len(self._load)), key=self._load.__getitem__)
        self._owner[handle] = child
        self._load[child] += 1
        return handle

    def drop(self, handle: int) -> None:
        child = self._owner.pop(handle, None)
        if child is not None:
            self._load[child] -= 1
            self.children[child].drop(handle)

    def forget(self, key: int) -> None:
        for child in self.children:
            child.forget(key)

    def step(
        self,
        matchers: list[tuple[int, int, bytes]],
        accepted: list[tuple[int, int]],
        fill: list[int],
        proposals: list[list[int]] | None = None,
    ) -> StepReply:
        self.send_step(matchers, accepted, fill, proposals)
        return self.receive_step()

    def send_step(
        self,
        matchers: list[tuple[int, int, bytes]],
        accepted: list[tuple[int, int]],
        fill: list[int],
        proposals: list[list[int]] | None = None,
    ) -> None:
        """One step to every child: ``matchers`` made since the last step, each to its child; ``accepted``: ``(handle,
        token)`` in generation order, for the matchers to take; ``fill``: handles whose rows to fill if their matcher
        is still live after accepting, ``proposals[i]`` the speculative proposals ``fill[i]`` verifies (a row per
        position, :func:`~weft.engine.core.grammar_proposals.fill_positions`; None: none). A dropped matcher's tokens
        and rows are left out (its child no longer holds it)."""
        owner = self._owner
        count = len(self.children)
        made: list[list[tuple[int, int, bytes]]] = [[] for _ in range(count)]
        for item in matchers:
            if (child := owner.get(item[0])) is not None:
                made[child].append(item)
        proposed = dict(zip(fill, proposals, strict=True)) if proposals is not None else {}
        if count == 1:
            parts = [[handle for handle in fill if handle in owner]]
        else:
            parts = [[] for _ in range(count)]
            for handle in fill:
                if (child := owner.get(handle)) is not None:
                    parts[child].append(handle)
        order = [handle for part in parts for handle in part]
        asked = [len(part) for part in parts]
        widths = [len(proposed.get(handle, ())) for handle in order]
        asked_rows = [len(part) + sum(len(proposed.get(handle, ())) for handle in part) for part in parts]
        rows = sum(asked_rows)
        for child in self.children:  # every earlier answer read before any child gets this step
            child.drain()
        segment = self._segment
        if segment is None or rows > segment.capacity[0] or len(accepted) > segment.capacity[1]:
            segment = self._grow(rows, len(accepted))
        tokens = len(accepted)
        if tokens:
            segment.accepted[:tokens] = accepted
            segment.reports[:tokens] = 0
        if order:
            segment.fill[: len(order)] = order
            segment.widths[: len(order)] = widths
            flat = [token for handle in order for token in proposed.get(handle, ())]
            segment.proposals[: len(flat)] = flat
        self._order, self._tokens, self._asked, self._asked_rows = order, tokens, asked, asked_rows
        self._widths = {handle: width for handle, width in zip(order, widths, strict=True) if width}
        start = row = proposal = 0
        for index, (child, handles, child_rows) in enumerate(zip(self.children, asked, asked_rows, strict=True)):
            self._offsets[index] = row
            child.send_step(made[index], tokens, start, handles, row, child_rows, proposal)
            proposal += sum(widths[start : start + handles])
            start += handles
            row += child_rows

    def _grow(self, rows: int, tokens: int) -> StepSegment:
        """A segment of at least ``rows`` rows and ``tokens`` tokens shared by every child (the old one freed once
        all moved)."""
        old = self._segment.capacity if self._segment is not None else (0, 0)
        rows, tokens = max(rows, 2 * old[0], 64), max(tokens, 2 * old[1], 256)
        memory = shared_memory.SharedMemory(create=True, size=StepSegment.size(rows, tokens, self.words))
        segment = StepSegment(memory, rows, tokens, self.words)
        try:
            for child in self.children:
                child.share(segment)
        except BaseException:
            segment.release()
            memory.close()
            memory.unlink()
            self._free_segment()  # some children may have moved to the segment just freed: the next step shares anew
            raise
        self._free_segment()
        self._segment = segment
        return segment

    def _free_segment(self) -> None:
        if self._segment is not None:
            segment, self._segment = self._segment, None
            segment.release()
            segment.memory.close()
            segment.memory.unlink()

    def receive_step(self) -> StepReply:
        """Every child's answer to the last :meth:`send_step`, in child order. A child that failed raises
        :class:`FillFailed` once the others were read (none is left for the next step), with the ended and
        refused matchers, and those over the fill budget, reported."""
        counts: list[int] = []
        overs: list[int] = []
        error: BaseException | None = None
        self._filled = [0] * len(self.children)
        for child in self.children:
            try:
                counts.append(child.receive_step())  # a KeyboardInterrupt leaves the rest to be read with the next step
                overs.append(child.over)
            except Exception as failure:
                error = error or failure
                counts.append(0)
                overs.append(0)
        ended, refused = self._reports()
        over = self._over(overs)
        if error is not None:
            raise FillFailed(str(error), StepReply([], ended, refused, over)) from error
        if counts == self._asked:
            self._filled = list(self._asked_rows)
            return StepReply(self._order, ended, refused, over)
        assert self._segment is not None
        filled = self._segment.filled
        handles: list[int] = []
        start = 0
        for index, (asked, count) in enumerate(zip(self._asked, counts, strict=True)):
            mine = filled[start : start + count].tolist()
            self._filled[index] = count + sum(self._widths.get(handle, 0) for handle in mine)
            handles += mine
            start += asked
        return StepReply(handles, ended, refused, over)

    def _over(self, counts: list[int]) -> list[int]:
        """The last step's handles over the fill budget, child after child (``counts``: how many each child named)."""
        if not any(counts):
            return []
        assert self._segment is not None
        handles: list[int] = []
        start = 0
        for asked, count in zip(self._asked, counts, strict=True):
            handles += self._segment.over[start : start + count].tolist()
            start += asked
        return handles

    def _reports(self) -> tuple[list[int], list[tuple[int, int]]]:
        """The last step's ended matchers and refused tokens, in the order of its tokens."""
        if not self._tokens:
            return [], []
        assert self._segment is not None
        reports = self._segment.reports[: self._tokens]
        marked = numpy.flatnonzero(reports)
        if not len(marked):
            return [], []
        ended: list[int] = []
        refused: list[tuple[int, int]] = []
        for index in marked.tolist():
            handle, token = self._segment.accepted[index].tolist()
            if reports[index] == ENDED:
                ended.append(handle)
            else:
                refused.append((handle, token))
        return ended, refused

    def rows(self, count: int) -> bytes:
        """The first ``count`` rows the last step filled, child after child (:meth:`receive_step`'s order, a row per
        position of each handle): one copy where every child filled the rows it was asked for, as they lie together in
        the shared segment."""
        assert self._segment is not None
        rows = self._segment.rows
        if self._filled == self._asked_rows:
            return rows[:count].tobytes()
        parts = []
        for offset, filled in zip(self._offsets, self._filled, strict=True):
            if count <= 0:
                break
            take = min(count, filled)
            if take:
                parts.append(rows[offset : offset + take].tobytes())
            count -= take
        return b"".join(parts)

    def held(self) -> tuple[int, int]:
        """Matchers and compiled constraints the children hold, summed (a constraint counts once per child
        holding it)."""
        answers = [child.held() for child in self.children]
        return sum(matchers for matchers, _ in answers), sum(compiled for _, compiled in answers)

    def close(self) -> None:
        for child in self.children:
            child.close()
        self._free_segment()
