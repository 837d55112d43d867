"""The tool-parser slot: finding the tool calls in what a model wrote.

Models write tool calls in their own format (Hermes/Qwen ``<tool_call>{...}</tool_call>``,
Llama 3's bare JSON, DeepSeek V4's DSML). A parser turns a request's output text into
OpenAI's shape: content, and calls with a name and JSON arguments.

``use.tool_parser`` names the parser; ``auto`` takes the one whose :attr:`ToolParser.architectures`
lists the checkpoint's architecture (none: tool calls are not parsed, ``tool_choice="auto"``
returns plain content).

A parser object serves one request: ``Parser(options, tools)``, where ``tools`` are the
request's function definitions (``{"name", "description", "parameters"}``). A parser
implements one method, :meth:`ToolParser.scan`, over the whole text so far; the base
class derives from it the whole-output answer (:meth:`ToolParser.parse`) and the
streaming one (:meth:`ToolParser.push`, then :meth:`ToolParser.finish`), so the two always
agree. ``scan`` must be prefix-stable: as the text grows, the content it reports and the
name and arguments of each call only grow, and a call once ``complete`` stays as it is
(a format where later text can still undo a call reports it complete only when ``final``).
A stream sends a call whole, in one delta, once it is complete and valid: never a piece
of a call the whole-output parse would leave in the content. A parser whose calls a grammar
enforces (:attr:`ToolParser.streams_pieces`: ``tool_choice = "required"`` or a named function)
streams as OpenAI does instead: a call's id and name first, then its arguments in pieces. Whatever a parser raises,
the base class answers with the text as content (a malformed call never fails a request).
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import msgspec

from weft.contracts.plugin import PluginBase

logger = logging.getLogger("weft.tool_parser")


class ToolCall(msgspec.Struct):
    """A complete call: ``arguments`` is JSON text."""

    id: str
    name: str
    arguments: str


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """A piece of a streamed call: the first piece of a call has its id and name, later ones more arguments
    (a parser with :attr:`ToolParser.streams_pieces` sends several per call, any other one piece holding it whole)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class ParsedOutput(msgspec.Struct):
    content: str | None
    """Text that is not a call (None when there is none)."""
    calls: list[ToolCall]


class StreamDelta(msgspec.Struct):
    content: str = ""
    calls: list[ToolCallDelta] = []


class PartialCall(msgspec.Struct):
    """A call as far as the text goes."""

    name: str
    arguments: str
    """JSON text of the arguments so far (a prefix of the final text until ``complete``)."""
    complete: bool
    """Nothing later in the output can change the call or take it back."""
    raw: str = ""
    """The call's source text, for the fallback to content when the finished call is not valid."""


class Scan(msgspec.Struct):
    content: str
    """Text that is not part of a call, so far. When not ``final``, hold back a tail that may start a call."""
    calls: list[PartialCall]


