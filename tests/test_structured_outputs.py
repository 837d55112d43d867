"""Structured outputs, tool calling, logit bias and prompt logprobs, with the official openai client against a
real server on the default model (SmolLM2), and offline through ``LLM``.

Outputs are checked with independent tools: ``jsonschema`` validates JSON against the request's schema,
``re.fullmatch`` regular expressions, Hugging Face transformers (the same GGUF weights) the prompt logprobs.
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
import torch

from weft import LLM, SamplingParams
from weft.contracts.structured_output import StructuredOutputsParams

MODEL = "smollm2-135m-instruct"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "artist", "doctor", "pilot"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
        },
        "skills": {"type": "array", "items": {"enum": ["go", "rust", "chess"]}, "minItems": 1, "maxItems": 2},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "skills", "active"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a timezone",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 16}},
            "required": ["timezone"],
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(default_server):
    return openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="unused", max_retries=0, timeout=1800)


def test_twenty_json_schema_requests_at_temperature_one_validate(client):
    def one(seed):
        reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Invent a person and describe them in JSON."}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True},
            },
            temperature=1.0,
            top_p=1.0,
            seed=seed,
            max_tokens=300,
        )
        return reply.choices[0]

    with ThreadPoolExecutor(20) as pool:
        choices = list(pool.map(one, range(20)))
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    assert len({choice.message.content for choice in choices}) > 1  # sampled, not one forced string


def test_json_object_and_vllm_structured_outputs_field(client):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
        response_format={"type": "json_object"},
        temperature=1.0,
        top_p=1.0,
        seed=5,
        max_tokens=200,
    )
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a valid prefix of an object
        assert reply.choices[0].message.content.lstrip().startswith("{")
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4}
    reply = client.completions.create(
        model=MODEL,
        prompt="Some numbers:",
        temperature=1.0,
        top_p=1.0,
        seed=1,
        max_tokens=60,
        extra_body={"structured_outputs": {"json": schema}},
    )
    jsonschema.validate(json.loads(reply.choices[0].text), schema)


def test_response_format_json_schema_on_completions(client):
    """docs/openai-api.md says completions take ``response_format`` as chat does; the openai client has no such
    argument on ``completions.create``, so it goes in the body as other clients send it."""
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "sights": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3},
        },
        "required": ["city", "sights"],
    }
    replies = client.completions.create(
        model=MODEL,
        prompt="A city and its sights, as JSON:",
        n=3,
        temperature=1.0,
        top_p=1.0,
        seed=6,
        max_tokens=120,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "city", "schema": schema, "strict": True},
            }
        },
    )
    for choice in replies.choices:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), schema)


def test_regex_choice_and_grammar_always_hold(client):
    pattern = r"[A-Z][a-z]{2,8} [0-9]{3}-[0-9]{4}"
    replies = client.completions.create(
        model=MODEL,
        prompt="Name and phone number:",
        n=6,
        temperature=1.0,
        top_p=1.0,
        seed=3,
        max_tokens=40,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    for choice in replies.choices:
        assert re.fullmatch(pattern, choice.text), choice.text
    colours = ["red", "green", "blue", "dark purple"]
    replies = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Pick a colour."}],
        n=6,
        temperature=1.0,
        top_p=1.0,
        seed=4,
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": colours}},
    )
    assert all(choice.message.content in colours for choice in replies.choices)
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is water wet?"}],
        temperature=1.0,
        top_p=1.0,
        max_tokens=20,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    assert reply.choices[0].message.content in ("The answer is yes.", "The answer is no.")


def test_streamed_constrained_output_equals_the_whole(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "population": {"type": "integer"}},
        "required": ["city", "population"],
    }
    kwargs = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "A city in JSON."}],
        temperature=0,
        max_tokens=100,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    )
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(lambda: client.chat.completions.create(**kwargs).choices[0].message.content)
        chunks = pool.submit(lambda: list(client.chat.completions.create(**kwargs, stream=True)))
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks.result() if chunk.choices)
    assert streamed == whole.result()
    jsonschema.validate(json.loads(streamed), schema)


def test_bad_constraints_get_400_naming_the_problem(default_server):
    def post(payload):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **payload}
        return httpx.post(f"{default_server.url}/v1/chat/completions", json=body, timeout=60)

    cases = [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "frobnicate"}},
                }
            },
            "response_format.json_schema.schema",
            "frobnicate",
        ),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "parenthesis"),
        ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar", "EBNF"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one", "regex, choice"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "'yaml'"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "give one of them", ""),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope'",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "unique"),
        ({"logit_bias": {"abc": 5}}, "logit_bias", "token ids"),
        ({"logit_bias": {"5": 300}}, "logit_bias", "100"),
        ({"logit_bias": {"999999": 5}}, "logit_bias", "[0, 49152)"),
        # Keywords xgrammar would compile as if absent: refused rather than answered with JSON that breaks them.
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"v": {"type": "array", "uniqueItems": True}}},
                    },
                }
            },
            "response_format.json_schema.schema",
            "'uniqueItems' (at #/properties/v/uniqueItems)",
            "does not enforce",
        ),
        (
            {"structured_outputs": {"json": {"anyOf": [{"type": "integer", "not": {"const": 3}}]}}},
            "structured_outputs.json",
            "#/anyOf/0/not",
        ),
        ({"top_logprobs": 3}, "top_logprobs", "logprobs"),
    ]
    for payload, *fragments in cases:
        response = post(payload)
        assert response.status_code == 400, (payload, response.text)
        message = response.json()["error"]["message"]
        assert all(fragment in message for fragment in fragments), (payload, message)
    assert post({"max_tokens": 2}).status_code == 200


def _validate_call(call, tools=(WEATHER, TIME)):
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_required_and_named_tool_choice_yield_valid_calls(client):
    named = {"type": "function", "function": {"name": "get_time"}}

    def one(seed):
        return client.chat.completions.create(
            model=MODEL,
            messages=ASK_WEATHER,
            tools=[WEATHER, TIME],
            tool_choice="required" if seed < 3 else named,
            temperature=1.0,
            top_p=1.0,
            seed=seed,
            max_tokens=200,
            parallel_tool_calls=False,
        ).choices[0]

    with ThreadPoolExecutor(4) as pool:
        *required, forced = pool.map(one, range(4))
    for choice in required:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        _validate_call(choice.message.tool_calls[0])
    assert forced.finish_reason == "stop" and [call.function.name for call in forced.message.tool_calls] == ["get_time"]
    _validate_call(forced.message.tool_calls[0])


def test_streamed_forced_tool_calls_send_id_and_name_first_then_arguments_in_pieces(client):
    """Under ``required`` or a named function the grammar holds the output to valid calls, so they stream as
    OpenAI's do; under ``auto`` a call goes out whole once valid (tests/test_tool_parsers.py)."""
    choices = ("required", {"type": "function", "function": {"name": "get_weather"}})

    def chunks_of(tool_choice):
        return list(
            client.chat.completions.create(
                model=MODEL,
                messages=ASK_WEATHER,
                tools=[WEATHER, TIME],
                tool_choice=tool_choice,
                temperature=1.0,
                top_p=1.0,
                seed=2,
                max_tokens=200,
                stream=True,
                parallel_tool_calls=False,
            )
        )

    with ThreadPoolExecutor(2) as pool:
        streams = list(pool.map(chunks_of, choices))
    for tool_choice, chunks in zip(choices, streams, strict=False):
        pieces = [call for chunk in chunks if chunk.choices for call in (chunk.choices[0].delta.tool_calls or [])]
        calls: dict[int, dict] = {}
        for piece in pieces:
            if piece.index not in calls:
                assert (
                    piece.id.startswith("call_") and piece.function.name and piece.type == "function"
                )  # its first piece
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
            else:
                assert piece.id is None and piece.function.name is None
            calls[piece.index]["arguments"] += piece.function.arguments or ""
        assert calls and len(pieces) > len(calls) + 1  # the arguments came in several pieces
        for call in calls.values():
            schema = next(
                tool["function"]["parameters"] for tool in (WEATHER, TIME) if tool["function"]["name"] == call["name"]
            )
            jsonschema.validate(json.loads(call["arguments"]), schema)
        assert not "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        finish = [
            chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason
        ]
        assert finish == ["tool_calls" if tool_choice == "required" else "stop"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_cut_short_comes_back_as_the_stream_sent_it(client, tool_choice):
    """``max_tokens`` ends a forced call mid-arguments: as OpenAI does, the answer is that call with its arguments as
    far as they were written (not content) and ``finish_reason`` ``length``, streamed or not."""
    request = dict(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=[WEATHER],
        tool_choice=tool_choice,
        temperature=0,
        parallel_tool_calls=False,
    )
    length = client.chat.completions.create(**request, max_tokens=200).usage.completion_tokens
    for cut in range(length - 1, 0, -1):  # the last cut that ends inside the arguments (the array's end comes after)
        whole = client.chat.completions.create(**request, max_tokens=cut).choices[0]
        assert whole.finish_reason == "length" and whole.message.content is None
        [call] = whole.message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        try:
            json.loads(call.function.arguments)
        except ValueError:
            break  # unfinished
    else:
        raise AssertionError("no cut ended inside the arguments")
    request["max_tokens"] = cut
    chunks = [chunk.choices[0] for chunk in client.chat.completions.create(**request, stream=True) if chunk.choices]
    streamed = "".join(piece.function.arguments or "" for chunk in chunks for piece in (chunk.delta.tool_calls or []))
    assert streamed == call.function.arguments and chunks[-1].finish_reason == "length"
    assert not "".join(chunk.delta.content or "" for chunk in chunks)


def test_two_turn_tool_conversation(client, default_server):
    first = (
        client.chat.completions.create(
            model=MODEL,
            messages=ASK_WEATHER,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=0,
            max_tokens=100,
        )
        .choices[0]
        .message
    )
    call = first.tool_calls[0]
    conversation = [
        *ASK_WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": "It is 22 degrees and sunny."},
    ]
    final = client.chat.completions.create(
        model=MODEL, messages=conversation, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=40
    )
    choice = final.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.content
    assert choice.message.tool_calls is None
    # The call and the tool's result reached the prompt through the chat template.
    server = default_server.app.state.server
    rendered = server.tokenizer.decode(
        server.chat_prompt(_protocol_messages(conversation), True), skip_special_tokens=False
    )
    assert "22 degrees and sunny" in rendered and "get_weather" in rendered


def _protocol_messages(messages):
    import msgspec

    from weft.serve import protocol

    return msgspec.convert(messages, list[protocol.ChatMessage])


def test_tool_choice_none_and_auto_return_content(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=20
    )
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], temperature=0, max_tokens=20
    )
    message = reply.choices[0].message
    assert message.content or message.tool_calls


