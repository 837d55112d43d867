"""Tool calling and reasoning in a chat: the request's tools, the prompt, and the reply as an assistant message.

* :func:`chat_tools` / :func:`responses_tools` read and check a request's ``tools``,
  ``tool_choice`` and ``parallel_tool_calls`` into :class:`ToolSettings`.
* :func:`forced_constraint`: ``tool_choice="required"`` or a named function is enforced by
  the structured-output backend. The model then writes JSON whatever its own call format:
  a named function's arguments, or for ``required`` an array of ``{"name", "parameters"}``
  objects (one, unless parallel calls are allowed) over the tools' schemas; the two
  parsers here read them (:class:`NamedCallParser`, :class:`RequiredCallsParser`).
  ``auto`` leaves the model free and parses its own format with the model's tool parser.
* :func:`chat_input` hands the tools and earlier calls to the chat template; a template
  that ignores them gets them written in the tool parser's format instead.
* :class:`AssistantOutput` splits one choice's text into reasoning, content and tool calls,
  whole or streamed.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Sequence
from typing import Any, ClassVar

import msgspec

from weft.builtins.tool_parsers import json_calls, json_value_end
from weft.contracts.reasoning_parser import ReasoningParser
from weft.contracts.structured_output import StructuredOutputsParams
from weft.contracts.tokenizer import Tokenizer
from weft.contracts.tool_parser import PartialCall, Scan, ToolCall, ToolCallDelta, ToolParser
from weft.serve import protocol as p


class ToolSettings(msgspec.Struct):
    tools: list[dict[str, Any]]
    """Function definitions: ``{"name", "description", "parameters"}``."""
    choice: str
    """``none``, ``auto``, ``required`` or ``function`` (the one named by ``function``)."""
    function: str | None = None
    parallel: bool = True

    @property
    def parses_calls(self) -> bool:
        return bool(self.tools) and self.choice != "none"


TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
"""A function's name, as OpenAI's API takes it."""


def chat_tools(body: p.ChatCompletionRequest) -> ToolSettings | None:
    functions = []
    for index, tool in enumerate(body.tools or []):
        if tool.type != "function":
            raise ValueError(f"tools[{index}]: only function tools are supported; got type {tool.type!r}")
        if tool.function is None:
            raise ValueError(
                f'tools[{index}].function: missing; a function tool is {{"type": "function", "function": '
                f'{{"name": ..., "parameters": {{...}}}}}}'
            )
        functions.append(msgspec.to_builtins(tool.function))
    return _settings(functions, body.tool_choice, body.parallel_tool_calls, "tool_choice")


def responses_tools(body: p.ResponsesRequest) -> ToolSettings | None:
    functions = []
    for index, tool in enumerate(body.tools or []):
        if tool.type != "function":
            raise ValueError(f"tools[{index}]: only function tools are supported here; got type {tool.type!r}")
        if not tool.name:
            raise ValueError(
                f'tools[{index}].name: missing; a function tool is {{"type": "function", "name": ..., '
                f'"parameters": {{...}}}}'
            )
        functions.append(msgspec.to_builtins(msgspec.structs.replace(tool, type="function")))
    for function in functions:
        function.pop("type", None)
    return _settings(functions, body.tool_choice, body.parallel_tool_calls, "tool_choice")


def _settings(
    functions: list[dict[str, Any]], choice: str | p.NamedToolChoice | None, parallel: bool | None, field: str
) -> ToolSettings | None:
    names = [function["name"] for function in functions]
    for index, name in enumerate(names):
        if not TOOL_NAME.fullmatch(name):
            raise ValueError(
                f"tools[{index}].name: {name!r} is not a function name; use 1 to 64 letters, digits, "
                "underscores or dashes (as OpenAI requires)"
            )
    duplicated = sorted({name for name in names if names.count(name) > 1})
    if duplicated:
        raise ValueError(f"tools: function names must be unique; {duplicated} appear more than once")
    for index, function in enumerate(functions):
        parameters = function.get("parameters")
        if parameters is not None and (
            not isinstance(parameters, dict) or parameters.get("type", "object") != "object"
        ):
            raise ValueError(f"tools[{index}].parameters: must be a JSON schema of type object")
    if isinstance(choice, p.NamedToolChoice):
        name = choice.function.name if choice.function is not None else choice.name
        if choice.type != "function" or not name:
            raise ValueError(f'{field}: a named choice is {{"type": "function", "function": {{"name": ...}}}}')
        if name not in names:
            raise ValueError(f"{field}: function {name!r} is not among the tools ({', '.join(names) or 'none given'})")
        return ToolSettings(functions, "function", name, parallel is not False)
    choice = choice or ("auto" if functions else "none")
    if choice not in ("none", "auto", "required"):
        raise ValueError(f"{field} = {choice!r}: expected 'none', 'auto', 'required' or a named function")
    if choice == "required" and not functions:
        raise ValueError(f"{field} = 'required' needs tools")
    if not functions:
        return None
    return ToolSettings(functions, choice, None, parallel is not False)


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


def forced_constraint(settings: ToolSettings | None) -> StructuredOutputsParams | None:
    """The constraint enforcing ``required`` or a named function (None otherwise)."""
    if settings is None or settings.choice not in ("required", "function"):
        return None
    if settings.choice == "function":
        function = next(function for function in settings.tools if function["name"] == settings.function)
        return StructuredOutputsParams(json=_parameters(function))
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": function["name"]}, "parameters": _parameters(function)},
            "required": ["name", "parameters"],
        }
        for function in settings.tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        "minItems": 1,
    }
    if not settings.parallel:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json=schema)


def output_constraint(
    settings: ToolSettings | None, constraint: StructuredOutputsParams | None, field: str, format_field: str
) -> tuple[StructuredOutputsParams | None, str]:
    """The output's one constraint and the field it came from: a forced tool choice's, or the format's
    (``format_field``); both at once is a ValueError."""
    forced = forced_constraint(settings)
    if forced is None:
        return constraint, field
    if constraint is not None:
        raise ValueError(
            f"tool_choice: it forces a tool call, which {format_field} would contradict; drop "
            f"{format_field} or let tool_choice be 'auto'"
        )
    return forced, "tools"


class NamedCallParser(ToolParser):
    """The whole output is the arguments of one call to the named function."""

    name: ClassVar[str] = "named"
    streams_pieces: ClassVar[bool] = True  # the forced constraint's grammar holds the output to the call

    def __init__(self, function: str) -> None:
        super().__init__()
        self.function = function

    def scan(self, text: str, final: bool) -> Scan:
        start = len(text) - len(text.lstrip())
        if start == len(text):
            return Scan("", [])  # nothing of the call written yet (a reasoning model cut while thinking, say)
        end = json_value_end(text, start, final)
        arguments = text[start:end].rstrip() if end is not None else text[start:]
        return Scan("", [PartialCall(self.function, arguments, end is not None, text)])


class RequiredCallsParser(ToolParser):
    """The output is a JSON array of ``{"name": ..., "parameters": {...}}`` calls."""

    name: ClassVar[str] = "required"
    streams_pieces: ClassVar[bool] = True

    def scan(self, text: str, final: bool) -> Scan:
        position = len(text) - len(text.lstrip())
        if position >= len(text) or text[position] != "[":
            return Scan(text if final else "", [])
        # Read as unfinished even when final: a call cut short keeps its arguments as written (what the stream sent).
        calls, stopped = json_calls(text, position + 1, False, " \t\r\n,")
        rest = text[stopped:]
        if final and rest.strip() not in ("", "]"):  # cut short before the next call's name and arguments key
            return Scan(text if not calls else rest, calls)
        return Scan("", calls)


def call_parser(settings: ToolSettings | None, tool_parser: type[ToolParser] | None, options: Any) -> ToolParser | None:
    """The parser that reads this request's calls: the forced JSON's, or the model's format under ``auto``."""
    if settings is None or not settings.parses_calls:
        return None
    if settings.choice == "function":
        return NamedCallParser(settings.function)  # type: ignore[arg-type]
    if settings.choice == "required":
        return RequiredCallsParser()
    return tool_parser(options, settings.tools) if tool_parser is not None else None