class ToolParser(PluginBase):
    """Finds tool calls in one request's output text."""

    name: ClassVar[str]
    architectures: ClassVar[tuple[str, ...]] = ()
    """Hugging Face architectures this parser is the default for (``use.tool_parser = "auto"``)."""
    needs_special_tokens: ClassVar[bool] = False
    """Whether the format's markers are special tokens, which the text must keep (``skip_special_tokens=False``)."""
    streams_pieces: ClassVar[bool] = False
    """Whether a stream sends each call's id and name as soon as they are known, then its arguments in pieces:
    only for output a grammar holds to valid calls (what is sent can never turn out not to be a call)."""

    def __init__(self, options: msgspec.Struct | None = None, tools: Sequence[dict[str, Any]] = ()) -> None:
        self.options = options if options is not None else self.Options()
        self.tools = list(tools)
        self._text = ""
        self._sent_content = 0
        self._sent_calls = 0
        self._sent_pieces: list[tuple[str, int]] = []
        """With :attr:`streams_pieces`, per streamed call: its id and how many characters of its arguments went out."""

    @abstractmethod
    def scan(self, text: str, final: bool) -> Scan:
        """Content and calls in ``text`` (the whole output so far); ``final``: nothing more will come."""

    # Templates that do not render tools themselves get them in the parser's format.

    def tools_prompt(self, tools: Sequence[dict[str, Any]]) -> str:
        """A system-prompt paragraph presenting ``tools`` and the call format (for chat templates that ignore
        ``tools``)."""
        listed = "\n".join(json.dumps({"type": "function", "function": tool}, ensure_ascii=False) for tool in tools)
        return (
            "You may call one or more functions to assist with the user query. The functions:\n"
            f"<tools>\n{listed}\n</tools>\n"
            "For each function call, answer with a JSON object with the function name and arguments within "
            '<tool_call></tool_call> tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
            "<args-json-object>}\n</tool_call>"
        )

    def render_calls(self, calls: Sequence[dict[str, Any]]) -> str:
        """An assistant turn's calls (``{"name", "arguments"}``, arguments a dict) as the model writes them
        (for chat templates that ignore ``tool_calls``)."""
        return "\n".join(
            "<tool_call>\n"
            + json.dumps({"name": call["name"], "arguments": call["arguments"]}, ensure_ascii=False)
            + "\n</tool_call>"
            for call in calls
        )

    def template_call_id(self, call_id: str) -> str:
        """The id the chat template gets for an earlier call of the conversation whose id is ``call_id`` (in the
        assistant message's ``tool_calls`` and in the tool message answering it): as given, unless the format's
        templates accept only ids of their own shape (Mistral's: 9 letters and digits)."""
        return call_id

    # Derived from scan.

    def parse(self, text: str) -> ParsedOutput:
        """The content and the complete, valid calls of a whole output; a call that is unfinished or
        whose arguments are not a JSON object stays in the content. With :attr:`streams_pieces` (a grammar held
        the output to calls), what a stream sends, whole: every named call, one cut short (``max_tokens``) with
        its arguments as far as they were written, as OpenAI returns it."""
        scan = self._safe_scan(text, final=True)
        if self.streams_pieces:
            named = next((index for index, call in enumerate(scan.calls) if not call.name), len(scan.calls))
            return ParsedOutput(
                scan.content or None, [ToolCall(_call_id(), call.name, call.arguments) for call in scan.calls[:named]]
            )
        valid = [call for call in scan.calls if is_valid_call(call)]
        if len(valid) < len(scan.calls) and not valid:
            return ParsedOutput(text or None, [])
        content = scan.content + "".join(call.raw for call in scan.calls if not is_valid_call(call))
        if valid:
            content = content.rstrip()  # the line breaks before a call are layout, not content
        return ParsedOutput(content or None, [ToolCall(_call_id(), call.name, call.arguments) for call in valid])

    def push(self, text: str) -> StreamDelta:
        """Add the next piece of output; returns the content and the calls now certain."""
        self._text += text
        return self._advance(final=False)

    def finish(self) -> StreamDelta:
        """The output ended: the rest of what :meth:`parse` gives for the whole of it."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> StreamDelta:
        if self.streams_pieces:
            return self._advance_in_pieces(final)
        if final:
            parsed = self.parse(self._text)
            content, calls = parsed.content or "", [(call.name, call.arguments) for call in parsed.calls]
        else:
            scan = self._safe_scan(self._text, final=False)
            calls = []
            for call in scan.calls:
                if not call.complete:
                    break
                if is_valid_call(call):  # a complete invalid call goes to the content at the end, as in parse
                    calls.append((call.name, call.arguments))
            content = scan.content.rstrip()  # trailing whitespace waits: before a call it is layout, not content
            if not calls:  # until a valid call, the output may turn out to be text as written (parse's fallback)
                content = os.path.commonprefix([content, self._text])
        delta = StreamDelta(content[self._sent_content :])
        self._sent_content = max(self._sent_content, len(content))
        for index in range(self._sent_calls, len(calls)):
            delta.calls.append(ToolCallDelta(index, _call_id(), *calls[index]))
        self._sent_calls = max(self._sent_calls, len(calls))
        return delta

    def _advance_in_pieces(self, final: bool) -> StreamDelta:
        """A grammar keeps the output to calls: each goes out as soon as it is named, its arguments as they grow."""
        scan = self._safe_scan(self._text, final)
        calls = list(scan.calls)
        named = next((index for index, call in enumerate(calls) if not call.name), len(calls))
        calls = calls[:named]  # a call streams once its name is known; the ones after it wait
        delta = StreamDelta()
        if final and scan.content[self._sent_content :]:  # a grammar's output cut short: what was not a call
            delta.content = scan.content[self._sent_content :]
            self._sent_content = len(scan.content)
        for index, call in enumerate(calls):
            if index == len(self._sent_pieces):
                self._sent_pieces.append((_call_id(), 0))
                delta.calls.append(ToolCallDelta(index, self._sent_pieces[index][0], call.name))
            call_id, sent = self._sent_pieces[index]
            if len(call.arguments) > sent:
                piece = call.arguments[sent:]
                if delta.calls and delta.calls[-1].index == index:
                    delta.calls[-1].arguments += piece
                else:
                    delta.calls.append(ToolCallDelta(index, arguments=piece))
                self._sent_pieces[index] = (call_id, len(call.arguments))
        return delta

    def _safe_scan(self, text: str, final: bool) -> Scan:
        try:
            return self.scan(text, final)
        except Exception:
            logger.warning("tool parser %r failed on the output; it is returned as content", self.name, exc_info=True)
            return Scan(text if final else "", [])


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def is_valid_call(call: PartialCall) -> bool:
    """A finished call whose arguments are a JSON object."""
    if not call.complete:
        return False
    try:
        return isinstance(json.loads(call.arguments), dict)
    except ValueError:
        return False