def test_responses_api_tools_text_format_and_function_call_items(client):
    tool = {"type": "function", **WEATHER["function"]}
    response = client.responses.create(
        model=MODEL,
        input="Weather in Oslo?",
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=120,
        temperature=1.0,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])
    named = client.responses.create(
        model=MODEL,
        input="Weather in Oslo?",
        tools=[tool],
        max_output_tokens=8,
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=1.0,
    )
    assert named.tool_choice.model_dump() == {"type": "function", "name": "get_weather"}  # as sent, no extra field
    # Cut short inside the forced call: the item the output stopped in is incomplete, streamed or not.
    cut = dict(model=MODEL, input="Weather in Oslo?", tools=[tool], tool_choice="required", max_output_tokens=3)
    whole = client.responses.create(**cut)
    assert whole.status == "incomplete" and whole.output[-1].status == "incomplete"
    done = [
        event.item for event in client.responses.create(**cut, stream=True) if event.type == "response.output_item.done"
    ]
    assert done[-1].status == "incomplete"
    follow_up = client.responses.create(
        model=MODEL,
        max_output_tokens=20,
        temperature=0,
        tools=[tool],
        input=[
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_weather",
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Snowing, -3 degrees."},
        ],
    )
    assert follow_up.output_text
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
    formatted = client.responses.create(
        model=MODEL,
        input="Name a city as JSON.",
        max_output_tokens=60,
        temperature=1.0,
        top_p=1.0,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
    )
    jsonschema.validate(json.loads(formatted.output_text), schema)
    events = list(
        client.responses.create(
            model=MODEL,
            input="Weather in Oslo?",
            tools=[tool],
            tool_choice="required",
            max_output_tokens=120,
            stream=True,
            parallel_tool_calls=False,
        )
    )
    kinds = [event.type for event in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    done = next(event for event in events if event.type == "response.function_call_arguments.done")
    streamed = "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta")
    assert streamed == done.arguments
    jsonschema.validate(json.loads(done.arguments), WEATHER["function"]["parameters"])


