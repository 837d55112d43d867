"""gpt-oss's harmony format: the reasoning parser ``harmony`` and the tool parser ``harmony``.

A harmony reply is a sequence of messages, each a header, ``<|message|>``, a body and a terminator::

    <|channel|>analysis<|message|>The user asks for the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

The first message's ``<|start|>assistant`` ends the prompt, so the output begins with the rest of its header.
A header names the channel (``analysis``: the thinking; ``commentary``: tool calls and the preambles before them;
``final``: the answer), optionally a recipient (``to=functions.NAME``, before or after the channel) and the body's
type (``<|constrain|>json`` or a bare ``json``). ``<|end|>`` ends a message, ``<|call|>`` a tool call and
``<|return|>`` the reply; the last two are end-of-sequence ids, so the text a request returns stops before them.

The reasoning parser takes the analysis messages' bodies as reasoning. The answer it hands on is the bodies of
the messages for the user (``final``, and ``commentary`` without a recipient), and every message with a recipient
whole, as a harmony message, so that the tool parser finds the calls in it: it reads ``to=functions.NAME``
messages as calls (their bodies the arguments) and the rest as content. Used alone (``use.reasoning_parser =
"none"``) the tool parser reads the raw output the same way, analysis bodies then being content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, ClassVar

import msgspec

from weft.builtins.tool_parsers import marker_overlap
from weft.contracts.reasoning_parser import ReasoningParser, ReasoningScan
from weft.contracts.tool_parser import PartialCall, Scan, ToolParser

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
CALL, RETURN = "<|call|>", "<|return|>"
TERMINATORS = (END, CALL, RETURN)
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, CALL, RETURN)
FUNCTIONS = "functions."
"""The namespace of the request's tools: ``to=functions.NAME`` calls one."""
ARCHITECTURES = ("GptOssForCausalLM",)

_RECIPIENT = re.compile(r"to=([^\s<]+)")
_PARTS = "\n\n"
"""Between the bodies of two messages joined into one text (reasoning, or content)."""


class HarmonyMessage(msgspec.Struct):
    """One message as far as the text goes, or (``header`` None) text outside any message."""

    header: str | None
    """The text between the message's start (``<|start|>``, or the output's beginning) and ``<|message|>``; None
    for plain text."""
    body: str
    """The body so far (without a tail that may be a marker arriving, unless the text is final)."""
    complete_header: bool = True
    """``<|message|>`` has arrived: the channel and the recipient are known."""
    terminator: str = ""
    """The marker that ended the message (``<|end|>``, ``<|call|>``, ``<|return|>``; ``<|end|>`` too for one the next
    message's ``<|start|>`` cut short); empty while it is open."""

    @property
    def channel(self) -> str:
        after = self.header.partition(CHANNEL)[2] if self.header else ""
        return after.split(maxsplit=1)[0] if after.split() else ""

    @property
    def recipient(self) -> str | None:
        match = _RECIPIENT.search(self.header or "")
        return match[1] if match else None

    def written(self) -> str:
        """The message as harmony text, from ``<|start|>assistant`` (the first one's is in the prompt) on."""
        header = self.header if self.header.startswith("assistant") else f"assistant{self.header}"
        return f"{START}{header}{MESSAGE}{self.body}{self.terminator}"


def harmony_messages(text: str, final: bool) -> list[HarmonyMessage]:
    """The messages of ``text`` (an output, or what :class:`HarmonyReasoningParser` hands on), in order. A message
    starts at ``<|start|>``, or at the text's beginning when it opens with ``<|channel|>`` or ``to=`` (the rest of
    the prompt's header); other text is plain. The last message may be open (no terminator, or no ``<|message|>``
    yet); unless ``final``, a tail that may be a marker arriving is left out."""
    messages: list[HarmonyMessage] = []
    position = 0
    opening = text.lstrip(" ")
    if not final and (CHANNEL.startswith(opening) or "to=".startswith(opening)):
        return messages  # nothing yet, or the first header's opening arriving
    if not opening.startswith((CHANNEL, "to=")):
        position = _plain(text, 0, final, messages)
    while position < len(text):
        header_start = position + len(START) if text.startswith(START, position) else position
        opened = text.find(MESSAGE, header_start)
        if opened < 0:
            messages.append(HarmonyMessage(text[header_start:], "", complete_header=False))
            return messages
        header, body_start = text[header_start:opened], opened + len(MESSAGE)
        ends = [(index, marker) for marker in (*TERMINATORS, START) if (index := text.find(marker, body_start)) >= 0]
        if not ends:
            body = text[body_start:]
            held = 0 if final else max(marker_overlap(body, marker) for marker in MARKERS)
            messages.append(HarmonyMessage(header, body[: len(body) - held]))
            return messages
        end, marker = min(ends)
        messages.append(HarmonyMessage(header, text[body_start:end], terminator=marker if marker != START else END))
        position = _plain(text, end + (len(marker) if marker != START else 0), final, messages)
    return messages


