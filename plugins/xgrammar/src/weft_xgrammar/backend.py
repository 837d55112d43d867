"""The ``xgrammar`` structured-output backend.

xgrammar compiles a JSON schema, regular expression or EBNF grammar against the model's
vocabulary into a compiled grammar (its own cache keeps those too); a ``GrammarMatcher``
walks one request through it, filling the int32 bitmask rows Weft's contract fixes (the
same layout xgrammar uses). Validation parses the constraint without a vocabulary, which
is cheap and catches what compiling would refuse.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import msgspec

from weft.api import usable_cpus
from weft.contracts.structured_output import (
    GrammarMatcher,
    StructuredOutputBackend,
    StructuredOutputsParams,
    Vocabulary,
)

if TYPE_CHECKING:
    import torch


class XgrammarOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    compile_threads: Annotated[
        int,
        msgspec.Meta(
            ge=1,
            description="threads xgrammar compiles one grammar with (at most the usable CPUs less one: on 2 CPUs, "
            "8 compile threads made plain requests 4x slower while a large schema compiled)",
        ),
    ] = 8
    cache_limit_bytes: Annotated[
        int, msgspec.Meta(ge=0, description="memory for xgrammar's cache of compiled grammars (0: no limit)")
    ] = 256 << 20
    fill_threads: Annotated[
        int,
        msgspec.Meta(
            ge=1,
            description="xgrammar threads filling one step's bitmask rows, in each fill process or the fill thread (at "
            "most the usable CPUs less one); default 1: on an H200 machine's CPU more gained nothing at batch 32, "
            "and 4 threads in each of two fill processes tripled the wait for the mask",
        ),
    ] = 1
    max_whitespace: Annotated[
        int, msgspec.Meta(ge=1, description="JSON with free whitespace: most whitespace characters in a row")
    ] = 4


_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s+\S+:\d+:\s*")
_BOUNDED_STRING_CHARACTER = re.compile(r'^(\w+ ::= \(\()\[\^\\"\\\\\\r\\n\](\)\))$', re.MULTILINE)
"""The rule xgrammar 0.2.9 writes for one character of a string with ``maxLength`` or ``minLength``, a whole
line of the grammar's text: its class leaves out only the quote, the backslash, CR and LF, so it admits raw
control characters (U+0000-U+001F), which JSON forbids in a string (xgrammar's rule for other strings keeps them
out)."""
_JSON_STRING_CHARACTER = r"[^\0-\x1f\"\\]"
"""One unescaped character of a JSON string (RFC 8259: not a quote, a backslash or a control character)."""

_PARALLEL_ROWS = 16
"""From this many rows a step's bitmask is filled by xgrammar's threads."""


UNENFORCED_KEYWORDS = (
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "not",
    "propertyNames",
    "dependentRequired",
    "dependentSchemas",
    "if",
    "then",
    "else",
    "unevaluatedProperties",
    "unevaluatedItems",
)
"""JSON-schema keywords xgrammar's grammar leaves out (it compiles them as if absent, or as anything): a schema
using one is refused, rather than answered with JSON that breaks it."""

SUPPORTED_KEYWORDS = (
    "type",
    "properties",
    "required",
    "additionalProperties",
    "patternProperties",
    "minProperties",
    "maxProperties",
    "items",
    "prefixItems",
    "minItems",
    "maxItems",
    "enum",
    "const",
    "anyOf",
    "oneOf",
    "allOf",
    "$ref",
    "$defs",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
)
"""What the 400 for an unenforced keyword lists as usable instead."""

_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMAS = ("anyOf", "oneOf", "allOf", "prefixItems", "items", "additionalProperties", "additionalItems")
"""Where enforced keywords hold subschemas to search (a schema holding an unenforced keyword is refused before its
subschemas are searched)."""


def unenforced_keyword(schema: Any) -> str | None:
    """The JSON pointer of the first keyword of :data:`UNENFORCED_KEYWORDS` in ``schema`` (``uniqueItems: false``
    constrains nothing and passes), or None."""

    def here(node: dict, path: str) -> str | None:
        for keyword in UNENFORCED_KEYWORDS:
            if keyword in node and not (keyword == "uniqueItems" and node[keyword] is False):
                return f"{path}/{keyword}"
        return None

    return _first(schema, here)


COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
"""Keywords whose value JSON Schema requires to be a non-negative integer."""


def bad_count(schema: Any) -> str | None:
    """What is wrong with the first keyword of :data:`COUNT_KEYWORDS` in ``schema`` that is not a non-negative
    integer (xgrammar reports it as a parse error of the grammar it writes), or None."""

    def here(node: dict, path: str) -> str | None:
        for keyword in COUNT_KEYWORDS:
            value = node.get(keyword)
            if keyword in node and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                return f"{keyword} = {value!r} (at {path}/{keyword}) must be a non-negative integer"
        return None

    return _first(schema, here)


def _first(schema: Any, here: Callable[[dict, str], str | None], path: str = "#") -> str | None:
    """The first answer of ``here`` (a schema object, its JSON pointer) over ``schema`` and the subschemas of enforced
    keywords, depth first, or None (a schema for which ``here`` answers is not searched further)."""
    if isinstance(schema, list):  # items as a list (draft 4-7 tuples)
        return next(
            (found for index, item in enumerate(schema) if (found := _first(item, here, f"{path}/{index}"))), None
        )
    if not isinstance(schema, dict):
        return None
    if (found := here(schema, path)) is not None:
        return found
    for keyword in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(keyword), dict):
            for name, child in schema[keyword].items():
                if (found := _first(child, here, f"{path}/{keyword}/{name}")) is not None:
                    return found
    for keyword in _SUBSCHEMAS:
        if keyword in schema and (found := _first(schema[keyword], here, f"{path}/{keyword}")) is not None:
            return found
    return None


def _reason(error: Exception) -> str:
    """xgrammar's message without its timestamp and C++ source location."""
    return _SOURCE_PREFIX.sub("", str(error).strip()).strip()


