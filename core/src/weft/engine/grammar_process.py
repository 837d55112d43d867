"""The structured-output fill in a process of its own (``engine.structured_output_fill = "process"``).

A backend whose fill holds the GIL (xgrammar 0.2.9's batch fill does) takes the engine core's time
while it fills, whichever thread it runs on. In a spawned child the matchers accept tokens and fill
bitmask rows beside the core. The core keeps compiling constraints (in its own thread pool, where
invalid ones fail as before) and sends each compiled constraint to the child once, serialized
(:meth:`~weft.contracts.structured_output.StructuredOutputBackend.serialize_compiled`). Each step is
one message, sent by the core's thread as soon as the step's tokens were accepted, its answer read when the
core needs the mask (no thread hands it on: a thread waiting for the GIL while the core launches the
forward would hold the message back): the matchers made and dropped since the last one, the
tokens to accept in order, the matchers whose rows to fill. The rows come back in shared memory, which
the core grows (a new segment) when a step needs more rows; the reply says which matchers filled a row
and which ones ended or refused a token.

Matchers are named by handles the core numbers (a request id can come back after its request ended).

A step's work splits across several such children (:class:`FillGroup`, ``engine.structured_output_fill_processes``):
each holds the matchers it was given (a new one goes to the child holding the fewest) and accepts and fills only
theirs, so a step's round trip takes its share of the batch rather than the whole. On the GPU machine's CPU one
child took 1.29 ms for 32 rows of the records schema, four took 0.62-0.76 ms, while xgrammar's own threads
gained nothing past one (``bench/structured_output.py``, docs/benchmarks.md).

Both ends wait for a message by polling it for a while before they sleep in the read (``spin``): on that machine
a sleeping process took a large share of the round trip to wake up, and a step's message comes every few
milliseconds while requests decode.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import select
import time
import traceback
from collections.abc import Callable, Hashable, Iterator, Sequence
from multiprocessing import shared_memory
from typing import TYPE_CHECKING, Any, TypeVar

import numpy

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


def default_spin() -> float:
    return SPIN_SECONDS if usable_cpus() >= SPIN_MIN_CPUS else 0.0


def default_processes() -> int:
    """Children of a :class:`FillGroup` when ``engine.structured_output_fill_processes`` is not set: one per
    4 CPUs, at most 4 (on 2 CPUs, one)."""
    return max(1, min(4, usable_cpus() // 4))


class Mailbox:
    """One end of the pipe, read after polling it for up to ``spin`` seconds (then a sleeping read)."""

    __slots__ = ("conn", "spin", "_poller")

    def __init__(self, conn: Connection, spin: float) -> None:
        self.conn = conn
        self.spin = spin
        self._poller = select.poll()
        self._poller.register(conn.fileno(), select.POLLIN)

    def recv(self) -> Any:
        if self.spin > 0 and not self._poller.poll(0):
            deadline = time.perf_counter() + self.spin
            while not self._poller.poll(0) and time.perf_counter() < deadline:
                pass
        return self.conn.recv()


class StepReply:
    """What the child did with one step's message."""

    __slots__ = ("filled", "ended", "refused")

    def __init__(self, filled: list[int], ended: list[int], refused: list[tuple[int, int]]) -> None:
        self.filled = filled
        """Handles whose bitmask row was filled, row ``i`` for ``filled[i]``."""
        self.ended = ended
        """Handles whose matcher terminated on a token of this step."""
        self.refused = refused
        """``(handle, token)`` of tokens a matcher refused (it takes no more tokens, as a failed constraint)."""