def _plain(text: str, position: int, final: bool, messages: list[HarmonyMessage]) -> int:
    """Record the plain text from ``position`` to the next ``<|start|>``; returns where that starts."""
    start = text.find(START, position)
    plain = text[position : start if start >= 0 else len(text)]
    if start < 0 and not final:
        plain = plain[: len(plain) - marker_overlap(plain, START)]
    if plain:
        messages.append(HarmonyMessage(None, plain))
    return start if start >= 0 else len(text)


class HarmonyReasoningParser(ReasoningParser):
    """Analysis messages are reasoning; the answer is what the other messages say to the user, with every
    message that has a recipient left whole for the tool parser."""

    name: ClassVar[str] = "harmony"
    architectures: ClassVar[tuple[str, ...]] = ARCHITECTURES
    needs_special_tokens: ClassVar[bool] = True
    start: ClassVar[str] = f"{CHANNEL}analysis{MESSAGE}"
    end: ClassVar[str] = f"{CHANNEL}final{MESSAGE}"
    """A structured-output constraint covers the final message's body: it starts after this header."""

    def reasoning_expected(self) -> bool:
        """Always: every reply is harmony messages, which this parser takes apart (``reasoning_effort`` only
        changes how long the analysis is)."""
        return True

    def reasoning_opened(self) -> bool:
        """The prompt ends with ``<|start|>assistant``: the output begins inside a message's header, and the answer
        (what a constraint covers) follows :attr:`end`."""
        return True

    def scan(self, text: str, final: bool) -> ReasoningScan:
        reasoning: list[str] = []
        answer, separate = "", False
        for message in harmony_messages(text, final):
            if not message.complete_header:
                break
            if message.header is not None and message.recipient is not None:
                answer, separate = answer + message.written(), False  # a call, whole: the tool parser reads it
            elif message.header is not None and message.channel == "analysis":
                reasoning.append(message.body)
            elif message.body:
                answer, separate = answer + (_PARTS if separate else "") + message.body, True
        return ReasoningScan(_PARTS.join(part for part in reasoning if part), answer)


class HarmonyToolParser(ToolParser):
    """``to=functions.NAME`` messages are calls, their bodies the arguments (JSON); other messages' bodies, and
    text outside messages, are content. A call is complete at its ``<|call|>``, or when the output ends (the
    returned text stops before ``<|call|>``, an end-of-sequence id)."""

    name: ClassVar[str] = "harmony"
    architectures: ClassVar[tuple[str, ...]] = ARCHITECTURES
    needs_special_tokens: ClassVar[bool] = True

    def scan(self, text: str, final: bool) -> Scan:
        content: list[str] = []
        calls: list[PartialCall] = []
        for message in harmony_messages(text, final):
            if not message.complete_header:
                break
            recipient = message.recipient
            if message.header is None or recipient is None:
                content.append(message.body)
            elif recipient.startswith(FUNCTIONS):
                complete = bool(message.terminator) or final
                calls.append(PartialCall(recipient[len(FUNCTIONS) :], message.body, complete, message.written()))
            else:  # a built-in tool's call (browser, python): not one of the request's functions
                content.append(message.written())
        return Scan(_PARTS.join(part for part in content if part), calls)

    def tools_prompt(self, tools: Sequence[dict[str, Any]]) -> str:
        """The developer message's tools section, each function's parameters as their JSON schema."""
        listed = "\n\n".join(
            f"// {tool.get('description') or tool['name']}\n"
            f"type {tool['name']} = (_: {json.dumps(tool.get('parameters') or {}, ensure_ascii=False)}) => any;"
            for tool in tools
        )
        return f"# Tools\n\n## functions\n\nnamespace functions {{\n\n{listed}\n\n}} // namespace functions"

    def render_calls(self, calls: Sequence[dict[str, Any]]) -> str:
        return "".join(
            f"{START}assistant{CHANNEL}commentary to={FUNCTIONS}{call['name']} {CONSTRAIN}json{MESSAGE}"
            f"{json.dumps(call['arguments'], ensure_ascii=False)}{CALL}"
            for call in calls
        )
