"""Tool-call and reasoning parsers on recorded model outputs: whole, streamed in random pieces, malformed and cut short.

The outputs are what the models write (Qwen 2.5/3 and Hermes ``<tool_call>`` JSON, Llama 3.1/3.2 JSON,
DeepSeek V4's DSML). Streaming must give the content and calls the whole-output parse gives; a
malformed or unfinished call never raises and comes back as content.
"""

from __future__ import annotations

import json
import random

import pytest

from weft.builtins.reasoning_parsers import ThinkReasoningParser
from weft.builtins.tool_parsers import (
    DeepseekV3ToolParser,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    Phi4MiniToolParser,
)
from weft.plugins import PluginRegistry
from weft.plugins.selection import select_parser
from weft.serve.tools import AssistantOutput, NamedCallParser, RequiredCallsParser
from weft.testing import ReasoningParserContract, ToolParserContract
from weft.testing.output_suites import parsed_tool_calls, stream_tool_calls
from weft_dsv4.parsers import DeepseekV4ReasoningParser, DeepseekV4ToolParser

QWEN_TWO_CALLS = (
    "<tool_call>\n"
    '{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
    "</tool_call>\n"
    "<tool_call>\n"
    '{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, USA", "date": "2024-10-01"}}\n'
    "</tool_call>"
)
HERMES_WITH_TEXT = (
    "Sure, let me look that up for you.\n"
    "<tool_call>\n"
    '{"arguments": {"symbol": "TSLA"}, "name": "get_stock_fundamentals"}\n'
    "</tool_call>"
)
HERMES_BRACES_IN_STRINGS = (
    '<tool_call>\n{"name": "run_code", "arguments": {"code": "if (x) { return \\"}\\"; } // ünïcødé ✓", "lang": '
    '"js"}}\n</tool_call>'
)
HERMES_STRINGIFIED_ARGUMENTS = '<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"weft\\"}"}\n</tool_call>'
LLAMA_ONE = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
LLAMA_TAGGED_TWO = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": '
    '{"tz": "CET"}}'
)
DSV4_CALLS = (
    "I will check both.\n\n"
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris "Rive Gauche"</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="hours" string="false">[8, 12]</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="read_file">\n'
    '<｜DSML｜parameter name="path" string="true">/tmp/example.lean</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)
# Mistral: tokenizer v3's JSON list (Mistral 7B v0.3, Mixtral 8x22B), v11's NAME[ARGS] per call, v7's call id.
MISTRAL_LIST = (
    '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", "format": '
    '"celsius"}}, {"name": "get_time", "arguments": {"tz": "CET"}}]'
)
MISTRAL_NAMED = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "hours": [8, 12]}[TOOL_CALLS]now[ARGS]{}'
MISTRAL_WITH_ID = 'Let me check.[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}'
PHI4_MINI_TWO = (
    'functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "parameters": '
    '{"tz": "CET"}}]'
)