def test_logit_bias_bans_and_forces_tokens(client, default_server):
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8, logprobs=0)
    tokenizer = default_server.app.state.server.tokenizer
    (first,) = tokenizer.encode(plain.choices[0].logprobs.tokens[0], add_special_tokens=False)
    banned = client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=8, logit_bias={str(first): -100}
    )
    banned_ids = tokenizer.encode(banned.choices[0].text, add_special_tokens=False)
    assert first not in banned_ids and banned.choices[0].text != plain.choices[0].text
    forced_token = tokenizer.encode(" banana", add_special_tokens=False)[0]
    forced = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        temperature=1.0,
        top_p=1.0,
        max_tokens=6,
        logit_bias={str(forced_token): 100},
        logprobs=True,
    )
    assert [item.token for item in forced.choices[0].logprobs.content] == [tokenizer.decode([forced_token])] * 6


def test_allowed_token_ids_and_bad_words(client, default_server):
    tokenizer = default_server.app.state.server.tokenizer
    allowed = tokenizer.encode(" yes no maybe", add_special_tokens=False)
    reply = client.completions.create(
        model=MODEL,
        prompt="Answer:",
        temperature=1.0,
        top_p=1.0,
        max_tokens=8,
        extra_body={"allowed_token_ids": allowed},
    )
    assert set(tokenizer.encode(reply.choices[0].text, add_special_tokens=False)) <= set(allowed)
    plain = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8)
    word = plain.choices[0].text.split()[0]
    reply = client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8, extra_body={"bad_words": [word]}
    )
    assert word not in reply.choices[0].text.split()


