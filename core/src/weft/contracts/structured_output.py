"""The structured-output slot: grammar-constrained decoding.

A request's :class:`StructuredOutputsParams` (vLLM's ``structured_outputs``: a JSON
schema, a regular expression, a choice of strings, an EBNF grammar, or any JSON
object) constrains every token it generates. A backend turns the constraint into
a token mask per step.

Where each call happens:

* API side, per request: :meth:`StructuredOutputBackend.validate` (a class method:
  no vocabulary, no compilation) refuses a constraint the backend cannot compile,
  with a ValueError naming the problem, which the server answers with a 400.
* Engine core, once: ``Backend(options, vocabulary)``, off the step loop.
* Engine core, once per distinct constraint: :meth:`StructuredOutputBackend.compile`
  on a worker thread, never on the step's critical path; the engine caches the
  result by constraint, so identical constraints compile once. A request waits
  (unscheduled, costing no step time) until its constraint is compiled.
* Engine core, per request: :meth:`StructuredOutputBackend.matcher` gives a fresh
  :class:`GrammarMatcher` over the compiled constraint.
* Engine core, per step: for each request that samples under its constraint,
  :meth:`GrammarMatcher.fill_bitmask` writes the row of allowed tokens; the rows go
  to the workers with the step (:class:`~weft.contracts.executor.GrammarOutput`),
  which apply them to the logits on the device. The core fills them while the
  workers run the step's forward, or while it schedules the next step.
* Engine core, per sampled token: :meth:`GrammarMatcher.accept_token`, just before the
  request's next fill; :meth:`GrammarMatcher.rollback` undoes tokens (speculative tokens a
  verifier rejected). Accepting and filling run on one thread of their own, never
  concurrently with each other for a matcher.

The bitmask layout is fixed: ``int32`` rows of ``bitmask_words(vocab_size)`` words;
bit ``i % 32`` of word ``i // 32`` is 1 when token ``i`` is allowed.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from weft.contracts.plugin import PluginBase

if TYPE_CHECKING:
    import torch


class StructuredOutputsParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One constraint on a request's output: exactly one of the fields.

    ``json`` is a JSON schema (a dict, or its JSON text); ``json_object`` asks for
    any JSON object; ``regex`` a regular expression the whole output matches;
    ``choice`` one of the strings exactly; ``grammar`` an EBNF grammar (xgrammar's
    dialect of GBNF: ``root ::= ...``). ``any_whitespace`` lets JSON output put any
    whitespace between tokens (off: compact separators only).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    any_whitespace: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            # Compact text: equal schemas are one cache entry, and the Struct stays hashable. Key order
            # is kept: a schema's property order is the order the output writes them in.
            msgspec.structs.force_setattr(self, "json", json.dumps(self.json, separators=(",", ":")))
        if self.choice is not None:
            msgspec.structs.force_setattr(self, "choice", tuple(self.choice))
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                f"structured_outputs: give exactly one of json, regex, choice, grammar or json_object; "
                f"got {', '.join(given) or 'none'}"
            )
        if self.choice is not None and (not self.choice or not all(isinstance(item, str) for item in self.choice)):
            raise ValueError(f"structured_outputs.choice = {list(self.choice)!r}: give a non-empty list of strings")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ValueError(f"structured_outputs.{name}: must not be empty")

    @property
    def kind(self) -> str:
        """``json``, ``json_object``, ``regex``, ``choice`` or ``grammar``."""
        if self.json_object:
            return "json_object"
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema as a dict (None unless ``json`` is set); ValueError when it is not JSON."""
        if self.json is None:
            return None
        try:
            schema = json.loads(self.json)  # type: ignore[arg-type]
        except ValueError as error:
            raise ValueError(f"structured_outputs.json: not valid JSON: {error}") from None
        except RecursionError:
            raise ValueError("structured_outputs.json: nested too deeply to read; send a flatter schema") from None
        if not isinstance(schema, dict):
            raise ValueError(f"structured_outputs.json: a JSON schema is an object; got {type(schema).__name__}")
        return schema


