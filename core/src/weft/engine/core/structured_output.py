"""The engine core's side of structured outputs: compiling constraints, per-step bitmasks, accepting tokens.

:class:`StructuredOutputManager` lives beside the scheduler. When a request with a
constraint arrives, its compilation is queued on a worker thread (the backend itself is
built there too, the first time: it loads the tokenizer and indexes the vocabulary);
compiled constraints are cached by constraint, so a schema sent by many requests compiles
once. The scheduler leaves a request waiting, at no cost to the running ones, until
:meth:`StructuredOutputManager.ready` says its matcher exists.

Compiles run on :class:`~weft.engine.core.grammar_compile.Compiler`'s threads, bounded in size
(``engine.structured_output_max_bytes``), time (``engine.structured_output_compile_timeout``) and memory
(``engine.structured_output_cache_bytes``).

A request whose reasoning comes first (:class:`~weft.engine.messages.GrammarStart`: the tokens that
end it) samples freely until those tokens were generated; its constraint covers the answer only. One
whose prompt did not open the reasoning is constrained from its first token, whose mask also allows
the token opening the reasoning: when it is sampled, the request reasons freely up to the end tokens.

Per step, :meth:`StructuredOutputManager.grammar_output` fills one bitmask row per
constrained request that samples, one per position for a request that verifies speculative proposals
(:mod:`weft.engine.core.grammar_proposals`: its matcher advances over them tentatively);
:meth:`StructuredOutputManager.accept` records each token the step produced, which its request's
matcher takes just before the next fill (rolling back the proposals the step rejected).

Accepting and filling run on their own thread, so the engine core schedules the next step
meanwhile where the backend lets go of the GIL (xgrammar 0.2.9 does not while it fills: a
Python thread spinning beside its batch fill slowed the fill 4x and lost 30% itself, so there
the fill's time adds to the core's; the step's tokens are accepted in one backend call, one
handoff of the GIL rather than one per token). Only that thread uses a matcher once made, and the
core calls :meth:`~StructuredOutputManager.accept` and
:meth:`~StructuredOutputManager.grammar_output` only once it has taken the previous fill's
result. The scheduler reads a constraint's ``terminated`` and ``failed`` flags meanwhile: they
only ever turn true, so a stale one costs a step that waits for a mask its request no longer
needs (the fill leaves it out), never a wrong token.

With the matchers in fill processes (``engine.structured_output_fill``, :mod:`weft.engine.core.grammar_process`;
``engine.structured_output_fill_processes`` of them, each holding its share of the matchers) no thread of the
core takes part: the core's own thread sends each step's message as it asks for the fill, and reads the
answers when it takes the result (:class:`RemoteReply`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy
import torch

from weft.contracts.executor import GrammarOutput
from weft.contracts.structured_output import Vocabulary, bitmask_words
from weft.engine.core.constraint_state import ConstraintState, RemoteMatcher
from weft.engine.core.fill_budget import FillBudget
from weft.engine.core.grammar_compile import Compiler
from weft.engine.core.grammar_group import FillGroup
from weft.engine.core.grammar_process import SPIN_MIN_CPUS, default_processes, distinct_batches
from weft.engine.core.grammar_proposals import fill_positions, settle
from weft.engine.core.remote_fill import allow, refused, send_remote
from weft.engine.messages import GrammarStart
from weft.host import usable_cpus
from weft.plugins.selection import no_backend_message

if TYPE_CHECKING:
    from weft.config import WeftConfig
    from weft.contracts.structured_output import StructuredOutputBackend, StructuredOutputsParams
    from weft.engine.core.request import Request
    from weft.plugins import PluginRegistry

logger = logging.getLogger("weft.engine")

FILL_START_RETRY_S = 10.0
"""After fill processes failed to start, constrained requests are refused for this long, then a start is tried again
(a failure that lasts, such as a backend the children cannot build, costs one try per interval; one that passes,
such as a process limit or memory reached for a moment, heals)."""


class StructuredOutputManager:
    def __init__(self, config: WeftConfig, registry: PluginRegistry, source: Any, vocab_size: int) -> None:
        self.config = config
        self.registry = registry
        self.source = source
        self.vocab_size = vocab_size
        """Width of the model's logits."""
        self._backend_class: Any = None
        self._backend: Future | None = None
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._filler: ThreadPoolExecutor | None = None
        """One thread accepting tokens and filling the step's bitmask (never behind a compilation on the pool)."""
        self._accepted: list[tuple[str, ConstraintState, int]] = []
        """Tokens generated since the last fill, for their matchers, in order."""
        self.compiler: Compiler | None = None
        """Compiles the constraints (made with the backend)."""
        self._thread_fill: ThreadFill | None = None
        """What the fill thread runs (made with the backend)."""
        self._process: Future[FillGroup] | None = None
        """The fill processes (``engine.structured_output_fill``, ``engine.structured_output_fill_processes``);
        None: the fill thread fills."""
        self._made: list[tuple[int, int, bytes]] = []
        """Matchers made since the last fill, for the fill process: ``(handle, key, compiled)``."""
        self._fill_failed = False
        """A step's message or answer failed: the matchers may have taken part of its tokens (:meth:`recover`)."""
        self._keys = itertools.count()
        self._start_failed_at: float | None = None
        """When :meth:`ready` first saw the fill processes' start fail (None: it did not, or a new start runs)."""

    @property
    def fills_in_process(self) -> bool:
        """Whether the matchers live in the fill process (known once the first constraint arrived)."""
        return self._process is not None

    # Requests.

    def add(self, request: Request, start: GrammarStart | None = None) -> None:
        """Start compiling the request's constraint (ValueError when no backend is installed); ``start``: where it
        starts when the model may reason first (None: the whole output)."""
        constraint = request.params.structured_outputs
        assert constraint is not None
        job = self._compile(constraint)
        request.constraint = ConstraintState(constraint, job.future, start, job)

    def ready(self, request: Request) -> bool:
        """Whether the request's matcher exists; raises ValueError when its constraint failed to compile."""
        state = request.constraint
        if state is None or state.matcher is not None:
            return True
        if not state.compiled.done():
            if state.job is not None:
                self.compiler.check(state.job, state.since)  # type: ignore[union-attr]
            return False
        state.compiled_now()
        try:
            compiled = state.compiled.result()
        except Exception as error:
            raise ValueError(str(error)) from None
        if self._process is None:
            state.matcher = self._backend.result().matcher(compiled)  # type: ignore[union-attr]
            return True
        if not self._process.done():
            return False
        try:
            process = self._process.result()
        except Exception as error:
            self._start_again_later()
            raise ValueError(f"structured outputs: {error}") from None
        state.matcher = RemoteMatcher(process)
        self._made.append((state.matcher.handle, *compiled))
        if state.active and state.start is not None:  # made again (its fill process died): it catches up
            self._accepted.extend(
                (request.request_id, state, token) for token in request.output_token_ids[state.start :]
            )
        return True

    def _start_again_later(self) -> None:
        """The fill processes failed to start: start them again once :data:`FILL_START_RETRY_S` passed."""
        now = time.monotonic()
        if self._start_failed_at is None:
            self._start_failed_at = now
        elif now - self._start_failed_at >= FILL_START_RETRY_S:
            logger.warning(
                "structured outputs: starting the fill processes again (they failed to start %.0f s ago)",
                now - self._start_failed_at,
            )
            self._start_failed_at = None
            self._process = self._pool.submit(self._start_process)  # type: ignore[union-attr]

    def verifiable(self, request: Request, proposals: list[int]) -> list[int]:
        """The speculative proposals a constrained request may verify in its next step: at most what the backend's
        matchers roll back (:meth:`ConstraintState.verifiable`)."""
        most = self._backend_class.max_rollback_tokens
        return request.constraint.verifiable(request.output_token_ids, proposals, most)  # type: ignore[union-attr]

    def accept(self, request: Request, token_id: int) -> None:
        """Record a token the request just generated (its matcher takes it on the fill thread, before the next fill)."""
        state = request.constraint
        if state is None or state.failed or state.terminated or state.matcher is None:
            return
        if state.opener is not None:  # the first output token: an answer, or the opening of the reasoning
            opener, state.opener = state.opener, None
            if token_id == opener:
                state.active, state.start = False, None
                return
        if not state.active:
            tail = request.output_token_ids[-len(state.starts_after) :]
            state.active = tuple(tail) == state.starts_after
            if state.active:
                state.start = len(request.output_token_ids)
            return
        self._accepted.append((request.request_id, state, token_id))

    def release(self, request: Request) -> None:
        """The request ended: its tokens not taken yet are dropped (they held its compiled constraint until the next
        constrained step), then its constraint is released (:meth:`ConstraintState.release`)."""
        state = request.constraint
        assert state is not None
        if any(entry[1] is state for entry in self._accepted):
            self._accepted = [entry for entry in self._accepted if entry[1] is not state]
        state.release()

    def recover(self, requests: Iterable[Request]) -> None:
        """After a failed step (its requests preempted): fill processes of which one exited, or whose step failed
        (a matcher may have taken part of its tokens), are replaced (started again in the background), and the
        matchers of ``requests`` are made again in the new ones once they run, each catching up on what its
        request generated under its constraint (:meth:`ready`, which holds the request back until then)."""
        process = self._process
        if process is None or not process.done() or process.exception() is not None:
            return
        group = process.result()
        failed, self._fill_failed = self._fill_failed, False
        if group.alive and not failed:
            return
        logger.error(
            "structured outputs: %s (exit codes %s); starting %d fill processes again; the constrained "
            "requests continue once their matchers are made again",
            "a fill process exited" if not group.alive else "a fill step failed",
            group.exit_codes,
            len(group.children),
        )
        group.close()
        self._made, self._accepted = [], []  # for matchers of the group that is gone
        self._process = self._pool.submit(self._start_process)  # type: ignore[union-attr]
        for request in requests:
            state = request.constraint
            if state is not None and isinstance(state.matcher, RemoteMatcher):
                state.matcher.release.detach()
                state.matcher = None

    # Steps.

    def grammar_output(
        self, request_ids: list[str], requests: dict[str, Request], proposals: dict[str, list[int]] | None = None
    ) -> Future[GrammarOutput]:
        """The bitmask rows of the requests among ``request_ids`` whose constraint is active now, filled on
        the fill thread once every matcher took the tokens :meth:`accept` recorded; a request verifying
        ``proposals[request_id]`` gets a row per position (:func:`~weft.engine.core.grammar_proposals.fill_positions`).
        Call neither method again before taking the result."""
        candidates = [
            (request_id, request.constraint)
            for request_id in request_ids
            if (request := requests.get(request_id)) is not None and request.constraint is not None
        ]
        if not candidates:  # finished meanwhile: the recorded tokens wait for the next fill
            empty: Future[GrammarOutput] = Future()
            empty.set_result(GrammarOutput([], b""))
            return empty
        accepted, self._accepted = self._accepted, []
        proposals = proposals or {}
        if self._process is not None:
            made, self._made = self._made, []
            failed, over_budget = self._mark_fill_failed, self._thread_fill.budget.message  # type: ignore[union-attr]
            return send_remote(self._process, accepted, candidates, made, proposals, failed, over_budget)
        return self._filler.submit(self._thread_fill.accept_and_fill, accepted, candidates, proposals)  # type: ignore[union-attr]

    def _mark_fill_failed(self) -> None:
        """A step's answer could not be read (:meth:`recover`)."""
        self._fill_failed = True

    # Compilation.

    def _compile(self, constraint: StructuredOutputsParams) -> Any:
        with self._lock:
            if self._pool is None:
                self._start()
        return self.compiler.submit(constraint)  # type: ignore[union-attr]

    def _forget_compiled(self, compiled: Any) -> None:
        """The compiler's cache dropped ``compiled``: the fill processes drop it with the next step."""
        if self._process is not None and self._process.done() and self._process.exception() is None:
            self._process.result().forget(compiled[0])

    def _start(self) -> None:
        from weft.plugins.selection import select_structured_output

        self._backend_class = select_structured_output(self.registry, self.config.use.structured_output)
        if self._backend_class is None:
            raise ValueError(no_backend_message(self.config))
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, min(4, usable_cpus() // 2)), thread_name_prefix="weft-grammar"
        )
        self._filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weft-grammar-fill")
        self._backend = self._pool.submit(
            _build_backend, self.config, self.registry, self.source, self.vocab_size, self._backend_class
        )
        self._thread_fill = ThreadFill(
            self._backend, self.vocab_size, FillBudget(self.config.engine.structured_output_fill_budget)
        )
        if fills_in_a_process(self.config, self._backend_class):
            self._process = self._pool.submit(self._start_process)
        engine = self.config.engine
        self.compiler = Compiler(
            self._compile_now,
            self._compiled_bytes,
            max(1, min(4, usable_cpus() // 2)),
            engine.structured_output_max_bytes,
            engine.structured_output_compile_timeout,
            engine.structured_output_cache_bytes,
            self._forget_compiled,
        )

    def _start_process(self) -> FillGroup:
        backend = self._backend.result()  # type: ignore[union-attr]
        count = self.config.engine.structured_output_fill_processes or default_processes()
        group = FillGroup(
            self._backend_class,
            backend.options,
            backend.vocabulary,
            bitmask_words(self.vocab_size),
            count,
            budget=self.config.engine.structured_output_fill_budget,
        )
        logger.debug(
            "structured outputs: bitmasks filled in %d process%s of their own (pid %s)",
            count,
            "" if count == 1 else "es",
            ", ".join(str(pid) for pid in group.pids),
        )
        return group

    def _compiled_bytes(self, compiled: Any) -> int:
        """What a compiled constraint keeps in the core: its bytes for the fill processes, else as the backend
        counts it."""
        if self._process is not None:
            return len(compiled[1])
        return self._backend.result().compiled_bytes(compiled)  # type: ignore[union-attr]

    def _compile_now(self, constraint: StructuredOutputsParams) -> Any:
        """The compiled constraint; for the fill process, its key and its bytes."""
        backend = self._backend.result()  # type: ignore[union-attr]
        compiled = backend.compile(constraint)
        if self._process is None:
            return compiled
        return next(self._keys), backend.serialize_compiled(compiled)

    def close(self) -> None:
        if self._pool is not None:
            self.compiler.close()  # type: ignore[union-attr]
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._filler.shutdown(wait=True)  # type: ignore[union-attr]
            if self._process is not None:
                process, self._process = self._process, None
                if process.done():
                    if process.exception() is None:
                        process.result().close()
                else:  # still starting (a restart): closed once it has
                    process.add_done_callback(lambda started: started.exception() or started.result().close())
            if self._backend is not None and self._backend.done() and self._backend.exception() is None:
                self._backend.result().close()
            self._pool = None


class ThreadFill:
    """The fill thread's work where the matchers live in the core: each step, the matchers take the tokens recorded
    since the last fill, then the constraints that mask fill their bitmask rows."""

    def __init__(self, backend: Future[StructuredOutputBackend], vocab_size: int, budget: FillBudget) -> None:
        self._backend = backend
        self.vocab_size = vocab_size
        """Width of the model's logits."""
        self.budget = budget
        """What one request's mask may cost in a step: a request over it fails (:attr:`ConstraintState.exceeded`)."""
        self._bitmask: torch.Tensor | None = None
        """The rows filled last (grown, never shrunk)."""
        self._advanced: weakref.WeakKeyDictionary[ConstraintState, list[int]] = weakref.WeakKeyDictionary()
        """The proposals each matcher took tentatively in its last fill, until its tokens settle them
        (:func:`~weft.engine.core.grammar_proposals.settle`); an ended request's entry goes with its state."""

    def accept_and_fill(
        self,
        accepted: list[tuple[str, ConstraintState, int]],
        candidates: list[tuple[str, ConstraintState]],
        proposals: dict[str, list[int]],
    ) -> GrammarOutput:
        self._accept(accepted, [state for _, state in candidates])
        return self._fill(candidates, proposals)

    def _accept(self, accepted: list[tuple[str, ConstraintState, int]], filling: list[ConstraintState]) -> None:
        """Tokens in the order they were generated: first those the matchers took as proposals (kept, the rest
        rolled back), then the others in batches where each matcher appears once."""
        if self._advanced:
            keep, ended = settle(
                self._advanced,
                [(state, token_id) for _, state, token_id in accepted],
                filling,
                lambda state: state.matcher,  # type: ignore[arg-type,return-value]
            )
            for _, state in ended:
                state.terminated = True
            accepted = [accepted[index] for index in keep]
        for batch in distinct_batches(accepted, lambda item: id(item[1])):
            self._accept_batch(batch)

    def _accept_batch(self, batch: list[tuple[str, ConstraintState, int]]) -> None:
        """Each matcher (once in ``batch``) takes its token in one backend call; a constraint already over takes
        nothing, one refusing its token is marked failed."""
        live = [
            (request_id, state, token_id)
            for request_id, state, token_id in batch
            if not (state.failed or state.terminated)
        ]
        if not live:
            return
        results = self._backend.result().accept_tokens(  # type: ignore[union-attr]
            [state.matcher for _, state, _ in live], [token_id for _, _, token_id in live]
        )  # type: ignore[misc]
        for (request_id, state, token_id), (ok, terminated) in zip(live, results, strict=True):
            if ok:
                state.terminated = terminated
                continue
            refused(request_id, state, token_id)

    def _fill(self, candidates: list[tuple[str, ConstraintState]], proposals: dict[str, list[int]]) -> GrammarOutput:
        # Still reasoning, or done: it samples freely.
        masked = [(request_id, state) for request_id, state in candidates if state.masks]
        if not masked:
            return GrammarOutput([], b"")
        proposed = [proposals.get(request_id, []) for request_id, _ in masked]
        bitmask = self._rows(len(masked) + sum(map(len, proposed)))
        over: set[int] = set()
        matchers = [state.matcher for _, state in masked]
        took = fill_positions(self._backend.result(), matchers, proposed, bitmask, self.budget, over)  # type: ignore[arg-type]
        for (_, state), advanced in zip(masked, took, strict=True):
            if advanced:
                self._advanced[state] = advanced
        for index in over:
            masked[index][1].exceeded = self.budget.message()
        if any(state.opener is not None for _, state in masked):
            # The opener may be a request's first output token: its first position's row allows it.
            rows = [[state.opener, *[None] * len(tokens)] for (_, state), tokens in zip(masked, proposed, strict=True)]
            allow(bitmask.numpy().view(numpy.uint32), [token for row in rows for token in row])
        return GrammarOutput([request_id for request_id, _ in masked], bitmask.numpy().tobytes())

    def _rows(self, count: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < count:
            self._bitmask = torch.empty(max(count, 64), bitmask_words(self.vocab_size), dtype=torch.int32)
        return self._bitmask[:count]


def _build_backend(
    config: WeftConfig,
    registry: PluginRegistry,
    source: Any,
    vocab_size: int,
    backend_class: type[StructuredOutputBackend],
) -> StructuredOutputBackend:
    from weft.resolve import load_tokenizer, options_for

    tokenizer = load_tokenizer(registry, config, source)
    tokens = tokenizer.vocabulary_bytes()
    vocabulary = Vocabulary(tokens[:vocab_size], vocab_size, tuple(sorted(tokenizer.eos_token_ids)))
    backend = backend_class(options_for(config, "structured_output", backend_class, backend_class.name), vocabulary)
    logger.debug("structured outputs: backend %r over %d tokens", backend_class.name, len(tokens))
    return backend


def fills_in_a_process(config: WeftConfig, backend_class: type[StructuredOutputBackend]) -> bool:
    """``engine.structured_output_fill``: "process" (refused for a backend that cannot), "thread", or "auto" (a
    process where the backend can and the machine has 8 CPUs or more, or ``engine.structured_output_fill_processes``
    is set: on fewer the process's CPU is one the core's own work needs)."""
    setting = config.engine.structured_output_fill
    if setting == "process" and not backend_class.fills_in_a_process():
        raise ValueError(
            f"engine.structured_output_fill = 'process', but the {backend_class.name!r} structured-output "
            "backend cannot serialize its compiled constraints; set it to 'thread' or 'auto'"
        )
    if setting == "auto":
        return backend_class.fills_in_a_process() and (
            usable_cpus() >= SPIN_MIN_CPUS or config.engine.structured_output_fill_processes is not None
        )
    return setting == "process"
