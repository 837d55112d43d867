"""Structured-output constraints validated in a process of their own, for an API process without torch.

A backend's ``validate`` runs for every constrained request before it is admitted, so that a constraint its
library cannot compile is a 400 before a stream starts. The library may import torch (xgrammar does whenever it
is imported: its FFI layer and its matcher's bitmasks), which ``weft serve``'s API process must not
(:mod:`weft.engine.api.torch_free`). There the check runs in one spawned worker process, started on the
first constrained request (its imports take a few seconds, once), and the backend's ``ValueError`` comes back
as it was raised. A process that has torch loaded anyway (``LLM``, tests) validates in place.

The worker answers one constraint at a time over a pipe (a validation takes well under a millisecond once
the library is loaded). It exits when the pipe closes, so it never outlives its API process, even one that
ends with ``os._exit``.
"""

from __future__ import annotations

import multiprocessing
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

from weft.contracts.structured_output import StructuredOutputsParams


class ConstraintValidator:
    """Calls ``backend_class.validate(constraint)``: here when torch is loaded, else in a worker process."""

    def __init__(self) -> None:
        self._process: Any = None
        self._connection: Connection | None = None
        self._lock = threading.Lock()
        """Held for a whole exchange with the worker: one question on the pipe at a time."""
        self._closed = False

    def validate(self, backend_class: Any, constraint: StructuredOutputsParams) -> None:
        """ValueError naming the problem when ``constraint`` cannot be compiled (the backend's own message)."""
        if _validates_in_place():
            backend_class.validate(constraint)
            return
        with self._lock:
            connection = self._worker()
            try:
                connection.send((backend_class, constraint))
                error = connection.recv()
            except (EOFError, OSError):
                # The worker died (killed, out of memory): the next request starts another.
                self._stop()
                raise RuntimeError("the structured-output validation process died; retry the request") from None
        if error is not None:
            raise error

    def _worker(self) -> Connection:
        if self._closed:
            raise RuntimeError("the server is shutting down")
        if self._connection is None:
            here, there = multiprocessing.Pipe()
            process = multiprocessing.get_context("spawn").Process(
                target=_answer, args=(there,), name="weft-constraint-validation", daemon=True
            )
            process.start()
            there.close()  # the worker's end lives in the worker: its exit reads as EOF here
            self._process, self._connection = process, here
        return self._connection

    def _stop(self) -> None:
        process, connection = self._process, self._connection
        self._process = self._connection = None
        if connection is not None:
            connection.close()  # the worker reads EOF and exits
        if process is not None:
            process.join(timeout=2)
            if process.is_alive():  # in the middle of a validation that does not end
                process.kill()
                process.join()

    def close(self) -> None:
        """Stop the worker, if one started; later validations are refused."""
        self._closed = True
        if self._lock.acquire(timeout=5):
            try:
                self._stop()
            finally:
                self._lock.release()
        elif (process := self._process) is not None:
            process.kill()  # a validation that does not end holds the pipe: its thread reads EOF and stops it


def _validates_in_place() -> bool:
    """True in a process that has torch loaded already: the backend's imports cost nothing more there."""
    return "torch" in sys.modules


def _answer(connection: Connection) -> None:
    """The worker: each ``(backend_class, constraint)`` received is answered with None or the error it raised."""
    while True:
        try:
            backend_class, constraint = connection.recv()
        except EOFError:  # the API process closed the pipe, or exited
            return
        try:
            backend_class.validate(constraint)
            reply: BaseException | None = None
        except Exception as error:
            reply = error
        try:
            connection.send(reply)
        except Exception:  # an error that does not pickle: its type and message do
            connection.send(RuntimeError(f"{type(reply).__name__}: {reply}"))
