"""Reasoning and tool calls through a real server, with the official openai client: ``reasoning_content`` on chat
(whole and streamed), the Responses API's reasoning items, and what a malformed or extra call becomes.

The model is a tiny Qwen3 (reasoning parser ``think``, tool parser ``hermes``) whose weights are set so that
its next token depends only on the current one: from the prompt's last token it writes
:data:`THINKING_OUTPUT` and ends, at any temperature. Its chat template opens the thinking (``<think>`` ends the
prompt), as QwQ's and DeepSeek R1's do. After ``</think>`` a ``structured_outputs`` constraint, which covers
the answer only, makes it write a chosen answer instead.
"""

from __future__ import annotations

import json

import openai
import pytest

from conftest import make_tiny_model

REASONING, ANSWER = "The user asks", "It is Paris."
THINKING_OUTPUT = f"{REASONING}</think>{ANSWER}"
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n' }}{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
    },
}
TWO_CALLS = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)
MALFORMED_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'  # a brace short
ASK = [{"role": "user", "content": "Where is the Eiffel tower?"}]


def _chain_model(folder, tokenizer_files, template: str, chain_text: list[str], **sizes):
    """A tiny Qwen3 that writes ``chain_text`` (pieces, each encoded on its own) then ends, from the prompt's last
    token (the ``\n`` ending ``template``'s generation prompt): every layer's output projections zero (the residual
    stream is the token's embedding), each chain token's embedding a unit vector of its own, and the head scoring
    its successor on that vector."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    folder = make_tiny_model(folder, "qwen3", tokenizer_files, max_position_embeddings=2048, **sizes)
    (folder / "chat_template.jinja").write_text(template)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    prompt = tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    chain = [
        tokenizer.encode(prompt, add_special_tokens=False)[-1],
        *(token for piece in chain_text for token in tokenizer.encode(piece, add_special_tokens=False)),
        tokenizer.eos_token_id,
    ]
    assert len(set(chain)) == len(chain), "each token of the chain must lead to one successor"
    weights = load_file(str(folder / "model.safetensors"))
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
    embeddings, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    embeddings.zero_()
    head.zero_()
    for dimension, (token, successor) in enumerate(zip(chain, chain[1:], strict=False)):
        embeddings[token, dimension] = 1.0
        head[successor, dimension] = 20.0
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory, tokenizer_files):
    """The template opens the thinking; the model writes :data:`THINKING_OUTPUT`."""
    return _chain_model(tmp_path_factory.mktemp("thinking"), tokenizer_files, TEMPLATE, [THINKING_OUTPUT])


@pytest.fixture(scope="module")
def client(thinking_model, one_torch_thread):
    server, client = _server(thinking_model)
    yield client
    server.stop()


def _chat(client, stream=False, **extra):
    extra.setdefault("max_tokens", 300)  # a constrained answer may take a token per character
    extra.setdefault("temperature", 1.0)
    return client.chat.completions.create(model=client.served_model, messages=ASK, stream=stream, **extra)


def _streamed(chunks):
    """``(reasoning, content, calls, finish_reasons)`` of a chat stream; calls as ``(name, arguments)``."""
    reasoning = content = ""
    calls, finish = {}, []
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if getattr(delta, "reasoning_content", None):
            assert not content, "the reasoning comes before the answer"
            reasoning += delta.reasoning_content
        content += delta.content or ""
        for call in delta.tool_calls or []:
            calls.setdefault(call.index, [call.function.name, ""])[1] += call.function.arguments or ""
        if chunk.choices[0].finish_reason:
            finish.append(chunk.choices[0].finish_reason)
    return reasoning, content, [tuple(call) for call in calls.values()], finish


def test_chat_returns_the_thinking_apart_whole_and_streamed(client):
    choice = _chat(client).choices[0]
    assert (choice.message.reasoning_content, choice.message.content) == (REASONING, ANSWER)
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert _streamed(_chat(client, stream=True)) == (REASONING, ANSWER, [], ["stop"])


def test_responses_api_has_a_reasoning_item_then_the_message(client):
    response = client.responses.create(
        model=client.served_model, input="Where is the Eiffel tower?", max_output_tokens=60
    )
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert [part.text for part in response.output[0].content] == [REASONING]
    assert response.output_text == ANSWER
    events = list(
        client.responses.create(
            model=client.served_model, input="Where is the Eiffel tower?", max_output_tokens=60, stream=True
        )
    )
    assert "".join(event.delta for event in events if event.type == "response.reasoning_text.delta") == REASONING
    assert "".join(event.delta for event in events if event.type == "response.output_text.delta") == ANSWER
    done = [event.item for event in events if event.type == "response.output_item.done"]
    assert [item.type for item in done] == ["reasoning", "message"] and done[0].content[0].text == REASONING


def test_without_parallel_calls_only_the_first_is_returned(client):
    answer = {"tools": [WEATHER, TIME], "extra_body": {"structured_outputs": {"choice": [TWO_CALLS]}}}
    both = _chat(client, **answer).choices[0]
    assert [call.function.name for call in both.message.tool_calls] == ["get_weather", "get_time"]
    choice = _chat(client, parallel_tool_calls=False, **answer).choices[0]
    assert choice.message.reasoning_content == REASONING and choice.finish_reason == "tool_calls"
    assert [(call.function.name, json.loads(call.function.arguments)) for call in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    reasoning, content, calls, finish = _streamed(_chat(client, stream=True, parallel_tool_calls=False, **answer))
    assert (reasoning, content, finish) == (REASONING, "", ["tool_calls"])
    assert [(name, json.loads(arguments)) for name, arguments in calls] == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize(("max_tokens", "finish_reason"), [(300, "stop"), (24, "length")])
def test_a_malformed_call_is_content_whole_and_streamed(client, max_tokens, finish_reason):
    """Not a call: no tool_calls (no delta either), the text as content, finish_reason stop (or length when cut)."""
    answer = {
        "tools": [WEATHER],
        "max_tokens": max_tokens,
        "seed": 7,
        "extra_body": {"structured_outputs": {"choice": [MALFORMED_CALL]}},
    }
    choice = _chat(client, **answer).choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == finish_reason
    text = choice.message.content
    assert MALFORMED_CALL.startswith(text) and (text == MALFORMED_CALL) is (finish_reason == "stop")
    streamed = _streamed(_chat(client, stream=True, **answer))
    assert streamed == (REASONING, text, [], [finish_reason])


# The template does not open the thinking (as Qwen3's, where the model writes ``<think>`` itself when it thinks).
ANSWER_TEMPLATE = TEMPLATE.replace("assistant\n<think>\n", "assistant\n")


def _server(folder, **overrides):
    from conftest import RunningServer

    server = RunningServer({"model": str(folder), **overrides})
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)
    client.served_model = server.app.state.server.model_name
    return server, client


@pytest.mark.parametrize(
    ("opens", "fill"),
    [(True, "thread"), (True, "process"), (False, "thread")],
    ids=["opens its thinking", "opens its thinking, fill process", "answers at once"],
)
def test_a_constraint_covers_the_answer_when_the_output_may_open_its_thinking(
    tmp_path_factory, tokenizer_files, one_torch_thread, opens, fill
):
    """The prompt does not open the thinking: the constraint covers the output from its first token, which may
    also open the thinking. A model writing ``<think>`` first thinks freely and its answer is constrained; one
    answering at once is constrained from there (before, the constraint waited for a ``</think>`` such a model never
    writes, so its answer was free text)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_files))
    tokenizer.add_tokens(["<think>", "</think>"])  # one token each, not special (as Qwen3's)
    tokenizer.save_pretrained(str(words := tmp_path_factory.mktemp("think-tokens")))
    chain = ["<think>", THINKING_OUTPUT] if opens else [THINKING_OUTPUT]
    folder = _chain_model(tmp_path_factory.mktemp("answers"), words, ANSWER_TEMPLATE, chain, vocab_size=len(tokenizer))
    server, client = _server(folder, engine={"structured_output_fill": fill})
    try:
        free = _chat(client, temperature=0).choices[0].message
        assert (free.reasoning_content, free.content) == ((REASONING, ANSWER) if opens else (None, THINKING_OUTPUT))
        choices = ["Rome", "The user"]
        for stream in (False, True):
            chunks = _chat(client, stream=stream, temperature=0, extra_body={"structured_outputs": {"choice": choices}})
            reasoning, content = (
                _streamed(chunks)[:2]
                if stream
                else (chunks.choices[0].message.reasoning_content or "", chunks.choices[0].message.content)
            )
            if opens:  # thinks as it would without the constraint; the answer is one of the choices
                assert reasoning == REASONING and content in choices
            else:  # its own first tokens are one of the choices: greedy keeps them
                assert (reasoning, content) == ("", "The user")
    finally:
        server.stop()