def test_logprobs_under_a_constraint_are_finite_and_completions_list_the_chosen_token(client):
    choice = {"structured_outputs": {"choice": ["yes", "no"]}}
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is water wet?"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=5,
        extra_body=choice,
    )
    assert chat.choices[0].message.content in ("yes", "no")
    entries = chat.choices[0].logprobs.content
    # The mask leaves only the grammar's tokens: the others' -inf arrives as vLLM's floor, -9999.0.
    assert entries and all(-9999.0 <= top.logprob <= 0 for entry in entries for top in entry.top_logprobs)
    assert any(top.logprob == -9999.0 for entry in entries for top in entry.top_logprobs)
    for stream in (False, True):
        reply = client.completions.create(
            model=MODEL,
            prompt="Is water wet? Answer:",
            max_tokens=4,
            logprobs=3,
            temperature=1.0,
            seed=5,
            extra_body=choice,
            stream=stream,
        )
        chunks = list(reply) if stream else [reply]
        tokens = [token for chunk in chunks if chunk.choices[0].logprobs for token in chunk.choices[0].logprobs.tokens]
        tops = [top for chunk in chunks if chunk.choices[0].logprobs for top in chunk.choices[0].logprobs.top_logprobs]
        assert tokens and len(tops) == len(tokens)
        for token, top in zip(tokens, tops, strict=True):
            assert token in top and len(top) <= 4 and all(-9999.0 <= value <= 0 for value in top.values())
    plain = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=12, logprobs=1, temperature=1.5, seed=3
    )
    logprobs = plain.choices[0].logprobs
    assert all(
        token in top and len(top) <= 2 for token, top in zip(logprobs.tokens, logprobs.top_logprobs, strict=True)
    )


def test_a_constraint_that_the_request_allows_no_token_of_is_a_400_and_the_server_goes_on(client, default_server):
    tokenizer = default_server.app.state.server.tokenizer
    allowed = tokenizer.encode(" banana split", add_special_tokens=False)  # no prefix of "yes" or "no"
    conflict = {"structured_outputs": {"choice": ["yes", "no"]}, "allowed_token_ids": allowed}
    with pytest.raises(openai.BadRequestError, match="no token is left to sample") as refused:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Is water wet?"}], max_tokens=4, extra_body=conflict
        )
    assert "allowed_token_ids" in refused.value.response.json()["error"]["message"]
    with pytest.raises(openai.APIError, match="no token is left to sample"):  # streamed: the error event
        list(
            client.completions.create(
                model=MODEL, prompt="Is water wet?", max_tokens=4, extra_body=conflict, stream=True
            )
        )
    after = client.completions.create(
        model=MODEL, prompt="Is water wet?", max_tokens=4, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}
    )
    assert after.choices[0].text in ("yes", "no")


