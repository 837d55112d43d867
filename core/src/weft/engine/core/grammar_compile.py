"""Compiling structured-output constraints for the engine core, bounded in size, time and memory.

A grammar engine's compile can take far longer than a request is worth (xgrammar's time grows about quadratically
with a schema's properties: 3,000 took 1.5 s on 2 CPUs, 30,000 took 96 s), and its compiled form can be large (a
20,000-value enum took over 100 MB). :class:`Compiler` runs compiles on a few threads of its own and bounds them:

- a constraint longer than ``engine.structured_output_max_bytes`` is refused before compiling (a 400 naming it);
- a request whose constraint has not compiled within ``engine.structured_output_compile_timeout`` fails (a 400
  naming it, counted in :attr:`Compiler.timeouts`). A compile cannot be interrupted, so its thread is left to
  finish: the compiles queued behind it move to fresh threads at once (at most :data:`MAX_ABANDONED` such
  threads run at a time, so a flood of pathological schemas cannot take every CPU);
- a compile that has not started when every request waiting for it has gone (its clients left) is dropped;
- the compiled constraints are cached by constraint (a schema sent by many requests compiles once) within
  ``engine.structured_output_cache_bytes`` (the backend's :meth:`compiled_bytes`) and :data:`MAX_CACHED` entries,
  least recently used first out. A request holds its own compiled constraint, so an eviction never fails it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from weft.contracts.structured_output import StructuredOutputsParams

logger = logging.getLogger("weft.engine")

MAX_CACHED = 512
"""Distinct compiled constraints the engine keeps at most, whatever their size."""

MAX_ABANDONED = 2
"""Compiles past their deadline whose threads may still run; past that, new compiles wait for a free thread."""


def constraint_bytes(constraint: StructuredOutputsParams) -> int:
    """The length of a constraint's text in UTF-8 bytes: its schema, regex or grammar, or its choices together."""
    if constraint.choice is not None:
        return sum(len(choice.encode()) for choice in constraint.choice)
    text = constraint.json if constraint.json is not None else constraint.regex or constraint.grammar or ""
    return len(text.encode()) if isinstance(text, str) else len(str(text).encode())


class CompileJob:
    """One constraint's compile: its result (:attr:`future`), and who waits for it."""

    __slots__ = ("constraint", "future", "claimed", "started", "waiters", "abandoned", "bytes", "_compiler")

    def __init__(self, constraint: StructuredOutputsParams, compiler: Compiler) -> None:
        self.constraint = constraint
        self.future: Future = Future()
        self.claimed = False
        """A thread has started compiling it."""
        self.started = 0.0
        """When a thread took it (``time.monotonic()``): its deadline runs from then, not while it is queued."""
        self.waiters = 0
        """Requests waiting for it (:meth:`join`, :meth:`leave`)."""
        self.abandoned = False
        """It outlived its deadline while compiling: its thread is no longer counted as the compilers'."""
        self.bytes = 0
        """What its compiled form takes, as the cache counts it (0 until compiled)."""
        self._compiler = compiler

    def join(self) -> CompileJob:
        self.waiters += 1
        return self

    def leave(self) -> None:
        """A request waiting for it ended: once none waits, a compile not started yet is dropped."""
        self.waiters -= 1
        if self.waiters <= 0 and not self.future.done():
            self._compiler.drop(self)