# The prompt.


def chat_input(
    tokenizer: Tokenizer,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool,
    settings: ToolSettings | None,
    tool_parser: type[ToolParser] | None,
    template_kwargs: dict[str, Any],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and template arguments to render: the template gets the tools and earlier calls, or, when
    it ignores them (its text is the same without), they are written into the conversation in the tool
    parser's format (Hermes' without one)."""
    writer = tool_parser() if tool_parser is not None else _HermesWriter()
    messages = [_template_message(message, writer) for message in messages]

    def render(conversation: list[dict[str, Any]], **extra: Any) -> str:
        return tokenizer.apply_chat_template(
            tokenizer.normalize_messages(conversation), add_generation_prompt, **template_kwargs, **extra
        )

    if any(message.get("tool_calls") for message in messages):
        without_calls = [{key: value for key, value in message.items() if key != "tool_calls"} for message in messages]
        if render(without_calls) == render(messages):
            messages = [_calls_as_content(message, writer) for message in messages]
    tools = settings.tools if settings is not None and settings.choice != "none" else None
    if not tools:
        return messages, dict(template_kwargs)
    wrapped = [{"type": "function", "function": function} for function in tools]
    if render(messages, tools=wrapped) != render(messages):
        return messages, {**template_kwargs, "tools": wrapped}
    # The template ignores tools: present them in a system message of the parser's format.
    prompt = writer.tools_prompt(tools)
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        messages = [{**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}".lstrip()}, *messages[1:]]
    else:
        messages = [{"role": "system", "content": prompt}, *messages]
    return messages, dict(template_kwargs)


class _HermesWriter(ToolParser):
    """The base class's Hermes-style prompt and call rendering, for a model without a tool parser."""

    name: ClassVar[str] = "hermes-writer"

    def scan(self, text: str, final: bool) -> Scan:
        return Scan(text, [])


