"""Core's tool parsers: ``hermes`` (Hermes/Qwen ``<tool_call>`` JSON), ``llama3_json`` (Llama 3's bare JSON),
``deepseek_v3`` (DeepSeek V3/V3.1/R1's marker-delimited calls), ``mistral`` (Mistral/Mixtral's ``[TOOL_CALLS]``) and
``phi4_mini_json`` (Phi-4-mini's ``functools[...]``).

Each reads the whole output so far (:meth:`~weft.contracts.tool_parser.ToolParser.scan`)
with two helpers other parsers may use too: :func:`json_value_end` finds where a JSON
value ends in text that may still be growing, and :func:`marker_overlap` says how much
of a text's tail could be the start of a marker (held back while streaming).
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

import msgspec

from weft.contracts.tool_parser import PartialCall, Scan, ToolParser, is_valid_call

_SCALAR = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|true|false|null")


def json_value_end(text: str, start: int, final: bool = False) -> int | None:
    """Index just past the JSON value starting at ``text[start]`` (after whitespace); None while it is unfinished.

    Strings, objects and arrays end at their closing character (escapes and nesting
    followed); a number or literal ends at the next character that cannot continue it,
    or at the end of ``text`` when ``final``. Only the extent is found: the value may
    still be invalid JSON (``json.loads`` decides).
    """
    position = start
    while position < len(text) and text[position] in " \t\r\n":
        position += 1
    if position >= len(text):
        return None
    if text[position] not in '{["':
        match = _SCALAR.match(text, position)
        if match is None:
            return position + 1  # not JSON: let the caller's json.loads say so
        return match.end() if match.end() < len(text) or final else None
    depth, in_string, escaped = 0, False, False
    for index in range(position, len(text)):
        char = text[index]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
                if depth == 0:
                    return index + 1
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return index + 1
    return None


def marker_overlap(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper start of ``marker``."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


_CALL_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def json_call(body: str, raw: str, finished: bool) -> PartialCall | None:
    """A call written as ``{"name": ..., "arguments"|"parameters": {...}}`` at the start of ``body``.

    While the object is unfinished, an incomplete call once the name is known (None until
    then), with the raw text of its arguments so far (which a stream sends in pieces only where
    a grammar holds the output to valid calls, :attr:`ToolParser.streams_pieces`). Finished, the
    object must parse: its arguments are then the raw text of the value (or the string's content
    when the model wrote them as a JSON string).
    """
    header = _CALL_HEADER.match(body)
    end = json_value_end(body, 0, final=finished)
    if end is None and not finished:
        if header is None:
            return None
        name = json.loads(f'"{header[1]}"')
        if body[header.end() : header.end() + 1] in ('"', ""):
            return PartialCall(name, "", False, raw)  # arguments as a JSON string: they go out whole
        arguments_end = json_value_end(body, header.end())
        return PartialCall(name, body[header.end() : arguments_end], False, raw)
    try:
        parsed = json.loads(body[: end or len(body)])
    except ValueError:
        return PartialCall(json.loads(f'"{header[1]}"') if header else "", "", False, raw)
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        return PartialCall("", "", False, raw)
    arguments: Any = parsed.get("arguments", parsed.get("parameters", {}))
    if header is not None and not isinstance(arguments, str):
        value_end = json_value_end(body, header.end(), final=True)
        text = body[header.end() : value_end].strip()
    else:
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return PartialCall(parsed["name"], text, True, raw)


def json_calls(text: str, position: int, final: bool, separators: str) -> tuple[list[PartialCall], int]:
    """Call objects (:func:`json_call`) one after another from ``position``, ``separators`` between them: the
    calls, and where reading stopped (a character that starts no call, or the end of the text)."""
    calls: list[PartialCall] = []
    while True:
        rest = text[position:]
        position += len(rest) - len(rest.lstrip(separators))
        if position >= len(text) or text[position] != "{":
            return calls, position
        end = json_value_end(text, position, final)
        element = text[position : end or len(text)]
        call = json_call(element, element, end is not None or final)
        if call is None:  # its name has not arrived yet
            return calls, position
        calls.append(call)
        if end is None:
            return calls, len(text)
        position = end


class HermesToolParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as Hermes and Qwen 2/2.5/3 write them."""

    name: ClassVar[str] = "hermes"
    architectures: ClassVar[tuple[str, ...]] = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    open_tag: ClassVar[str] = "<tool_call>"
    close_tag: ClassVar[str] = "</tool_call>"

    def scan(self, text: str, final: bool) -> Scan:
        content: list[str] = []
        calls: list[PartialCall] = []
        position = 0
        while True:
            opened = text.find(self.open_tag, position)
            if opened < 0:
                tail = text[position:]
                content.append(tail if final else tail[: len(tail) - marker_overlap(tail, self.open_tag)])
                break
            content.append(text[position:opened])
            body_start = opened + len(self.open_tag)
            closed = text.find(self.close_tag, body_start)
            finished = closed >= 0 or final
            body_end = closed if closed >= 0 else len(text)
            if closed < 0 and not final:  # a close tag may be arriving
                body_end -= marker_overlap(text[body_start:], self.close_tag)
            raw = text[opened : closed + len(self.close_tag) if closed >= 0 else len(text)]
            call = json_call(text[body_start:body_end], raw, finished)
            if call is not None and closed >= 0 and not is_valid_call(call):
                content.append(raw)  # a finished call that is not one: it stays where it was, as text
            elif call is not None:
                calls.append(call)
            if closed < 0:
                break
            position = closed + len(self.close_tag)
        return Scan("".join(content), calls)


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON calls: the answer is ``{"name": ..., "parameters": {...}}`` (several joined by ``;``),
    optionally after ``<|python_tag|>``. An answer that starts otherwise is content."""

    name: ClassVar[str] = "llama3_json"
    architectures: ClassVar[tuple[str, ...]] = ("LlamaForCausalLM",)
    python_tag: ClassVar[str] = "<|python_tag|>"

    def scan(self, text: str, final: bool) -> Scan:
        start = len(text) - len(text.lstrip())
        if text.startswith(self.python_tag, start):
            start += len(self.python_tag)
            start += len(text[start:]) - len(text[start:].lstrip())
        elif not final and self.python_tag.startswith(text[start:]):
            return Scan("", [])  # nothing, or the tag arriving: undecided
        if start >= len(text):
            return Scan(text if final else "", [])
        if text[start] != "{":
            return Scan(text, [])
        calls, stop = json_calls(text, start, final, " \t\r\n;")
        if final and stop < len(text):
            return Scan(text, [])  # trailing prose: not a call answer after all
        if not final:  # prose may still follow and make it all text: no call is certain before the end
            calls = [msgspec.structs.replace(call, complete=False) for call in calls]
        return Scan("", calls)

    def tools_prompt(self, tools: Any) -> str:
        listed = "\n\n".join(json.dumps({"type": "function", "function": tool}, ensure_ascii=False) for tool in tools)
        return (
            "Given the following functions, please respond with a JSON for a function call with its proper arguments "
            "that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. '
            f"Do not use variables.\n\n{listed}"
        )

    def render_calls(self, calls: Any) -> str:
        return "; ".join(
            json.dumps({"name": call["name"], "parameters": call["arguments"]}, ensure_ascii=False) for call in calls
        )


class DeepseekV3ToolParser(ToolParser):
    """DeepSeek V3 / V3.1 / R1 calls, between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``, each
    ``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>``. Two bodies share the architecture: V3 and R1 write
    ``function<｜tool▁sep｜>NAME`` then the arguments in a json code fence; V3.1 writes ``NAME<｜tool▁sep｜>ARGUMENTS``.
    Text before the calls (and after them) is content."""

    name: ClassVar[str] = "deepseek_v3"
    architectures: ClassVar[tuple[str, ...]] = ("DeepseekV3ForCausalLM",)
    needs_special_tokens: ClassVar[bool] = True
    calls_begin: ClassVar[str] = "<｜tool▁calls▁begin｜>"
    calls_end: ClassVar[str] = "<｜tool▁calls▁end｜>"
    call_begin: ClassVar[str] = "<｜tool▁call▁begin｜>"
    call_end: ClassVar[str] = "<｜tool▁call▁end｜>"
    separator: ClassVar[str] = "<｜tool▁sep｜>"

    def scan(self, text: str, final: bool) -> Scan:
        opened = text.find(self.calls_begin)
        if opened < 0:
            return Scan(text if final else text[: len(text) - marker_overlap(text, self.calls_begin)], [])
        content, calls = text[:opened], []
        position = opened + len(self.calls_begin)
        while True:
            begin = text.find(self.call_begin, position)
            section_end = text.find(self.calls_end, position)
            if begin < 0 or 0 <= section_end < begin:
                break
            body_start = begin + len(self.call_begin)
            end = text.find(self.call_end, body_start)
            raw = text[begin : end + len(self.call_end) if end >= 0 else len(text)]
            call = self._call(text[body_start : end if end >= 0 else len(text)], raw, end >= 0)
            if call is not None and call.complete and not is_valid_call(call):
                content += raw  # a finished call that is not one: it stays, as text
            elif call is not None:
                calls.append(call)
            if end < 0:
                return Scan(content, calls)
            position = end + len(self.call_end)
        section_end = text.find(self.calls_end, position)
        if section_end >= 0:
            tail = text[section_end + len(self.calls_end) :]
            content += tail if final else tail[: len(tail) - marker_overlap(tail, self.calls_begin)]
        return Scan(content, calls)

    def _call(self, body: str, raw: str, finished: bool) -> PartialCall | None:
        """One call's body: ``function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```` or ``NAME<｜tool▁sep｜>ARGS``;
        None until its name is known."""
        fenced = "function" + self.separator
        if body.startswith(fenced):
            name, newline, rest = body[len(fenced) :].partition("\n")
            if not newline:
                return PartialCall(name.strip(), "", False, raw) if finished else None
            arguments = rest.strip().removeprefix("```json").removesuffix("```").strip()
        elif not finished and fenced.startswith(body):
            return None  # the V3 prefix may be arriving
        else:
            name, separator, arguments = body.partition(self.separator)
            if not separator:
                return PartialCall(name.strip(), "", False, raw) if finished else None
            arguments = arguments.strip()
        return PartialCall(name.strip(), arguments if finished else "", finished, raw)

    def tools_prompt(self, tools: Any) -> str:
        listed = "\n".join(json.dumps({"type": "function", "function": tool}, ensure_ascii=False) for tool in tools)
        return (
            f"## Tools\nYou have access to the following functions:\n{listed}\n"
            "To call functions, answer with:\n"
            f"{self.calls_begin}{self.call_begin}function{self.separator}<function-name>\n```json\n<arguments>\n```"
            f"{self.call_end}{self.calls_end}"
        )

    def render_calls(self, calls: Any) -> str:
        return (
            self.calls_begin
            + "".join(
                f"{self.call_begin}function{self.separator}{call['name']}\n```json\n"
                f"{json.dumps(call['arguments'], ensure_ascii=False)}\n```{self.call_end}"
                for call in calls
            )
            + self.calls_end
        )


class MistralToolParser(ToolParser):
    """Mistral and Mixtral calls after the ``[TOOL_CALLS]`` control token, in either body Mistral's tokenizers
    define: a JSON list of ``{"name": ..., "arguments": {...}}`` objects (tokenizer v3: Mistral 7B Instruct v0.3,
    Mixtral 8x22B Instruct), or ``NAME[ARGS]{...}`` after a ``[TOOL_CALLS]`` of its own for each call (v11 on:
    Mistral Small 3.2, Magistral, Devstral; v7 writes ``NAME[CALL_ID]ID[ARGS]{...}``). Text before the first
    marker is content, and so is text after the list. The templates accept only call ids of 9 letters and
    digits in a conversation's history: other ids are cut to their last 9 (:meth:`template_call_id`)."""

    name: ClassVar[str] = "mistral"
    architectures: ClassVar[tuple[str, ...]] = ("MistralForCausalLM", "MixtralForCausalLM")
    needs_special_tokens: ClassVar[bool] = True
    marker: ClassVar[str] = "[TOOL_CALLS]"
    arguments_marker: ClassVar[str] = "[ARGS]"
    id_marker: ClassVar[str] = "[CALL_ID]"

    def scan(self, text: str, final: bool) -> Scan:
        opened = text.find(self.marker)
        if opened < 0:
            return Scan(text if final else text[: len(text) - marker_overlap(text, self.marker)], [])
        content, body = text[:opened], text[opened + len(self.marker) :]
        stripped = body.lstrip()
        if not stripped:
            return Scan(content + self.marker + body if final else content, [])
        if stripped[0] == "[":
            return self._listed(content, body, len(body) - len(stripped), final)
        calls: list[PartialCall] = []
        for segment in body.split(self.marker):
            call, rest = self._named(segment, final)
            if call is None:
                break
            if call.complete and not is_valid_call(call):
                content += call.raw  # a finished call that is not one: it stays, as text
            else:
                calls.append(call)
            content += rest
        if not final:  # the next call's marker may be arriving
            content = content[: len(content) - marker_overlap(content, self.marker)]
        return Scan(content, calls)

    def _listed(self, content: str, body: str, start: int, final: bool) -> Scan:
        """``[{...}, {...}]`` from ``body[start]``: its calls, and the text after the list as content."""
        calls, stopped = json_calls(body, start + 1, final, " \t\r\n,")
        rest = body[stopped:].lstrip()
        if rest.startswith("]"):
            return Scan(content + rest[1:], calls)
        if not final and (not rest or rest.startswith("{")):
            return Scan(content, calls)  # the list is still being written
        if not calls:  # not a list of calls after all: the text as written
            return Scan(content + self.marker + body if final else content, [])
        return Scan(content + body[stopped:], calls)  # calls, then something else: that is content

    def _named(self, segment: str, final: bool) -> tuple[PartialCall | None, str]:
        """One ``NAME[CALL_ID]ID[ARGS]{...}`` segment: the call (None until its name is known), and the text after
        its arguments (content)."""
        raw = self.marker + segment
        head, found, arguments = segment.partition(self.arguments_marker)
        if not found:
            if final:
                return PartialCall(head.strip(), "", True, raw), ""
            return None, ""
        name = head.partition(self.id_marker)[0].strip()
        end = json_value_end(arguments, 0, final)
        if end is None:
            return PartialCall(name, "", final, raw), ""
        return PartialCall(name, arguments[:end].strip(), True, raw), arguments[end:]

    def template_call_id(self, call_id: str) -> str:
        letters = re.sub(r"[^A-Za-z0-9]", "", call_id)
        return letters[-9:].rjust(9, "0")

    def tools_prompt(self, tools: Any) -> str:
        listed = json.dumps([{"type": "function", "function": tool} for tool in tools], ensure_ascii=False)
        return (
            f"You may call these functions: {listed}\n"
            f'To call functions, answer with {self.marker} then a JSON list of {{"name": <function-name>, '
            '"arguments": <args-json-object>} objects.'
        )

    def render_calls(self, calls: Any) -> str:
        listed = [{"name": call["name"], "arguments": call["arguments"]} for call in calls]
        return f"{self.marker} {json.dumps(listed, ensure_ascii=False)}"


