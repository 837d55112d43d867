"""The reasoning-parser slot: separating a model's thinking from its answer.

Reasoning models write their thinking before the answer, between markers such as
``<think>`` and ``</think>`` (the opening one is often already in the prompt). A
parser splits a request's output into ``reasoning_content`` and ``content``.

``use.reasoning_parser`` names the parser; ``auto`` takes the one whose
:attr:`ReasoningParser.architectures` lists the checkpoint's architecture (none: the
output is all content).

A parser object serves one request: ``Parser(options, prompt)``, ``prompt`` being the
rendered prompt text (it tells whether the template opened the reasoning, or closed it
because thinking is off). As with tool parsers, a parser implements only
:meth:`ReasoningParser.scan`, prefix-stable over the whole text so far; the base class
derives :meth:`ReasoningParser.parse` (whole output) and :meth:`ReasoningParser.push` /
:meth:`ReasoningParser.finish` (streaming) from it.

A structured-output constraint applies to the answer only. When
:meth:`ReasoningParser.reasoning_expected` is true and :meth:`ReasoningParser.reasoning_opened`
too (the prompt opened the thinking), the engine starts constraining the output after the text
:attr:`ReasoningParser.end` has been generated. When the prompt did not open it, the output is
constrained from its first token, whose mask also allows :attr:`ReasoningParser.start` where that
is one token: an output opening with it reasons freely and is constrained after the end marker
(core API 1.12; before, such an output was never constrained unless it wrote the end marker).
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from typing import ClassVar

import msgspec

from weft.contracts.plugin import PluginBase

logger = logging.getLogger("weft.reasoning_parser")


class ReasoningScan(msgspec.Struct):
    reasoning: str
    """Thinking so far (without the markers)."""
    content: str
    """Answer so far. When not ``final``, hold back a tail that may be part of a marker."""


class ReasoningParser(PluginBase):
    """Splits one request's output into reasoning and answer."""

    name: ClassVar[str]
    architectures: ClassVar[tuple[str, ...]] = ()
    """Hugging Face architectures this parser is the default for (``use.reasoning_parser = "auto"``)."""
    needs_special_tokens: ClassVar[bool] = False
    """Whether the markers are special tokens, which the text must keep (``skip_special_tokens=False``)."""
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"

    def __init__(self, options: msgspec.Struct | None = None, prompt: str = "") -> None:
        self.options = options if options is not None else self.Options()
        self.prompt = prompt
        self._text = ""
        self._sent = (0, 0)

    @abstractmethod
    def scan(self, text: str, final: bool) -> ReasoningScan:
        """Reasoning and content in ``text`` (the whole output so far); ``final``: nothing more will come."""

    def reasoning_expected(self) -> bool:
        """Whether the output may begin with reasoning (default: unless the prompt closed it, thinking off)."""
        return not self.prompt.rstrip().endswith(self.end)

    def reasoning_opened(self) -> bool:
        """Whether the prompt opened the reasoning (its last marker is :attr:`start`), so the output begins inside
        it; when not, only an output opening with :attr:`start` reasons (core API 1.12)."""
        return self.prompt.rfind(self.start) > self.prompt.rfind(self.end)

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole output; None for an empty part."""
        scan = self._safe_scan(text, final=True)
        return scan.reasoning or None, scan.content or None

    def push(self, text: str) -> tuple[str, str]:
        """Add the next piece of output; returns the new ``(reasoning, content)`` pieces."""
        self._text += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        """The output ended: what was held back."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        scan = self._safe_scan(self._text, final)
        sent_reasoning, sent_content = self._sent
        self._sent = (max(sent_reasoning, len(scan.reasoning)), max(sent_content, len(scan.content)))
        return scan.reasoning[sent_reasoning:], scan.content[sent_content:]

    def _safe_scan(self, text: str, final: bool) -> ReasoningScan:
        try:
            return self.scan(text, final)
        except Exception:
            logger.warning(
                "reasoning parser %r failed on the output; it is returned as content", self.name, exc_info=True
            )
            return ReasoningScan("", text if final else "")