def _template_message(message: dict[str, Any], writer: ToolParser) -> dict[str, Any]:
    """Earlier calls as templates expect them: ``arguments`` as an object, not JSON text, a content (empty)
    beside the calls, and the calls' ids (and a tool message's ``tool_call_id``) in the format's shape
    (:meth:`~weft.contracts.tool_parser.ToolParser.template_call_id`)."""
    if message.get("role") == "tool" and isinstance(message.get("tool_call_id"), str):
        return {**message, "tool_call_id": writer.template_call_id(message["tool_call_id"])}
    if not message.get("tool_calls"):
        return message
    message = copy.deepcopy(message)
    message.setdefault("content", "")
    for call in message["tool_calls"]:
        if isinstance(call.get("id"), str):
            call["id"] = writer.template_call_id(call["id"])
        function = call.get("function", call)
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except ValueError:
                pass
    return message


def _calls_as_content(message: dict[str, Any], writer: ToolParser) -> dict[str, Any]:
    if not message.get("tool_calls"):
        return message
    calls = [call.get("function", call) for call in message["tool_calls"]]
    written = writer.render_calls([{"name": call.get("name"), "arguments": call.get("arguments")} for call in calls])
    content = message.get("content") or ""
    return {
        **{key: value for key, value in message.items() if key != "tool_calls"},
        "content": f"{content}\n{written}" if content else written,
    }


# The reply.


class MessageDelta(msgspec.Struct):
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = []


class AssistantOutput:
    """One choice's text as an assistant message: reasoning first (when the model has a reasoning
    parser), then the answer's content and tool calls (when the request parses calls). Without
    ``parallel`` (``parallel_tool_calls=false``) only the first call is kept."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None, parallel: bool = True) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.parallel = parallel

    def parse(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """``(reasoning, content, calls)`` of the whole output."""
        reasoning, answer = self.reasoning.parse(text) if self.reasoning is not None else (None, text)
        if self.tools is None:
            return reasoning, answer or None, []
        parsed = self.tools.parse(answer or "")
        return reasoning, parsed.content, parsed.calls if self.parallel else parsed.calls[:1]

    def push(self, text: str) -> MessageDelta:
        reasoning, answer = self.reasoning.push(text) if self.reasoning is not None else ("", text)
        return self._answer(reasoning, answer, final=False)

    def finish(self) -> MessageDelta:
        reasoning, answer = self.reasoning.finish() if self.reasoning is not None else ("", "")
        return self._answer(reasoning, answer, final=True)

    def _answer(self, reasoning: str, answer: str, final: bool) -> MessageDelta:
        if self.tools is None:
            return MessageDelta(reasoning, answer)
        delta = self.tools.push(answer) if answer or not final else None
        if final:
            last = self.tools.finish()
            if delta is None:
                delta = last
            else:
                delta.content += last.content
                delta.calls = delta.calls + last.calls
        calls = delta.calls if self.parallel else [call for call in delta.calls if call.index == 0]  # type: ignore[union-attr]
        return MessageDelta(reasoning, delta.content, calls)  # type: ignore[union-attr]


def reasoning_parser(parser: type[ReasoningParser] | None, options: Any, prompt_text: str) -> ReasoningParser | None:
    """The request's reasoning parser (None without one, or when the prompt turned thinking off)."""
    if parser is None:
        return None
    instance = parser(options, prompt_text)
    return instance if instance.reasoning_expected() else None