class Vocabulary(msgspec.Struct, frozen=True):
    """The model's tokens as a grammar engine needs them."""

    token_bytes: list[bytes]
    """Per token id, the bytes it adds to decoded text; ``b""`` for special tokens (never allowed inside a
    constraint)."""
    size: int
    """Width of the model's logits (may exceed ``len(token_bytes)``: padded embeddings, never allowed)."""
    eos_token_ids: tuple[int, ...]
    """Tokens that end the output once the constraint is complete."""


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return (vocab_size + 31) // 32


class GrammarMatcher(ABC):
    """One request's position in its compiled constraint. Used from one thread at a time."""

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance over a sampled token; False (and no change) when the constraint forbids it."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of an int32 CPU ``bitmask`` (layout: module docstring)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (rejected speculative tokens)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the output is complete and an end token was accepted: nothing more may follow."""


class StructuredOutputBackend(PluginBase):
    """Compiles constraints for one vocabulary and hands out per-request matchers.

    Built as ``Backend(options, vocabulary)`` in the engine core's process.
    ``priority`` breaks the tie when ``use.structured_output = "auto"`` finds several backends.
    """

    name: ClassVar[str]
    priority: ClassVar[int] = 0
    max_rollback_tokens: ClassVar[int] = 16
    """How many tokens :meth:`GrammarMatcher.rollback` can undo at least."""

    def __init__(self, options: msgspec.Struct | None, vocabulary: Vocabulary) -> None:
        self.options = options if options is not None else self.Options()
        self.vocabulary = vocabulary

    @classmethod
    @abstractmethod
    def validate(cls, constraint: StructuredOutputsParams) -> None:
        """Raise ValueError naming the problem (``structured_outputs.json: ...``) when ``constraint``
        cannot be compiled. Cheap and vocabulary-free: the API side calls it for every request, in a worker
        process where the API process has no torch loaded (``weft serve``), so the class is found by its module
        path and the error is pickled back."""

    @abstractmethod
    def compile(self, constraint: StructuredOutputsParams) -> Any:
        """The compiled form of ``constraint`` (slow; thread-safe; called once per distinct constraint)."""

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of ``compiled`` (fast)."""

    def compiled_bytes(self, compiled: Any) -> int:
        """Memory ``compiled`` (from :meth:`compile`) takes, about: the engine keeps its cache of compiled
        constraints within ``engine.structured_output_cache_bytes`` by it. The default counts its serialized form
        where the backend has one, else 0 (only the cache's entry count bounds it then)."""
        return len(self.serialize_compiled(compiled)) if self.fills_in_a_process() else 0

    def serialize_compiled(self, compiled: Any) -> bytes:
        """``compiled`` (from :meth:`compile`) as bytes :meth:`deserialize_compiled` of a backend built alike in
        another process reads back; backends that implement both can fill in a process of their own
        (``engine.structured_output_fill``)."""
        raise NotImplementedError

    def deserialize_compiled(self, data: bytes) -> Any:
        raise NotImplementedError

    @classmethod
    def fills_in_a_process(cls) -> bool:
        """Whether the backend implements :meth:`serialize_compiled` and :meth:`deserialize_compiled`."""
        return (
            cls.serialize_compiled is not StructuredOutputBackend.serialize_compiled
            and cls.deserialize_compiled is not StructuredOutputBackend.deserialize_compiled
        )

    def accept_tokens(self, matchers: Sequence[GrammarMatcher], tokens: Sequence[int]) -> list[tuple[bool, bool]]:
        """For each ``matchers[i]``: :meth:`GrammarMatcher.accept_token` of ``tokens[i]``, then (when accepted)
        :meth:`GrammarMatcher.is_terminated`; a backend may do them all in one call."""
        results = []
        for matcher, token in zip(matchers, tokens, strict=True):
            accepted = matcher.accept_token(token)
            results.append((accepted, accepted and matcher.is_terminated()))
        return results

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor) -> None:
        """Fill row ``i`` of ``bitmask`` for ``matchers[i]``; a backend may spread the rows over threads."""
        for row, matcher in enumerate(matchers):
            matcher.fill_bitmask(bitmask, row)

    def close(self) -> None:
        """Release threads and caches. Idempotent."""