WELL_FORMED = [
    (
        HermesToolParser,
        QWEN_TWO_CALLS,
        None,
        [
            ("get_current_temperature", {"location": "San Francisco, CA, USA"}),
            ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01"}),
        ],
    ),
    (
        HermesToolParser,
        HERMES_WITH_TEXT,
        "Sure, let me look that up for you.",
        [("get_stock_fundamentals", {"symbol": "TSLA"})],
    ),
    (
        HermesToolParser,
        HERMES_BRACES_IN_STRINGS,
        None,
        [("run_code", {"code": 'if (x) { return "}"; } // ünïcødé ✓', "lang": "js"})],
    ),
    (HermesToolParser, HERMES_STRINGIFIED_ARGUMENTS, None, [("search", {"query": "weft"})]),
    (
        HermesToolParser,
        "The weather is sunny today; no tool is needed.",
        "The weather is sunny today; no tool is needed.",
        [],
    ),
    (Llama3JsonToolParser, LLAMA_ONE, None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    (Llama3JsonToolParser, LLAMA_TAGGED_TWO, None, [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    (Llama3JsonToolParser, "Paris is the capital of France.", "Paris is the capital of France.", []),
    (
        DeepseekV4ToolParser,
        DSV4_CALLS,
        "I will check both.",
        [
            ("get_weather", {"city": 'Paris "Rive Gauche"', "days": 3, "hours": [8, 12]}),
            ("read_file", {"path": "/tmp/example.lean"}),
        ],
    ),
    (DeepseekV4ToolParser, "No calls, only an answer.", "No calls, only an answer.", []),
    (
        MistralToolParser,
        MISTRAL_LIST,
        None,
        [("get_current_weather", {"location": "Paris, France", "format": "celsius"}), ("get_time", {"tz": "CET"})],
    ),
    (MistralToolParser, MISTRAL_NAMED, None, [("get_weather", {"city": "Paris", "hours": [8, 12]}), ("now", {})]),
    (MistralToolParser, MISTRAL_WITH_ID, "Let me check.", [("get_weather", {"city": "Paris"})]),
    (MistralToolParser, "Paris is the capital of France.", "Paris is the capital of France.", []),
    (Phi4MiniToolParser, PHI4_MINI_TWO, None, [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    (
        Phi4MiniToolParser,
        "Use functools[...] sparingly; functools.partial binds arguments.",
        "Use functools[...] sparingly; functools.partial binds arguments.",
        [],
    ),
]

MALFORMED = [
    (
        HermesToolParser,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
    ),  # a brace short
    (HermesToolParser, '<tool_call>\n{"name": "get_weather", "argu'),  # cut by max_tokens
    (HermesToolParser, "<tool_call>\nget_weather(city='Paris')\n</tool_call>"),  # not JSON at all
    (HermesToolParser, '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>'),  # arguments not an object
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {"city": }}'),
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {"city": "Par'),
    (Llama3JsonToolParser, '{"answer": 42}'),
    (Llama3JsonToolParser, '{"name": "get_weather", "parameters": {}} and then some prose'),
    (DeepseekV4ToolParser, DSV4_CALLS[:170]),  # cut inside the first parameter
    (
        DeepseekV4ToolParser,
        '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="a">1</｜DSML｜parameter>\n',
    ),
    (MistralToolParser, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": }}]'),
    (MistralToolParser, MISTRAL_LIST[:40]),  # cut before the first call's arguments
    (MistralToolParser, MISTRAL_NAMED[:40]),  # cut inside the first call's arguments
    (MistralToolParser, '[TOOL_CALLS]get_weather(city="Paris")'),  # no [ARGS]
    (MistralToolParser, "[TOOL_CALLS] [get_weather(city='Paris')]"),  # a list, not of JSON calls
    (Phi4MiniToolParser, 'functools[{"name": "get_weather", "arguments": {"city": '),  # cut short
    (Phi4MiniToolParser, "functools[get_weather(city='Paris')]"),
]

MIXED = [  # a valid call and a malformed or unfinished one
    (HermesToolParser, QWEN_TWO_CALLS[:150]),  # one call, then cut by max_tokens inside the next
    (
        HermesToolParser,
        '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>\n' + HERMES_WITH_TEXT,
    ),  # bad, then good
    (Llama3JsonToolParser, LLAMA_TAGGED_TWO[:80]),
    (DeepseekV4ToolParser, DSV4_CALLS[:330]),  # the first invoke closed, the second cut short
    (MistralToolParser, MISTRAL_LIST[:140]),  # the first call closed, the second cut short
    (MistralToolParser, MISTRAL_NAMED[:-1]),  # the second call's arguments cut short
    (MistralToolParser, MISTRAL_LIST + " That is all."),  # text after the list
    (Phi4MiniToolParser, PHI4_MINI_TWO[:90]),  # the first call closed, the second cut short
]

RECORDED = [(parser, text) for parser, text, _, _ in WELL_FORMED] + MALFORMED + MIXED


@pytest.mark.parametrize(("parser", "text", "content", "calls"), WELL_FORMED)
def test_recorded_outputs_parse_whole_and_streamed(parser, text, content, calls):
    parsed = parser().parse(text)
    assert parsed.content == content
    assert [(call.name, json.loads(call.arguments)) for call in parsed.calls] == calls
    assert len({call.id for call in parsed.calls}) == len(calls)
    for seed in range(8):
        streamed_content, streamed_calls = stream_tool_calls(parser(), text, seed)
        assert streamed_content == (content or "")
        assert [(name, json.loads(arguments)) for name, arguments in streamed_calls] == calls


@pytest.mark.parametrize(("parser", "text"), MALFORMED)
def test_malformed_and_partial_calls_fall_back_to_content(parser, text):
    parsed = parser().parse(text)
    assert parsed.calls == [] and parsed.content == text
    for seed in range(4):
        assert stream_tool_calls(parser(), text, seed) == (text, [])  # no call delta for a call that is none


@pytest.mark.parametrize(("parser", "text"), RECORDED)
def test_streaming_gives_what_the_whole_output_parse_gives(parser, text):
    """Each recorded output, whole and cut short (max_tokens) at many points, streamed in random pieces."""
    for cut in [*range(0, len(text), 7), len(text)]:
        expected = parsed_tool_calls(parser().parse(text[:cut]))
        for seed in range(3):
            assert stream_tool_calls(parser(), text[:cut], seed) == expected, (cut, seed)


def test_mixed_outputs_keep_the_valid_call_and_the_rest_as_content():
    parsed = HermesToolParser().parse(MIXED[0][1])
    assert [call.name for call in parsed.calls] == ["get_current_temperature"]
    assert parsed.content == MIXED[0][1][MIXED[0][1].index("</tool_call>") + len("</tool_call>") :]
    parsed = HermesToolParser().parse(MIXED[1][1])
    assert [call.name for call in parsed.calls] == ["get_stock_fundamentals"]
    assert parsed.content.startswith('<tool_call>\n{"name": "f"') and parsed.content.endswith("look that up for you.")


def test_a_parser_that_raises_answers_with_the_text_as_content():
    class Broken(HermesToolParser):
        def scan(self, text, final):
            raise RuntimeError("bug")

    assert Broken().parse("hello").content == "hello"
    assert stream_tool_calls(Broken(), "hello", 0) == ("hello", [])


def test_dsv4_calls_rendered_by_the_parser_parse_back():
    calls = [{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2, "flags": {"a": True}}}]
    parsed = DeepseekV4ToolParser().parse(DeepseekV4ToolParser().render_calls(calls))
    assert [(call.name, json.loads(call.arguments)) for call in parsed.calls] == [
        (c["name"], c["arguments"]) for c in calls
    ]
    hermes = HermesToolParser().parse(HermesToolParser().render_calls(calls))
    assert [(call.name, json.loads(call.arguments)) for call in hermes.calls] == [
        (c["name"], c["arguments"]) for c in calls
    ]
    llama = Llama3JsonToolParser().parse(Llama3JsonToolParser().render_calls(calls * 2))
    assert [json.loads(call.arguments) for call in llama.calls] == [calls[0]["arguments"]] * 2


def test_forced_choice_parsers_read_the_constrained_json():
    named = NamedCallParser("get_weather")
    parsed = named.parse('  {"city": "Paris", "unit": "celsius"}')
    assert [(call.name, json.loads(call.arguments)) for call in parsed.calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})
    ]
    assert stream_tool_calls(NamedCallParser("get_weather"), '{"city": "Paris"}', 1) == (
        "",
        [("get_weather", '{"city": "Paris"}')],
    )
    required = (
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {"timezone": '
        '"CET"}}]'
    )
    expected = [("get_weather", {"city": "Paris"}), ("get_time", {"timezone": "CET"})]
    assert [(call.name, json.loads(call.arguments)) for call in RequiredCallsParser().parse(required).calls] == expected
    for seed in range(4):
        assert [
            (name, json.loads(arguments))
            for name, arguments in stream_tool_calls(RequiredCallsParser(), required, seed)[1]
        ] == expected
    # Cut short (max_tokens): the unfinished call comes back as a call with its arguments as written, as OpenAI
    # returns it, and as the stream sent it.
    for parser, text in (
        (
            RequiredCallsParser,
            '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {"ti',
        ),
        (lambda: NamedCallParser("get_time"), '{"ti'),
    ):
        cut = parser().parse(text)
        assert cut.content is None and [(call.name, call.arguments) for call in cut.calls][-1] == ("get_time", '{"ti')
        for seed in range(3):
            assert stream_tool_calls(parser(), text, seed) == ("", [(call.name, call.arguments) for call in cut.calls])
    # Cut before a call is named: no call is made up, and what was written comes back as content, streamed or not.
    for parser, text, content in (
        (RequiredCallsParser, '[{"name": "get_wea', '[{"name": "get_wea'),
        (RequiredCallsParser, '[{"name": "get_weather", "par', '[{"name": "get_weather", "par'),
        (RequiredCallsParser, '[{"name": "now", "parameters": {}}, {"na', '{"na'),
        (lambda: NamedCallParser("now"), "", None),
        (lambda: NamedCallParser("now"), " \n", None),
    ):
        cut = parser().parse(text)
        assert cut.content == content and [call.name for call in cut.calls] == (["now"] if "now" in text else [])
        assert stream_tool_calls(parser(), text, 1) == parsed_tool_calls(cut)


def test_reasoning_parsers_split_thinking_from_the_answer():
    qwen3 = "<think>\nThe user asks about Paris. It is in France.\n</think>\n\nParis is in France."
    think = ThinkReasoningParser(prompt="<|im_start|>assistant\n")
    assert think.parse(qwen3) == ("\nThe user asks about Paris. It is in France.\n", "\n\nParis is in France.")
    opened = ThinkReasoningParser(prompt="<|im_start|>assistant\n<think>\n")
    assert opened.parse("Thinking...</think>Answer.") == ("Thinking...", "Answer.")
    assert opened.parse("Still thinking when max_tokens hit") == ("Still thinking when max_tokens hit", None)
    closed = ThinkReasoningParser(prompt="<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not closed.reasoning_expected()
    dsv4 = DeepseekV4ReasoningParser(prompt="<｜User｜>hi<｜Assistant｜><think>")
    calls_only = DSV4_CALLS.split("\n\n", 1)[1]
    assert dsv4.parse("Plan: call the tool.\n\n" + calls_only) == ("Plan: call the tool.\n\n", calls_only)
    assert dsv4.parse("Short.</think>The answer is 4.") == ("Short.", "The answer is 4.")
    assert not DeepseekV4ReasoningParser(prompt="<｜Assistant｜></think>").reasoning_expected()
    for parser, text in ((think, qwen3), (dsv4, "Plan.</think>Answer")):
        whole = parser.parse(text)
        for seed in range(5):
            fresh = type(parser)(prompt=parser.prompt)
            rng, position, reasoning, content = random.Random(seed), 0, "", ""
            while position < len(text):
                size = rng.randint(1, 4)
                piece = fresh.push(text[position : position + size])
                reasoning, content, position = reasoning + piece[0], content + piece[1], position + size
            last = fresh.finish()
            assert (reasoning + last[0] or None, content + last[1] or None) == whole


def test_assistant_output_reasoning_then_dsml_calls_streamed():
    prompt = "<｜Assistant｜><think>"
    text = "The user wants weather; I should call the tool.</think>Checking.\n\n" + DSV4_CALLS.split("\n\n", 1)[1]
    whole = AssistantOutput(DeepseekV4ReasoningParser(prompt=prompt), DeepseekV4ToolParser()).parse(text)
    assert whole[0] == "The user wants weather; I should call the tool." and whole[1] == "Checking."
    assert [call.name for call in whole[2]] == ["get_weather", "read_file"]
    output = AssistantOutput(DeepseekV4ReasoningParser(prompt=prompt), DeepseekV4ToolParser())
    reasoning = content = ""
    calls: dict[int, str] = {}
    for index in range(0, len(text), 3):
        for delta in (output.push(text[index : index + 3]),):
            reasoning, content = reasoning + delta.reasoning, content + delta.content
            for piece in delta.calls:
                calls[piece.index] = calls.get(piece.index, "") + piece.arguments
    last = output.finish()
    reasoning, content = reasoning + last.reasoning, content + last.content
    for piece in last.calls:
        calls[piece.index] = calls.get(piece.index, "") + piece.arguments
    assert (reasoning, content) == (whole[0], whole[1])
    assert [json.loads(arguments) for arguments in calls.values()] == [json.loads(call.arguments) for call in whole[2]]


def test_without_parallel_calls_only_the_first_call_is_kept_whole_and_streamed():
    assert [call.name for call in AssistantOutput(None, HermesToolParser()).parse(QWEN_TWO_CALLS)[2]] == [
        "get_current_temperature",
        "get_temperature_date",
    ]
    _, content, calls = AssistantOutput(None, HermesToolParser(), parallel=False).parse(QWEN_TWO_CALLS)
    assert content is None and [(call.name, json.loads(call.arguments)) for call in calls] == [
        ("get_current_temperature", {"location": "San Francisco, CA, USA"})
    ]
    output = AssistantOutput(None, HermesToolParser(), parallel=False)
    deltas = [output.push(QWEN_TWO_CALLS[index : index + 5]) for index in range(0, len(QWEN_TWO_CALLS), 5)] + [
        output.finish()
    ]
    pieces = [piece for delta in deltas for piece in delta.calls]
    assert [(piece.index, piece.name, piece.arguments) for piece in pieces] == [(0, calls[0].name, calls[0].arguments)]
    assert "".join(delta.content for delta in deltas) == ""


def test_parsers_are_chosen_by_architecture_or_by_name():
    registry = PluginRegistry()
    assert select_parser(registry, "tool_parser", "auto", "Qwen2ForCausalLM") is HermesToolParser
    assert select_parser(registry, "tool_parser", "auto", "LlamaForCausalLM") is Llama3JsonToolParser
    assert select_parser(registry, "tool_parser", "auto", "DeepseekV4ForCausalLM") is DeepseekV4ToolParser
    assert select_parser(registry, "tool_parser", "auto", "DeepseekV3ForCausalLM") is DeepseekV3ToolParser
    assert select_parser(registry, "tool_parser", "auto", "MixtralForCausalLM") is MistralToolParser
    assert select_parser(registry, "tool_parser", "auto", "MistralForCausalLM") is MistralToolParser
    assert select_parser(registry, "tool_parser", "auto", "Phi3ForCausalLM") is Phi4MiniToolParser
    assert select_parser(registry, "reasoning_parser", "auto", "DeepseekV4ForCausalLM") is DeepseekV4ReasoningParser
    assert select_parser(registry, "reasoning_parser", "auto", "LlamaForCausalLM") is None
    assert select_parser(registry, "tool_parser", "hermes", "LlamaForCausalLM") is HermesToolParser
    assert select_parser(registry, "tool_parser", "none", "Qwen2ForCausalLM") is None


# The conformance kit's suites, on every parser Weft ships.


class TestHermesContract(ToolParserContract):
    plugin_name = "hermes"


class TestLlama3JsonContract(ToolParserContract):
    plugin_name = "llama3_json"
    leading_text = ""  # a Llama 3 answer is calls or text, not both


class TestDeepseekV4ToolContract(ToolParserContract):
    plugin_name = "dsv4"


def test_deepseek_v3_reads_the_v3_and_the_v3_1_bodies_and_keeps_a_broken_call_as_text():
    begin, end, call, call_end, sep = (
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁calls▁end｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁sep｜>",
    )
    v3 = f'{call}function{sep}get_weather\n```json\n{{"city": "Paris"}}\n```{call_end}'
    v3_1 = f"{call}now{sep}{{}}{call_end}"
    broken = f"{call}function{sep}oops\n```json\nnot json\n```{call_end}"
    parsed = DeepseekV3ToolParser().parse(f"Checking.{begin}{v3}{v3_1}{broken}{end} Done.")
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris"}),
        ("now", {}),
    ]
    assert parsed.content == f"Checking.{broken} Done."


class TestDeepseekV3ToolContract(ToolParserContract):
    plugin_name = "deepseek_v3"


class TestMistralToolContract(ToolParserContract):
    plugin_name = "mistral"


class TestPhi4MiniToolContract(ToolParserContract):
    plugin_name = "phi4_mini_json"
    leading_text = ""  # a Phi-4-mini answer is calls or text, not both


class TestThinkContract(ReasoningParserContract):
    plugin_name = "think"
    thinking_prompt = "<|im_start|>assistant\n"
    thinking_output = "<think>\nFirst, France.\n</think>\n\nParis."
    reasoning, answer = "\nFirst, France.\n", "\n\nParis."


class TestDeepseekV4ReasoningContract(ReasoningParserContract):
    plugin_name = "dsv4"
    thinking_prompt = "<｜User｜>Capital of France?<｜Assistant｜><think>"
    thinking_output = "France's capital.</think>Paris."
    reasoning, answer = "France's capital.", "Paris."


# gpt-oss's harmony format (the model's output begins after the prompt's ``<|start|>assistant``).

HARMONY_ANSWER = (
    "<|channel|>analysis<|message|>The user asks about Paris. Simple.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Paris is the capital of France."
)
HARMONY_CALL = (
    "<|channel|>analysis<|message|>Need the weather: call get_weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city":"Paris","days":3}'
)
HARMONY_PREAMBLE_AND_TWO_CALLS = (
    "<|channel|>analysis<|message|>Two lookups.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Checking both now.<|end|>"
    '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>'
    "<|start|>assistant<|channel|>commentary to=functions.now <|constrain|>json<|message|>{}"
)


@pytest.mark.parametrize(
    ("text", "reasoning", "content", "calls"),
    [
        (HARMONY_ANSWER, "The user asks about Paris. Simple.", "Paris is the capital of France.", []),
        (HARMONY_CALL, "Need the weather: call get_weather.", None, [("get_weather", {"city": "Paris", "days": 3})]),
        (
            HARMONY_PREAMBLE_AND_TWO_CALLS,
            "Two lookups.",
            "Checking both now.",
            [("get_weather", {"city": "Oslo"}), ("now", {})],
        ),
        # Two analysis messages; a final answer without reasoning; a model that ignored the format.
        (
            "<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis<|message|>Two.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Done.",
            "One.\n\nTwo.",
            "Done.",
            [],
        ),
        ("<|channel|>final<|message|>Just the answer.", None, "Just the answer.", []),
        ("Plain text, no harmony.", None, "Plain text, no harmony.", []),
    ],
)
def test_harmony_output_splits_into_reasoning_content_and_calls_whole_and_streamed(text, reasoning, content, calls):
    from weft.builtins.harmony import HarmonyReasoningParser, HarmonyToolParser

    prompt = "<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant"
    whole = AssistantOutput(HarmonyReasoningParser(prompt=prompt), HarmonyToolParser()).parse(text)
    assert whole[:2] == (reasoning, content)
    assert [(call.name, json.loads(call.arguments)) for call in whole[2]] == calls
    for seed in range(6):
        output = AssistantOutput(HarmonyReasoningParser(prompt=prompt), HarmonyToolParser())
        rng, position, deltas = random.Random(seed), 0, []
        while position < len(text):
            size = rng.randint(1, 6)
            deltas.append(output.push(text[position : position + size]))
            position += size
        deltas.append(output.finish())
        streamed_calls: dict[int, list[str]] = {}
        for delta in deltas:
            for piece in delta.calls:
                streamed_calls.setdefault(piece.index, [piece.name, ""])[1] += piece.arguments
        assert "".join(delta.reasoning for delta in deltas) == (reasoning or "")
        assert "".join(delta.content for delta in deltas) == (content or "")
        assert [(name, json.loads(arguments)) for name, arguments in streamed_calls.values()] == calls


def test_harmony_without_the_reasoning_parser_and_with_a_broken_call():
    """Alone, the tool parser reads the raw output (analysis bodies are then content); a call whose body is not a
    JSON object stays as text; a built-in tool's call (``to=python``) is not one of the request's functions."""
    from weft.builtins.harmony import HarmonyToolParser

    parsed = HarmonyToolParser().parse(HARMONY_CALL)
    assert parsed.content == "Need the weather: call get_weather."
    assert [(call.name, json.loads(call.arguments)) for call in parsed.calls] == [
        ("get_weather", {"city": "Paris", "days": 3})
    ]
    broken = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{city: Paris"
    parsed = HarmonyToolParser().parse(broken)
    assert parsed.calls == [] and parsed.content == broken
    python = "<|channel|>analysis to=python<|message|>print(1)"
    parsed = HarmonyToolParser().parse(python)
    assert parsed.calls == [] and "print(1)" in parsed.content
    assert select_parser(PluginRegistry(), "tool_parser", "auto", "GptOssForCausalLM") is HarmonyToolParser


class TestHarmonyToolContract(ToolParserContract):
    plugin_name = "harmony"


class TestHarmonyReasoningContract(ReasoningParserContract):
    plugin_name = "harmony"
    thinking_prompt = "<|start|>user<|message|>Capital of France?<|end|><|start|>assistant"
    thinking_output = (
        "<|channel|>analysis<|message|>France's capital.<|end|><|start|>assistant<|channel|>final<|message|>Paris."
    )
    reasoning, answer = "France's capital.", "Paris."


# Mistral 7B Instruct v0.3's template checks the ids of earlier calls (its tool-call parts, abridged).
MISTRAL_TEMPLATE = """
{%- if tools %}[AVAILABLE_TOOLS] {{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}
{%- for message in messages %}
{%- if message.role == "user" %}[INST] {{ message.content }}[/INST]
{%- elif message.tool_calls %}[TOOL_CALLS] [
{%- for tool_call in message.tool_calls %}
{%- if not (tool_call.id is defined and tool_call.id|length == 9) %}
{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{% endif %}
{"name": "{{ tool_call.function.name }}", "arguments": {{ tool_call.function.arguments|tojson }}, "id": "
{{- tool_call.id }}"}{% if not loop.last %}, {% endif %}
{%- endfor %}]</s>
{%- elif message.role == "tool" %}
{%- if message.tool_call_id is not defined or message.tool_call_id|length != 9 %}
{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{% endif %}
[TOOL_RESULTS] {"content": {{ message.content|tojson }}, "call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]
{%- elif message.role == "assistant" %} {{ message.content }}</s>
{%- endif %}
{%- endfor %}
"""


def test_mistral_templates_get_call_ids_of_nine_letters_and_digits(tokenizer_files, tmp_path):
    """OpenAI-style ids (``call_`` + 24 characters) in a conversation's history reach Mistral's template as their
    last 9 letters and digits, the same in the assistant's call and in the tool's answer; Hermes' keep them."""
    import shutil

    from weft.builtins.hf_tokenizer import HFTokenizer
    from weft.serve.tools import ToolSettings, chat_input

    folder = tmp_path / "mistral-template"
    shutil.copytree(tokenizer_files, folder)
    (folder / "chat_template.jinja").write_text(MISTRAL_TEMPLATE)
    tokenizer = HFTokenizer.from_folder(folder)
    call_id = "call_0f3a9c2b7d4e4b1a9c8d7e6f"
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "tool_calls": [{"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "Sunny."},
    ]
    settings = ToolSettings([{"name": "get_weather", "parameters": {"type": "object"}}], "auto")
    messages, kwargs = chat_input(tokenizer, history, True, settings, MistralToolParser, {})
    prompt = tokenizer.apply_chat_template(tokenizer.normalize_messages(messages), True, **kwargs)
    assert '"id": "9c8d7e6f"' not in prompt and '"id": "a9c8d7e6f"' in prompt
    assert '"call_id": "a9c8d7e6f"' in prompt and "[AVAILABLE_TOOLS]" in prompt
    assert MistralToolParser().template_call_id("call_1") == "0000call1"  # short ones padded
    with pytest.raises(ValueError, match="length 9"):  # the ids as given: the template refuses them
        chat_input(tokenizer, history, True, settings, HermesToolParser, {})