class Compiler:
    """Compiles constraints (``compile``, thread-safe) on ``threads`` threads of its own, within the limits the
    module docstring lists. Its methods are called from the engine core's thread."""

    def __init__(
        self,
        compile: Callable[[StructuredOutputsParams], Any],
        compiled_bytes: Callable[[Any], int],
        threads: int,
        max_bytes: int,
        timeout: float,
        cache_bytes: int,
        evicted: Callable[[Any], None] = lambda compiled: None,
    ) -> None:
        self._compile = compile
        self._compiled_bytes = compiled_bytes
        self._threads = threads
        self.max_bytes, self.timeout, self.cache_bytes = max_bytes, timeout, cache_bytes
        self._evicted = evicted
        """Told each compiled constraint the cache drops."""
        self._pool = self._new_pool()
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutputsParams, CompileJob] = OrderedDict()
        self._pending: list[CompileJob] = []
        """Jobs submitted and not started."""
        self._abandoned = 0
        self.cached_bytes = 0
        """What the cached compiled constraints take, by the backend's count."""
        self.timeouts = 0
        """Requests failed because their constraint outlived ``engine.structured_output_compile_timeout``."""

    def _new_pool(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="weft-grammar-compile")

    def submit(self, constraint: StructuredOutputsParams) -> CompileJob:
        """The job compiling ``constraint`` (one cached or running already, else a new one), joined by the caller;
        ValueError when the constraint is over ``engine.structured_output_max_bytes``."""
        size = constraint_bytes(constraint)
        if size > self.max_bytes:
            raise ValueError(
                f"structured_outputs.{constraint.kind}: {size} bytes, over engine.structured_output_max_bytes = "
                f"{self.max_bytes} (compile time grows about quadratically with a schema's size); send a smaller "
                "constraint, or raise the limit"
            )
        with self._lock:
            job = self._cache.get(constraint)
            if job is not None and not (job.future.done() and job.future.exception() is not None):
                self._cache.move_to_end(constraint)
                return job.join()
            job = CompileJob(constraint, self)
            self._cache[constraint] = job
            self._pending.append(job)
            self._evict()
        self._pool.submit(self._run, job)
        return job.join()

    def check(self, job: CompileJob, since: float) -> None:
        """Raise ValueError naming ``engine.structured_output_compile_timeout`` when ``job``, waited for since
        ``since`` (``time.monotonic()``), is not compiled past it."""
        # A queued job's wait is the running ones': those time out, and it moves to a fresh thread then.
        if job.future.done() or not job.claimed or time.monotonic() - max(since, job.started) <= self.timeout:
            return
        self.timeouts += 1
        with self._lock:
            if job.claimed and not job.abandoned and self._abandoned < MAX_ABANDONED:
                job.abandoned = True
                self._abandoned += 1
                self._move_pending()
        raise ValueError(
            f"structured_outputs.{job.constraint.kind}: not compiled within engine.structured_output_compile_timeout"
            f" = {self.timeout:g} s; send a smaller or simpler constraint, or raise the timeout"
        )

    def _move_pending(self) -> None:
        """A thread is taken by a compile past its deadline: the jobs queued behind it go to fresh threads (the old
        pool's threads end once their compile has; a job both pools hold runs once, :meth:`_run`)."""
        old, self._pool = self._pool, self._new_pool()
        for job in self._pending:
            self._pool.submit(self._run, job)
        old.shutdown(wait=False)
        logger.warning(
            "structured outputs: a constraint's compile outlived engine.structured_output_compile_timeout = %g s; "
            "it finishes on its own thread, and %d queued compile%s moved to fresh threads",
            self.timeout,
            len(self._pending),
            "" if len(self._pending) == 1 else "s",
        )

    def drop(self, job: CompileJob) -> None:
        """No request waits for ``job``: forget it, and drop its compile if it has not started."""
        with self._lock:
            if self._cache.get(job.constraint) is job and not job.future.done():
                del self._cache[job.constraint]
            if not job.claimed and job in self._pending:
                self._pending.remove(job)
                job.future.cancel()

    def _run(self, job: CompileJob) -> None:
        with self._lock:
            if job.claimed or job.future.cancelled():
                return
            job.claimed = True
            job.started = time.monotonic()
            self._pending.remove(job)
        try:
            compiled = self._compile(job.constraint)
        except BaseException as error:
            job.future.set_exception(error)
        else:
            job.future.set_result(compiled)
            self._cached(job, compiled)
        finally:
            with self._lock:
                if job.abandoned:
                    self._abandoned -= 1

    def _cached(self, job: CompileJob, compiled: Any) -> None:
        try:
            size = int(self._compiled_bytes(compiled))
        except Exception:  # a backend that cannot tell: the entry count bounds it
            size = 0
        with self._lock:
            if self._cache.get(job.constraint) is not job:  # dropped meanwhile (its requests left)
                return
            job.bytes = size
            self.cached_bytes += size
            self._evict()

    def _evict(self) -> None:
        """Least recently used compiled constraints out until the cache is within its budget (under the lock)."""
        for constraint, job in list(self._cache.items()):
            if self.cached_bytes <= self.cache_bytes and len(self._cache) <= MAX_CACHED:
                return
            if not job.future.done() and job.bytes == 0 and len(self._cache) <= MAX_CACHED:
                continue  # compiling: it takes nothing yet
            del self._cache[constraint]
            self.cached_bytes -= job.bytes
            if job.future.done() and not job.future.cancelled() and job.future.exception() is None:
                self._evicted(job.future.result())

    def held(self) -> tuple[int, int]:
        """Compiled constraints cached, and the bytes they take."""
        with self._lock:
            return len(self._cache), self.cached_bytes

    def close(self) -> None:
        with self._lock:
            for job in self._pending:
                job.future.cancel()
            self._pending.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