@pytest.fixture(scope="module")
def hf_model():
    """Transformers' Llama with the default model's weights, exactly as Weft's GGUF loader dequantizes them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from weft.config import load_config
    from weft.plugins import PluginRegistry
    from weft.resolve import resolve_source

    loader, source = resolve_source(PluginRegistry(), load_config(None, {}))
    settings = dict(source.hf_config)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.for_model(settings.pop("model_type"), **settings), dtype=torch.float32
    )
    missing, unexpected = model.load_state_dict(dict(loader.iter_weights(source, "float32")), strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # the head is tied to the embeddings
    model.tie_weights()
    return model.eval()


def _hf_prompt_logprobs(hf_model, token_ids):
    with torch.no_grad():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[position, token]) for position, token in enumerate(token_ids[1:])]


def test_echo_with_logprobs_returns_hf_prompt_logprobs(client, default_server, hf_model):
    prompt = "The quick brown fox jumps over the lazy dog because"
    reply = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=4, temperature=0)
    tokens = default_server.app.state.server.tokenizer.encode(prompt)
    logprobs = reply.choices[0].logprobs
    assert reply.choices[0].text.startswith(prompt)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = _hf_prompt_logprobs(hf_model, tokens)
    assert logprobs.token_logprobs[1 : len(tokens)] == pytest.approx(expected, abs=2e-3)
    assert len(logprobs.tokens) == len(tokens) + 4
    assert "".join(logprobs.tokens) == reply.choices[0].text
    stream = client.completions.create(
        model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=4, temperature=0, stream=True
    )
    streamed = [
        value
        for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for value in chunk.choices[0].logprobs.token_logprobs
    ]
    assert streamed[1 : len(tokens)] == pytest.approx(expected, abs=2e-3)
    # max_tokens 0 scores the prompt only (what evaluation harnesses send); without echo it is refused.
    for stream in (False, True):
        scored = client.completions.create(
            model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=0, stream=stream
        )
        chunks = [chunk.choices[0] for chunk in scored if chunk.choices] if stream else scored.choices
        assert "".join(choice.text for choice in chunks) == prompt and chunks[-1].finish_reason == "length"
        values = [value for choice in chunks if choice.logprobs for value in choice.logprobs.token_logprobs]
        assert values[0] is None and values[1:] == pytest.approx(expected, abs=2e-3)
    assert client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=0).usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="max_tokens: 0 generates nothing"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)


# Offline: the same features through LLM.


@pytest.fixture(scope="module")
def llm():
    engine = LLM(model=MODEL, quantization="none")  # compared with transformers on the dequantized weights
    yield engine
    engine.close()


def test_offline_structured_outputs_and_prompt_logprobs(llm, hf_model):
    schema = {
        "type": "object",
        "properties": {"colour": {"enum": ["red", "blue"]}, "count": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["colour", "count"],
    }
    params = [
        SamplingParams(
            temperature=1.0,
            top_p=1.0,
            seed=seed,
            max_tokens=60,
            structured_outputs=StructuredOutputsParams(json=schema),
        )
        for seed in range(4)
    ]
    for output in llm.generate(["A JSON object:"] * 4, params):
        jsonschema.validate(json.loads(output.outputs[0].text), schema)
    prompt = "Paris is the capital and largest city of France."
    output = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(output.prompt_token_ids)
    expected = _hf_prompt_logprobs(hf_model, output.prompt_token_ids)
    got = [
        entry[token].logprob
        for entry, token in zip(output.prompt_logprobs[1:], output.prompt_token_ids[1:], strict=False)
    ]
    assert got == pytest.approx(expected, abs=2e-3)
    assert all(len(entry) >= 3 for entry in output.prompt_logprobs[1:])


def test_compilation_is_off_the_step_loop_and_cached(llm, monkeypatch):
    """A constraint still compiling keeps only its own request waiting; identical constraints compile once."""
    from weft_xgrammar.backend import XgrammarBackend

    release, calls = threading.Event(), []
    compile_original = XgrammarBackend.compile

    def slow_compile(self, constraint):
        calls.append(constraint)
        release.wait(timeout=120)
        return compile_original(self, constraint)

    monkeypatch.setattr(XgrammarBackend, "compile", slow_compile)
    engine = llm.engine
    constraint = StructuredOutputsParams(regex=r"(ab){3}")
    slow = [
        engine.add_request(f"slow-{index}", [1, 2, 3], SamplingParams(max_tokens=10, structured_outputs=constraint))
        for index in range(2)
    ]
    plain = engine.add_request("plain", llm.tokenizer.encode("Hello"), SamplingParams(temperature=0, max_tokens=5))
    try:
        while not plain.finished:
            engine.step()
        waiting = {request.request_id for request in engine.scheduler.waiting}
        assert {"slow-0", "slow-1"} <= waiting  # the plain request ran to the end meanwhile
    finally:
        release.set()
    while engine.has_unfinished:
        engine.step()
    assert engine.requests == {} and len(calls) == 1
    assert [request.text for request in slow] == ["ababab", "ababab"]


def test_a_compile_past_its_deadline_fails_its_own_request_and_stalls_no_other(llm, monkeypatch):
    """A constraint whose compile never ends (a pathological schema) fails its request with a 400 naming
    engine.structured_output_compile_timeout; a small constraint queued behind it and a plain request finish
    meanwhile, and the timeout is counted."""
    from weft_xgrammar.backend import XgrammarBackend

    release = threading.Event()
    compile_original = XgrammarBackend.compile
    stuck = StructuredOutputsParams(regex=r"(stuck){2}")

    def compile_or_hang(self, constraint):
        if constraint == stuck:
            release.wait(timeout=120)
        return compile_original(self, constraint)

    engine = llm.engine
    yes = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(choice=["yes"]))
    # Another constraint compiled first: a loaded machine's first compile (the vocabulary's tables) may outlive
    # the 1 s below; "yes" itself still compiles, queued behind the stuck one.
    no = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(choice=["no"]))
    warm = engine.add_request("warm", [1, 2, 3], no)
    while not warm.finished:
        engine.step()
    monkeypatch.setattr(XgrammarBackend, "compile", compile_or_hang)
    manager = engine.scheduler.structured_outputs
    slow = engine.add_request("stuck", [1, 2, 3], SamplingParams(max_tokens=10, structured_outputs=stuck))
    compiler = manager.compiler
    monkeypatch.setattr(compiler, "timeout", 1.0)
    before = compiler.timeouts
    choice = engine.add_request("choice", [1, 2, 3], yes)
    plain = engine.add_request("plain", llm.tokenizer.encode("Hello"), SamplingParams(temperature=0, max_tokens=5))
    started = time.monotonic()
    refusals = []
    try:
        while not (choice.finished and plain.finished and refusals):
            assert time.monotonic() - started < 30, "a request waited behind the stuck compile"
            try:
                engine.step()
            except ValueError as refused:
                refusals.append(str(refused))
        assert not release.is_set() and choice.finish_reason == "stop"  # finished while the compile still hung
    finally:
        release.set()
    while engine.has_unfinished:
        engine.step()
    assert choice.text == "yes" and not slow.text
    assert len(refusals) == 1 and "'stuck'" in refusals[0], refusals
    assert "engine.structured_output_compile_timeout = 1 s" in refusals[0]
    assert compiler.timeouts == before + 1


def test_a_constraint_over_the_size_limit_is_refused_naming_it(llm):
    limit = llm.engine.config.engine.structured_output_max_bytes
    schema = {"type": "object", "properties": {f"p{index}": {"type": "string"} for index in range(limit // 20)}}
    request = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(json=schema))
    with pytest.raises(ValueError, match=r"over engine\.structured_output_max_bytes = 131072"):
        llm.engine.add_request("huge", [1, 2, 3], request)
        while llm.engine.has_unfinished:
            llm.engine.step()


def test_compiled_constraints_stay_within_the_cache_budget_across_100_distinct_schemas(llm, monkeypatch):
    """The engine keeps compiled constraints within engine.structured_output_cache_bytes: of 100 distinct large
    schemas, those it still holds (alive after their requests ended) take at most the budget."""
    import gc
    import weakref

    from weft_xgrammar.backend import XgrammarBackend

    compiled = []
    compile_original = XgrammarBackend.compile

    def compile_recorded(self, constraint):
        result = compile_original(self, constraint)
        compiled.append((weakref.ref(result), result.memory_size_bytes))
        return result

    monkeypatch.setattr(XgrammarBackend, "compile", compile_recorded)
    engine = llm.engine
    schemas = [{"enum": [f"value-{schema}-{index}" for index in range(300)]} for schema in range(100)]
    first = SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(json=schemas[0]))
    engine.add_request("first", [1, 2, 3], first)
    budget = 8 * 48 << 10  # about 8 of these schemas (48 KB each compiled)
    monkeypatch.setattr(engine.scheduler.structured_outputs.compiler, "cache_bytes", budget, raising=False)
    for index, schema in enumerate(schemas[1:]):
        constraint = StructuredOutputsParams(json=schema)
        engine.add_request(f"schema-{index}", [1, 2, 3], SamplingParams(max_tokens=1, structured_outputs=constraint))
    while engine.has_unfinished:
        engine.step()
    gc.collect()
    assert len(compiled) == 100 and sum(size for _, size in compiled) > 10 * budget
    alive = [size for reference, size in compiled if reference() is not None]
    assert 0 < sum(alive) <= budget, (len(alive), sum(alive), budget)
