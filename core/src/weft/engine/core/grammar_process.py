"""The structured-output fill in a process of its own (``engine.structured_output_fill = "process"``).

A backend whose fill holds the GIL (xgrammar 0.2.9's batch fill does) takes the engine core's time
while it fills, whichever thread it runs on. In a spawned child the matchers accept tokens and fill
bitmask rows beside the core. The core keeps compiling constraints (in its own thread pool, where
invalid ones fail as before) and sends each compiled constraint to the child once, serialized
(:meth:`~weft.contracts.structured_output.StructuredOutputBackend.serialize_compiled`).

A step is sent by the core's thread as soon as the step's tokens were accepted, and its answer read when the
core needs the mask (no thread hands it on: a thread waiting for the GIL while the core launches the
forward would hold the message back). The step's data lies in one shared segment (:class:`StepSegment`): the
tokens to accept in order, the matchers whose rows to fill with the speculative proposals each verifies (a row per
position, :mod:`weft.engine.core.grammar_proposals`), and the rows themselves, which the core grows (a new
segment) when a step needs more room. Each child has a small shared box of its own (where its part of the step
is, what it filled, whether it failed) and two semaphores: the core posts ``go`` once the step is written, the
child posts ``done`` once it has answered in the box and the segment. A step's hot path therefore pickles
nothing and writes no pipe; the pipe carries what is rare and variable (the matchers made and dropped and the
compiled constraints forgotten since the last step, sent after ``go`` when there are any, the child reading
them first), the other requests (``held``, a new segment, ``close``) and a child's errors. The semaphores' post
and wait order the shared writes on every architecture.

Each child times its fills against ``engine.structured_output_fill_budget`` as the core's fill thread does
(:class:`~weft.engine.core.fill_budget.FillBudget`): it names the matchers over it in the segment and drops them,
and the core ends their requests.

Matchers are named by handles the core numbers (a request id can come back after its request ended).

A step's work splits across several such children (:class:`~weft.engine.core.grammar_group.FillGroup`,
``engine.structured_output_fill_processes``):
each holds the matchers it was given (a new one goes to the child holding the fewest) and accepts and fills only
theirs, so a step's round trip takes its share of the batch rather than the whole. On the GPU machine's CPU one
child took 1.29 ms for 32 rows of the records schema, four took 0.62-0.76 ms, while xgrammar's own threads
gained nothing past one (``bench/structured_output.py``, docs/benchmarks.md). Every child reads the whole step
(it skips the tokens of matchers it does not hold); the rows to fill are ordered child after child, each child
filling its own range.

Both ends wait for the other by polling its semaphore for a while before they sleep on it (``spin``): on that
machine a sleeping process took a large share of the round trip to wake up, and a step comes every few
milliseconds while requests decode. A sleeping child wakes every second to see whether the core still runs.
"""

from __future__ import annotations

import functools
import itertools
import logging
import multiprocessing
import os
import time
import traceback
from collections.abc import Callable, Hashable, Iterator, Sequence
from multiprocessing import shared_memory
from typing import TYPE_CHECKING, Any, TypeVar

import numpy

from weft.engine.core.fill_budget import FillBudget
from weft.engine.core.grammar_proposals import fill_positions, settle
from weft.host import usable_cpus

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from weft.contracts.structured_output import StructuredOutputBackend, Vocabulary

logger = logging.getLogger("weft.engine")

T = TypeVar("T")

START_SECONDS = 120.0
"""How long the child may take to start and build its backend."""

SPIN_SECONDS = 0.005
"""How long each end polls for the other's next message before it sleeps in the read (machines of
:data:`SPIN_MIN_CPUS` CPUs or more: on fewer, a polling process takes the CPU the other end needs)."""

SPIN_MIN_CPUS = 8
"""Also where ``engine.structured_output_fill = "auto"`` takes fill processes."""

ALIVE_CHECK_SECONDS = 0.05
"""While the core waits for a child's answer, how often it checks that the child still runs."""

PARENT_CHECK_SECONDS = 1.0
"""While a child waits for the next message, how often it checks that the core still runs."""

# A child's box: int64 words.
_KIND, _START, _COUNT, _ACCEPTED, _FAILED, _FILLED, _ROW, _PROPOSAL, _OVER = range(9)
_BOX_WORDS = 9
# What ``go`` announces (_KIND).
_PIPE, _STEP, _STEP_AFTER_PIPE = 1, 2, 3
"""A message on the pipe, answered on the pipe; a step in the segment, answered in the box; a step whose matchers
made and dropped since the last one come on the pipe first."""
# A token's report in the segment.
ENDED, REFUSED = 1, 2


