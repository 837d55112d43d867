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
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import traceback
from collections.abc import Callable, Hashable, Iterator, Sequence
from multiprocessing import shared_memory
from typing import TYPE_CHECKING, Any, TypeVar

import numpy

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from weft.contracts.structured_output import StructuredOutputBackend, Vocabulary

logger = logging.getLogger("weft.engine")

T = TypeVar("T")

START_SECONDS = 120.0
"""How long the child may take to start and build its backend."""


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
                 words: int) -> None:
        self.words = words
        """int32 words of one bitmask row."""
        context = multiprocessing.get_context("spawn")  # the core may hold a CUDA context: no fork
        self._conn, child = context.Pipe()
        self._rows = 0
        self._memory: shared_memory.SharedMemory | None = None
        self._process = context.Process(
            target=serve, args=(child, backend_class, options, vocabulary, words), daemon=True,
            name="weft-grammar-fill",
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
        if not self._conn.poll(START_SECONDS):
            self.close()
            raise RuntimeError(f"the structured-output fill process did not start within {START_SECONDS:.0f} s")
        self._receive()

    @property
    def pid(self) -> int | None:
        return self._process.pid

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

    def step(self, matchers: list[tuple[int, int, bytes]], accepted: list[tuple[int, int]], fill: list[int]) -> StepReply:
        """:meth:`send_step`, then the child's answer (blocks until it comes)."""
        self.send_step(matchers, accepted, fill)
        return self.receive_step()

    def send_step(self, matchers: list[tuple[int, int, bytes]], accepted: list[tuple[int, int]], fill: list[int]) -> None:
        """Send one step's message; the child starts on it at once. ``matchers``: ``(handle, key, compiled)`` made
        since the last step (``compiled`` is sent only for keys the child lacks); ``accepted``: ``(handle, token)``
        in generation order; ``fill``: handles whose row to fill if their matcher is still live after
        accepting. The answer: :meth:`receive_step` (one left unread is read and dropped before the next message)."""
        self._drain()
        if len(fill) > self._rows:
            self._grow(len(fill))
        made = []
        for handle, key, compiled in matchers:
            made.append((handle, key, None if key in self._sent else compiled))
            self._sent.add(key)
        dropped, self._dropped = self._dropped, []
        forgotten, self._forgotten = self._forgotten, []
        self._conn.send(("step", made, dropped, forgotten, accepted, fill))
        self._unread += 1

    def receive_step(self) -> StepReply:
        """The answer to the step :meth:`send_step` sent (its rows in :meth:`rows` until the next step)."""
        kind, value = self._read()
        self._unread -= 1  # read, an error the child answered included
        return self._answer(kind, value)

    def _drain(self) -> None:
        while self._unread:
            self.receive_step()

    def held(self) -> tuple[int, int]:
        """Matchers and compiled constraints the child holds (the drops sent so far applied)."""
        self._drain()
        self._conn.send(("held",))
        return self._receive()

    def rows(self, count: int) -> bytes:
        """The first ``count`` rows the last step filled."""
        assert self._memory is not None
        return bytes(self._memory.buf[: count * self.words * 4])

    def _grow(self, rows: int) -> None:
        rows = max(rows, 2 * self._rows, 64)
        self._drain()
        memory = shared_memory.SharedMemory(create=True, size=rows * self.words * 4)
        self._conn.send(("memory", memory.name, rows))
        self._receive()
        if self._memory is not None:
            self._memory.close()
            self._memory.unlink()
        self._memory, self._rows = memory, rows

    def _receive(self) -> Any:
        return self._answer(*self._read())

    def _read(self) -> tuple[str, Any]:
        try:
            return self._conn.recv()
        except (EOFError, OSError) as error:
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
        if self._memory is not None:
            self._memory.close()
            self._memory.unlink()
            self._memory = None


def serve(conn: Connection, backend_class: type[StructuredOutputBackend], options: Any, vocabulary: Vocabulary,
          words: int) -> None:
    """The child: build the backend, then answer the core's messages until it says close."""
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
            message = conn.recv()
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
            _, made, dropped, forgotten, accepted, fill = message
            for handle in dropped:
                matchers.pop(handle, None)
            for key in forgotten:
                compiled.pop(key, None)
            for handle, key, payload in made:
                if payload is not None:
                    compiled[key] = backend.deserialize_compiled(payload)
                matchers[handle] = backend.matcher(compiled[key])
            ended, refused = _accept(backend, matchers, accepted)
            live = [handle for handle in fill if handle in matchers]
            if live:
                backend.fill_bitmasks([matchers[handle] for handle in live], bitmask[: len(live)])  # type: ignore[index]
            conn.send(("step", StepReply(live, ended, refused)))
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
