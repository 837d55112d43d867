"""Chat templates rendered in a sandboxed Jinja environment, with ``{% generation %}`` blocks.

Hugging Face chat templates may wrap the assistant's text in
``{% generation %}...{% endgeneration %}`` to mark the tokens a model is
trained on. :class:`GenerationExtension` parses the tag with Jinja's own
parser into a call block: the body renders as usual (whitespace control,
literals, comments and raw blocks untouched; variables set inside stay local)
and the rendered span is recorded. Unclosed, stray or argument-carrying tags
are Jinja syntax errors.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from jinja2 import TemplateRuntimeError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class GenerationExtension(Extension):
    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_mark", []), [], [], body).set_lineno(lineno)

    def _mark(self, caller: Any) -> str:
        text = caller()
        spans = self.environment.globals.get("_generation_spans")
        if spans is not None:
            spans.append(text)
        return text


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationExtension, loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment


class ChatTemplate:
    """A compiled chat template."""

    def __init__(self, source: str) -> None:
        self.environment = _environment()
        self.template = self.environment.from_string(source)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **variables: Any) -> str:
        """The template's text for ``messages``; TemplateError when it fails on them (an expression of the template
        that does not apply to what the messages hold raises TypeError, KeyError... in Python)."""
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except (TypeError, LookupError, AttributeError, ArithmeticError) as error:
            raise TemplateRuntimeError(f"{type(error).__name__}: {error}") from error

    def render_with_generation_spans(
        self, messages: list[dict[str, Any]], **variables: Any
    ) -> tuple[str, list[tuple[int, int]]]:
        """Render, and return the character spans of every ``{% generation %}`` block's output."""
        pieces: list[str] = []
        self.environment.globals["_generation_spans"] = pieces
        try:
            text = self.render(messages, **variables)
        finally:
            self.environment.globals.pop("_generation_spans", None)
        spans, cursor = [], 0
        for piece in pieces:
            start = text.find(piece, cursor)
            if start == -1:
                continue
            spans.append((start, start + len(piece)))
            cursor = start + len(piece)
        return text, spans