class FillProcess:
    """The child process and the core's end of it; used from one thread at a time (the engine core's),
    except :meth:`new_handle`, :meth:`drop` and :meth:`close`."""

    def __init__(self, backend_class: type[StructuredOutputBackend], options: Any, vocabulary: Vocabulary,
                 words: int, spin: float | None = None, name: str = "weft-grammar-fill", wait: bool = True) -> None:
        self.words = words
        """int32 words of one bitmask row."""
        spin = default_spin() if spin is None else spin
        context = multiprocessing.get_context("spawn")  # the core may hold a CUDA context: no fork
        self._conn, child = context.Pipe()
        self._mailbox = Mailbox(self._conn, spin)
        self._rows = 0
        """Rows of the shared segment its group gave it (:meth:`share`)."""
        self._gone = False
        """Its pipe broke (the child exited, perhaps not reaped yet)."""
        self._process = context.Process(
            target=serve, args=(child, backend_class, options, vocabulary, words, spin), daemon=True, name=name,
        )
        self._process.start()
        child.close()
        self._handles = itertools.count()
        self._sent: set[int] = set()
        """Keys of the compiled constraints the child holds."""
        self._dropped: list[int] = []
        self._forgotten: list[int] = []
        self._unread = 0
        """Step answers sent by the child and not read yet (a read interrupted, a step abandoned): read before
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

    def send_step(self, matchers: list[tuple[int, int, bytes]], accepted: list[tuple[int, int]], fill: list[int],
                  offset: int = 0) -> None:
        """Send one step's message; the child starts on it at once. ``matchers``: ``(handle, key, compiled)`` made
        since the last step (``compiled`` is sent only for keys the child lacks); ``accepted``: ``(handle, token)``
        in generation order; ``fill``: handles whose row to fill if their matcher is still live after
        accepting, from row ``offset`` of the shared memory on (a group's children share one segment). The answer:
        :meth:`receive_step` (one left unread is read and dropped before the next message)."""
        self.drain()
        if offset + len(fill) > self._rows:
            raise ValueError(f"rows {offset}..{offset + len(fill)} do not fit the {self._rows} rows shared with this child")
        made = []
        for handle, key, compiled in matchers:
            made.append((handle, key, None if key in self._sent else compiled))
            self._sent.add(key)
        dropped, self._dropped = self._dropped, []
        forgotten, self._forgotten = self._forgotten, []
        self._send(("step", made, dropped, forgotten, accepted, fill, offset))
        self._unread += 1

    def receive_step(self) -> StepReply:
        """The answer to the step :meth:`send_step` sent (its rows in :meth:`rows` until the next step)."""
        kind, value = self._read()
        self._unread -= 1  # read, an error the child answered included
        return StepReply(*self._answer(kind, value))

    def drain(self) -> None:
        """Read (and drop) every answer left unread."""
        while self._unread:
            self.receive_step()

    def held(self) -> tuple[int, int]:
        """Matchers and compiled constraints the child holds (the drops sent so far applied)."""
        self.drain()
        self._send(("held",))
        return self._receive()

    def share(self, memory: shared_memory.SharedMemory, rows: int) -> None:
        """Fill rows into ``memory`` (``rows`` rows) from the next step on; the caller keeps it and unlinks it."""
        self.drain()
        self._send(("memory", memory.name, rows))
        self._receive()
        self._rows = rows

    def _receive(self) -> Any:
        return self._answer(*self._read())

    def _read(self) -> tuple[str, Any]:
        try:
            return self._mailbox.recv()
        except (EOFError, OSError) as error:
            self._gone = True
            raise RuntimeError(f"the structured-output fill process exited (code {self._process.exitcode})") from error

    def _send(self, message: tuple) -> None:
        try:
            self._conn.send(message)
        except OSError as error:  # a broken pipe: the child is gone
            self._gone = True
            raise RuntimeError(f"the structured-output fill process exited (code {self._process.exitcode})") from error

    @staticmethod
    def _answer(kind: str, value: Any) -> Any:
        if kind == "error":
            raise RuntimeError(f"the structured-output fill process failed:\n{value}")
        return value

    def close(self) -> None:
        """Stop the child and free the shared memory. Idempotent."""
        if self._process.is_alive():
            try:
                self._conn.send(("close",))
            except OSError:
                pass
            self._process.join(5)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._conn.close()


class FillFailed(RuntimeError):
    """A fill child answered a step with an error; ``reply`` holds what the other children did (their ended and
    refused matchers are gone from them all the same)."""

    def __init__(self, message: str, reply: StepReply) -> None:
        super().__init__(message)
        self.reply = reply


class FillGroup:
    """Several :class:`FillProcess` children sharing the matchers, seen by the core as one (the same methods): each
    matcher lives in one child (a new one in the child holding the fewest), a step's message goes to every child
    with its own matchers' part, and the filled rows come back in child order. Used from one thread at a time
    (the engine core's), except :meth:`new_handle`, :meth:`drop` and :meth:`close`."""

    def __init__(self, backend_class: type[StructuredOutputBackend], options: Any, vocabulary: Vocabulary,
                 words: int, processes: int = 1, spin: float | None = None) -> None:
        if processes < 1:
            raise ValueError(f"a fill group needs at least one process, not {processes}")
        self.children: list[FillProcess] = []
        self._handles = itertools.count()
        self._owner: dict[int, int] = {}
        """Each live matcher's child."""
        self._load = [0] * processes
        """Live matchers per child."""
        self._memory: shared_memory.SharedMemory | None = None
        """The children's rows, one segment it owns and unlinks: child ``i`` fills from ``self._offsets[i]``."""
        self._rows = 0
        self._offsets: list[int] = [0] * processes
        self._asked: list[int] = [0] * processes
        """Rows the last step asked of each child."""
        self._filled: list[int] = []
        """Rows the last step filled, per child (:meth:`rows` reads them in child order)."""
        try:
            for index in range(processes):  # all start, then each is waited for
                self.children.append(FillProcess(backend_class, options, vocabulary, words, spin,
                                                 name=f"weft-grammar-fill-{index}", wait=False))
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

    def step(self, matchers: list[tuple[int, int, bytes]], accepted: list[tuple[int, int]], fill: list[int]) -> StepReply:
        self.send_step(matchers, accepted, fill)
        return self.receive_step()

    def send_step(self, matchers: list[tuple[int, int, bytes]], accepted: list[tuple[int, int]], fill: list[int]) -> None:
        """:meth:`FillProcess.send_step` to every child, each with its own matchers' part (a dropped matcher's
        tokens and rows are left out: its child no longer holds it)."""
        if len(self.children) == 1:
            parts = [(matchers, accepted, fill)]  # a dropped matcher's part is skipped in the child
        else:
            parts = [([], [], []) for _ in self.children]
            owner = self._owner
            for made in matchers:
                if (child := owner.get(made[0])) is not None:
                    parts[child][0].append(made)
            for item in accepted:
                if (child := owner.get(item[0])) is not None:
                    parts[child][1].append(item)
            for handle in fill:
                if (child := owner.get(handle)) is not None:
                    parts[child][2].append(handle)
        for child in self.children:  # every earlier answer read before any child gets this message
            child.drain()
        total = sum(len(part[2]) for part in parts)
        if total > self._rows:
            self._grow(total)
        offset = 0
        for index, (child, part) in enumerate(zip(self.children, parts, strict=True)):
            self._offsets[index], self._asked[index] = offset, len(part[2])
            child.send_step(*part, offset=offset)
            offset += len(part[2])

    def _grow(self, rows: int) -> None:
        """A segment of at least ``rows`` rows shared by every child (the old one freed once all moved)."""
        rows = max(rows, 2 * self._rows, 64)
        memory = shared_memory.SharedMemory(create=True, size=rows * self.children[0].words * 4)
        try:
            for child in self.children:
                child.share(memory, rows)
        except BaseException:
            memory.close()
            memory.unlink()
            self._rows = 0  # some children may have moved to the segment just freed: the next step shares anew
            raise
        if self._memory is not None:
            self._memory.close()
            self._memory.unlink()
        self._memory, self._rows = memory, rows

    def receive_step(self) -> StepReply:
        """Every child's answer to the last :meth:`send_step`, in child order. A child that failed raises
        :class:`FillFailed` once the others were read (none is left for the next step), with their ended and
        refused matchers."""
        filled: list[int] = []
        ended: list[int] = []
        refused: list[tuple[int, int]] = []
        counts: list[int] = []
        error: BaseException | None = None
        self._filled = [0] * len(self.children)
        for child in self.children:
            try:
                reply = child.receive_step()  # a KeyboardInterrupt leaves the rest to be read with the next step
            except Exception as failure:
                error = error or failure
                counts.append(0)
                continue
            filled += reply.filled
            ended += reply.ended
            refused += reply.refused
            counts.append(len(reply.filled))
        if error is not None:
            raise FillFailed(str(error), StepReply([], ended, refused)) from error
        self._filled = counts
        return StepReply(filled, ended, refused)

    def rows(self, count: int) -> bytes:
        """The first ``count`` rows the last step filled, child after child (:meth:`receive_step`'s order): one copy
        where every child filled the rows it was asked for, as they lie together in the shared segment."""
        assert self._memory is not None
        row = self.children[0].words * 4
        if self._filled == self._asked:
            return bytes(self._memory.buf[: count * row])
        parts = []
        for offset, filled in zip(self._offsets, self._filled, strict=True):
            if count <= 0:
                break
            take = min(count, filled)
            if take:
                parts.append(self._memory.buf[offset * row : (offset + take) * row])
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
        if self._memory is not None:
            self._memory.close()
            self._memory.unlink()
            self._memory = None


def serve(conn: Connection, backend_class: type[StructuredOutputBackend], options: Any, vocabulary: Vocabulary,
          words: int, spin: float = 0.0) -> None:
    """The child: build the backend, then answer the core's messages until it says close."""
    mailbox = Mailbox(conn, spin)
    try:
        backend = backend_class(options, vocabulary)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", None))
    compiled: dict[int, Any] = {}
    matchers: dict[int, Any] = {}
    memory: shared_memory.SharedMemory | None = None
    bitmask = None
    while True:
        try:
            message = mailbox.recv()
        except EOFError:
            break
        if message[0] == "close":
            break
        try:
            if message[0] == "held":
                conn.send(("held", (len(matchers), len(compiled))))
                continue
            if message[0] == "memory":
                import torch

                if memory is not None:
                    bitmask = None
                    memory.close()
                memory = shared_memory.SharedMemory(name=message[1])
                bitmask = torch.from_numpy(numpy.ndarray((message[2], words), dtype=numpy.int32, buffer=memory.buf))
                conn.send(("ok", None))
                continue
            _, made, dropped, forgotten, accepted, fill, offset = message
            # Forgotten first: a key forgotten and sent again in one message holds the new bytes. Dropped before
            # the matchers are made, and a dropped one is not made (a request that ended before its matcher's first
            # step drops it in the same message); its compiled constraint is kept all the same (the core counts
            # it sent).
            for key in forgotten:
                compiled.pop(key, None)
            for handle in dropped:
                matchers.pop(handle, None)
            gone = set(dropped)
            for handle, key, payload in made:
                if payload is not None:
                    compiled[key] = backend.deserialize_compiled(payload)
                if handle not in gone:
                    matchers[handle] = backend.matcher(compiled[key])
            ended, refused = _accept(backend, matchers, accepted)
            live = [handle for handle in fill if handle in matchers]
            if live:
                backend.fill_bitmasks([matchers[handle] for handle in live], bitmask[offset : offset + len(live)])  # type: ignore[index]
            conn.send(("step", (live, ended, refused)))  # a tuple: a class with slots unpickles slower
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    bitmask = None
    if memory is not None:
        memory.close()
    backend.close()


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


def _accept(backend: StructuredOutputBackend, matchers: dict[int, Any], accepted: list[tuple[int, int]]) -> tuple[list[int], list[tuple[int, int]]]:
    """Each token by its matcher, in order, in batches where a matcher appears once; a matcher that ended or
    refused a token leaves ``matchers`` (it takes no more tokens and fills no rows)."""
    ended: list[int] = []
    refused: list[tuple[int, int]] = []
    for batch in distinct_batches(accepted, lambda item: item[0]):
        live = [(handle, token) for handle, token in batch if handle in matchers]
        if not live:
            continue
        results = backend.accept_tokens([matchers[handle] for handle, _ in live], [token for _, token in live])
        for (handle, token), (ok, terminated) in zip(live, results, strict=True):
            if not ok:
                refused.append((handle, token))
                del matchers[handle]
            elif terminated:
                ended.append(handle)
                del matchers[handle]
    return ended, refused
