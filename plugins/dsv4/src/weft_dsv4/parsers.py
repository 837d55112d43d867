"""DeepSeek V4's tool calls (DSML) and thinking, as Weft's ``dsv4`` tool and reasoning parsers.

Tool calls come after the answer's text, in DeepSeek's markup (DSML)::

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

A ``string="true"`` parameter's value is the text itself; otherwise it is JSON. The
arguments are rebuilt as a JSON object; a call is complete (and streams, whole) once its
``invoke`` closes.

Thinking: with thinking on, V4.1's template ends the prompt in an open ``<think>``; the model
thinks, closes with ``</think>`` and answers. A tool call may also end the thinking
without ``</think>``. With thinking off the prompt already ends with ``</think>``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, ClassVar

from weft.api import marker_overlap
from weft.contracts.reasoning_parser import ReasoningParser, ReasoningScan
from weft.contracts.tool_parser import PartialCall, Scan, ToolParser

ARCHITECTURES = ("DeepseekV4ForCausalLM",)
DSML = "｜DSML｜"
CALLS_START = f"<{DSML}tool_calls>"
CALLS_END = f"</{DSML}tool_calls>"
INVOKE_END = f"</{DSML}invoke>"
PARAMETER_END = f"</{DSML}parameter>"
_INVOKE = re.compile(rf'\s*<{DSML}invoke\s+name="([^"]*)"\s*>')
_PARAMETER = re.compile(rf'\s*<{DSML}parameter\s+name="([^"]*)"\s+string="(true|false)"\s*>')
_CLOSE_INVOKE = re.compile(rf"\s*{re.escape(INVOKE_END)}")


class DeepseekV4ToolParser(ToolParser):
    """DSML ``<｜DSML｜tool_calls>`` blocks of ``invoke`` elements with ``parameter`` children."""

    name: ClassVar[str] = "dsv4"
    architectures: ClassVar[tuple[str, ...]] = ARCHITECTURES
    needs_special_tokens: ClassVar[bool] = True

    def scan(self, text: str, final: bool) -> Scan:
        opened = text.find(CALLS_START)
        if opened < 0:
            return Scan(text if final else text[: len(text) - marker_overlap(text, CALLS_START)], [])
        calls: list[PartialCall] = []
        position = opened + len(CALLS_START)
        while True:
            invoke = _INVOKE.match(text, position)
            if invoke is None:
                break
            call, position = self._invoke(text, invoke)
            calls.append(call)
            if not call.complete:
                break
        closed = text.find(CALLS_END, position)
        after = text[closed + len(CALLS_END) :] if closed >= 0 else ""
        return Scan(text[:opened] + after, calls)

    def _invoke(self, text: str, invoke: re.Match[str]) -> tuple[PartialCall, int]:
        """One call from its ``invoke`` tag; the position after what was read."""
        parts: list[str] = []
        position = invoke.end()
        while True:
            close = _CLOSE_INVOKE.match(text, position)
            if close is not None:
                body = "{" + ", ".join(parts) + "}"
                return PartialCall(invoke[1], body, True, text[invoke.start() : close.end()]), close.end()
            parameter = _PARAMETER.match(text, position)
            if parameter is None:
                break
            value_end = text.find(PARAMETER_END, parameter.end())
            key = json.dumps(parameter[1], ensure_ascii=False)
            if value_end < 0:
                break
            raw = text[parameter.end() : value_end]
            parts.append(f"{key}: {_value(raw, parameter[2] == 'true')}")
            position = value_end + len(PARAMETER_END)
        arguments = "{" + ", ".join(parts)
        return PartialCall(invoke[1], arguments, False, text[invoke.start() :]), len(text)

    def render_calls(self, calls: Sequence[dict[str, Any]]) -> str:
        invokes = []
        for call in calls:
            arguments = call["arguments"] if isinstance(call["arguments"], dict) else {}
            parameters = "".join(
                f'<{DSML}parameter name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
                f"{value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}{PARAMETER_END}\n"
                for key, value in arguments.items()
            )
            invokes.append(f'<{DSML}invoke name="{call["name"]}">\n{parameters}{INVOKE_END}')
        return f"{CALLS_START}\n" + "\n".join(invokes) + f"\n{CALLS_END}"


def _value(raw: str, is_string: bool) -> str:
    """A parameter's value as JSON text: a string parameter's text, else the JSON it holds (as a string if it is
    none)."""
    if is_string:
        return json.dumps(raw, ensure_ascii=False)
    try:
        return json.dumps(json.loads(raw), ensure_ascii=False)
    except ValueError:
        return json.dumps(raw, ensure_ascii=False)


class DeepseekV4ReasoningParser(ReasoningParser):
    """V4's thinking: from the prompt's ``<think>`` to ``</think>`` (or to a tool call, which ends it too)."""

    name: ClassVar[str] = "dsv4"
    architectures: ClassVar[tuple[str, ...]] = ARCHITECTURES
    needs_special_tokens: ClassVar[bool] = True

    def reasoning_expected(self) -> bool:
        """The template opened the thinking: the prompt's last marker is ``<think>``, not ``</think>``."""
        return self.prompt.rfind(self.start) > self.prompt.rfind(self.end)

    def scan(self, text: str, final: bool) -> ReasoningScan:
        if not self.reasoning_expected():
            return ReasoningScan("", text)
        ends = [(at, marker) for marker in (self.end, CALLS_START) if (at := text.find(marker)) >= 0]
        if not ends:
            held = 0 if final else max(marker_overlap(text, self.end), marker_overlap(text, CALLS_START))
            return ReasoningScan(text[: len(text) - held], "")
        at, marker = min(ends)
        answer = text[at + len(marker) :] if marker == self.end else text[at:]
        return ReasoningScan(text[:at], answer)