def default_spin() -> float:
    return SPIN_SECONDS if usable_cpus() >= SPIN_MIN_CPUS else 0.0


def default_processes() -> int:
    """Children of a :class:`~weft.engine.core.grammar_group.FillGroup` when ``engine.structured_output_fill_processes``
    is not set: one per 4 CPUs, at most 4 (on 2 CPUs, one)."""
    return max(1, min(4, usable_cpus() // 4))


def wait_for(semaphore: Any, spin: float, every: float, check: Callable[[], None]) -> None:
    """Acquire ``semaphore``, polling it for ``spin`` seconds before sleeping on it; while asleep, ``check`` runs
    every ``every`` seconds (it raises to stop the wait)."""
    if semaphore.acquire(False):
        return
    if spin > 0:
        deadline = time.perf_counter() + spin
        while time.perf_counter() < deadline:
            if semaphore.acquire(False):
                return
    while not semaphore.acquire(True, every):
        check()


class StepSegment:
    """One step's shared data: the tokens to accept (``accepted``, ``[tokens, 2]``: handle, token) and their reports
    (``reports``: 0, ended, refused), the handles whose rows to fill (``fill``), how many proposals each verifies
    (``widths``; the proposals end to end in ``proposals``), the handles a child filled (``filled``) and those of them
    over the fill budget (``over``; both from the child's start in ``fill``), then the rows (``rows``, ``[rows,
    words]`` int32; a handle fills one per proposal and one more). Handles and proposals are never more than the rows.
    Views of ``memory``; the core owns it."""

    def __init__(self, memory: shared_memory.SharedMemory, rows: int, tokens: int, words: int) -> None:
        self.memory = memory
        self.capacity = (rows, tokens)
        buffer = memory.buf
        offset = 0

        def take(shape: tuple[int, ...], dtype: type) -> numpy.ndarray:
            nonlocal offset
            array = numpy.ndarray(shape, dtype=dtype, buffer=buffer, offset=offset)
            offset += array.nbytes
            return array

        self.rows = take((rows, words), numpy.int32)  # first: the rows start where the segment does
        self.accepted = take((tokens, 2), numpy.int64)
        self.reports = take((tokens,), numpy.int64)
        self.fill = take((rows,), numpy.int64)
        self.filled = take((rows,), numpy.int64)
        self.over = take((rows,), numpy.int64)
        self.widths = take((rows,), numpy.int64)
        self.proposals = take((rows,), numpy.int64)

    @staticmethod
    def size(rows: int, tokens: int, words: int) -> int:
        return rows * words * 4 + tokens * 3 * 8 + rows * 5 * 8

    def release(self) -> None:
        """Drop the views, so the memory can close."""
        self.rows = self.accepted = self.reports = self.fill = self.filled = None  # type: ignore[assignment]
        self.over = self.widths = self.proposals = None  # type: ignore[assignment]


class FillProcess:
    """The child process and the core's end of it; used from one thread at a time (the engine core's),
    except :meth:`new_handle`, :meth:`drop` and :meth:`close`."""

    def __init__(
        self,
        backend_class: type[StructuredOutputBackend],
        options: Any,
        vocabulary: Vocabulary,
        words: int,
        spin: float | None = None,
        name: str = "weft-grammar-fill",
        wait: bool = True,
        budget: float = 0.0,
    ) -> None:
        """``budget``: the CPU seconds one matcher's fill may take in a step (``engine.structured_output_fill_budget``;
        0: none); the child names those over it (:attr:`over`)."""
        self.words = words
        """int32 words of one bitmask row."""
        self.spin = default_spin() if spin is None else spin
        context = multiprocessing.get_context("spawn")  # the core may hold a CUDA context: no fork
        self._conn, child = context.Pipe()
        self._go = context.Semaphore(0)
        self._done = context.Semaphore(0)
        self._box_memory = shared_memory.SharedMemory(create=True, size=_BOX_WORDS * 8)
        self._box = numpy.ndarray((_BOX_WORDS,), dtype=numpy.int64, buffer=self._box_memory.buf)
        self._box[:] = 0
        self._rows = 0
        """Rows of the shared segment its group gave it (:meth:`share`)."""
        self._gone = False
        """Its pipe broke or it exited (perhaps not reaped yet)."""
        self._process = context.Process(
            target=serve,
            args=(
                child,
                self._go,
                self._done,
                self._box_memory.name,
                backend_class,
                options,
                vocabulary,
                words,
                self.spin,
                budget,
            ),
            daemon=True,
            name=name,
        )
        try:
            self._process.start()
        except BaseException:
            self._free_box()
            raise
        child.close()
        self._handles = itertools.count()
        self._sent: set[int] = set()
        """Keys of the compiled constraints the child holds."""
        self._dropped: list[int] = []
        self._forgotten: list[int] = []
        self._unread = 0
        """Step answers posted by the child and not read yet (a read interrupted, a step abandoned): read before
        the next message, so each answer is read with its own step."""
        if wait:
            self.wait_started()

    def wait_started(self) -> None:
        """Block until the child built its backend (RuntimeError, the child stopped, when it failed or took
        over :data:`START_SECONDS`)."""
        if not self._conn.poll(START_SECONDS):
            self.close()
            raise RuntimeError(f"the structured-output fill process did not start within {START_SECONDS:.0f} s")
        try:
            self._receive()
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def alive(self) -> bool:
        return not self._gone and self._process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self._process.exitcode

    def new_handle(self) -> int:
        return next(self._handles)

    def drop(self, handle: int) -> None:
        """The matcher's request is gone (sent with the next step; safe from any thread, a finalizer's included)."""
        self._dropped.append(handle)

    def forget(self, key: int) -> None:
        """The core no longer caches compiled constraint ``key``: the child drops it with the next step."""
        if key in self._sent:
            self._sent.discard(key)
            self._forgotten.append(key)

    def send_step(
        self,
        matchers: list[tuple[int, int, bytes]],
        tokens: int,
        start: int,
        count: int,
        row: int | None = None,
        rows: int | None = None,
        proposal: int = 0,
    ) -> None:
        """Start the child on the step its group wrote in the shared segment: accept its first ``tokens`` tokens (those
        of the matchers it holds, in order), then fill the rows of the live ones among the handles at
        ``start:start + count`` of the segment's fill list, from row ``row`` on (default ``start``; ``rows`` of them
        at most, default ``count``), their proposals from ``proposal`` on in the segment's. ``matchers``: ``(handle,
        key, compiled)`` made since the last step (``compiled`` is sent only for keys the child lacks). The answer:
        :meth:`receive_step` (one left unread is read and dropped before the next message)."""
        self.drain()
        row = start if row is None else row
        rows = count if rows is None else rows
        if row + rows > self._rows:
            raise ValueError(f"rows {row}..{row + rows} do not fit the {self._rows} rows shared with this child")
        made = []
        for handle, key, compiled in matchers:
            made.append((handle, key, None if key in self._sent else compiled))
            self._sent.add(key)
        dropped, self._dropped = self._dropped, []
        forgotten, self._forgotten = self._forgotten, []
        piped = bool(made or dropped or forgotten)
        box = self._box
        box[_KIND], box[_START], box[_COUNT], box[_ACCEPTED], box[_ROW], box[_PROPOSAL] = (
            _STEP_AFTER_PIPE if piped else _STEP,
            start,
            count,
            tokens,
            row,
            proposal,
        )
        self._unread += 1  # its answer comes whatever happens to the pipe below
        self._go.release()
        if piped:  # after ``go``: the child reads it as it comes (a large one does not wait in a full pipe)
            self._send(("matchers", made, dropped, forgotten))

    def receive_step(self) -> int:
        """The answer to the step :meth:`send_step` sent: how many rows the child filled (the handles in its group's
        segment)."""
        self._wait_answer()
        self._unread -= 1  # read, an error the child answered included
        if self._box[_FAILED]:
            self._receive()  # raises the child's error
        return int(self._box[_FILLED])

    @property
    def over(self) -> int:
        """How many of the handles the last answer filled took longer than the fill budget (the first ones of the
        segment's ``over`` from the child's start); read after :meth:`receive_step` returned. The child dropped
        their matchers."""
        return int(self._box[_OVER])

    def drain(self) -> None:
        """Read (and drop) every answer left unread."""
        while self._unread:
            self.receive_step()

    def held(self) -> tuple[int, int]:
        """Matchers and compiled constraints the child holds (the drops sent so far applied)."""
        self.drain()
        self._request(("held",))
        return self._receive()

    def share(self, segment: StepSegment) -> None:
        """Take steps from ``segment`` from the next step on; the caller keeps its memory and unlinks it."""
        self.drain()
        self._request(("memory", segment.memory.name, *segment.capacity))
        self._receive()
        self._rows = segment.capacity[0]

    def _request(self, message: tuple) -> None:
        self._box[_KIND] = _PIPE
        self._go.release()
        self._send(message)

    def _wait_answer(self) -> None:
        if self._gone:
            raise self._exited()
        wait_for(self._done, self.spin, ALIVE_CHECK_SECONDS, self._check_alive)

    def _check_alive(self) -> None:
        if not self._process.is_alive():
            self._gone = True
            raise self._exited()

    def _exited(self) -> RuntimeError:
        return RuntimeError(f"the structured-output fill process exited (code {self._process.exitcode})")

    def _receive(self) -> Any:
        try:
            kind, value = self._conn.recv()
        except (EOFError, OSError) as error:
            self._gone = True
            raise self._exited() from error
        return self._answer(kind, value)

    def _send(self, message: tuple) -> None:
        try:
            self._conn.send(message)
        except OSError as error:  # a broken pipe: the child is gone
            self._gone = True
            raise self._exited() from error

    @staticmethod
    def _answer(kind: str, value: Any) -> Any:
        if kind == "error":
            raise RuntimeError(f"the structured-output fill process failed:\n{value}")
        return value

    def close(self) -> None:
        """Stop the child and free its box. Idempotent."""
        if self._process.is_alive():
            try:
                self._request(("close",))
            except (OSError, RuntimeError, ValueError):
                pass
            self._process.join(5)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._conn.close()
        self._free_box()

    def _free_box(self) -> None:
        if self._box_memory is not None:
            self._box = None  # type: ignore[assignment]
            self._box_memory.close()
            self._box_memory.unlink()
            self._box_memory = None  # type: ignore[assignment]


def serve(
    conn: Connection,
    go: Any,
    done: Any,
    box_name: str,
    backend_class: type[StructuredOutputBackend],
    options: Any,
    vocabulary: Vocabulary,
    words: int,
    spin: float = 0.0,
    budget: float = 0.0,
) -> None:
    """The child: build the backend, then answer the core's messages until it says close (or is gone); its fills are
    timed against ``budget`` (:class:`~weft.engine.core.fill_budget.FillBudget`)."""
    parent = os.getppid()
    box_memory = shared_memory.SharedMemory(name=box_name)
    box = numpy.ndarray((_BOX_WORDS,), dtype=numpy.int64, buffer=box_memory.buf)
    try:
        backend = backend_class(options, vocabulary)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    check_parent = functools.partial(_check_parent, parent)
    compiled: dict[int, Any] = {}
    matchers: dict[int, Any] = {}
    advanced: dict[int, list[int]] = {}
    """The proposals each matcher took tentatively in its last fill (:mod:`weft.engine.core.grammar_proposals`)."""
    fill_budget = FillBudget(budget)
    memory: shared_memory.SharedMemory | None = None
    segment: StepSegment | None = None
    bitmask = None
    try:
        while True:
            wait_for(go, spin, PARENT_CHECK_SECONDS, check_parent)
            kind = box[_KIND]
            if kind == _PIPE:
                message = conn.recv()
                if message[0] == "close":
                    break
                try:
                    if message[0] == "held":
                        conn.send(("held", (len(matchers), len(compiled))))
                    elif message[0] == "memory":
                        import torch

                        if memory is not None:
                            bitmask = None
                            segment.release()  # type: ignore[union-attr]
                            memory.close()
                        memory = shared_memory.SharedMemory(name=message[1])
                        segment = StepSegment(memory, message[2], message[3], words)
                        bitmask = torch.from_numpy(segment.rows)
                        conn.send(("ok", None))
                except BaseException:
                    conn.send(("error", traceback.format_exc()))
                continue
            piped = conn.recv() if kind == _STEP_AFTER_PIPE else None
            try:
                box[_FAILED], box[_FILLED] = (
                    0,
                    _answer_step(backend, compiled, matchers, advanced, segment, bitmask, box, piped, fill_budget),
                )
            except BaseException:
                box[_FAILED], box[_FILLED], box[_OVER] = 1, 0, 0
                conn.send(("error", traceback.format_exc()))
            done.release()
    except (EOFError, OSError):
        pass  # the core is gone
    finally:
        bitmask = None
        if segment is not None:
            segment.release()
        if memory is not None:
            memory.close()
        box = None  # type: ignore[assignment]
        box_memory.close()
        backend.close()


def _check_parent(parent: int) -> None:
    if os.getppid() != parent:
        raise EOFError("the engine core is gone")


def _answer_step(
    backend: StructuredOutputBackend,
    compiled: dict[int, Any],
    matchers: dict[int, Any],
    advanced: dict[int, list[int]],
    segment: StepSegment | None,
    bitmask: Any,
    box: numpy.ndarray,
    piped: tuple | None,
    budget: FillBudget,
) -> int:
    """One step of :func:`serve`: the matchers made, dropped and forgotten (``piped``: the message the pipe brought
    with the step, or None), then the step's accepted tokens taken and its rows filled in the shared segment; the
    number of handles filled. Those whose fill took longer than ``budget`` are named in the segment's ``over`` (their
    count in the box) and leave ``matchers``: their rows are filled, but they take no more tokens and fill no more
    rows (their requests end)."""
    if piped is not None:
        _take_matchers(backend, compiled, matchers, advanced, *piped[1:])
    assert segment is not None, "a step before the shared segment"
    start, count, tokens = int(box[_START]), int(box[_COUNT]), int(box[_ACCEPTED])
    row, proposal = int(box[_ROW]), int(box[_PROPOSAL])
    handles = segment.fill[start : start + count].tolist()
    if tokens or advanced:
        _accept_reporting(backend, matchers, advanced, segment.accepted[:tokens].tolist(), handles, segment.reports)
    widths = segment.widths[start : start + count].tolist()
    flat = segment.proposals[proposal : proposal + sum(widths)].tolist()
    live, proposals, offset = [], [], 0
    for handle, width in zip(handles, widths, strict=True):
        if handle in matchers:
            live.append(handle)
            proposals.append(flat[offset : offset + width])
        offset += width
    over: set[int] = set()
    if live:
        took = fill_positions(backend, [matchers[handle] for handle in live], proposals, bitmask[row:], budget, over)
        advanced.update((handle, tokens) for handle, tokens in zip(live, took, strict=True) if tokens)
        segment.filled[start : start + len(live)] = live
    for position, index in enumerate(sorted(over)):
        handle = live[index]
        segment.over[start + position] = handle
        del matchers[handle]
        advanced.pop(handle, None)
    box[_OVER] = len(over)
    return len(live)


def _take_matchers(
    backend: StructuredOutputBackend,
    compiled: dict[int, Any],
    matchers: dict[int, Any],
    advanced: dict[int, list[int]],
    made: list[tuple[int, int, bytes | None]],
    dropped: list[int],
    forgotten: list[int],
) -> None:
    # Forgotten first: a key forgotten and sent again in one message holds the new bytes. Dropped before the matchers
    # are made, and a dropped one is not made (a request that ended before its matcher's first step drops it in the
    # same message); its compiled constraint is kept all the same (the core counts it sent).
    for key in forgotten:
        compiled.pop(key, None)
    for handle in dropped:
        matchers.pop(handle, None)
        advanced.pop(handle, None)
    gone = set(dropped)
    for handle, key, payload in made:
        if payload is not None:
            compiled[key] = backend.deserialize_compiled(payload)
        if handle not in gone:
            matchers[handle] = backend.matcher(compiled[key])


def distinct_batches(items: Sequence[T], key: Callable[[T], Hashable]) -> Iterator[list[T]]:
    """``items`` in order, cut into runs where no ``key`` repeats (a matcher's tokens in one backend call each)."""
    batch: list[T] = []
    keys: set[Hashable] = set()
    for item in items:
        if key(item) in keys:
            yield batch
            batch, keys = [], set()
        batch.append(item)
        keys.add(key(item))
    if batch:
        yield batch


def _accept_reporting(
    backend: StructuredOutputBackend,
    matchers: dict[int, Any],
    advanced: dict[int, list[int]],
    accepted: list[list[int]],
    filling: list[int],
    reports: numpy.ndarray,
) -> None:
    """Each token of the matchers in ``matchers`` (``accepted``: ``[handle, token]`` in order): first those a matcher
    took as proposals (``advanced``; kept, the rest rolled back, as for the matchers about to fill rows, ``filling``),
    then the others in batches where a matcher appears once; one that ended or refused a token leaves ``matchers``
    (it takes no more tokens and fills no rows) and has that token's entry of ``reports`` set (:data:`ENDED`,
    :data:`REFUSED`)."""
    mine = [(index, handle, token) for index, (handle, token) in enumerate(accepted) if handle in matchers]
    if advanced:
        keep, ended = settle(advanced, [(handle, token) for _, handle, token in mine], filling, matchers.__getitem__)
        for position, handle in ended:
            reports[mine[position][0]] = ENDED
            del matchers[handle]
        mine = [mine[position] for position in keep]
    for batch in distinct_batches(mine, lambda item: item[1]):
        live = [item for item in batch if item[1] in matchers]
        if not live:
            continue
        results = backend.accept_tokens([matchers[handle] for _, handle, _ in live], [token for _, _, token in live])
        for (index, handle, _), (ok, terminated) in zip(live, results, strict=True):
            if not ok:
                reports[index] = REFUSED
                del matchers[handle]
            elif terminated:
                reports[index] = ENDED
                del matchers[handle]