class Phi4MiniToolParser(ToolParser):
    """Phi-4-mini's calls: the answer is ``functools[{"name": ..., "arguments": {...}}, ...]`` (``parameters``
    read as ``arguments``); an answer that starts otherwise is content, and so is text after the list. The
    default for ``Phi3ForCausalLM``, whose other checkpoints (Phi-3, Phi-3.5, Phi-4) write no calls: their
    answers stay content. Tools reach a template that ignores them as Phi-4-mini's template writes them, in
    ``<|tool|>...<|/tool|>`` after the system message."""

    name: ClassVar[str] = "phi4_mini_json"
    architectures: ClassVar[tuple[str, ...]] = ("Phi3ForCausalLM",)
    opener: ClassVar[str] = "functools["

    def scan(self, text: str, final: bool) -> Scan:
        start = len(text) - len(text.lstrip())
        if not text.startswith(self.opener, start):
            if not final and self.opener.startswith(text[start:]):
                return Scan("", [])  # nothing yet, or the opener arriving: undecided
            return Scan(text, [])
        calls, stopped = json_calls(text, start + len(self.opener), final, " \t\r\n,")
        rest = text[stopped:].lstrip()
        if rest.startswith("]"):
            return Scan(rest[1:], calls)
        if not final and (not rest or rest.startswith("{")):
            return Scan("", calls)  # the list is still being written
        if not calls:  # not a list of calls after all: the text as written
            return Scan(text if final else "", [])
        return Scan(text[stopped:], calls)  # calls, then something else: that is content

    def tools_prompt(self, tools: Any) -> str:
        return f"<|tool|>{json.dumps(list(tools), ensure_ascii=False)}<|/tool|>"

    def render_calls(self, calls: Any) -> str:
        listed = [{"name": call["name"], "arguments": call["arguments"]} for call in calls]
        return f"{self.opener[:-1]}{json.dumps(listed, ensure_ascii=False)}"
