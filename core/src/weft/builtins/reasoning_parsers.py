"""Core's reasoning parser ``think``: thinking between ``<think>`` and ``</think>`` (Qwen3, DeepSeek R1 and the
like)."""

from __future__ import annotations

from typing import ClassVar

from weft.builtins.tool_parsers import marker_overlap
from weft.contracts.reasoning_parser import ReasoningParser, ReasoningScan


class ThinkReasoningParser(ReasoningParser):
    """Reasoning is what comes before ``</think>``, when the output opens with ``<think>`` or the prompt
    ended inside an open ``<think>``. Without an end marker the whole output is reasoning if it was opened,
    else content."""

    name: ClassVar[str] = "think"
    architectures: ClassVar[tuple[str, ...]] = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")

    def scan(self, text: str, final: bool) -> ReasoningScan:
        body = text
        if not self.reasoning_opened():
            stripped = text.lstrip()
            if stripped.startswith(self.start):
                body = stripped[len(self.start) :]
            elif not final and self.start.startswith(stripped):
                return ReasoningScan("", "")  # the opening marker may be arriving
            else:
                return ReasoningScan("", text)
        closed = body.find(self.end)
        if closed < 0:
            held = 0 if final else marker_overlap(body, self.end)
            return ReasoningScan(body[: len(body) - held], "")
        return ReasoningScan(body[:closed], body[closed + len(self.end) :])
