"""The engine core's side of a step whose grammar masks the fill processes fill
(``engine.structured_output_fill = "process"``, :mod:`weft.engine.core.grammar_group`): the step's message sent
(:func:`send_remote`), and the answer read when the engine core takes the result (:class:`RemoteReply`) and
applied to the constraints; plus what both fill modes do to a constraint's rows and refused tokens."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future

import numpy

from weft.contracts.executor import GrammarOutput
from weft.engine.core.constraint_state import ConstraintState
from weft.engine.core.grammar_group import FillFailed, FillGroup, StepReply

logger = logging.getLogger("weft.engine")


def send_remote(
    starting: Future[FillGroup],
    accepted: list[tuple[str, ConstraintState, int]],
    candidates: list[tuple[str, ConstraintState]],
    made: list[tuple[int, int, bytes]],
    proposals: dict[str, list[int]],
    failed: Callable[[], None],
    over_budget: str,
) -> Future[GrammarOutput]:
    """:meth:`~weft.engine.core.structured_output.ThreadFill.accept_and_fill` by the fill processes
    (``starting``): the message sent now, the reply read when the result is taken (:class:`RemoteReply`,
    :func:`_finish_remote`); ``failed()`` when either fails."""
    reply = RemoteReply()
    try:
        process = starting.result()
        live = [
            (request_id, state, token_id)
            for request_id, state, token_id in accepted
            if not (state.failed or state.terminated)
        ]
        masked = [(request_id, state) for request_id, state in candidates if state.masks]
        process.send_step(
            made,
            [(state.matcher.handle, token_id) for _, state, token_id in live],  # type: ignore[union-attr]
            [state.matcher.handle for _, state in masked],  # type: ignore[union-attr]
            [proposals.get(request_id, []) for request_id, _ in masked],
        )
    except BaseException as error:
        failed()
        reply.set_exception(error)
        return reply
    openers = {state.matcher.handle: state.opener for _, state in masked if state.opener is not None}  # type: ignore[union-attr]
    widths = {state.matcher.handle: len(proposals.get(request_id, ())) for request_id, state in masked}  # type: ignore[union-attr]
    reply.receive = lambda: _finish_remote(process, live, masked, openers, widths, failed, over_budget)
    return reply


class RemoteReply(Future):
    """The fill process's answer to one step's message, read on the thread that asks for the result (the engine
    core's) when it asks, so no other thread needs the GIL on the way. Until then it is not ``done()`` and runs
    no callbacks: take :meth:`result` or :meth:`exception` (blocking, ``timeout`` ignored), never
    ``concurrent.futures.wait`` on it."""

    def __init__(self) -> None:
        super().__init__()
        self.receive: Callable[[], GrammarOutput] | None = None

    def result(self, timeout: float | None = None) -> GrammarOutput:
        self._collect()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._collect()
        return super().exception(timeout)

    def _collect(self) -> None:
        receive, self.receive = self.receive, None
        if receive is None:
            return
        try:
            self.set_result(receive())
        except BaseException as error:
            self.set_exception(error)


def _finish_remote(
    process: FillGroup,
    live: list[tuple[str, ConstraintState, int]],
    masked: list[tuple[str, ConstraintState]],
    openers: dict[int, int],
    widths: dict[int, int],
    failed: Callable[[], None],
    over_budget: Callable[[], str],
) -> GrammarOutput:
    """The fill process's answer to :func:`send_remote`'s message, applied to the
    constraints (what the children that did not fail report is applied before a failure raises); ``widths``: the
    proposals each masked handle verifies (a row per position); ``failed`` is called when the answer could not be
    read; ``over_budget``: the error of a constraint whose fill took longer than the fill budget (the scheduler ends
    its request, :attr:`ConstraintState.exceeded`)."""
    by_handle = {state.matcher.handle: (request_id, state) for request_id, state, _ in live}  # type: ignore[union-attr]
    by_handle.update((state.matcher.handle, (request_id, state)) for request_id, state in masked)  # type: ignore[union-attr]

    def apply(reply: StepReply) -> None:
        for handle in reply.ended:
            by_handle[handle][1].terminated = True
        for handle, token_id in reply.refused:
            request_id, state = by_handle[handle]
            refused(request_id, state, token_id)
        for handle in reply.over:
            by_handle[handle][1].exceeded = over_budget()

    try:
        reply = process.receive_step()
    except FillFailed as failure:
        failed()
        apply(failure.reply)
        raise
    except BaseException:
        failed()
        raise
    apply(reply)
    filled = [by_handle[handle][0] for handle in reply.filled]
    count = sum(1 + widths[handle] for handle in reply.filled)
    rows = process.rows(count) if filled else b""
    if openers and filled:
        words = numpy.frombuffer(bytearray(rows), dtype=numpy.uint32).reshape(count, -1)
        allow(words, [token for handle in reply.filled for token in [openers.get(handle), *[None] * widths[handle]]])
        rows = words.tobytes()
    return GrammarOutput(filled, rows)


def allow(words: numpy.ndarray, tokens: list[int | None]) -> None:
    """Set, in each bitmask row of ``words`` (uint32), the bit allowing its token (None: none); a first output token
    may open the reasoning beside what the grammar allows (:attr:`ConstraintState.opener`)."""
    for row, token in enumerate(tokens):
        if token is not None:
            words[row, token // 32] |= numpy.uint32(1 << (token % 32))


def refused(request_id: str, state: ConstraintState, token_id: int) -> None:
    # Only a token sampled without its mask gets here (a step that raced its reasoning's end).
    logger.warning(
        "request %s: token %d breaks its %s constraint; the rest of its output is unconstrained",
        request_id,
        token_id,
        state.constraint.kind,
    )
    state.failed = True