def _bounded_strings_fixed(grammar: str) -> str:
    """``grammar`` (xgrammar's for a JSON schema) with its length-bounded strings keeping raw control characters out."""
    return _BOUNDED_STRING_CHARACTER.sub(lambda rule: rule[1] + _JSON_STRING_CHARACTER + rule[2], grammar)


def spare_threads(wanted: int) -> int:
    """``wanted`` threads, at most the CPUs this process may use (affinity, cgroup quota) less one, at least one."""
    return max(1, min(wanted, usable_cpus() - 1))


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF whose only sentences are ``choices`` (JSON string escapes are valid EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


class XgrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


class XgrammarBackend(StructuredOutputBackend):
    """JSON schema, JSON object, regex, choice and EBNF constraints on xgrammar."""

    name: ClassVar[str] = "xgrammar"
    max_rollback_tokens: ClassVar[int] = 1 << 30
    Options: ClassVar[type[msgspec.Struct]] = XgrammarOptions
    options: XgrammarOptions

    def __init__(self, options: msgspec.Struct | None, vocabulary: Vocabulary) -> None:
        super().__init__(options, vocabulary)
        import xgrammar as xgr

        self._xgr = xgr
        info = xgr.TokenizerInfo(
            vocabulary.token_bytes,
            xgr.VocabType.RAW,
            vocab_size=vocabulary.size,
            stop_token_ids=list(vocabulary.eos_token_ids),
        )
        self._info = info
        self._stop_token_ids = frozenset(info.stop_token_ids)
        self.compiler = xgr.GrammarCompiler(
            info,
            max_threads=spare_threads(self.options.compile_threads),
            cache_enabled=True,
            cache_limit_bytes=self.options.cache_limit_bytes or -1,
        )
        # The fill overlaps the engine core's scheduling or forward: leave it a CPU (on a 2-CPU machine one
        # fill thread gave 0.79x the plain throughput where two gave 0.67-0.73x, bench/structured_output.py --tiny).
        self.batch = xgr.BatchGrammarMatcher(max_threads=spare_threads(self.options.fill_threads))

    @classmethod
    def validate(cls, constraint: StructuredOutputsParams) -> None:
        import xgrammar as xgr

        kind = constraint.kind
        schema = constraint.schema()  # its own ValueError when it is not a JSON object
        if (keyword := unenforced_keyword(schema)) is not None:
            raise ValueError(
                f"structured_outputs.json: the schema uses {keyword.rsplit('/', 1)[1]!r} (at {keyword}), which "
                f"xgrammar does not enforce; remove it (enforced: {', '.join(SUPPORTED_KEYWORDS)})"
            )
        if (problem := bad_count(schema)) is not None:
            raise ValueError(f"structured_outputs.json: {problem}")
        try:
            if kind == "json":
                grammar = str(
                    xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=constraint.any_whitespace)
                )
                if (fixed := _bounded_strings_fixed(grammar)) != grammar:  # what compile() compiles: its errors too
                    xgr.Grammar.from_ebnf(fixed)
            elif kind == "regex":
                if "\x00" in constraint.regex:  # type: ignore[operator]
                    raise ValueError("contains a NUL character")
                xgr.Grammar.from_regex(constraint.regex)
            elif kind == "choice":
                xgr.Grammar.from_ebnf(choice_grammar(constraint.choice))  # type: ignore[arg-type]
            elif kind == "grammar":
                xgr.Grammar.from_ebnf(constraint.grammar)
        except Exception as error:
            raise ValueError(f"structured_outputs.{kind}: xgrammar cannot compile it: {_reason(error)}") from None

    def compile(self, constraint: StructuredOutputsParams) -> Any:
        try:
            return self._compile(constraint)
        except RuntimeError as error:  # xgrammar's own message, without its timestamp and C++ source location
            raise ValueError(
                f"structured_outputs.{constraint.kind}: xgrammar cannot compile it: {_reason(error)}"
            ) from None

    def _compile(self, constraint: StructuredOutputsParams) -> Any:
        compiler, kind = self.compiler, constraint.kind
        whitespace = {"any_whitespace": constraint.any_whitespace}
        if constraint.any_whitespace:
            whitespace["max_whitespace_cnt"] = self.options.max_whitespace
        else:
            whitespace["separators"] = (",", ":")
        if kind == "json":
            return self._compile_json_schema(constraint.json, strict_mode=True, **whitespace)  # type: ignore[arg-type]
        if kind == "json_object":
            return self._compile_json_schema('{"type": "object"}', strict_mode=False, **whitespace)
        if kind == "regex":
            return compiler.compile_regex(constraint.regex)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(constraint.choice))  # type: ignore[arg-type]
        return compiler.compile_grammar(constraint.grammar)

    def _compile_json_schema(self, schema: str, **settings: Any) -> Any:
        """xgrammar's grammar for ``schema``, its length-bounded strings keeping raw control characters out."""
        grammar = str(self._xgr.Grammar.from_json_schema(schema, **settings))
        fixed = _bounded_strings_fixed(grammar)
        if fixed == grammar:
            return self.compiler.compile_json_schema(schema, **settings)
        return self.compiler.compile_grammar(fixed)

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return XgrammarMatcher(self._xgr.GrammarMatcher(compiled))  # xgrammar rolls back any number of tokens

    def compiled_bytes(self, compiled: Any) -> int:
        return int(compiled.memory_size_bytes)

    def serialize_compiled(self, compiled: Any) -> bytes:
        return compiled.serialize_json().encode()

    def deserialize_compiled(self, data: bytes) -> Any:
        return self._xgr.CompiledGrammar.deserialize_json(data.decode(), self._info)

    def accept_tokens(self, matchers: Sequence[GrammarMatcher], tokens: Sequence[int]) -> list[tuple[bool, bool]]:
        """One call of xgrammar's batch accept (one release of the GIL rather than one per token); a matcher
        terminates only on accepting a stop token (matchers are made with ``terminate_without_stop_token``
        off), so only those are asked."""
        if not all(isinstance(matcher, XgrammarMatcher) for matcher in matchers):
            return super().accept_tokens(matchers, tokens)
        accepted = self._xgr.BatchGrammarMatcher.batch_accept_token(
            [matcher.matcher for matcher in matchers], list(tokens)
        )  # type: ignore[attr-defined]
        stops = self._stop_token_ids
        return [
            (ok, ok and token in stops and matcher.is_terminated())
            for matcher, token, ok in zip(matchers, tokens, accepted, strict=True)
        ]

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor) -> None:
        if len(matchers) < _PARALLEL_ROWS or not all(isinstance(matcher, XgrammarMatcher) for matcher in matchers):
            super().fill_bitmasks(matchers, bitmask)
            return
        self.batch.batch_fill_next_token_bitmask([matcher.matcher for matcher in matchers], bitmask)  # type: ignore[attr-defined]

    def close(self) -> None:
        self.compiler.clear_cache()
